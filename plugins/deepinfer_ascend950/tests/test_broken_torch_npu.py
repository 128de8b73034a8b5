"""A broken ``torch_npu`` does not break deepinfer, and the plugin cannot install one (issue 31.6).

An installed ``torch_npu`` without CANN made ``import torch`` itself fail (torch >= 2.5 auto-loads
every "torch.backends" entry point), so every deepinfer command died with "Failed to load the
backend extension: torch_npu". A fake one, registered the way torch_npu registers itself and
raising what torch_npu raises without CANN, is put on the path of a ``deepinfer plugins`` child.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import deepinfer_ascend950

LIBHCCL = "libhccl.so: cannot open shared object file: No such file or directory"


def _fake_torch_npu(root: Path) -> None:
    (root / "torch_npu").mkdir()
    (root / "torch_npu" / "__init__.py").write_text(f"raise ImportError({LIBHCCL!r})\n")
    info = root / "torch_npu-2.13.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch_npu\nVersion: 2.13.0\n")
    (info / "entry_points.txt").write_text("[torch.backends]\ntorch_npu = torch_npu:_autoload\n")


def test_deepinfer_plugins_survives_a_broken_torch_npu_and_says_why(tmp_path):
    _fake_torch_npu(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DEVICE_BACKEND_AUTOLOAD"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), *sys.path])
    broken = subprocess.run([sys.executable, "-c", "import torch"], env=env, capture_output=True, text=True)
    assert "Failed to load the backend extension: torch_npu" in broken.stderr  # the fake does break torch
    done = subprocess.run(
        [sys.executable, "-m", "deepinfer_core.entrypoints", "plugins"], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("ascend950"))
    assert f"no (torch_npu not importable (ImportError: {LIBHCCL}))" in line, line


def test_the_plugin_installs_no_torch_npu_with_any_extra():
    """Each torch-npu release pins one torch: pip resolving it replaced the installed CPU torch."""
    import tomllib  # Python 3.11+

    project = Path(deepinfer_ascend950.__file__).parents[1] / "pyproject.toml"
    meta = tomllib.loads(project.read_text())["project"]
    requirements = meta["dependencies"] + [r for extra in meta.get("optional-dependencies", {}).values() for r in extra]
    assert not [r for r in requirements if r.replace("_", "-").lower().startswith("torch-npu")], requirements
