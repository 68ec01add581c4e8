"""What the dual connector's scheduler tells its workers each step, and what they report.

vLLM hands the scheduler's `NixlConnectorMetadata` to every worker each step; ours
carries one more attribute, `push` (a `PushStep`), with the push work of that step. The
workers' answer comes back through vLLM's worker-metadata hook as a `PushReport`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

from connector.messages import TransferId
from connector.registry import BlockIds


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


@dataclass(frozen=True, slots=True)
class PushEnd:
    """How one WRITE ended on a worker: `error` None when every block was written."""

    error: str | None
    seconds: float
    blocks: int


class PushReport(KVConnectorWorkerMetadata):
    """Workers -> scheduler: the WRITEs that ended since the last step, by transfer."""

    def __init__(self, ended: dict[TransferId, PushEnd] | None = None) -> None:
        self.ended: dict[TransferId, PushEnd] = dict(ended or {})

    def aggregate(self, other: KVConnectorWorkerMetadata) -> PushReport:
        """Merge the reports of several ranks: a transfer failed if any rank failed."""
        assert isinstance(other, PushReport)
        merged = dict(self.ended)
        for tid, end in other.ended.items():
            mine = merged.get(tid)
            if mine is None or (end.error is not None and mine.error is None):
                merged[tid] = end
        return PushReport(merged)
