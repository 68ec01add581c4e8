"""The GPU tests' clock: a kernel that keeps the GPU busy for a number of cycles, how
many cycles make a millisecond on this GPU, and a bounded wait for a condition."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def spin(cycles: int) -> None:
    """A kernel that keeps the GPU busy for `cycles` clock cycles, on the current stream."""
    torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]


def measure_cycles_per_ms() -> float:
    """How many cycles `spin` takes per millisecond on this GPU, measured."""
    assert torch.cuda.is_available(), "these tests need a CUDA GPU"
    spin(1_000_000)  # warm up
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start.record()
    spin(50_000_000)
    end.record()
    end.synchronize()
    return 50_000_000 / float(start.elapsed_time(end))


def wait_for(condition: Callable[[], bool], what: str, *, timeout: float = 10.0,
             then: Callable[[], object] = lambda: None, poll: float = 0.005) -> None:
    """Poll `condition` every `poll` seconds, calling `then` between looks (to progress a
    NIXL agent, say); fail naming `what` after `timeout` seconds. The tests run without
    the project's conftest (a GPU machine may lack the router's dependencies), so this is
    their own `until_sync`."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        then()
        time.sleep(poll)
