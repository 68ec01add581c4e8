"""P's worker: the pushes one rank WRITEs, one record per P request, with its state.

A record follows P's blocks of one request on this rank, from the job that WRITEs them
to the step that hands them back to vLLM:

    early WRITE: EARLY --(the forward pass that completes its prompt is done)--> a job
    job: HANDSHAKING --(D's handshake done)--> WRITING (at once if one is cached)
    HANDSHAKING, WRITING --(its WRITE handles are done, or it failed or could not
        start)--> RELEASED, or HELD when it failed and P keeps its blocks for D to
        READ (`pull_fallback_ttl`)
    HELD --(start_load_kv)--> gone, under vLLM's pull lease (`_reqs_to_send`: D's READ
        or the lease's end frees the blocks)
    HELD, or no record --(a `release` order: no READ will come)--> RELEASED
    RELEASED --(get_transfer_results: reported finished sending)--> gone

Each end also goes in the next `PushReport` (`take_report`), by transfer: the outcome
for the scheduler, kept apart from the record, which may be gone by then. A record
carries its job's write deadline (`deadline`, this worker's monotonic clock: the write
lease, `PushJob.write_within` from when the job reached the worker): the worker posts no
WRITE after it, and cancels the WRITE handles still in flight then.

The transitions are the methods below; each checks the state it starts from against
one table (`_NEXT`), so nothing but `_move` changes a state or removes a record. A
record carries its flags: the early WRITE's step, and, in its job, fault injection
(`PushJob.fail_on_purpose`). vLLM's push code keeps its own per-request WRITE handles
(`_sending_transfers`, under its lock, polled by the poller thread) and handle failures
(`_send_failures`); the worker folds those failures into the record (`failed`) each step.

Owned by the worker's engine thread; no lock.
"""

from __future__ import annotations

import enum
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from connector.protocol.side_channel import TransferId
from connector.protocol.step import PushEnd, PushJob, PushReport


class OutgoingState(enum.Enum):
    EARLY = "early"  # an early WRITE, waiting for the forward pass that completes its prompt
    HANDSHAKING = "handshaking"  # waiting for this rank's NIXL handshake with D
    WRITING = "writing"  # its WRITE handles are submitted, until every one is done
    HELD = "held"  # the WRITE failed: its blocks go under vLLM's pull lease next
    RELEASED = "released"  # its blocks are reported finished sending next


_NEXT: dict[OutgoingState | None, frozenset[OutgoingState | None]] = {
    None: frozenset({OutgoingState.EARLY, OutgoingState.HANDSHAKING, OutgoingState.WRITING,
                     OutgoingState.RELEASED}),
    OutgoingState.EARLY: frozenset({OutgoingState.HANDSHAKING, OutgoingState.WRITING}),
    OutgoingState.HANDSHAKING: frozenset({OutgoingState.WRITING, OutgoingState.HELD,
                                          OutgoingState.RELEASED}),
    OutgoingState.WRITING: frozenset({OutgoingState.HELD, OutgoingState.RELEASED}),
    OutgoingState.HELD: frozenset({OutgoingState.RELEASED, None}),
    OutgoingState.RELEASED: frozenset({None}),
}
_IN_FLIGHT = (OutgoingState.EARLY, OutgoingState.HANDSHAKING, OutgoingState.WRITING)


@dataclass(slots=True)
class OutgoingPush:
    """One P request's blocks on this rank: the job that WRITEs them, if any."""

    request_id: str  # P's
    state: OutgoingState
    job: PushJob | None = None  # None: a release of blocks no job of this rank has now
    early_step: int | None = None  # EARLY: the step whose forward pass completes the prompt
    started: float = 0.0  # perf_counter, when the job started (its PushEnd's seconds)
    failed: bool = False  # WRITING: one of its WRITE handles failed
    lease_until: float = 0.0  # HELD: when vLLM's pull lease ends (perf_counter)
    deadline: float = math.inf  # no WRITE posted after it (time.monotonic; write lease)
    layered: bool = False  # WRITING: written layer by layer (connector/prefill/layers.py)
    chunked: bool = False  # WRITING: its earlier chunks' blocks written while later computed


