"""The low-bit CPU backend as a builtin plugin (``core.lowbit``, every hook ``trylast``).

Its kernels live in :mod:`deepinfer_core.lowbit` (packed GGUF block formats, C kernels compiled
at first use, paged decode attention in C); this package is how the engine reaches them, only
through hooks:

- ``deepinfer_weight_format``: :class:`.weight_format.LowBitWeightFormat` for a block-quantized
  GGUF on CPU with dtype ``auto`` (packs the loader's tensors, swaps the packed modules in,
  chooses the KV cache dtype, and gives each layer the paged-decode form of the torch reference
  attention through ``WeightFormat.attention_backend``);
- ``deepinfer_fused_decode_step``: :mod:`.llama_decode`'s one native call per step for a Llama
  model on those weights;
- ``deepinfer_probe``: whether the kernels can be built here and for which instruction set.

Blocked (``DEEPINFER_PLUGINS=-core.lowbit``) the engine loads the same files dequantized.
"""

from __future__ import annotations

from ...hookspecs import hookimpl
from ...platform import ProbeResult

NAME = "core.lowbit"


@hookimpl(trylast=True)
def deepinfer_probe() -> ProbeResult:
    """Checked without building the kernels: AVX2 and a C compiler, and the instruction set the
    kernels would be built for (``native.isa_choice``)."""
    from ...lowbit.native import compiler_path, cpu_supports_kernels, describe_isa, isa_choice

    try:
        ok, why = cpu_supports_kernels()
        if ok and compiler_path() is None:
            ok, why = False, "no C compiler (set CC or install gcc/clang)"
        if not ok:
            return ProbeResult(False, f"{why}; quantized GGUFs load dequantized")
        return ProbeResult(
            True, f"dtype auto keeps a quantized GGUF's weights packed (kernels {describe_isa(isa_choice())})"
        )
    except Exception as exc:  # DEEPINFER_LOWBIT_ISA refused, an unreadable /proc/cpuinfo
        return ProbeResult(False, str(exc))


@hookimpl(trylast=True)
def deepinfer_weight_format(weights, platform):
    from .weight_format import CLAIMED_DTYPES, LowBitWeightFormat

    if platform.device_type != "cpu" or not weights.quantized_names or weights.dtype not in CLAIMED_DTYPES:
        return None
    return LowBitWeightFormat(weights)


@hookimpl(trylast=True)
def deepinfer_fused_decode_step(model, platform):
    from ...lowbit.modules import LowBitLinear
    from ...models.llama.model import LlamaForCausalLM
    from .llama_decode import plan_for

    if platform.device_type != "cpu" or not isinstance(model, LlamaForCausalLM) or not len(model.model.layers):
        return None
    if not isinstance(model.model.layers[0].self_attn.o_proj, LowBitLinear):
        return None  # dense weights: the model's own layers
    return plan_for(model)
