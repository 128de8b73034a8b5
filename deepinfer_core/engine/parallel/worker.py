"""One rank of a parallel engine: an :class:`~deepinfer_core.engine.llm_engine.LLMEngine` on its own
device, holding only its experts, stepping in lockstep with the other ranks.

The worker model (what a cluster manager runs, one process per rank)::

    worker_main(rank, spec: WorkerSpec, commands: list[Queue], results: Queue)

``commands[rank]`` (driver -> this rank) carry :class:`Command` tuples: ``add`` (a request, already
checked by the driver), ``abort``, ``stats``, ``rebalance`` (rank 0 only: re-place now, optionally to a given
table), ``stop``. ``results`` (all ranks -> driver) carry ``("ready", rank, info)`` once the model
is loaded, ``("out", rank, outputs, stats)`` after a step that produced outputs, ``("stats", rank, stats)``
when asked (``stats`` command), and
``("fatal", rank, message)`` before the rank exits on an error. The loop: take the commands that
wait, run one engine step (its vote happens inside, :class:`~.lockstep.Lockstep`), send the
outputs, re-place when the group decided to. A broken group (a collective fails or times out)
ends the loop: the engine has already failed every request with the reason, the rank says
``fatal`` and exits with status 1.
"""

from __future__ import annotations

import logging
import os
import queue
import traceback
from dataclasses import dataclass, replace

import torch

from ...moe import ParallelConfig
from .experts import moe_layers, prepare_rank_model
from .launch import RankEnv, init_process_group
from .lockstep import Lockstep
from .replacement import rebalance

__all__ = ["WorkerSpec", "rank_config", "worker_main"]

log = logging.getLogger(__name__)
IDLE_POLL_S = 0.01  # how long a rank of an idle group waits for a command before voting again


@dataclass(frozen=True)
class WorkerSpec:
    config: object  # the EngineConfig every rank shares (rank_config adapts it per rank)
    world_size: int
    master_port: int
    device_type: str  # "cpu" | "cuda" | ...
    parent_pid: int


def rank_config(config, rank: int, device_type: str):
    """The rank's EngineConfig: its own device (``cuda:RANK`` on GPUs), no overlapped scheduling
    (each step is voted before it runs) and no captured decode graphs when experts are exchanged
    (a collective inside a graph replay is not supported yet)."""
    device = "cpu" if device_type == "cpu" else f"{device_type}:{rank}"
    eager = config.enforce_eager or config.expert_parallel_size > 1
    return replace(config, device=device, overlap_scheduling=False, enforce_eager=eager)


def worker_main(rank: int, spec: WorkerSpec, commands, results) -> None:
    lockstep = None
    try:
        engine, lockstep, layers = _start(rank, spec)
        results.put(("ready", rank, _info(engine)))
        _serve(rank, spec, engine, lockstep, layers, commands[rank], results)
    except BaseException as exc:  # the driver reports it and stops the group
        results.put(("fatal", rank, f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise SystemExit(1) from None
    finally:
        import torch.distributed as dist

        if dist.is_initialized() and (lockstep is None or lockstep.broken is None):
            dist.destroy_process_group()  # a broken group is left to the process exit


def _start(rank: int, spec: WorkerSpec):
    from ..llm_engine import LLMEngine

    config = spec.config
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world_size))
    init_process_group(RankEnv(rank, spec.world_size, master_port=spec.master_port), spec.device_type,
                       config.collective_timeout_s)  # fmt: skip
    parallel = ParallelConfig(
        ep_size=config.expert_parallel_size,
        dp_size=config.data_parallel_size,
        rank=rank,
        num_redundant_experts=config.num_redundant_experts,
    )
    prepare = prepare_rank_model if config.expert_parallel_size > 1 else None  # load only this rank's experts
    engine = LLMEngine(rank_config(config, rank, spec.device_type), parallel=parallel, prepare_model=prepare)
    layers = moe_layers(engine.model) if config.expert_parallel_size > 1 else []
    if config.expert_parallel_size > 1 and not layers:
        raise ValueError(
            f"{config.model} has no MoE layer served by an expert-parallel dispatcher: use expert_parallel_size=1 "
            "(data_parallel_size alone replicates a dense model)"
        )
    lockstep = Lockstep(layers, engine.device, engine.dtype, solo=config.expert_parallel_size == 1)
    engine.lockstep = lockstep
    return engine, lockstep, layers


def _info(engine) -> dict:
    return {
        "limits": engine.limits,
        "max_model_len": engine.max_model_len,
        "num_blocks": engine.num_blocks,
        "model_config": engine.model.config,
        "platform": engine.platform.name,
        "dtype": str(engine.dtype).removeprefix("torch."),
    }


def _serve(rank, spec, engine, lockstep, layers, commands, results) -> None:
    config = spec.config
    forced = None  # a table rank 0 was told to adopt at the next re-placement
    replacements: list[dict] = []
    while True:
        idle = lockstep.decision is None or (not lockstep.decision.max_tokens and not engine.has_unfinished_requests())
        outputs, report = [], False
        for command in _take(commands, IDLE_POLL_S if idle else 0.0):
            kind = command[0]
            if kind == "add":
                _, ids, params, prompt, request_id, final_only = command
                try:
                    engine.add_request(ids, params, prompt, request_id, final_only=final_only)
                except (ValueError, TypeError) as exc:  # checked by the driver: a limit of this rank
                    outputs.append(_refused(request_id, ids, prompt, str(exc)))
            elif kind == "abort":
                out = engine.abort_request(command[1])
                if out is not None:
                    outputs.append(out)
            elif kind == "rebalance":
                lockstep.want_rebalance, forced = True, command[1]
            elif kind == "stop":
                lockstep.want_stop = True
            elif kind == "stats":
                report = True
        if idle and not _alive(spec.parent_pid):
            lockstep.want_stop = True  # the driver is gone: leave with the group
        outputs += engine.step()
        if lockstep.broken is not None:
            results.put(("out", rank, outputs, _stats(engine, lockstep, replacements)))
            raise RuntimeError(f"the parallel group broke: {lockstep.broken}")
        decision = lockstep.decision
        due = config.eplb_interval and decision.max_tokens and lockstep.steps % config.eplb_interval == 0
        if decision.rebalance or (due and layers):
            done = rebalance(layers, rank, spec.world_size, forced if rank == 0 else None, counter=engine.expert_load)
            replacements.append({**done, "after_step": lockstep.steps})
            lockstep.want_rebalance, forced = False, None
        if outputs:
            results.put(("out", rank, outputs, _stats(engine, lockstep, replacements)))
        if report:
            results.put(("stats", rank, _stats(engine, lockstep, replacements)))
        if decision.stop:
            return


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # no signal: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _take(commands, wait_s: float) -> list:
    got = []
    try:
        got.append(commands.get(timeout=wait_s) if wait_s else commands.get_nowait())
        while True:
            got.append(commands.get_nowait())
    except queue.Empty:
        return got


def _refused(request_id, ids, prompt, message):
    from ..outputs import CompletionOutput, RequestOutput

    return RequestOutput(request_id, prompt, list(ids), [CompletionOutput(0, "", [], "error", error=message)], True)


def _stats(engine, lockstep, replacements) -> dict:
    return {
        **engine.stats(),
        "steps": lockstep.steps,
        "busy_steps": lockstep.busy_steps,
        "empty_passes": lockstep.empty_passes,
        "expert_slots": [layer.weights().gate_up.shape[0] for layer in lockstep.layers],  # rows held per layer
        "replacements": list(replacements),
    }
