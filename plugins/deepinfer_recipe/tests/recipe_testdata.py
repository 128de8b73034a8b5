"""Where the golden DeepSeek V4 vectors are: ``$DEEPINFER_TESTDATA`` or a ``testdata`` /
``shared/testdata`` folder above this file. (A uniquely named module, so it can be imported
from the test files without making ``tests`` a package that clashes with the core's.)"""
from __future__ import annotations

import json
import os
from pathlib import Path

VECTORS = Path("deepseek_v4_encoding") / "vectors.json"


def _find_vectors() -> Path | None:
    roots = [Path(os.environ["DEEPINFER_TESTDATA"])] if os.environ.get("DEEPINFER_TESTDATA") else []
    for parent in Path(__file__).resolve().parents:
        roots += [parent / "testdata", parent / "shared" / "testdata"]
    for root in roots:
        if (root / VECTORS).is_file():
            return root / VECTORS
    return None


def load_vectors() -> dict:
    path = _find_vectors()
    return json.loads(path.read_text(encoding="utf-8")) if path else {"encode": [], "parse": []}


GOLDEN = load_vectors()

