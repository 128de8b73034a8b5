"""Reading DeepSeek-V3-style FP8 checkpoints (``quantization_config.quant_method == "fp8"``,
``weight_block_size [128, 128]``): each FP8 ``X.weight`` comes with a float32
``X.weight_scale_inv`` of one scale per 128 x 128 tile.

Two streams over the same files: :func:`iter_dequantized` (every FP8 weight times its scales,
float32: the reference path and any platform without FP8 kernels), and :func:`iter_keeping`,
which passes the weights a model keeps FP8 (:func:`deepinfer_core.models.fp8.swap_in_fp8`)
through with their scales and dequantizes the rest.
"""

from __future__ import annotations

import json
import struct
from typing import Iterator

import torch

from .. import WeightsError
from ..fp8 import FP8_BLOCK, dequantize

SCALE = "_scale_inv"


def is_fp8_block_checkpoint(config: dict) -> bool:
    """True for a DeepSeek FP8 block-quantized config; a ValueError naming the field for an FP8
    config in a block format this reader does not know."""
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") != "fp8":
        return False
    block = list(quant.get("weight_block_size") or [])
    if block != [FP8_BLOCK, FP8_BLOCK]:
        raise ValueError(
            f"quantization_config.weight_block_size is {block or 'missing'}; FP8 checkpoints are read with "
            "[128, 128] blocks only"
        )
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt is {fmt!r}; FP8 checkpoints are read in 'e4m3' only")
    return True


def _header(path: str) -> dict:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length))


def fp8_index(paths: list[str]) -> dict[str, str]:
    """``{FP8 weight name: shard path of its scale}`` from the shards' headers (no tensor read);
    a scale grid of the wrong shape or an FP8 weight without scales is a WeightsError."""
    where: dict[str, tuple[str, dict]] = {}
    for path in paths:
        for name, meta in _header(path).items():
            if name != "__metadata__":
                where[name] = (path, meta)
    index, problems = {}, []
    for name, (_, meta) in where.items():
        if meta["dtype"] != "F8_E4M3":
            continue
        if name + SCALE not in where:
            problems.append(f"{name}: FP8 weight without {name + SCALE}")
            continue
        spath, smeta = where[name + SCALE]
        want = [*meta["shape"][:-2], *(-(-d // FP8_BLOCK) for d in meta["shape"][-2:])]
        if smeta["shape"] != want:
            problems.append(f"{name + SCALE}: got {smeta['shape']}, expected {want} for a {meta['shape']} weight")
            continue
        index[name] = spath
    if problems:
        raise WeightsError("FP8 checkpoint is inconsistent: " + "; ".join(problems))
    return index


def iter_keeping(
    paths: list[str], index: dict[str, str], keep: frozenset[str] | set[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)``: weights in ``keep`` as their FP8 values (float32, exact) followed by
    their scales; other FP8 weights dequantized; everything else float32 (integers as they are)."""
    from safetensors import safe_open

    for path in paths:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name.endswith(SCALE) and name[: -len(SCALE)] in index:
                    continue  # travels with its weight
                tensor = f.get_tensor(name)
                if name in index:
                    scale = _get(f, path, index[name], name + SCALE)
                    if name in keep:
                        yield name, tensor.float()
                        yield name + SCALE, scale.float()
                        continue
                    tensor = dequantize(tensor, scale.float())
                yield name, tensor.float() if tensor.is_floating_point() else tensor


def iter_dequantized(paths: list[str], index: dict[str, str]) -> Iterator[tuple[str, torch.Tensor]]:
    return iter_keeping(paths, index, frozenset())


def _get(f, path: str, scale_path: str, name: str) -> torch.Tensor:
    if scale_path == path:
        return f.get_tensor(name)
    from safetensors import safe_open

    with safe_open(scale_path, framework="pt") as other:
        return other.get_tensor(name)
