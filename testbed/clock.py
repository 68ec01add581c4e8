"""When an emulated forward pass ends, and the record each one leaves.

`StepClock` decides how long to sleep after a step's real compute. A step on an idle
engine lasts its profile time from its start. A step of a busy engine (it carries on a
request of the previous step: a decode, or a prefill's next chunk) that follows the
previous step closely (the host spent less time between them than the step's own GPU
time) starts its "GPU" time where the previous step ended: on a GPU server vLLM's
asynchronous scheduling prepares step N+1 on the host while the GPU runs step N, so a
busy engine's steps follow each other at the GPU's pace, not at GPU + host. vLLM on CPU
does that host work serially, between forwards; counting it as overlapped puts the
engine back in the GPU regime, where a busy server steps at the profile's step time.
Not hidden: the host time before a step of new requests only (the engine was idle, the
GPU would have been too), and a host slower than the "GPU" (gap at least the step
time): the step then lasts gap + step time, and the record shows it.

A request "carries on" when its context is where one of the previous step's requests
ended (the step's shapes carry no request ids; a new request whose cached prefix ends
exactly there is taken for a continuation, which only shortens its step's host gap).

Layers: a model of L decoder layers ends layer i (from 0) at the step's "GPU" start +
target x (i + 1) / L (`Planned.layer_deadline`, `StepClock.pace`): the step's time split
evenly over its layers, the whole step still ending at its deadline as planned above.
vLLM's per-layer KV hooks (a connector's `save_kv_layer`, on exit of each attention
layer) then fire when they would on a GPU, a layer's own compute after the previous
layer's end: the hook of layer i fires at about start + target x i / L plus that
layer's attention, earlier than on a GPU by the rest of a layer's share (its MLP).

`StepRecord` is one forward pass, a JSON line in the file named by the environment
variable `TESTBED_STEP_LOG` (unset: no records), appended after the step (tens of
microseconds of host time, which the next step's overlap absorbs).

Pure Python (no torch, no vLLM), so that tests drive it with a fake clock.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

import msgspec

from testbed.profiles import StepShape

STEP_LOG_ENV = "TESTBED_STEP_LOG"
# Every step's profile time multiplied by this (unset: 1): an emulated GPU this many
# times slower, for prompts whose real compute on this CPU would outlast the profile's
# time (`scripts.bench_regime --slowdown`, which slows the emulated link alike). With
# TIME_SCALE_FILE_ENV naming a file, the factor is that file's content instead, read
# again whenever the file changes: a benchmark changes it between cases, live.
TIME_SCALE_ENV = "TESTBED_TIME_SCALE"
TIME_SCALE_FILE_ENV = "TESTBED_TIME_SCALE_FILE"


def parse_scale(raw: str, what: str = TIME_SCALE_ENV) -> float:
    """A time scale's text as a positive float; ValueError naming `what` otherwise."""
    try:
        scale = float(raw.strip())
    except ValueError:
        scale = 0.0
    if not scale > 0 or scale == float("inf"):
        raise ValueError(f"{what} must be a positive number, got {raw!r}")
    return scale


def time_scale() -> float:
    """TIME_SCALE_ENV's value (1.0 when unset); a value that is not a positive number
    fails here, at the model's start."""
    raw = os.environ.get(TIME_SCALE_ENV, "").strip()
    return parse_scale(raw) if raw else 1.0


class TimeScale:
    """The factor on every step's time: TIME_SCALE_ENV's, or TIME_SCALE_FILE_ENV's file's
    content, read again when the file's modification time changes (a file that is
    missing or does not hold a positive number keeps the factor as it was)."""

    def __init__(self, value: float = 1.0, path: Path | None = None) -> None:
        self.value = value
        self.path = path
        self._stamp: int | None = None

    @classmethod
    def from_env(cls) -> TimeScale:
        path = os.environ.get(TIME_SCALE_FILE_ENV)
        return cls(time_scale(), Path(path) if path else None)

    def current(self) -> float:
        if self.path is not None:
            try:
                stamp = self.path.stat().st_mtime_ns
                if stamp != self._stamp:
                    self.value = parse_scale(self.path.read_text(), str(self.path))
                    self._stamp = stamp
            except (OSError, ValueError):
                pass
        return self.value


