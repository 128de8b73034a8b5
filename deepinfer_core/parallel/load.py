"""Per-expert load counted on the device, in windows of steps, for the EPLB planner.

Each MoE layer that was given an :class:`ExpertLoadCounter` (through ``ModelContext.expert_load``)
adds its router's choices to one row of a ``[layers, experts]`` int64 buffer on the device after
choosing experts: one ``index_add_`` of ones at the chosen ids, no value read back, so counting
never synchronises the host with the device and is captured by decode graphs like any other
kernel. The engine calls :meth:`~ExpertLoadCounter.step` once per step; every ``window`` steps the
window's counts move into a ring of the last ``history`` windows (DeepSeek: load gathered every
1,000 steps, experts re-placed every 10,000, i.e. ``window=1000, history=10``).
:meth:`~ExpertLoadCounter.load` sums the finished windows, still on the device; the planner's
caller copies it to the host once per re-placement.

What is counted is the logical experts the router chose, per token (padding rows of a captured
decode batch included), hash-routed layers too: their experts need placing as well.
"""

from __future__ import annotations

import torch

__all__ = ["ExpertLoadCounter"]


class ExpertLoadCounter:
    """Routed tokens per (MoE layer, logical expert), counted on ``device``.

    Layers join at model build time (:meth:`add_layer`, with the model's layer index); rows
    follow the order they joined, which :attr:`layers` lists."""

    def __init__(self, device: torch.device | str, window: int, history: int = 10) -> None:
        if window < 1 or history < 1:
            raise ValueError(f"window and history must be >= 1, got {window} and {history}")
        self.device = torch.device(device)
        self.window, self.history = window, history
        self.layers: tuple[int, ...] = ()
        self._row: dict[int, int] = {}
        self.num_experts = 0
        self.counts = torch.zeros(0, 0, dtype=torch.long, device=self.device)  # [L, E] this window
        self.windows = torch.zeros(history, 0, 0, dtype=torch.long, device=self.device)  # ring [W, L, E]
        self._ones = torch.ones(0, dtype=torch.long, device=self.device)
        self.steps = 0  # steps begun (host-side count)
        self.windows_done = 0

    def add_layer(self, layer_index: int, num_experts: int) -> None:
        """Give MoE layer ``layer_index`` a row (at build time: it resets every count)."""
        if self.num_experts and num_experts != self.num_experts:
            raise ValueError(f"layer {layer_index} has {num_experts} experts, the others {self.num_experts}")
        if layer_index in self._row:
            raise ValueError(f"layer {layer_index} was added twice")
        self._row[layer_index] = len(self.layers)
        self.layers += (layer_index,)
        self.num_experts = num_experts
        shape = (len(self.layers), num_experts)
        self.counts = torch.zeros(shape, dtype=torch.long, device=self.device)
        self.windows = torch.zeros((self.history, *shape), dtype=torch.long, device=self.device)
        self.steps = self.windows_done = 0

    def record(self, layer_index: int, topk_ids: torch.Tensor) -> None:
        """Count one forward's router choices (``topk_ids [T, k]`` logical expert ids) of a layer."""
        flat = topk_ids.reshape(-1)
        n = flat.shape[0]  # a shape, known on the host: no sync
        if self._ones.shape[0] < n:
            self._ones = torch.ones(max(n, 2 * self._ones.shape[0]), dtype=torch.long, device=self.device)
        self.counts[self._row[layer_index]].index_add_(0, flat.to(self.device), self._ones[:n])

    def step(self) -> None:
        """Begin a step: when the steps so far fill a window, move its counts into the ring."""
        if self.steps and self.steps % self.window == 0:
            self.windows[self.windows_done % self.history].copy_(self.counts)
            self.counts.zero_()
            self.windows_done += 1
        self.steps += 1

    def load(self) -> torch.Tensor:
        """``[L, E]`` int64 on the device: the tokens of the last ``min(windows_done, history)``
        finished windows (zeros before the first window ends)."""
        return self.windows.sum(dim=0)

    def last_window(self) -> torch.Tensor:
        """``[L, E]`` int64: the most recent finished window (zeros before the first)."""
        return self.windows[(self.windows_done - 1) % self.history].clone() if self.windows_done else self.counts * 0
