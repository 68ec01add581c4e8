"""What the dual connector's scheduler tells its workers each step, and what they report.

vLLM hands the scheduler's `NixlConnectorMetadata` to every worker each step; ours
carries one more attribute, `push` (a `PushStep`), with the push work of that step. The
workers' answer comes back through vLLM's worker-metadata hook as a `PushReport`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

from connector.protocol.side_channel import PullOffer, RegisterBlocks, TransferId
from connector.vllm_compat import KVConnectorWorkerMetadata

BlockIds = list[list[int]]  # one list per KV-cache group


class WriteOrder(Protocol):
    """What `PushJob.of` reads: P's channel's `StartWrite` (`connector.prefill.channel`),
    named by its shape, so that this floor imports nothing from P's side."""

    @property
    def transfer_id(self) -> TransferId: ...
    @property
    def request_id(self) -> str: ...
    @property
    def block_ids(self) -> BlockIds: ...
    @property
    def registration(self) -> RegisterBlocks: ...
    @property
    def fail_on_purpose(self) -> bool: ...
    @property
    def write_by(self) -> float: ...
    @property
    def ranks(self) -> tuple[int, ...] | None: ...
    @property
    def early_step(self) -> int | None: ...
    @property
    def chunk(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class PushJob:
    """P: WRITE P's blocks of `request_id` into D's blocks, then notify D's request."""

    transfer_id: TransferId
    request_id: str  # P's
    block_ids: BlockIds  # P's, one list per KV-cache group
    decode_engine_id: str
    decode_request_id: str  # named in the WRITE's notification
    decode_host: str  # D's NIXL side channel (vLLM's handshake listener)
    decode_port: int
    decode_tp_size: int
    decode_block_ids: BlockIds
    fail_on_purpose: bool = False  # fault injection (`fail_write`): fail, do not WRITE
    # Seconds, from when this was made: no part of the WRITE is posted later, and what is
    # in flight then is cancelled (the write lease). A lifetime, not a clock reading: the
    # worker may run on another host than the scheduler.
    write_within: float = math.inf
    # The ranks (P's workers) that start it; None: all (the others had it early).
    ranks: tuple[int, ...] | None = None
    # An early WRITE's step (it reached the engine, not the worker); None: not early.
    early_step: int | None = None
    # Only some of the prompt's blocks, computed in an earlier chunk, without D's
    # notification: the push's final WRITE skips them (connector/prefill/layers.py).
    chunk: bool = False

    @classmethod
    def of(cls, write: WriteOrder, now: float) -> PushJob:
        """The job for P's channel's `StartWrite`, made at `now` (the channel's clock)."""
        reg = write.registration
        return cls(
            transfer_id=write.transfer_id, request_id=write.request_id,
            block_ids=write.block_ids, decode_engine_id=reg.engine_id,
            decode_request_id=reg.request_id, decode_host=reg.host, decode_port=reg.port,
            decode_tp_size=reg.tp_size, decode_block_ids=reg.block_ids,
            fail_on_purpose=write.fail_on_purpose, write_within=write.write_by - now,
            ranks=write.ranks, early_step=write.early_step, chunk=write.chunk)


@dataclass(slots=True)
class PushStep:
    """One step's push work, attached to the step's NixlConnectorMetadata as `push`."""

    # D: requests in this step's reqs_to_recv that P will WRITE (D does not READ them).
    recv: set[str] = field(default_factory=set)
    # D: pushes that will not arrive: fail their receive (vLLM recomputes the prompt, or
    # frees the blocks of a request that was aborted meanwhile).
    failed: set[str] = field(default_factory=set)
    # P: WRITEs to start.
    jobs: list[PushJob] = field(default_factory=list)
    # P: requests whose held blocks no WRITE will read: free them now.
    release: set[str] = field(default_factory=set)
    # P: push requests whose prompt this step completes, to be written layer by layer
    # while its forward pass runs, if D has registered by then (progressive push,
    # connector/prefill/layers.py); otherwise they are written whole after it. Also
    # those it computes a chunk of (not the last), whose chunk WRITE goes so.
    layered: set[str] = field(default_factory=set)
    # P: push requests that ended before their prompt was computed (vLLM freed their
    # blocks) after chunk WRITEs: P's workers let go of them, reporting nothing.
    chunks_dropped: set[str] = field(default_factory=set)
    # P: push requests preempted after chunk WRITEs (vLLM took their blocks back while a
    # chunk's WRITE may have read them): their push fails, and D reads it instead.
    chunks_failed: set[str] = field(default_factory=set)
    # D: pushes that failed while P kept the prompt's KV: READ P's blocks instead.
    pull: dict[str, PullOffer] = field(default_factory=dict)
    # The scheduler's count of the steps it built, this one included: P's worker starts
    # an early WRITE (`StartWrite.early_step`) only once that step's forward is done.
    number: int = 0

    def is_empty(self) -> bool:
        return not (self.recv or self.failed or self.jobs or self.release or self.pull
                    or self.layered)


@dataclass(frozen=True, slots=True)
class PushEnd:
    """How one WRITE ended on `ranks` of P's workers (one, until merged): `error` None
    when every one of them wrote all its blocks. A rank whose share failed keeps its
    blocks for a READ instead (`pull_fallback_ttl`); `holding_ranks` counts those."""

    error: str | None
    seconds: float
    blocks: int
    ranks: int = 1
    holding_ranks: int = 0
    layered: bool = False  # written layer by layer (on every rank, when merged)
    chunked: bool = False  # its earlier chunks written while later ones computed (any rank)

    def merge(self, other: PushEnd) -> PushEnd:
        """Both ranks' shares (of the same blocks): failed if either failed; as long as
        the slower one."""
        return PushEnd(self.error if self.error is not None else other.error,
                       max(self.seconds, other.seconds), max(self.blocks, other.blocks),
                       self.ranks + other.ranks, self.holding_ranks + other.holding_ranks,
                       self.layered and other.layered, self.chunked or other.chunked)


class PushReport(KVConnectorWorkerMetadata):
    """Workers -> scheduler: the WRITEs that ended since the last step, by transfer.

    vLLM merges the reports of all ranks of one step with `aggregate`; ranks whose
    share ends in a later step report then, so the scheduler adds them up (`WriteTally`)."""

    def __init__(self, ended: dict[TransferId, PushEnd] | None = None) -> None:
        self.ended: dict[TransferId, PushEnd] = dict(ended or {})

    def aggregate(self, other: KVConnectorWorkerMetadata) -> PushReport:
        assert isinstance(other, PushReport)
        merged = dict(self.ended)
        for tid, end in other.ended.items():
            mine = merged.get(tid)
            merged[tid] = end if mine is None else mine.merge(end)
        return PushReport(merged)


class WriteTally:
    """P's scheduler: a push's WRITE is over once every one of P's `ranks` workers
    (TP x PP) reported its share, whichever steps those reports came in."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self._partial: dict[TransferId, PushEnd] = {}

    def add(self, report: PushReport) -> dict[TransferId, PushEnd]:
        """The transfers that `report` completes, each merged over all ranks."""
        complete: dict[TransferId, PushEnd] = {}
        for tid, end in report.ended.items():
            mine = self._partial.pop(tid, None)
            end = end if mine is None else mine.merge(end)
            if end.ranks >= self.ranks:
                complete[tid] = end
            else:
                self._partial[tid] = end
        return complete

    def __len__(self) -> int:
        return len(self._partial)