def write_time_scale(path: Path, scale: float) -> None:
    """Set the factor a `TimeScale` on `path` reads (atomically: a reader never sees a
    half-written number)."""
    parse_scale(repr(scale))
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    staging.write_text(repr(float(scale)))
    os.replace(staging, path)


class StepRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One emulated forward pass. Times in seconds; `at` is the wall clock at its end."""

    at: float
    pid: int
    requests: int  # requests in the step
    prefill_tokens: int  # new tokens of requests with more than one new token
    decodes: int  # requests with exactly one new token after some context
    context_tokens: int  # KV positions the step reads, new ones included
    target_s: float  # the profile's time for this step
    compute_s: float  # the tiny model's real forward
    gap_s: float | None  # host time since the previous forward ended (None: first)
    overlapped: bool  # started where the previous step ended (see the module docstring)
    step_s: float  # the forward's whole duration: compute plus sleep
    # When each decoder layer ended, seconds after the forward entered the model (a
    # layered model's pacing, see the module docstring); None for one paced step.
    layer_ends_s: list[float] | None = None


class Planned(msgspec.Struct, frozen=True):
    """What the clock decided for one step."""

    deadline: float  # on the clock's own time base
    gap_s: float | None
    overlapped: bool
    target_s: float = 0.0

    def layer_deadline(self, index: int, layers: int) -> float:
        """When layer `index` (0-based) of `layers` ends: the step's start + its target
        x (index + 1) / layers; the last layer's is the step's deadline."""
        if not 0 <= index < layers:
            raise ValueError(f"layer {index} of {layers}")
        return self.deadline - self.target_s * (layers - index - 1) / layers


class StepClock:
    """Sleeps each forward to its profile time; see the module docstring."""

    def __init__(
        self,
        now: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._now = now
        self._sleep = sleep
        self._last_end: float | None = None
        self._last_ends: frozenset[int] = frozenset()  # where the last step's requests end

    def plan(self, started: float, target_s: float, shapes: Sequence[StepShape] = ()) -> Planned:
        """The deadline of a step of `shapes` that entered the model at `started`."""
        gap = None if self._last_end is None else started - self._last_end
        busy = any(shape.context > 0 and shape.context in self._last_ends for shape in shapes)
        self._last_ends = frozenset(shape.context + shape.new for shape in shapes)
        overlapped = busy and gap is not None and gap < target_s
        gpu_start = self._last_end if overlapped and self._last_end is not None else started
        return Planned(deadline=gpu_start + target_s, gap_s=gap, overlapped=overlapped,
                       target_s=target_s)

    def pace(self, deadline: float) -> float:
        """Sleep until `deadline` (a layer's end, see `Planned.layer_deadline`), not at
        all if it has passed; return the seconds slept. The step goes on: unlike
        `wait`, this does not end it."""
        remaining = deadline - self._now()
        if remaining <= 0:
            return 0.0
        self._sleep(remaining)
        return remaining

    def wait(self, planned: Planned) -> float:
        """Sleep until the deadline (not at all if it has passed); return the end time."""
        remaining = planned.deadline - self._now()
        if remaining > 0:
            self._sleep(remaining)
        end = self._now()
        self._last_end = end
        return end


class StepLog:
    """Appends `StepRecord`s to a file, one JSON line each, flushed at once."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file: IO[bytes] = open(path, "ab")  # noqa: SIM115 - lives as long as the model
        self._encoder = msgspec.json.Encoder()

    @classmethod
    def from_env(cls) -> StepLog | None:
        path = os.environ.get(STEP_LOG_ENV)
        return cls(Path(path)) if path else None

    def write(self, record: StepRecord) -> None:
        self._file.write(self._encoder.encode(record) + b"\n")
        self._file.flush()


def read_step_log(path: Path) -> list[StepRecord]:
    """Every record in a step log (a line cut short by a writer still writing is skipped)."""
    decoder = msgspec.json.Decoder(StepRecord)
    records = []
    for line in path.read_bytes().splitlines():
        try:
            records.append(decoder.decode(line))
        except msgspec.DecodeError:
            continue
    return records
