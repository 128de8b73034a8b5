"""The V4 parser's C front (``deepseek_v4/_quiet.c``) against the pure-Python quiet push.

The helper is compiled when the first parser is made; where a C compiler and the interpreter's
headers exist it must build (a broken build fails here instead of silently falling back). The
parser with its C front and the parser alone (pure-Python quiet push) must give exactly the
one-shot parse for any text and any chunking, including pieces the front hands back to Python
(bars, lone surrogates, ``str`` subclasses) and non-ASCII text it stores as UTF-8.
"""

from __future__ import annotations

import gc
import json
import os
import random
import shutil
import sysconfig
import types
import weakref

import pytest

from deepinfer_recipe.deepseek_v4 import DeepSeekV4Parser, native, new_parser

HELPER = native.load()
CAN_BUILD = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang") or os.environ.get("CC")
CAN_BUILD = bool(CAN_BUILD) and os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
needs_helper = pytest.mark.skipif(
    HELPER.module is None or not native.enabled(),
    reason=f"no C front here: {HELPER.reason or 'DEEPINFER_NATIVE_PARSER=0'}",
)

HEAD = 'ok\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="a" string="true">'
TAIL = (
    '</｜DSML｜parameter>\n</｜DSML｜invoke>\n<｜DSML｜invoke name="g">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>tail'
)
WORDS = [
    "lorem ipsum dolor sit amet ",
    "｜",
    "a｜b ",
    "</｜DSML｜invok",
    "<｜end▁of▁sent",
    "\n",
    "中文 ",
    "🌍",
    "é ",
    "\ud800",
    "x" * 40,
]


def parse(pieces, accelerate: bool) -> tuple:
    parser = new_parser(thinking=False, accelerate=accelerate)
    outs = [parser.push(p) for p in pieces] + [parser.finish()]
    return ("".join(o.content for o in outs), [(c.name, c.arguments) for o in outs for c in o.tool_calls])


def test_helper_builds_wherever_a_compiler_and_headers_exist():
    if CAN_BUILD:
        assert HELPER.module is not None, HELPER.reason
    else:
        assert HELPER.reason


@needs_helper
def test_long_quiet_run_is_stored_by_the_c_front():
    """The C path is really the one streaming (else the comparisons below compare Python with itself)."""
    front = new_parser(thinking=False, accelerate=True)
    assert isinstance(front, HELPER.module.Front) and isinstance(front.logic, DeepSeekV4Parser)
    for piece in [HEAD] + ["abcd"] * 20:
        front.push(piece)
    assert front._q_on and len(front.logic._pieces) < 10  # the parser holds the first few pieces,
    stored = front._take()  # the front the rest
    assert "".join(front.logic._pieces) + stored == HEAD[HEAD.index("\n<｜DSML｜invoke") :] + "abcd" * 20
    python = new_parser(thinking=False, accelerate=False)
    assert isinstance(python, DeepSeekV4Parser)
    for piece in [HEAD] + ["abcd"] * 20:
        python.push(piece)
    assert isinstance(python.push, types.FunctionType)  # the quiet closure


@needs_helper
@pytest.mark.parametrize("seed", range(30))
def test_c_front_and_python_quiet_push_equal_the_one_shot_parse(seed):
    rng = random.Random(seed)
    value = "".join(rng.choice(WORDS) for _ in range(rng.randint(20, 150)))
    text = HEAD + value + TAIL
    whole = parse([text], accelerate=False)
    assert json.loads(whole[1][0][1]) == {"a": value}
    pieces, i = [], 0
    while i < len(text):
        step = rng.choice((1, 2, 4, 4, 4, 7, 30))
        pieces.append(text[i : i + step])
        i += step
    assert parse(pieces, accelerate=True) == whole
    assert parse(pieces, accelerate=False) == whole


class Piece(str):
    """A str subclass: the front does not trust it and hands it to Python."""


@needs_helper
def test_str_subclass_and_truncated_output_in_quiet_state():
    pieces = [HEAD] + ["abcd"] * 10 + [Piece("efgh")] + ["ijkl"] * 10
    content, calls = parse(pieces + [TAIL], accelerate=True)
    assert json.loads(calls[0][1]) == {"a": "abcd" * 10 + "efgh" + "ijkl" * 10}
    assert parse(pieces + [TAIL], accelerate=False) == (content, calls)
    # a length stop inside the argument: stored text is taken by finish, the call is dropped
    assert parse(pieces, accelerate=True) == parse(pieces, accelerate=False) == ("ok", [])


@needs_helper
def test_front_and_parser_are_freed():
    """The front and its parser refer to each other; the cycle must be collectable."""
    front = new_parser(thinking=False, accelerate=True)
    for piece in [HEAD] + ["abcd"] * 20:
        front.push(piece)
    logic = weakref.ref(front.logic)
    del front
    gc.collect()
    assert logic() is None


def test_failed_build_falls_back_to_python(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "false")  # a compiler that always fails
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))
    helper = native.load.__wrapped__()
    assert helper.module is None and "failed" in helper.reason
    assert os.listdir(tmp_path / "native") == []  # no half-written file left behind
    monkeypatch.setattr(native, "load", lambda: helper)
    pieces = [HEAD] + ["abcd"] * 30 + [TAIL]
    assert isinstance(new_parser(thinking=False, accelerate=True), DeepSeekV4Parser)
    assert parse(pieces, accelerate=True) == parse(["".join(pieces)], accelerate=False)


@pytest.mark.skipif(not CAN_BUILD, reason="no C compiler or no Python.h: nothing is built")
def test_a_new_build_prunes_older_versions(tmp_path, monkeypatch):
    """A fresh build (another source, flags or interpreter gives another file name) leaves the
    three most recently used builds: its own and the two newest of four stale ones."""
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))
    folder = tmp_path / "native"
    folder.mkdir()
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    stale = [folder / f"v4quiet-000000000000000{age}{suffix}" for age in (1, 2, 3, 4)]
    for age, path in enumerate(stale, 1):
        path.write_bytes(b"not a real build")
        stamp = path.stat().st_mtime - age * 3600  # last used ``age`` hours ago
        os.utime(path, (stamp, stamp))
    helper = native.load.__wrapped__()
    assert helper.module is not None, helper.reason
    left = sorted(p.name for p in folder.iterdir())
    built = [name for name in left if name not in {p.name for p in stale}]
    assert len(built) == 1 and built[0].startswith("v4quiet-")
    assert left == sorted([built[0], stale[0].name, stale[1].name])


def test_environment_switch_turns_the_helper_off(monkeypatch):
    monkeypatch.setenv("DEEPINFER_NATIVE_PARSER", "0")
    assert isinstance(new_parser(thinking=False), DeepSeekV4Parser)
