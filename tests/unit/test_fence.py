"""P's WRITEs wait for the KV they read (`connector.prefill.fence`): on a GPU, behind a
CUDA event recorded where the forward pass was; here with stand-in events the test
releases, so the GPU path's order and waits run without a GPU (none here)."""

from __future__ import annotations

import threading
from collections import defaultdict
from functools import partial
from types import SimpleNamespace
from typing import Any

import numpy as np

from connector.prefill.fence import CudaFence, HostFence, ThreadFence, fence_for
from connector.prefill.layers import HELD, LayeredWrite, PlannedWrite, RecordingAgent, RegionLayers
from tests.conftest import until_sync
from tests.unit.test_layers_push import StatefulAgent


class StandInEvents:
    """Events the test reaches by hand: `synchronize` returns once the test released the
    event (as the GPU reaching a recorded CUDA event), or fails after 5 s."""

    def __init__(self) -> None:
        self.recorded: list[threading.Event] = []
        self.stream_waits = 0

    def new(self) -> Any:
        reached = threading.Event()
        events = self

        class Event:
            def record(self) -> None:
                events.recorded.append(reached)

            def synchronize(self) -> None:
                assert reached.wait(5), "a stand-in event was never reached"

        return Event()

    def reach(self, index: int) -> None:
        self.recorded[index].set()

    def sync_stream(self) -> None:
        self.stream_waits += 1


def cuda_fence() -> tuple[CudaFence, StandInEvents]:
    events = StandInEvents()
    return CudaFence(events.new, events.sync_stream), events


def test_a_host_fence_runs_each_write_at_once() -> None:
    fence, ran = HostFence(), []
    fence.after_queued_work(lambda: ran.append(1))
    fence.wait_for_forward()
    assert ran == [1]


def test_a_cpu_servers_fence_posts_on_its_own_thread_in_order_and_closes() -> None:
    """A CPU server's fence (`fence_for("cpu")`): nothing to wait for, but the WRITEs go
    on a thread of their own, so the forward pass goes on meanwhile; in the order given."""
    fence = fence_for("cpu")
    assert isinstance(fence, ThreadFence) and not isinstance(fence, CudaFence)
    caller, ran = threading.get_ident(), []

    def post(n: int) -> None:
        ran.append((n, threading.get_ident()))

    for n in range(5):
        fence.after_queued_work(partial(post, n))
    fence.wait_for_forward()  # nothing to wait for on a CPU
    until_sync(lambda: len(ran) == 5, "the five WRITEs posted", 5.0)
    assert [n for n, _ in ran] == list(range(5))
    assert all(thread != caller for _, thread in ran), "posted on the engine's thread"
    fence.close()
    assert fence._thread is not None and not fence._thread.is_alive()


def test_a_gpu_fence_runs_each_write_once_its_event_is_reached_in_the_order_given() -> None:
    fence, events = cuda_fence()
    ran: list[str] = []
    fence.after_queued_work(lambda: ran.append("layer 0"))
    fence.after_queued_work(lambda: ran.append("layer 1"))
    try:
        events.reach(1)  # the later event first: the earlier action still waits
        assert ran == []
        events.reach(0)
        until_sync(lambda: ran == ["layer 0", "layer 1"], "both actions, in order")
    finally:
        fence.close()


def test_a_failing_write_does_not_stop_the_ones_after_it() -> None:
    fence, events = cuda_fence()
    ran: list[int] = []

    def fail() -> None:
        raise RuntimeError("NIXL said no")

    fence.after_queued_work(fail)
    fence.after_queued_work(lambda: ran.append(2))
    events.reach(0)
    events.reach(1)
    until_sync(lambda: ran == [2], "the action after the failed one")
    fence.close()


def test_closing_runs_what_is_queued_then_drops_what_comes_after() -> None:
    fence, events = cuda_fence()
    ran: list[int] = []
    fence.after_queued_work(lambda: ran.append(1))
    events.reach(0)
    fence.close()  # joins the thread: the queued action ran first
    assert ran == [1]
    assert fence._thread is not None and not fence._thread.is_alive()
    fence.after_queued_work(lambda: ran.append(2))
    assert ran == [1] and len(events.recorded) == 1


