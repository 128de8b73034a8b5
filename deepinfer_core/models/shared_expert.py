"""A MoE layer's shared expert in the routed experts' launches: a dispatcher's optional
``forward_with_shared(spec, hidden, topk_ids, topk_weights, experts, shared)`` (docs/writing-plugins.md)
takes the shared expert as a one-expert stack and returns the layer's whole output, or None to
decline (the layer then runs its shared MLP itself and adds it). DeepSeek-V3 and V4 layers share
this through :class:`SharedExpertFold`."""

from __future__ import annotations

import torch
import torch.nn as nn

from ..moe import ExpertWeights
from .fp8 import Fp8Linear
from .layers import FusedLinear


def shared_expert_weights(gate_up: nn.Module, down: nn.Module) -> ExpertWeights | None:
    """A shared expert's two projections as a one-expert stack (views of their weights: FP8 with
    their scales, else the plain 16/32-bit weights); None where they are not bias-free plain
    linears or FP8 modules (e.g. packed low-bit modules)."""
    if isinstance(gate_up, Fp8Linear) and isinstance(down, Fp8Linear):
        return ExpertWeights(
            gate_up.weight_fp8[None], down.weight_fp8[None], gate_up.scale_inv[None], down.scale_inv[None]
        )
    w1, w2 = getattr(gate_up, "weight", None), getattr(down, "weight", None)
    plain = type(gate_up).forward is FusedLinear.forward and type(down).forward is nn.Linear.forward
    if plain and isinstance(w1, torch.Tensor) and isinstance(w2, torch.Tensor):
        if gate_up.bias is None and down.bias is None:
            return ExpertWeights(w1[None], w2[None])
    return None


class SharedExpertFold:
    """For a MoE layer with ``spec``, ``dispatcher`` and ``shared_experts`` (a module with
    ``gate_up_proj`` / ``down_proj``, or None): the shared expert derived once as a one-expert
    stack and handed to the dispatcher's ``forward_with_shared`` where it has one."""

    _shared: tuple[ExpertWeights | None] | None = None  # (shared_weights(),) once derived

    def shared_weights(self) -> ExpertWeights | None:
        """The shared expert as a one-expert stack, None without one or where its projections do
        not fit (:func:`shared_expert_weights`)."""
        mlp = self.shared_experts
        return None if mlp is None else shared_expert_weights(mlp.gate_up_proj, mlp.down_proj)

    def bind_shared(self) -> None:
        """Derive :meth:`shared_weights` once the weights are in place (``load_weights`` calls
        it), instead of rebuilding its views on every forward; call it again after replacing the
        shared expert's weights (its views would still read the old ones)."""
        self._shared = (self.shared_weights(),)

    def forward_folded(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: ExpertWeights
    ) -> torch.Tensor | None:
        """The layer's output (routed + shared) from the dispatcher's ``forward_with_shared``, or
        None where it has none, there is no shared expert to fold, or it declines."""
        both = getattr(self.dispatcher, "forward_with_shared", None)
        if both is None:
            return None
        if self._shared is None:  # a layer used without load_weights
            self.bind_shared()
        shared = self._shared[0]
        return None if shared is None else both(self.spec, x, ids, weights, experts, shared)
