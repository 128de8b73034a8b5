"""deepinfer plugin for Huawei Ascend 950 NPUs (torch_npu is an optional extra)."""

from __future__ import annotations

from .platform import Ascend950Platform, interpret_report, run_probe_subprocess

__all__ = ["Ascend950Platform", "interpret_report", "run_probe_subprocess"]
__version__ = "0.1.0"
