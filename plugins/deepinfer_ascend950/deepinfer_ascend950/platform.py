"""The NPU platform and its out-of-process probe.

Why a subprocess: importing ``torch_npu`` without CANN raises ``ImportError``, and an installed
``torch_npu`` is auto-loaded by ``import torch`` (torch >= 2.5), failing with ``RuntimeError``.
Neither may happen in the host process, which may be a CPU or CUDA engine that merely has this
plugin installed. So the probe asks a fresh interpreter (``TORCH_DEVICE_BACKEND_AUTOLOAD=0``,
explicit ``import torch_npu``) and reads back one JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from deepinfer_core.platform import ProbeResult, TorchPlatform

PROBE_TIMEOUT_S = 120.0
SOC_PREFIX = "Ascend950"

# Runs in the child interpreter; prints exactly one JSON object on its last line.
PROBE_SCRIPT = r"""
import json
report = {}
try:
    import torch
    import torch_npu
except (ImportError, RuntimeError) as exc:
    report["import_error"] = f"{type(exc).__name__}: {exc}"
else:
    try:
        report["device_count"] = int(torch_npu.npu.device_count())
        if report["device_count"] > 0:
            report["soc_name"] = str(torch_npu.npu.get_device_name(0))
            get_soc_version = getattr(torch_npu.npu, "get_soc_version", None)
            report["soc_version"] = None if get_soc_version is None else int(get_soc_version())
    except Exception as exc:
        report["device_error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(report))
"""


def run_probe_subprocess(
    python: str = sys.executable, timeout: float = PROBE_TIMEOUT_S, env: dict | None = None
) -> dict:
    """Run :data:`PROBE_SCRIPT` in a child interpreter and return its report (never raises)."""
    child_env = dict(os.environ if env is None else env)
    child_env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    try:
        done = subprocess.run(
            [python, "-c", PROBE_SCRIPT], capture_output=True, text=True, timeout=timeout, env=child_env
        )
    except subprocess.TimeoutExpired:
        return {"probe_error": f"probe timed out after {timeout:.0f} s"}
    except OSError as exc:
        return {"probe_error": f"probe could not start: {exc}"}
    lines = done.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, ValueError):
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"probe_error": f"probe exited {done.returncode}: {tail}"}


def torch_npu_missing() -> dict | None:
    """The report a child would give when ``torch_npu`` is not installed at all, found without
    starting one (a child interpreter that imports torch costs seconds of every engine's start-up
    on machines with this plugin but no NPU stack); None when it is installed and must be tried."""
    import importlib.util

    try:
        found = importlib.util.find_spec("torch_npu") is not None
    except (ImportError, ValueError):
        found = False
    return None if found else {"import_error": "ModuleNotFoundError: No module named 'torch_npu'"}


def interpret_report(report: dict) -> ProbeResult:
    """Turn the child's report into the answer ``deepinfer plugins`` shows."""
    if "probe_error" in report:
        return ProbeResult(False, report["probe_error"])
    if "import_error" in report:
        return ProbeResult(False, f"torch_npu not importable ({report['import_error']})")
    if "device_error" in report:
        return ProbeResult(False, f"NPU query failed ({report['device_error']})")
    if not report.get("device_count"):
        return ProbeResult(False, "no NPU device")
    name = report.get("soc_name") or ""
    if not name.startswith(SOC_PREFIX):
        version = report.get("soc_version")
        suffix = "" if version is None else f" (soc version {version})"
        return ProbeResult(False, f"SoC {name or 'unknown'}{suffix} is not an Ascend 950")
    return ProbeResult(True, name)


class Ascend950Platform(TorchPlatform):
    """``device_type="npu"``. Device calls go through ``torch.npu``, which exists only once
    torch_npu is loaded: the engine imports it only after the probe said yes."""

    def __init__(self, index: int | None = None) -> None:
        super().__init__("ascend950", "npu")
        self.index = index
        self._probe: ProbeResult | None = None

    def probe(self) -> ProbeResult:
        if self._probe is None:  # one child interpreter per platform object is enough
            self._probe = interpret_report(torch_npu_missing() or run_probe_subprocess())
        return self._probe

    def _module(self):
        if self.probe().usable:
            import torch_npu  # noqa: F401  (registers torch.npu; safe: the probe imported it)
        return getattr(torch, "npu", None)

    def torch_device(self, index: int | None = None) -> torch.device:
        return super().torch_device(self.index if index is None else index)

    def capability(self) -> tuple[int, int] | None:
        return None  # Ascend has no CUDA-style compute capability; the SoC name is in probe()
