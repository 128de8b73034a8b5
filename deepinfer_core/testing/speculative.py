"""Conformance suite for speculative verification policies (``deepinfer_register_spec_policies``).

Subclass :class:`VerificationPolicySuite` and override the ``policy`` fixture. Policies that
claim to maximise expected accepted tokens (DSpark's confidence scheduling) set
``maximises_survival = True``; they are then checked against a brute-force optimum computed here.
"""

from __future__ import annotations

import pytest
import torch

from ..speculative import VerificationPolicy

__all__ = ["BUDGETS", "SHAPES", "VerificationPolicySuite", "survivals"]


BUDGETS = (0, 1, 3, 7, 12, 40)
SHAPES = ((1, 5), (4, 5), (6, 3))


def survivals(confidences: torch.Tensor) -> torch.Tensor:
    """a_k = c_1 * ... * c_k per row, by an explicit loop (independent of any policy)."""
    out = confidences.double().clone()
    for k in range(1, out.shape[1]):
        out[:, k] = out[:, k - 1] * confidences[:, k].double()
    return out


class VerificationPolicySuite:
    """What every :class:`~deepinfer_core.speculative.VerificationPolicy` must do."""

    maximises_survival: bool = False
    device: str = "cpu"

    @pytest.fixture
    def policy(self) -> VerificationPolicy:
        pytest.fail("a VerificationPolicySuite subclass must override the `policy` fixture")

    def confidences(self, shape, seed: int = 0) -> torch.Tensor:
        return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)).to(self.device)

    def test_is_a_policy(self, policy):
        assert isinstance(policy, VerificationPolicy)
        assert isinstance(policy.name, str) and policy.name

    @pytest.mark.parametrize("shape", SHAPES, ids=str)
    @pytest.mark.parametrize("budget", BUDGETS)
    def test_plan_shape_range_and_budget(self, policy, shape, budget):
        plan = policy.plan(self.confidences(shape), budget)
        num_reqs, gamma = shape
        assert plan.shape == (num_reqs,) and plan.dtype == torch.int64
        assert plan.device.type == torch.device(self.device).type
        assert int(plan.min()) >= 0 and int(plan.max()) <= gamma
        assert int(plan.sum()) <= budget

    @pytest.mark.parametrize("budget", BUDGETS)
    def test_top_survivals_are_verified(self, policy, budget):
        if not self.maximises_survival:
            pytest.skip(f"{policy.name} does not claim to maximise expected acceptance")
        conf = self.confidences((5, 5), seed=3)
        plan = policy.plan(conf, budget).cpu()
        surv = survivals(conf.cpu())
        assert int(plan.sum()) == min(budget, surv.numel())
        chosen = sum(float(surv[r, : int(n)].sum()) for r, n in enumerate(plan))
        best = float(surv.flatten().topk(min(budget, surv.numel())).values.sum())
        assert chosen == pytest.approx(best, rel=1e-9), "verified drafts are not the global top survivals"

    @pytest.mark.parametrize("budget", (0, 7))
    def test_plan_reads_nothing_back_from_the_device(self, policy, budget):
        """The sync guard on any machine: on the ``meta`` device a tensor has no values, so a
        plan that reads one back (``.item()``, ``.tolist()``, ``int(t)``, a data-dependent
        ``if``) raises here, as ``torch.cuda.set_sync_debug_mode("error")`` would on a GPU."""
        conf = torch.empty(4, 5, device="meta")
        plan = policy.plan(conf, budget)
        assert plan.device.type == "meta" and tuple(plan.shape) == (4,)

    def test_confident_request_gets_more(self, policy):
        if not self.maximises_survival:
            pytest.skip(f"{policy.name} does not claim to maximise expected acceptance")
        conf = torch.tensor([[0.1, 0.1, 0.1, 0.1], [0.99, 0.99, 0.99, 0.99]], device=self.device)
        assert policy.plan(conf, 4).tolist() == [0, 4]
