"""The command line as one package (issue 24, deliverables 6 and 7): every command's engine
options generated from EngineConfig (same names and defaults as ``LLM(model, **options)``), and
the papercuts a new user hit: ports out of range, a port in use found only after the model
loaded, tracebacks from ``plan`` and from a closed pipe, no token-id prompts, help text."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from deepinfer_core.engine.config import EngineConfig, engine_config, engine_options
from deepinfer_core.entrypoints.engine_options import engine_kwargs, flag
from deepinfer_core.entrypoints.main import build_parser, main

ENGINE_COMMANDS = {"generate": ["hello"], "serve": [], "plan": ["--kv-cache-gib", "1"]}


def deepinfer(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "deepinfer_core.entrypoints", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=timeout,
    )


def one_line_error(result: subprocess.CompletedProcess, prefix: str, *needles: str) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# -- engine options ------------------------------------------------------------------------------
@pytest.mark.parametrize("command", sorted(ENGINE_COMMANDS))
def test_every_engine_command_takes_every_field_with_the_engine_default(command):
    args = build_parser().parse_args([command, *ENGINE_COMMANDS[command]])
    given = engine_kwargs(args)
    defaults = {f.name: f.default for f in engine_options()}
    if command == "plan":
        assert given.pop("kv_cache_gib") == 1.0
        defaults.pop("kv_cache_gib")
    assert {k: v for k, v in given.items() if k in defaults} == defaults
    assert set(given) | ({"kv_cache_gib"} if command == "plan" else set()) == {f.name for f in engine_options()}


def test_commands_agree_on_each_option_and_its_parsing():
    """The same flags parse to the same values in generate, serve and plan (serve could not
    choose the attention or MoE backend; plan's --device defaulted to cpu)."""
    line = [
        "--device", "cpu", "--dtype", "float32", "--kv-cache-dtype", "float32", "--max-num-seqs", "3",
        "--attention-backend", "builtin", "--moe-backend", "builtin", "--no-enable-prefix-caching",
        "--overlap-scheduling", "--kv-cache-gib", "0.5", "--kv-store", "memory://", "--seed", "7",
    ]  # fmt: skip
    parsed = [
        engine_kwargs(build_parser().parse_args([c, *line, *(["hi"] if c == "generate" else [])]))
        for c in ENGINE_COMMANDS
    ]
    assert parsed[0] == parsed[1] == parsed[2]
    assert parsed[0]["attention_backend"] == "builtin" and parsed[0]["enable_prefix_caching"] is False
    assert parsed[0]["overlap_scheduling"] is True and parsed[0]["max_num_seqs"] == 3
    assert build_parser().parse_args(["plan", "--kv-gib", "2"]).kv_cache_gib == 2.0  # the older flag
    assert build_parser().parse_args(["serve", "--no-prefix-caching"]).enable_prefix_caching is False


def test_each_field_has_help_and_a_flag_in_help_output():
    for f in engine_options():
        assert f.metadata.get("help"), f"EngineConfig.{f.name} has no help text"
    text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for f in engine_options():
        assert flag(f.name) in text, f.name


def test_llm_signature_and_unknown_option():
    from deepinfer_core import LLM

    params = inspect.signature(LLM).parameters
    for f in dataclasses.fields(EngineConfig):
        assert f.name in params, f.name
        if f.name != "model":
            assert params[f.name].default == f.default and params[f.name].kind is inspect.Parameter.KEYWORD_ONLY
    assert "max_num_seqs" in LLM.__init__.__doc__
    with pytest.raises(TypeError, match=r"unknown engine option 'max_num_seq'; did you mean max_num_seqs\?"):
        LLM("/no/such/model", max_num_seq=4)
    with pytest.raises(TypeError, match=r"unknown engine option 'colour'; the engine options are device, dtype"):
        engine_config("m", colour="red")
    assert engine_config("m", seed=3) == EngineConfig(model="m", seed=3)


def test_engine_config_imports_no_torch():
    """The parsers are built for every command, ``deepinfer version`` included: no torch there."""
    code = "import sys, deepinfer_core.entrypoints.main as m; m.build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


# -- serve ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("port", ["99999", "0", "-1", "http"])
def test_serve_refuses_a_port_out_of_range(port):
    one_line_error(deepinfer("serve", "--port", port), "deepinfer serve: error: argument --port", port)


def test_serve_root_path_is_a_path_prefix():
    assert build_parser().parse_args(["serve", "--root-path", "/deepinfer/"]).root_path == "/deepinfer"
    assert build_parser().parse_args(["serve"]).root_path == ""
    one_line_error(deepinfer("serve", "--root-path", "deepinfer"), "deepinfer serve: error: argument --root-path")


def test_serve_reports_a_port_in_use_before_loading_the_model():
    """The model path does not exist: had it loaded first, the error would name the model."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    pytest.importorskip("deepinfer_recipe")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        started = time.monotonic()
        result = deepinfer("serve", "--port", str(port), "--model", "/no/such/model")
        line = one_line_error(result, "deepinfer serve: error: cannot listen on 127.0.0.1:")
    assert str(port) in line and "/no/such/model" not in line
    assert time.monotonic() - started < 120


def test_serve_help_documents_host_port_and_engine_options():
    text = " ".join(deepinfer("serve", "--help").stdout.split())
    assert "--host HOST address to listen on" in text and "(default: 127.0.0.1)" in text
    assert "--port PORT TCP port to listen on, 1-65535 (default: 8000)" in text
    assert "--attention-backend NAME plugin whose attention kernels to use" in text
    assert "--max-num-seqs N requests decoded together at most (default: 64)" in text


def test_serve_names_how_to_install_the_recipe_plugin():
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    result = deepinfer("serve", env={"DEEPINFER_PLUGINS": "none-installed"})
    one_line_error(result, "deepinfer serve: error: no protocol codecs", "pip install -e plugins/deepinfer_recipe")
    assert "pip install deepinfer-recipe" not in result.stderr  # not published


# -- plan ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--model", "/nope", "--kv-gib", "1"], "/nope"),
        (["--kv-gib", "-1"], "must be > 0"),
        (["--kv-cache-gib", "-1"], "must be > 0"),
        ([], "--kv-cache-gib is required"),
        (["--kv-gib", "1", "--device", "nosuchdevice"], "nosuchdevice"),
    ],
)
def test_plan_errors_are_one_line(args, needle):
    one_line_error(deepinfer("plan", *args), "deepinfer plan: error:", needle)


# -- plugins, help, pipes ------------------------------------------------------------------------
def test_a_closed_pipe_ends_quietly():
    """``deepinfer plugins --json | head -1``: the reader is gone before the output is written."""
    read, write = os.pipe()
    os.close(read)  # every write now fails with EPIPE
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "deepinfer_core.entrypoints", "plugins", "--json"],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
        )
    finally:
        os.close(write)
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr
    assert proc.stderr == "" and proc.returncode == 1


def test_help_prints_each_default_once_and_no_markup():
    for command in ("generate", "serve", "plan", "kv"):
        text = " ".join(deepinfer(command, "--help").stdout.split())
        assert not re.search(r"\(default: [^)]*\) \(default:", text), command
        assert "(default: None)" not in text and "(default: False)" not in text, command
        assert "``" not in text, command
    for action in ("stats", "gc", "ls"):
        assert "``" not in deepinfer("kv", action, "--help").stdout


def test_argparse_errors_are_one_line():
    one_line_error(deepinfer("generate", "--max-num-seqs", "0", "hi"), "deepinfer generate: error:", "must be >= 1")
    one_line_error(deepinfer("kv", "ls"), "deepinfer kv ls: error: --kv-store is required")


# -- token-id prompts on a tiny DeepSeek-V4 checkpoint (no tokenizer) ------------------------------
def test_generate_runs_a_tiny_v4_checkpoint_from_token_ids(tmp_path, capsys):
    pytest.importorskip("safetensors")
    from deepinfer_core import LLM, SamplingParams
    from deepinfer_core.testing.v4_checkpoint import write_tiny_v4_checkpoint

    path = str(tmp_path / "v4")
    write_tiny_v4_checkpoint(path)
    common = ["generate", "--model", path, "--device", "cpu", "--max-tokens", "4", "--kv-cache-blocks", "16"]
    assert main([*common, "--prompt-token-ids", "1,2,3", "--prompt-token-ids", "7, 8", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    llm = LLM(path, device="cpu", kv_cache_blocks=16)
    want = [
        o.outputs[0].token_ids for o in llm.generate([[1, 2, 3], [7, 8]], SamplingParams(temperature=0, max_tokens=4))
    ]
    assert [r["prompt"] for r in rows] == [[1, 2, 3], [7, 8]]
    assert [r["token_ids"] for r in rows] == [list(w) for w in want] and all(len(w) == 4 for w in want)
    assert main([*common, "--prompt-token-ids", "1,2,3", "--stream"]) == 0
    assert capsys.readouterr().out.split() == [str(t) for t in want[0]]
    with pytest.raises(SystemExit) as info:
        main([*common, "--prompt-token-ids", "1,x"])
    assert info.value.code == 2 and "comma-separated token ids such as 1,2,3, got '1,x'" in capsys.readouterr().err


# -- the first run's kernel build says so --------------------------------------------------------
def test_the_kernel_build_is_announced_with_its_duration(tmp_path, monkeypatch, capsys):
    """The first use compiles the low-bit kernels (about a minute): one stderr line when it
    starts, one with the duration when it ends. The compiler is replaced by a stub here."""
    from deepinfer_core.lowbit import native

    built = []

    def fake_build(compiler, flags, output):
        built.append(output)
        time.sleep(0.05)
        with open(output, "wb") as f:
            f.write(b"not a library")

    monkeypatch.setattr(native, "cache_dir", lambda: str(tmp_path))
    monkeypatch.setattr(native, "cpu_supports_kernels", lambda: (True, "test"))
    monkeypatch.setattr(native, "compiler_path", lambda: "cc")
    monkeypatch.setattr(native, "_build", fake_build)
    monkeypatch.setattr(native, "_open", lambda target, isa: native.NativeKernels(None, "stub", isa))
    native.load_isa.__wrapped__("avx2")
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(built) == 1 and len(lines) == 2, lines
    assert lines[0].startswith("deepinfer: building the low-bit CPU kernels (avx2)")
    assert re.match(r"deepinfer: built the low-bit CPU kernels in \d+\.\d s", lines[1]), lines[1]
    native.load_isa.__wrapped__("avx2")  # cached: nothing built, nothing said
    assert len(built) == 1 and capsys.readouterr().err == ""
