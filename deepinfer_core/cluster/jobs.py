"""What the ingress hands a replica: one job, prefill or decode, with its prompt's hash chain.

Ray Serve's request router sees the job (the first argument of the call) before it picks a
replica, so the chain travels with it: the router matches it against the digests replicas
publish, with no round trip to any replica.

The lease (PD through the store): a prefill job asks for a hold of ``kv_lease_s`` seconds on the
blocks it commits; the decode job carries that hold (``kv_hold``) so that decode releases it
once it has loaded them. The store keeps held blocks past their retention until the hold ends.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engine.sampling_params import SamplingParams
from ..kv_store import KVHold

__all__ = ["Job"]


@dataclass(frozen=True)
class Job:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    block_keys: tuple[bytes, ...] = ()  # the prompt's full blocks (kv_cache_manager.chain_keys)
    role: str = "decode"  # "prefill": compute the prompt into the store; "decode": generate
    final_only: bool = False
    kv_lease_s: float = 0.0  # prefill: hold the committed blocks this long for decode (0: no hold)
    kv_hold: KVHold | None = None  # decode: prefill's hold on the prompt's blocks, released once loaded

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens or 0
