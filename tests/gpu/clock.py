"""The GPU tests' clock: a kernel that keeps the GPU busy for a number of cycles, and how
many cycles make a millisecond on this GPU."""

from __future__ import annotations

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
