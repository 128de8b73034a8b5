"""``deepinfer cluster --config FILE.yaml`` (entrypoints/config_file.py), without Ray.

The reference for a file is the command line: the same settings given as flags must give an
equal :class:`ClusterSpec`. Refusals are one line naming the file and the key, exit status 2,
checked before Ray is imported (``ray`` is made unimportable here: a refusal that came after the
import would say "the cluster runs on Ray Serve" instead).
"""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("yaml")

from deepinfer_core.entrypoints.cluster import options_with_config, spec_from_args  # noqa: E402
from deepinfer_core.entrypoints.main import build_parser, main  # noqa: E402

FILE = """\
model: smollm2-135m-instruct
served-model-name: smol
prefill: 1
decode: 2
kv_store: local:///tmp/deepinfer-kv
autoscale: {decode: "1:4"}
tier_bounds: "256,1024,4096"
max-queue: 16
kv_lease: 20
# engine options
max_num_seqs: 8
block_size: 64
enforce_eager: true
enable_prefix_caching: false
"""
FLAGS = [
    "--served-model-name", "smol", "--prefill", "1", "--decode", "2", "--kv-store", "local:///tmp/deepinfer-kv",
    "--autoscale", "decode=1:4", "--tier-bounds", "256,1024,4096", "--max-queue", "16", "--max-num-seqs", "8",
    "--block-size", "64", "--enforce-eager", "--no-enable-prefix-caching", "--kv-lease", "20",
]  # fmt: skip


def spec(*argv: str):
    args = build_parser().parse_args(["cluster", *argv])
    return spec_from_args(options_with_config(args, list(argv)))


def write(tmp_path, text: str) -> str:
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return str(path)


def test_a_file_gives_the_spec_of_the_same_flags(tmp_path):
    from_file = spec("--config", write(tmp_path, FILE))
    assert from_file == spec(*FLAGS)
    assert from_file != spec()  # the file did set something
    assert from_file.autoscale == {"decode": (1, 4)} and from_file.engine_kwargs["enforce_eager"] is True
    assert from_file.engine_kwargs["enable_prefix_caching"] is False
    assert from_file.kv_lease_s == 20.0 and spec().kv_lease_s == 60.0


def test_a_list_of_autoscale_values_is_the_repeated_flag(tmp_path):
    path = write(tmp_path, 'prefill: 1\nkv_store: local:///tmp/kv\nautoscale: ["0:2", "decode=1:4"]\n')
    assert spec("--config", path) == spec(
        "--prefill", "1", "--kv-store", "local:///tmp/kv", "--autoscale", "0:2", "--autoscale", "decode=1:4"
    )


def test_flags_win_over_the_file(tmp_path):
    path = write(tmp_path, FILE)
    # --decode 1 is the default: a flag given is a flag given, whatever its value
    s = spec("--decode", "1", "--config", path, "--no-enforce-eager", "--autoscale", "decode=2:6")
    assert s.decode == 1 and s.engine_kwargs["enforce_eager"] is False
    assert s.autoscale == {"decode": (2, 6)}
    assert s.prefill == 1 and s.engine_kwargs["max_num_seqs"] == 8  # the rest from the file


def test_null_and_empty_file_mean_the_defaults(tmp_path):
    assert spec("--config", write(tmp_path, "")) == spec()
    assert spec("--config", write(tmp_path, "kv_store: null\ndecode: 1\n")) == spec()


@pytest.mark.parametrize(
    "text, needle",
    [
        ("decodes: 2\n", "unknown key 'decodes' (did you mean 'decode'?)"),
        ("config: other.yaml\n", "unknown key 'config'"),
        ("decode: two\n", "key 'decode': invalid int value: 'two'"),
        ("decode: [1, 2]\n", "key 'decode': expected one value, got a list"),
        ("max_num_seqs: true\n", "key 'max_num_seqs': expected one value, got a boolean"),
        ("enforce_eager: 1\n", "key 'enforce_eager': expected true or false"),
        ("block_size: 0\n", "key 'block_size': must be >= 1, got 0"),
        ("dtype: float8\n", "key 'dtype': invalid choice: 'float8'"),
        ("autoscale: {decode: [1, 4]}\n", "key 'autoscale': expected a value, a list or a mapping"),
        ("- decode: 2\n", "expected a mapping of option: value, got a list"),
        ("decode: [1\n", "not valid YAML"),
    ],
)
def test_a_bad_file_is_refused_in_one_line_before_ray(tmp_path, monkeypatch, capsys, text, needle):
    path = write(tmp_path, text)
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails: the check must come first
    status = main(["cluster", "--config", path])
    err = capsys.readouterr().err
    assert status == 2 and err.startswith(f"deepinfer cluster: error: --config {path}: "), err
    assert needle in err and err.count("\n") == 1, err


def test_a_missing_file_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)
    status = main(["cluster", "--config", str(tmp_path / "nope.yaml")])
    err = capsys.readouterr().err
    assert status == 2 and "nope.yaml: cannot read it (No such file or directory)" in err
    assert err.count("\n") == 1


def test_a_good_file_reaches_the_ray_import(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)
    status = main(["cluster", "--config", write(tmp_path, FILE)])
    assert status == 2 and "the cluster runs on Ray Serve" in capsys.readouterr().err
