"""Per-request state KV slots (models whose cache is not all paged, e.g. DeepSeek-V4).

Block KV is paged and shared through the prefix cache (``kv_cache_manager``); state KV (a
sliding window's ring, compressor tails) belongs to one running request and is overwritten as it
advances. Each running request holds one slot from first scheduling until it finishes or is
preempted; a preempted request restarts from position 0 (or a prefix hit) and rebuilds its state.
"""

from __future__ import annotations


class StateKVSlots:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"state KV needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.free_slots = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.owner: dict[str, int] = {}  # request id -> slot
        # called as on_release(request_id, slot) before a slot goes back (its state still there):
        # the window cache keeps what it saved of the request (engine/window_cache.py)
        self.on_release = None

    def slot(self, request_id: str) -> int:
        """The request's slot, taken on first use."""
        slot = self.owner.get(request_id)
        if slot is None:
            if not self.free_slots:
                raise RuntimeError(
                    f"no free state KV slot for request {request_id!r} ({self.num_slots} slots, all held)"
                )
            slot = self.free_slots.pop()
            self.owner[request_id] = slot
        return slot

    def holds(self, request_id: str) -> bool:
        return request_id in self.owner

    def release(self, request_id: str) -> None:
        slot = self.owner.pop(request_id, None)
        if slot is not None:
            if self.on_release is not None:
                self.on_release(request_id, slot)
            self.free_slots.append(slot)