def test_a_fence_never_used_starts_no_thread() -> None:
    fence, _ = cuda_fence()
    fence.wait_for_forward()
    fence.close()
    assert fence._thread is None


# --- P's worker on a GPU: each layer's part behind its layer's event ---------------------


def gpu_worker() -> tuple[Any, StatefulAgent, LayeredWrite, StandInEvents]:
    """P's worker half over a stand-in of vLLM's worker, with a CUDA fence of stand-in
    events and one layered push of three layers, open (its placeholder handle held)."""
    from connector.prefill.worker_side import PrefillWorker

    agent = StatefulAgent()
    vllm = SimpleNamespace(
        _sending_transfers=defaultdict(list), _sending_transfers_lock=threading.Lock(),
        _send_failures=set(), nixl_wrapper=RecordingAgent(agent),
        _try_release_xfer_handle=lambda rid, handle: True)
    fence, events = cuda_fence()
    worker = PrefillWorker(vllm, pull_fallback_ttl=1.0, early_at=None,  # type: ignore[arg-type]
                           wake_poller=lambda: None, fence=fence)
    layers = RegionLayers(["a", "b", "c"], [10, 10, 10])
    write = PlannedWrite("L", np.asarray([1, 11, 21], np.int32), "R",
                         np.asarray([2, 12, 22], np.int32), b"d:1")
    push = LayeredWrite.plan("r", [write], layers)
    vllm._sending_transfers["r"].append(HELD)
    return worker, agent, push, events


def test_on_a_gpu_a_layers_write_waits_for_its_layers_event_and_the_last_for_all() -> None:
    worker, agent, push, events = gpu_worker()
    try:
        worker._post_after_layer(push, push.due([0]))  # the hook of layer 0
        assert agent.posted == [], "posted before the GPU wrote the layer"
        events.reach(0)
        until_sync(lambda: [ids for _, ids, _ in agent.posted] == [[1]], "layer 0's part")
        worker._layering = {"r": push}
        worker.write_early()  # the pass is over on the CPU, not yet on the GPU
        assert len(agent.posted) == 1, "the rest went before the pass's event"
        events.reach(1)
        until_sync(lambda: "r" in worker._finishing, "the push waiting for its final part")
        assert [ids for _, ids, _ in agent.posted] == [[1], [11]]
        agent.states[1] = agent.states[2] = "DONE"
        assert worker.poll_writes() is True  # the poller: the final part, with D's notice
        assert agent.posted[-1] == ("WRITE", [21], b"d:1")
        assert HELD not in worker._vllm._sending_transfers["r"]
    finally:
        worker.close_fence()


def test_on_a_gpu_a_push_ended_while_its_layer_waited_posts_nothing_more() -> None:
    worker, agent, push, events = gpu_worker()
    try:
        worker._post_after_layer(push, push.due([0]))
        with worker._vllm._sending_transfers_lock:  # its write lease ended meanwhile
            worker._drop_held("r")
        events.reach(0)
        worker.close_fence()  # the queued part's turn came and went
        assert agent.posted == [], "a part was written after the push ended"
    finally:
        worker.close_fence()


def test_only_full_graphs_for_prefill_batches_are_said_to_make_pushes_whole() -> None:
    from vllm.config.compilation import CUDAGraphMode

    from connector.prefill.fence import full_graph_note

    def note(mode: CUDAGraphMode) -> str | None:
        return full_graph_note(SimpleNamespace(cudagraph_mode=mode,
                                               max_cudagraph_capture_size=512))

    assert note(CUDAGraphMode.FULL) is not None and "512 tokens" in str(note(CUDAGraphMode.FULL))
    for mode in (CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.FULL_DECODE_ONLY,
                 CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE):
        assert note(mode) is None, mode
    assert full_graph_note(SimpleNamespace()) is None  # an older vLLM: nothing to say
