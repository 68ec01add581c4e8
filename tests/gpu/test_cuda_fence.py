"""P's WRITEs wait for the KV they read, on a real GPU (`connector.prefill.fence`).

NIXL reads P's KV cache outside any CUDA stream's order, so a WRITE that a layer's hook
asks for must not be posted before the GPU has written that layer. Here a "forward pass"
of several layers runs on a CUDA stream, each layer a kernel that takes its time and then
writes the layer's KV; the hook after each layer hands the fence an action that reads the
layer's KV on another stream, as NIXL would, without waiting on the forward's.

These tests need a CUDA GPU and PyTorch, and are not in the default test run (pytest's
`testpaths` leaves `tests/gpu` out): on a GPU machine, `python -m pytest tests/gpu`. They
fail, not skip, without a GPU. They import nothing of vLLM or NIXL.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from functools import partial

import pytest
import torch

from connector.prefill.fence import CudaFence, Fence, HostFence, ThreadFence, fence_for
from tests.gpu.clock import measure_cycles_per_ms, spin, wait_for

LAYERS = 6
LAYER_MS = 30.0  # each layer's kernel: long enough that Python runs far ahead of the GPU
ROW = 1 << 16  # floats of KV per layer



@pytest.fixture(scope="module")
def cycles_per_ms() -> float:
    return measure_cycles_per_ms()


class Forward:
    """A forward pass of `LAYERS` layers on a stream of its own: each layer spins the GPU
    for `LAYER_MS`, then writes its KV (the row of the layer, every value layer + 1)."""

    def __init__(self, cycles_per_ms: float) -> None:
        # An earlier test's pass may still run: its KV, freed, is the block `kv` gets
        # next, and its late writes would land in this pass's KV.
        torch.cuda.synchronize()
        self.stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        self.kv = torch.zeros(LAYERS, ROW, device="cuda")
        # NIXL's stand-in: a stream not ordered after the forward's.
        self.reader = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        self.cycles = int(LAYER_MS * cycles_per_ms)
        # Load every kernel the pass and the reads use now: CUDA loads a kernel's module
        # on its first launch, and that load waits for the whole device, which would
        # make a first read wait for the pass and hide the race.
        self.kv[0].fill_(0.0)
        self.read(0)
        torch.cuda.synchronize()

    def layers(self) -> Iterator[int]:
        """Run each layer's kernels on the forward's stream; yield after each, where
        vLLM's per-layer hook runs (current stream: the forward's)."""
        with torch.cuda.stream(self.stream):
            for layer in range(LAYERS):
                spin(self.cycles)
                self.kv[layer].fill_(layer + 1)
                yield layer

    def read(self, layer: int) -> float:
        """What a WRITE posted now would send of `layer`: the smallest value in its row,
        read on another stream, as NIXL reads, without waiting for the forward."""
        with torch.cuda.stream(self.reader):
            row = self.kv[layer].min()
            value = float(row.item())  # waits for the reader's stream only
        return value


def run_pass(fence: Fence, forward: Forward) -> tuple[list[tuple[int, float]], bool]:
    """One pass with a WRITE of each layer after its hook: (layer, value) in the order the
    WRITEs were posted, and whether the GPU was still busy with the pass when the engine
    thread's last hook returned."""
    posted: list[tuple[int, float]] = []

    def write(layer: int) -> None:
        posted.append((layer, forward.read(layer)))

    for layer in forward.layers():
        fence.after_queued_work(partial(write, layer))
    busy = not forward.stream.query()
    return posted, busy


@pytest.mark.parametrize("fence", [HostFence, ThreadFence], ids=["at once", "a CPU's thread"])
def test_without_cuda_events_a_layers_write_reads_kv_not_yet_written(
        fence: Callable[[], Fence], cycles_per_ms: float) -> None:
    """The race the fence closes, shown on this GPU: posted from the hook at once, or on a
    thread with nothing to wait for (a CPU server's fence), a layer's WRITE reads the
    layer before its kernels ran."""
    forward = Forward(cycles_per_ms)
    writes = fence()
    try:
        posted, busy = run_pass(writes, forward)
        assert busy
        wait_for(lambda: len(posted) == LAYERS, "every layer's WRITE posted")
    finally:
        writes.close()
    stale = [layer for layer, value in posted if value != layer + 1]
    assert stale, "every layer was written before its WRITE read it: the test cannot tell"


