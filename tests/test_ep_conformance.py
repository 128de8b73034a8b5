"""The builtin expert-parallel dispatcher passes the EP conformance suite on 2 gloo ranks."""

from __future__ import annotations

import pytest

from deepinfer_core.testing.ep import ExpertParallelSuite, builtin_ep_dispatcher


class TestBuiltinExpertParallel(ExpertParallelSuite):
    @pytest.fixture(scope="class")
    @classmethod
    def dispatcher_factory(cls):
        return builtin_ep_dispatcher
