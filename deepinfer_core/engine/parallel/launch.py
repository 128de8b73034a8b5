"""Starting the rank processes and their process group (torchrun's environment, without torchrun).

One process per rank from ``torch.multiprocessing``, each forked from a fork server (a fresh
interpreter that has imported torch and the engine once and never touched a device or started a
thread: safe with CUDA, and a rank starts without paying the imports again; ``spawn`` where
there is no fork server), each told who it is the way ``torchrun`` tells it
(``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), so the same worker
runs under torchrun or a cluster manager unchanged. The process group is gloo on CPU and NCCL on
GPUs (one device per rank, ``cuda:LOCAL_RANK``); its timeout bounds every collective, so a rank
that dies or stalls turns into an error on the others, never a hang.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["RankEnv", "free_port", "init_process_group", "rank_context", "start_ranks"]

# what the fork server imports once, so that each rank it forks starts with them loaded
PRELOAD = ["torch", "deepinfer_core.engine.llm_engine", "deepinfer_core.engine.parallel.worker"]


@dataclass(frozen=True)
class RankEnv:
    """Who a rank is: torchrun's variables."""

    rank: int
    world_size: int
    master_addr: str = "127.0.0.1"
    master_port: int = 29500

    @property
    def local_rank(self) -> int:
        return self.rank  # one host: the local rank is the rank

    def export(self) -> None:
        os.environ.update(
            MASTER_ADDR=self.master_addr,
            MASTER_PORT=str(self.master_port),
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK=str(self.local_rank),
        )


def free_port() -> int:
    """A TCP port nobody listens on now (for the rendezvous store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_group(env: RankEnv, device_type: str, timeout_s: float) -> str:
    """Join the group (``env://`` rendezvous); returns the backend: ``nccl`` for CUDA devices,
    ``gloo`` otherwise. ``timeout_s`` bounds every collective of the group."""
    env.export()
    backend = "nccl" if device_type == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(env.local_rank)
    dist.init_process_group(backend, rank=env.rank, world_size=env.world_size, timeout=timedelta(seconds=timeout_s))
    return backend


def rank_context():
    """The multiprocessing context the ranks start in (make their queues from it)."""
    import multiprocessing

    if "forkserver" in multiprocessing.get_all_start_methods():
        context = mp.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)  # takes effect when the server starts (once per process)
        return context
    return mp.get_context("spawn")


def start_ranks(fn, world_size: int, args: tuple) -> mp.ProcessContext:
    """Start ``fn(rank, *args)`` in ``world_size`` processes of :func:`rank_context` and return at
    once (``.processes``: the ``multiprocessing.Process`` objects, to watch and to stop)."""
    method = rank_context().get_start_method()
    return mp.start_processes(fn, args=args, nprocs=world_size, join=False, start_method=method)