def test_each_layers_write_waits_for_its_layer_and_the_engine_thread_does_not(
        cycles_per_ms: float) -> None:
    forward = Forward(cycles_per_ms)
    fence = fence_for("cuda")
    assert isinstance(fence, CudaFence)
    try:
        posted, busy = run_pass(fence, forward)
        assert busy, "the hooks waited for the GPU: the engine thread must not"
        wait_for(lambda: len(posted) == LAYERS, "every layer's WRITE posted")
        assert posted == [(layer, float(layer + 1)) for layer in range(LAYERS)]
    finally:
        fence.close()


def test_a_write_after_the_pass_waits_for_the_whole_pass(cycles_per_ms: float) -> None:
    """A push's last part (with D's notification) goes behind the pass's last event; and
    `wait_for_forward` (a whole WRITE due after the pass) returns only once the GPU is
    done."""
    forward = Forward(cycles_per_ms)
    fence = CudaFence()
    last: list[bool] = []
    try:
        with torch.cuda.stream(forward.stream):
            for _ in forward.layers():
                pass
            fence.after_queued_work(lambda: last.append(
                all(forward.read(layer) == layer + 1 for layer in range(LAYERS))))
            assert not forward.stream.query()
            fence.wait_for_forward()
            assert forward.stream.query(), "wait_for_forward returned before the pass ended"
        wait_for(lambda: bool(last), "the last part posted")
        assert last == [True]
    finally:
        fence.close()


def test_the_fence_thread_sleeps_while_the_gpu_works(cycles_per_ms: float) -> None:
    """A blocking-sync event: while the fence waits for a layer, it spins no core."""
    forward = Forward(cycles_per_ms)
    fence = CudaFence()
    thread_cpu: list[float] = []

    def note_cpu() -> None:
        thread_cpu.append(time.thread_time())

    try:
        fence.after_queued_work(note_cpu)  # starts the thread; note its CPU so far
        wait_for(lambda: bool(thread_cpu), "the first action")
        wall = time.monotonic()
        with torch.cuda.stream(forward.stream):
            spin(int(20 * LAYER_MS * cycles_per_ms))
            fence.after_queued_work(note_cpu)
        wait_for(lambda: len(thread_cpu) == 2, "the action behind the long kernel")
        wall = time.monotonic() - wall
        cpu = thread_cpu[1] - thread_cpu[0]
        assert wall > 0.3, f"the kernel took {wall:.3f} s: too short to tell"
        assert cpu < 0.25 * wall, f"the fence's thread used {cpu:.3f} s of CPU in {wall:.3f} s"
    finally:
        fence.close()


def test_the_fence_thread_runs_on_the_workers_device() -> None:
    """The fence's thread takes the device current when the fence was made (a worker's
    GPU), not device 0."""
    device = torch.cuda.device_count() - 1
    seen: list[int] = []
    done = threading.Event()
    with torch.cuda.device(device):
        fence = CudaFence()
    try:
        def note_device() -> None:
            seen.append(torch.cuda.current_device())
            done.set()

        fence.after_queued_work(note_device)
        assert done.wait(10), "the action never ran"
        assert seen == [device]
    finally:
        fence.close()


def test_a_whole_write_after_a_full_cuda_graph_waits_for_its_replay(
        cycles_per_ms: float) -> None:
    """vLLM's full CUDA graphs replay a pass without the per-layer hook, so such a push
    is written whole after the pass (`full_graph_note`): behind an event recorded after
    the replay, or `wait_for_forward`, both on the replay's stream."""
    forward = Forward(cycles_per_ms)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=forward.stream):
        for _ in forward.layers():
            pass
    forward.kv.zero_()  # the capture ran nothing; start from nothing written
    torch.cuda.synchronize()
    fence = CudaFence()
    posted: list[list[float]] = []
    try:
        with torch.cuda.stream(forward.stream):
            graph.replay()
            fence.after_queued_work(lambda: posted.append(
                [forward.read(layer) for layer in range(LAYERS)]))
            assert not forward.stream.query(), "the replay ended before the WRITE was asked"
            fence.wait_for_forward()
            assert forward.stream.query(), "wait_for_forward returned before the replay ended"
        wait_for(lambda: bool(posted), "the whole WRITE posted")
        assert posted == [[float(layer + 1) for layer in range(LAYERS)]]
    finally:
        fence.close()
