"""Expert re-placement while serving: a new placement table, and the weights moved to match it.

All ranks call :func:`rebalance` at the same step (the vote's ``rebalance`` flag, or every
``eplb_interval`` steps): the per-expert load each rank counted since the last plan is summed
over the group (``all_reduce``), rank 0 plans (``plan_placement``, its slots reordered by
``MigrationPlan`` so experts stay where they are; or the table it was given) and broadcasts it,
then :func:`move_experts` moves weights layer by layer. Between two steps, so no request sees a
half-moved layer; requests in flight just continue (their KV does not depend on where an expert
lives), none is dropped.

Moving one layer: each new slot reads its expert from a slot that held it before, on its own rank
when possible (a local copy), else from the lowest old slot holding it. Every rank derives the
same source table, packs the rows the others need in their slot order and one
``all_to_all_single`` per tensor (the layer's chunk) delivers them; unchanged layers move nothing.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .experts import MoELayer

__all__ = ["move_experts", "plan_from_load", "rebalance", "slot_sources"]


def slot_sources(old: torch.Tensor, new: torch.Tensor, slots_per_rank: int) -> list[int]:
    """For each new slot ``p``, the old slot its weights come from ([S] -> list of S)."""
    sources = []
    for p, e in enumerate(new.tolist()):
        holders = torch.nonzero(old == e).flatten().tolist()
        if not holders:
            raise ValueError(f"expert {e} has no old slot to copy from")
        same_rank = [q for q in holders if q // slots_per_rank == p // slots_per_rank]
        sources.append(same_rank[0] if same_rank else holders[0])
    return sources


def move_experts(layers: list[MoELayer], new_tables: torch.Tensor, rank: int, world: int, group=None) -> int:
    """Adopt ``new_tables`` ([L, S] logical expert per slot, identical on every rank): move the
    weights and switch each dispatcher's table. Returns the expert copies this rank received."""
    received = 0
    for layer, new in zip(layers, new_tables.to(torch.int64).cpu(), strict=True):
        old = layer.dispatcher.physical_to_logical
        if torch.equal(old, new):
            continue
        spr = layer.dispatcher.slots_per_rank
        src = slot_sources(old, new, spr)
        mine = range(rank * spr, (rank + 1) * spr)
        # rows this rank sends to each rank d: its old local rows feeding d's new slots, in d's slot order
        send_rows = [
            [src[p] % spr for p in range(d * spr, (d + 1) * spr) if src[p] // spr == rank] for d in range(world)
        ]
        recv_slots = [[p for p in mine if src[p] // spr == s] for s in range(world)]  # by source rank
        send_index = torch.tensor([i for d in range(world) if d != rank for i in send_rows[d]], dtype=torch.int64)
        send_counts = [0 if d == rank else len(send_rows[d]) for d in range(world)]
        recv_counts = [0 if s == rank else len(recv_slots[s]) for s in range(world)]
        recv_order = [p - rank * spr for s in range(world) if s != rank for p in recv_slots[s]]
        new_tensors = {}
        for name, tensor in layer.tensors(spr).items():
            out = torch.empty_like(tensor)
            local = [(p - rank * spr, src[p] % spr) for p in recv_slots[rank]]
            if local:
                dst, frm = zip(*local)
                out[list(dst)] = tensor[list(frm)]
            if world > 1:  # every rank takes part, with or without rows to move
                inbox = tensor.new_empty(sum(recv_counts), *tensor.shape[1:])
                outbox = tensor[send_index.to(tensor.device)].contiguous()
                dist.all_to_all_single(inbox, outbox, recv_counts, send_counts, group=group)
                if recv_order:
                    out[recv_order] = inbox
            new_tensors[name] = out
        layer.replace_tensors(new_tensors)
        layer.dispatcher.set_placement(new)
        received += len(recv_order)
    return received


def plan_from_load(layers: list[MoELayer], world: int, group=None, counter=None) -> torch.Tensor | None:
    """The group's summed per-expert load ([L, E], collective); None without layers. Each rank's
    share: the engine's windowed counter (``expert_load_window``, DeepSeek's ring of windows) once
    it has a finished window, else what the dispatchers counted since the last plan."""
    if not layers:
        return None
    device = layers[0].weights().gate_up.device
    own = [layer.dispatcher.expert_load() for layer in layers]  # read (and reset) either way
    if counter is not None and counter.windows_done:
        ring, row = counter.load(), {index: i for i, index in enumerate(counter.layers)}
        rows = [ring[row[layer.spec.layer_index]] for layer in layers]
    else:
        rows = [torch.zeros(layer.spec.num_experts, dtype=torch.int64, device=device) if load is None else load
                for layer, load in zip(layers, own)]  # fmt: skip
    load = torch.stack([r.to(device, torch.int64) for r in rows])
    dist.all_reduce(load, group=group)
    return load


def rebalance(
    layers: list[MoELayer], rank: int, world: int, forced: torch.Tensor | None = None, group=None, counter=None
) -> dict:
    """Plan (rank 0: ``forced`` when given, else ``plan_placement`` of the summed load) and move.
    Collective. Returns ``{"pause_s", "received", "changed_layers"}`` for this rank."""
    start = time.perf_counter()
    load = plan_from_load(layers, world, group, counter)
    plan = [None]
    if rank == 0 and layers:
        if forced is not None:
            plan[0] = torch.as_tensor(forced, dtype=torch.int64).reshape(len(layers), -1)
        else:
            from ...parallel.eplb import MigrationPlan, plan_placement  # the EPLB planner (pure functions)

            d = layers[0].dispatcher
            num_groups = layers[0].spec.num_groups if layers[0].spec.num_groups > 1 else 1
            planned = plan_placement(load.cpu(), d.num_slots, num_groups, 1, world)[0]
            current = torch.stack([layer.dispatcher.physical_to_logical for layer in layers])
            # each rank keeps the experts it already holds in their slots: fewer weights move
            plan[0] = MigrationPlan.between(current, planned, world).new_physical_to_logical
    dist.broadcast_object_list(plan, src=0, group=group)
    if plan[0] is None:
        return {"pause_s": time.perf_counter() - start, "received": 0, "changed_layers": 0}
    before = [layer.dispatcher.physical_to_logical.clone() for layer in layers]
    received = move_experts(layers, plan[0], rank, world, group)
    changed = sum(not torch.equal(b, layer.dispatcher.physical_to_logical) for b, layer in zip(before, layers))
    return {"pause_s": time.perf_counter() - start, "received": received, "changed_layers": changed}
