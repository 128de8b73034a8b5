"""Expert-parallel load balancing (EPLB): where each routed expert's copies live.

A layer has ``E`` logical experts (the model's) and ``S >= E`` physical slots spread evenly over
``D`` devices (``S / D`` slots each); a hot expert may fill several slots (replicas), each taking
an equal share of its tokens. :func:`plan_placement` turns measured per-expert load into a
placement that evens out the tokens each device computes:

1. **replicas**: every expert gets one slot; each spare slot goes, one at a time, to the expert
   with the highest load per replica (this minimises the largest per-replica load);
2. **packing**: the replicas, heaviest first, each go to the lightest device that still has a free
   slot (balanced packing with equal slot counts), then pairwise swaps between the busiest device
   and another while they lower the busier of the two;
3. **guard**: per layer, the plan is kept only if its busiest device is no busier than under
   :func:`identity_placement` (the layout a deployment starts from); otherwise the identity is
   returned for that layer, so re-planning never makes balance worse.

Two policies (DeepSeek's), chosen by the arguments:

- **hierarchical** (``num_groups % num_nodes == 0``): the ``num_groups`` expert groups (the
  router's group-limited routing splits the experts into equal consecutive groups) are first
  packed onto the ``num_nodes`` nodes, ``num_groups / num_nodes`` groups each, balancing the
  groups' load (heaviest first, then swaps, as in step 2); then steps 1-3 run inside each node
  on its experts, its ``S / num_nodes`` slots and its ``D / num_nodes`` devices. Every replica
  of a group's experts stays on that group's node, so group-limited routing keeps a token's
  experts on few nodes.
- **global** (otherwise): steps 1-3 over all experts, slots and devices.

Layouts (all int64, on the CPU)::

    physical slot p lives on device p // (S / D)   (devices are EP ranks, nodes hold D / N consecutive devices)
    physical_to_logical  [L, S]        logical expert held by each slot
    logical_to_physical  [L, E, S-E+1] slots of each expert, ascending, padded with -1
                                       (the width fits the most replicas any plan of S slots can give,
                                       so the table's shape never changes between plans)
    replica_counts       [L, E]        slots per expert (>= 1)

:class:`MigrationPlan` compares an old and a new ``physical_to_logical``: which slots change and
where each changed slot's weights can be read. Everything here is pure tensor bookkeeping on the
host (a plan per few thousand steps); the load it reads is counted on the device by
:class:`~deepinfer_core.parallel.load.ExpertLoadCounter`.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

__all__ = [
    "MigrationPlan",
    "balance",
    "device_loads",
    "identity_placement",
    "plan_placement",
    "tables_from_physical",
]


def plan_placement(
    load: torch.Tensor,  # [L, E] tokens per expert (float or int, any device)
    num_physical_slots: int,
    num_groups: int,
    num_nodes: int,
    num_devices: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(physical_to_logical [L, S], logical_to_physical [L, E, S-E+1], replica_counts [L, E])``
    for ``load``; the hierarchical policy when ``num_groups % num_nodes == 0``, else the global
    one (module docstring). ``ValueError`` names the first impossible argument."""
    weights = _check(load, num_physical_slots, num_groups, num_nodes, num_devices)
    L, E = weights.shape
    S, D = num_physical_slots, num_devices
    hierarchical = num_groups % num_nodes == 0
    identity = identity_placement(L, E, S, num_nodes if hierarchical else 1)
    identity_max = device_loads(weights, identity, D).max(dim=1).values
    rows = []
    for layer in range(L):
        row = _plan_layer(weights[layer].tolist(), S, num_groups, num_nodes, D, hierarchical)
        planned = torch.tensor(row, dtype=torch.long)
        planned_max = device_loads(weights[layer : layer + 1], planned[None], D).max()
        # the guard: never hand back a layer busier than the layout a deployment starts from
        rows.append(planned if planned_max <= identity_max[layer] * (1 + 1e-12) else identity[layer])
    physical_to_logical = torch.stack(rows)
    logical_to_physical, replica_counts = tables_from_physical(physical_to_logical, E)
    return physical_to_logical, logical_to_physical, replica_counts


