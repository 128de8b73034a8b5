"""The golden DeepSeek V4 vectors, kept in this repository (``data/deepseek_v4_encoding/``; the
README there says where they came from). A missing or unreadable file is an error at import,
so every test that needs them fails instead of skipping. (A uniquely named module, so it can be
imported from the test files without making ``tests`` a package that clashes with the core's.)"""

from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "deepseek_v4_encoding"
VECTORS = DATA / "vectors.json"


def load(path: Path) -> dict:
    """The vectors file as a dict; raises (FileNotFoundError / ValueError) when it is absent or
    broken: the tests that use it must fail, not skip."""
    return json.loads(path.read_text(encoding="utf-8"))


GOLDEN = load(VECTORS)
REFERENCE_BEHAVIOUR = DATA / "reference_behaviour.json"
