"""P posts a WRITE only once its server has computed the KV the WRITE reads.

A WRITE posted early (right after the forward pass that completes a prompt,
`connector.prefill.early`) or by layer (from vLLM's per-layer hook,
`connector.prefill.layers`) reads KV that this very forward pass writes. NIXL reads the
KV cache outside any CUDA stream's order, so the WRITE must wait until the KV is
written:

- On a GPU the Python code runs ahead of the kernels it launches. `CudaFence` records a
  CUDA event on the forward's stream where the hook runs (after the layer's attention
  wrote its KV); one thread of its own waits for each event in turn and only then posts
  the WRITEs queued behind it, in the order they were queued, so that a push's last
  part (with D's notification) still follows its layers' parts. The engine thread
  never waits on the GPU for a layer; it waits once, after the pass
  (`wait_for_forward`), only when a whole WRITE of a prompt that pass completed is due.
- On a CPU server the forward pass is synchronous: when the hook (or vLLM's
  `wait_for_save`, after the pass) runs, the KV is in memory. `ThreadFence`, what
  `CudaFence` is with nothing to wait for, posts on its thread all the same, so that
  the forward pass goes on while a layer's WRITEs are posted (over UCX's TCP transport,
  a post copies bytes: on the engine thread it lengthened every layer; the regime
  benchmark's 80-layer profile lost to whole push on a fast link by it).
- `HostFence` posts at once, on the caller's thread (tests that play the pass by hand).

Where this has been tested: every real-vLLM e2e test runs `ThreadFence`, the thread and
order `CudaFence` uses; the unit tests run its order and waits with stand-in events; and
`tests/gpu/test_cuda_fence.py` runs `CudaFence` with real CUDA events on a GPU (an H100:
each layer's WRITE read its layer's KV written, within a millisecond of the GPU reaching
it, while the engine thread ran ahead; a CPU's fence there read KV not yet written), and
`tests/gpu/test_layered_push_nixl.py` posts a progressive push's parts with real NIXL
(UCX) from GPU memory into another agent's, every layer landing before D's notification.
vLLM's hooks and CUDA graphs on a GPU are not tested: no vLLM runs there.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol

logger = logging.getLogger("vllm.pd_connector.fence")

Action = Callable[[], None]

# How long `close` waits for the thread to post what is queued (seconds).
CLOSE_WAIT = 5.0


class Fence(Protocol):
    """Where P's WRITEs wait for the KV they read to be computed."""

    def after_queued_work(self, action: Action) -> None:
        """Run `action` once the device has done the work queued so far (the forward
        pass up to here), after every action given before it."""

    def wait_for_forward(self) -> None:
        """Block until the device has done the work queued so far."""

    def close(self) -> None:
        """Run what is queued (bounded wait), then stop."""


class HostFence:
    """Posts at once, on the caller's thread: nothing to wait for, as on a CPU."""

    def after_queued_work(self, action: Action) -> None:
        action()

    def wait_for_forward(self) -> None:
        return None

    def close(self) -> None:
        return None


class Event(Protocol):
    """What `ThreadFence` needs of `torch.cuda.Event` (tests give stand-ins)."""

    def record(self) -> Any: ...

    def synchronize(self) -> Any: ...


class Reached:
    """A CPU's event: the work queued before it is done when it is recorded."""

    def record(self) -> None:
        return None

    def synchronize(self) -> None:
        return None


class ThreadFence:
    """Actions run on a thread of their own, in order, each once the event recorded when
    it was given has been reached (on a CPU: at once, `Reached`)."""

    def __init__(self, new_event: Callable[[], Event] = Reached,
                 sync_stream: Callable[[], None] = lambda: None,
                 on_thread_start: Callable[[], None] = lambda: None) -> None:
        self._new_event = new_event
        self._sync_stream = sync_stream
        self._on_thread_start = on_thread_start
        self._queue: queue.SimpleQueue[tuple[Event, Action] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # starts the thread once
        self._closed = False

    def after_queued_work(self, action: Action) -> None:
        if self._closed:
            logger.warning("a WRITE asked for after the fence closed is dropped")
            return
        event = self._new_event()
        event.record()  # on the current stream: the forward's, where vLLM's hooks run
        self._start()
        self._queue.put((event, action))

    def wait_for_forward(self) -> None:
        self._sync_stream()

    def close(self) -> None:
        self._closed = True
        thread = self._thread
        if thread is None:
            return
        self._queue.put(None)
        thread.join(CLOSE_WAIT)
        if thread.is_alive():
            logger.warning("the WRITE fence's thread did not end within %.0f s", CLOSE_WAIT)

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="pd-write-fence",
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        try:
            self._on_thread_start()
        except Exception:  # the default device then: events still work, maybe slower
            logger.exception("the WRITE fence's thread could not take the worker's device")
        while True:
            item = self._queue.get()
            if item is None:
                return
            event, action = item
            try:
                event.synchronize()  # releases the GIL while the GPU catches up
                action()
            except Exception:  # one WRITE's trouble must not stop the others'
                logger.exception("a fenced WRITE failed")


class CudaFence(ThreadFence):
    """A GPU server's: `ThreadFence` with CUDA events recorded on the forward's stream
    (module docstring)."""

    def __init__(self, new_event: Callable[[], Event] | None = None,
                 sync_stream: Callable[[], None] | None = None,
                 on_thread_start: Callable[[], None] | None = None) -> None:
        """Stand-ins for tests; by default CUDA's, on the device current now (the
        worker's): `on_thread_start` makes it the fence thread's too, which would
        otherwise be device 0 (and a CUDA context there, for a worker of another GPU)."""
        if new_event is None or sync_stream is None:
            import torch

            # A blocking-sync event: the waiting thread sleeps instead of spinning a core.
            new_event = new_event or (lambda: torch.cuda.Event(blocking=True))  # type: ignore[no-untyped-call]
            sync_stream = sync_stream or (lambda: torch.cuda.current_stream().synchronize())
            if on_thread_start is None:
                device = torch.cuda.current_device()
                on_thread_start = lambda: torch.cuda.set_device(device)  # noqa: E731
        super().__init__(new_event, sync_stream, on_thread_start or (lambda: None))


def full_graph_note(compilation_config: Any) -> str | None:
    """On a GPU: which pushes vLLM's CUDA graphs make P write whole, or None. A full
    graph's replay skips vLLM's per-layer hook, so a push whose prefill a full graph runs
    is written whole after the pass (never before its KV is written: the fence). Only
    graphs for mixed (prefill) batches matter: `FULL`, not `FULL_AND_PIECEWISE` (full for
    decode batches only)."""
    mode: Any = getattr(compilation_config, "cudagraph_mode", None)
    mixed = getattr(mode, "mixed_mode", None)
    if mixed is None or mixed().name != "FULL":
        return None
    size = getattr(compilation_config, "max_cudagraph_capture_size", None)
    return (f"cudagraph_mode {mode.name} runs prefill batches of up to {size} tokens as "
            "full CUDA graphs, whose replay skips the per-layer hook: such a push is "
            "written whole after the pass (push_layers: on asks vLLM for piecewise graphs)")


def fence_for(device: str) -> Fence:
    """The fence for a server whose KV cache is on `device` ("cpu", "cuda", ...)."""
    return CudaFence() if device == "cuda" else ThreadFence()
