"""Parallel engines: expert parallelism and attention data parallelism over ``torch.distributed``.

One worker process per rank (:mod:`.worker`), started and driven by :mod:`.driver` (what
``LLM(model, data_parallel_size=D, expert_parallel_size=E)`` and ``deepinfer serve`` build);
:mod:`.launch` starts ranks with torchrun's environment and joins the process group (gloo on CPU,
NCCL on GPUs); :mod:`.lockstep` is the per-step group vote and the empty passes; :mod:`.experts`
finds a model's MoE layers and keeps a rank's share; :mod:`.replacement` moves experts to a new
placement while serving. The expert exchange itself is the MoE dispatcher ``deepinfer_core.moe.ep``.
"""

__all__: list[str] = []
