"""What the ingress hands a replica: one job, prefill or decode, with its prompt's hash chain.

Ray Serve's request router sees the job (the first argument of the call) before it picks a
replica, so the chain travels with it: the router matches it against the digests replicas
publish, with no round trip to any replica.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engine.sampling_params import SamplingParams

__all__ = ["Job"]


@dataclass(frozen=True)
class Job:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    block_keys: tuple[bytes, ...] = ()  # the prompt's full blocks (kv_cache_manager.chain_keys)
    role: str = "decode"  # "prefill": compute the prompt into the store; "decode": generate
    final_only: bool = False

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens or 0