def identity_placement(num_layers: int, num_experts: int, num_physical_slots: int, num_nodes: int = 1) -> torch.Tensor:
    """The placement without planning, ``[L, S]``: each node's slots hold that node's experts (the
    ``E / N`` consecutive ones) in order, the spare slots starting over from the node's first
    expert. With one node that is slot ``p`` -> expert ``p % E``; with ``S == E``, slot ``p`` ->
    expert ``p``."""
    if num_experts % num_nodes or num_physical_slots % num_nodes:
        raise ValueError(f"{num_experts} experts and {num_physical_slots} slots do not split over {num_nodes} nodes")
    per_node_experts, per_node_slots = num_experts // num_nodes, num_physical_slots // num_nodes
    slot = torch.arange(num_physical_slots)
    row = (slot // per_node_slots) * per_node_experts + (slot % per_node_slots) % per_node_experts
    return row.expand(num_layers, -1).clone()


def tables_from_physical(physical_to_logical: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logical_to_physical [L, E, S-E+1], replica_counts [L, E])`` of a ``[L, S]`` placement
    (slots ascending, padded with -1). ``ValueError`` if some expert has no slot."""
    p2l = physical_to_logical.long().cpu()
    L, S = p2l.shape
    if S < num_experts:
        raise ValueError(f"{S} slots cannot hold {num_experts} experts")
    counts = torch.zeros(L, num_experts, dtype=torch.long).scatter_add_(1, p2l, torch.ones_like(p2l))
    if bool((counts == 0).any()):
        layer, expert = (counts == 0).nonzero()[0].tolist()
        raise ValueError(f"layer {layer}: expert {expert} has no slot")
    # slots sorted by (expert, slot): a stable sort by expert keeps slots ascending within one
    order = torch.sort(p2l, dim=1, stable=True).indices  # [L, S]
    start = torch.cumsum(counts, dim=1) - counts  # [L, E] first position of each expert in `order`
    rank = torch.arange(S).expand(L, S) - start.gather(1, p2l.gather(1, order))  # replica number
    table = torch.full((L, num_experts, S - num_experts + 1), -1, dtype=torch.long)
    layer_ix = torch.arange(L)[:, None].expand(L, S)
    table[layer_ix, p2l.gather(1, order), rank] = order
    return table, counts


def device_loads(load: torch.Tensor, physical_to_logical: torch.Tensor, num_devices: int) -> torch.Tensor:
    """``[L, D]`` float64: tokens each device computes when each expert's ``load`` is split evenly
    over its replicas."""
    weights = load.detach().to("cpu", torch.float64)
    p2l = physical_to_logical.long().cpu()
    L, S = p2l.shape
    if S % num_devices:
        raise ValueError(f"{S} slots do not split evenly over {num_devices} devices")
    counts = torch.zeros(weights.shape, dtype=torch.float64).scatter_add_(
        1, p2l, torch.ones(p2l.shape, dtype=torch.float64)
    )
    per_slot = weights.gather(1, p2l) / counts.gather(1, p2l)  # [L, S]
    return per_slot.view(L, num_devices, S // num_devices).sum(dim=2)


def balance(load: torch.Tensor, placement: torch.Tensor, num_devices: int) -> torch.Tensor:
    """``[L]`` float64: the busiest device's tokens over the mean device's, per layer (1.0 is
    perfect; a layer without load counts as 1.0). ``placement`` is a ``physical_to_logical``."""
    per_device = device_loads(load, placement, num_devices)
    mean = per_device.mean(dim=1)
    return torch.where(mean > 0, per_device.max(dim=1).values / mean.clamp_min(1e-300), torch.ones_like(mean))


@dataclass(frozen=True)
class MigrationPlan:
    """What changes between two placements of ``S`` slots on ``D`` devices.

    ``new_physical_to_logical`` is the new placement with each device's slots reordered so that an
    expert the device already holds stays in its old slot (same balance, fewer copies): use it,
    and :func:`tables_from_physical` for its other tables, instead of the planner's raw output.
    ``changed [L, S]``: slots whose expert changes. For a changed slot, ``source_device`` and
    ``source_slot`` name a slot of the *old* placement that holds the new expert (the destination
    device itself when it can, else the holder with the fewest copies assigned so far in that
    layer); -1 for unchanged slots. Sources refer to the old weights: read every source before
    overwriting any slot (or copy through a staging buffer)."""

    new_physical_to_logical: torch.Tensor  # [L, S]
    changed: torch.Tensor  # [L, S] bool
    source_device: torch.Tensor  # [L, S] long, -1 where unchanged
    source_slot: torch.Tensor  # [L, S] long, -1 where unchanged
    num_devices: int

    @classmethod
    def between(cls, old: torch.Tensor, new: torch.Tensor, num_devices: int) -> MigrationPlan:
        """The plan that turns placement ``old`` ([L, S]) into ``new`` (reordered within devices)."""
        old_p2l, new_p2l = old.long().cpu(), new.long().cpu()
        if old_p2l.shape != new_p2l.shape or old_p2l.dim() != 2:
            raise ValueError(f"placements must both be [layers, slots], got {tuple(old.shape)} and {tuple(new.shape)}")
        L, S = old_p2l.shape
        if S % num_devices:
            raise ValueError(f"{S} slots do not split evenly over {num_devices} devices")
        k = S // num_devices
        aligned = torch.empty_like(new_p2l)
        source_device = torch.full((L, S), -1, dtype=torch.long)
        source_slot = torch.full((L, S), -1, dtype=torch.long)
        for layer in range(L):
            old_row, new_row = old_p2l[layer].tolist(), new_p2l[layer].tolist()
            holders: dict[int, list[int]] = {}
            for slot, expert in enumerate(old_row):
                holders.setdefault(expert, []).append(slot)
            sends = [0] * num_devices
            for device in range(num_devices):
                lo = device * k
                row = _align_device(old_row[lo : lo + k], new_row[lo : lo + k])
                aligned[layer, lo : lo + k] = torch.tensor(row)
                for offset, expert in enumerate(row):
                    if old_row[lo + offset] == expert:
                        continue
                    if expert not in holders:
                        raise ValueError(f"layer {layer}: expert {expert} has no slot in the old placement")
                    local = [s for s in holders[expert] if s // k == device]
                    slot = local[0] if local else min(holders[expert], key=lambda s: (sends[s // k], s))
                    if not local:
                        sends[slot // k] += 1
                    source_device[layer, lo + offset] = slot // k
                    source_slot[layer, lo + offset] = slot
        return cls(aligned, aligned != old_p2l, source_device, source_slot, num_devices)

    @property
    def num_changed(self) -> int:
        return int(self.changed.sum())

    def incoming(self, device: int) -> list[tuple[int, int, int, int]]:
        """``(layer, slot, source_device, source_slot)`` for each slot of ``device`` that changes."""
        k = self.changed.shape[1] // self.num_devices
        rows = self.changed[:, device * k : (device + 1) * k].nonzero().tolist()
        return [
            (
                layer,
                device * k + s,
                int(self.source_device[layer, device * k + s]),
                int(self.source_slot[layer, device * k + s]),
            )
            for layer, s in rows
        ]

    def outgoing(self, device: int) -> list[tuple[int, int, int, int]]:
        """``(layer, source_slot, destination_device, destination_slot)`` for each copy ``device``
        sends to another device."""
        k = self.changed.shape[1] // self.num_devices
        sends = ((self.source_device == device) & self.changed).nonzero().tolist()
        return [(layer, int(self.source_slot[layer, s]), s // k, s) for layer, s in sends if s // k != device]


def _check(load, num_physical_slots: int, num_groups: int, num_nodes: int, num_devices: int) -> torch.Tensor:
    if not isinstance(load, torch.Tensor) or load.dim() != 2:
        raise ValueError(f"load must be a [layers, experts] tensor, got {getattr(load, 'shape', type(load).__name__)}")
    weights = load.detach().to("cpu", torch.float64)
    L, E = weights.shape
    if E == 0:
        raise ValueError("load has no experts")
    if not bool(torch.isfinite(weights).all()) or bool((weights < 0).any()):
        raise ValueError("load must be finite and non-negative")
    for name, value in (("num_physical_slots", num_physical_slots), ("num_groups", num_groups)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if num_nodes < 1 or num_devices < 1:
        raise ValueError(f"num_nodes and num_devices must be >= 1, got {num_nodes} and {num_devices}")
    if num_physical_slots < E:
        raise ValueError(f"{num_physical_slots} physical slots cannot hold {E} experts")
    if num_physical_slots % num_devices:
        raise ValueError(f"{num_physical_slots} physical slots do not split evenly over {num_devices} devices")
    if num_devices % num_nodes:
        raise ValueError(f"{num_devices} devices do not split evenly over {num_nodes} nodes")
    if num_groups % num_nodes == 0 and E % num_groups:
        raise ValueError(f"{E} experts do not split into {num_groups} equal groups")
    return weights


def _plan_layer(load: list[float], S: int, G: int, N: int, D: int, hierarchical: bool) -> list[int]:
    """One layer's ``physical_to_logical`` row (before the guard)."""
    E = len(load)
    if not hierarchical:
        G, N = 1, 1
    group_size = E // G
    group_load = [sum(load[g * group_size : (g + 1) * group_size]) for g in range(G)]
    nodes = _refine(_pack(group_load, N, G // N), group_load)  # [N][G/N] group ids
    row: list[int] = []
    for groups in nodes:
        experts = [g * group_size + i for g in sorted(groups) for i in range(group_size)]
        counts = _replicate([load[e] for e in experts], S // N)
        items = [(experts[i], load[experts[i]] / c) for i, c in enumerate(counts) for _ in range(c)]
        bins = _pack([w for _, w in items], D // N, S // D)
        bins = _refine(bins, [w for _, w in items])
        for member in bins:  # canonical order inside a device: by logical expert
            row.extend(sorted(items[i][0] for i in member))
    return row


def _replicate(load: list[float], slots: int) -> list[int]:
    """Replica count per expert: one each, then every spare slot to the highest load per replica."""
    counts = [1] * len(load)
    heap = [(-w, e) for e, w in enumerate(load)]
    heapq.heapify(heap)
    for _ in range(slots - len(load)):
        _, e = heapq.heappop(heap)
        counts[e] += 1
        heapq.heappush(heap, (-load[e] / counts[e], e))
    return counts


def _pack(weights: list[float], num_bins: int, per_bin: int) -> list[list[int]]:
    """Balanced packing: items heaviest first (ties: lower index), each into the lightest bin
    (ties: lower index) that still has room; every bin ends with exactly ``per_bin`` items."""
    assert len(weights) == num_bins * per_bin
    order = sorted(range(len(weights)), key=lambda i: (-weights[i], i))
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    heap = [(0.0, b) for b in range(num_bins)]
    for i in order:
        total, b = heapq.heappop(heap)
        bins[b].append(i)
        if len(bins[b]) < per_bin:
            heapq.heappush(heap, (total + weights[i], b))
    return bins


def _refine(bins: list[list[int]], weights: list[float], max_rounds: int = 64) -> list[list[int]]:
    """Swap one item of the busiest bin with one of another bin while that lowers the busier of
    the two below the busiest bin's load (best swap first), until the busiest is within
    0.01% of the mean (at most ``max_rounds`` swaps); slot counts stay equal."""
    if len(bins) < 2 or not bins[0]:
        return bins
    members = torch.tensor(bins, dtype=torch.long)  # [B, k]
    w = torch.tensor(weights, dtype=torch.float64)
    for _ in range(max_rounds):
        item_w = w[members]  # [B, k]
        totals = item_w.sum(dim=1)
        h = int(totals.argmax())
        if totals[h] <= totals.mean() * (1 + 1e-4):  # within 0.01% of the mean: good enough
            break
        delta = item_w[h][:, None, None] - item_w[None, :, :]  # [k, B, k]: moving w_i out, w_j in
        busier = torch.maximum(totals[h] - delta, totals[None, :, None] + delta)
        busier[:, h, :] = float("inf")
        busier[delta <= 0] = float("inf")
        best = int(busier.argmin())
        if not bool(busier.view(-1)[best] < totals[h] * (1 - 1e-12)):
            break
        i, o, j = torch.unravel_index(torch.tensor(best), busier.shape)
        members[h, i], members[o, j] = members[o, j].clone(), members[h, i].clone()
    return members.tolist()


def _align_device(old: list[int], new: list[int]) -> list[int]:
    """``new`` (one device's experts) reordered so each expert also in ``old`` keeps its slot."""
    remaining = list(new)
    out: list[int | None] = [None] * len(old)
    for pos, expert in enumerate(old):
        if expert in remaining:
            remaining.remove(expert)
            out[pos] = expert
    rest = iter(remaining)
    return [e if e is not None else next(rest) for e in out]
