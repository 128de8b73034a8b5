"""The registry of model file formats (models/loaders/files.FileFormats): a path finds its loader
by file type, and a format added to the registry is found the same way as the builtin ones."""

from __future__ import annotations

import pytest

from deepinfer_core.models import ModelFilesNotFound
from deepinfer_core.models.loaders.files import FileFormat, FileFormats
from deepinfer_core.models.loaders.formats import BUILTIN_FORMATS


def opener(kind: str):
    return lambda path: (kind, path)  # stands in for the ModelFiles a loader returns


TOY = FileFormats(
    [
        FileFormat("marked directory", opener("marked"), marker="model.toml"),
        FileFormat("toy file", opener("toy"), suffix=".toy"),
        FileFormat("other file", opener("other"), suffix=".other"),
    ]
)


def test_builtin_formats_are_keyed_by_gguf_suffix_and_hf_config():
    assert set(BUILTIN_FORMATS.by_suffix) == {".gguf"} and set(BUILTIN_FORMATS.by_marker) == {"config.json"}


def test_a_path_finds_its_format_by_file_type(tmp_path):
    (tmp_path / "a.toy").write_text("")
    assert TOY.open(tmp_path / "a.toy") == ("toy", str(tmp_path / "a.toy"))
    assert TOY.open(tmp_path) == ("toy", str(tmp_path / "a.toy"))  # the one .toy file of a directory
    (tmp_path / "model.toml").write_text("")
    assert TOY.open(tmp_path) == ("marked", str(tmp_path))  # a marker file wins over a lone file in the directory


def test_paths_that_hold_no_single_model_are_clear_errors(tmp_path):
    with pytest.raises(ModelFilesNotFound, match="does not exist .expected a .toy file or a .other file or a model"):
        TOY.open(tmp_path / "absent")
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(ValueError, match="is not a model: expected a .toy file or a .other file or a directory with"):
        TOY.open(tmp_path / "notes.txt")
    with pytest.raises(ModelFilesNotFound, match=r"no model.toml or .toy weights or .other weights in"):
        TOY.open(tmp_path)
    (tmp_path / "a.other").write_text("")
    (tmp_path / "b.other").write_text("")
    with pytest.raises(ValueError, match=r"several .other files \(a.other, b.other\); pass the one to load"):
        TOY.open(tmp_path)


def test_a_file_type_is_claimed_once():
    with pytest.raises(ValueError, match="both claim '.toy'"):
        FileFormats([FileFormat("a", opener("a"), suffix=".toy"), FileFormat("b", opener("b"), suffix=".toy")])
    with pytest.raises(ValueError, match="exactly one of a suffix and a marker"):
        FileFormats([FileFormat("c", opener("c"))])