class OutgoingPushes:
    """P's worker: its pushes by P's request id, and the ends for the next report."""

    def __init__(self) -> None:
        self._records: dict[str, OutgoingPush] = {}
        self._report: dict[TransferId, PushEnd] = {}
        # Records per state: each step asks for the EARLY, HELD and RELEASED ones, and
        # mostly there are none, so the records are scanned only when there are.
        self._counts: Counter[OutgoingState] = Counter()

    def get(self, request_id: str) -> OutgoingPush | None:
        return self._records.get(request_id)

    def early(self, job: PushJob, step: int | None, *, deadline: float = math.inf) -> None:
        """An early WRITE, to start once engine step `step`'s forward pass is done (None:
        at once), and posted by `deadline`."""
        record = OutgoingPush(job.request_id, OutgoingState.EARLY, job, early_step=step,
                              deadline=deadline)
        self._move(record, OutgoingState.EARLY)

    def early_due(self, step: int) -> list[OutgoingPush]:
        """The early WRITEs whose prompt is computed once step `step`'s forward is done,
        in the order they came. Still EARLY: `start` each."""
        if not self._counts[OutgoingState.EARLY]:
            return []
        return [r for r in self._records.values() if r.state is OutgoingState.EARLY
                and (r.early_step is None or r.early_step <= step)]

    def start(self, job: PushJob, *, handshaking: bool, now: float,
              deadline: float = math.inf) -> OutgoingPush:
        """The job starts: HANDSHAKING (D's handshake is under way) or WRITING, to be
        posted by `deadline` (an early WRITE keeps the one it came with)."""
        record = self._records.get(job.request_id) or OutgoingPush(
            job.request_id, OutgoingState.HANDSHAKING, job, deadline=deadline)
        record.job, record.started = job, now
        self._move(record, OutgoingState.HANDSHAKING if handshaking else OutgoingState.WRITING)
        return record

    def handshaken(self, record: OutgoingPush) -> None:
        """D's handshake is done: WRITE."""
        self._move(record, OutgoingState.WRITING)

    def failed(self, request_ids: Iterable[str]) -> None:
        """A WRITE handle of each of these failed (vLLM's push code saw it): their WRITE
        fails once all their handles are done. Unknown or ended ones: nothing to do."""
        for rid in request_ids:
            record = self._records.get(rid)
            if record is not None and record.state is OutgoingState.WRITING:
                record.failed = True

    def ended(self, record: OutgoingPush, error: str | None, *, now: float,
              lease_ttl: float) -> None:
        """The job is over on this rank (`error` None: written). Its blocks are RELEASED,
        or, when it failed and `lease_ttl` > 0, HELD for D to READ that long; its end
        goes in the next report."""
        job = record.job
        assert job is not None
        held = error is not None and lease_ttl > 0
        if held:
            record.lease_until = now + lease_ttl
        self._move(record, OutgoingState.HELD if held else OutgoingState.RELEASED)
        blocks = sum(len(group) for group in job.block_ids)
        self._report[job.transfer_id] = PushEnd(
            error, now - record.started, blocks, holding_ranks=int(held),
            layered=record.layered, chunked=record.chunked)

    def release(self, request_id: str) -> OutgoingState | None:
        """No READ will come for these blocks: RELEASED. Returns the state it was in
        (None: no record; its blocks may be under vLLM's pull lease). A job still in
        flight is left as it is: its end frees or holds the blocks."""
        record = self._records.get(request_id)
        was = None if record is None else record.state
        if was in _IN_FLIGHT or was is OutgoingState.RELEASED:
            return was
        self._move(record or OutgoingPush(request_id, OutgoingState.RELEASED),
                   OutgoingState.RELEASED)
        return was

    def take_held(self) -> list[tuple[str, float]]:
        """The HELD records, gone from here to vLLM's pull lease: (request id, lease end)."""
        held = self._in(OutgoingState.HELD)
        for record in held:
            self._move(record, None)
        return [(r.request_id, r.lease_until) for r in held]

    def take_released(self) -> set[str]:
        """The RELEASED records, gone from here: to report finished sending."""
        released = self._in(OutgoingState.RELEASED)
        for record in released:
            self._move(record, None)
        return {r.request_id for r in released}

    def take_report(self) -> PushReport | None:
        """The ends since the last report (None: none)."""
        if not self._report:
            return None
        report, self._report = PushReport(self._report), {}
        return report

    def _move(self, record: OutgoingPush, to: OutgoingState | None) -> None:
        """The one place a record changes state, enters or leaves (`to` None)."""
        current = self._records.get(record.request_id)
        if current is not None and current is not record:
            raise ValueError(f"request {record.request_id}: a second record while "
                             f"{current.state.value}")
        was = None if current is None else record.state
        if to not in _NEXT[was]:
            raise ValueError(f"request {record.request_id}: "
                             f"{'new' if was is None else was.value} -> "
                             f"{'gone' if to is None else to.value}")
        if was is not None:
            self._counts[was] -= 1
        if to is None:
            del self._records[record.request_id]
        else:
            self._counts[to] += 1
            record.state = to
            self._records[record.request_id] = record

    def _in(self, state: OutgoingState) -> list[OutgoingPush]:
        if not self._counts[state]:
            return []
        return [r for r in self._records.values() if r.state is state]

    def __len__(self) -> int:
        return len(self._records)
