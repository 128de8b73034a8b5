"""A decode graph captured while another thread of the process keeps using the GPU (another
engine's KV-store copies, say) captures and replays correctly, and the other thread's calls do not
fail. GPU only."""

from __future__ import annotations

import threading

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_capture_while_another_thread_copies_device_to_host():
    from deepinfer_cuda_sm100.decode_capture import capture_buckets

    torch.manual_seed(0)
    w = torch.randn(256, 256, device="cuda")
    x = torch.randn(8, 256, device="cuda")

    def step(n: int) -> torch.Tensor:
        h = x[:n]
        for _ in range(64):  # enough launches that the capture overlaps the other thread's copies
            h = torch.tanh(h @ w)
        return h

    stop, errors, copies = threading.Event(), [], [0]

    def other() -> None:  # what the KV tiers' threads do: pinned host buffers (cudaHostAlloc), copies
        # on a stream of their own fenced by an event. No CUDA random numbers (torch refuses those in
        # any thread during a capture) and no device-wide synchronize.
        try:
            side = torch.cuda.Stream()
            src = torch.full((1 << 16,), 1.0, device="cuda")
            while not stop.is_set():
                host = torch.empty(1 << 16, pin_memory=True)
                with torch.cuda.stream(side):
                    host.copy_(src, non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(side)
                done.synchronize()
                assert host[0].item() == 1.0
                copies[0] += 1
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=other)
    thread.start()
    try:
        graphs, outputs, _ = capture_buckets([1, 2, 4, 8], step, lambda n, h: None)
    finally:
        stop.set()
        thread.join()
    assert not errors, errors
    assert copies[0] > 0
    for n, graph in graphs.items():
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(outputs[n], step(n), rtol=0, atol=0)
