"""P's scheduler: one record per push request computing its prompt, from the step that
schedules it to its end. P's worker's records are in `connector.prefill.outgoing`.

A record carries its transfer, whether its WRITE is to fail on purpose (`fail_write`),
and, for a request whose WRITE may start right after the forward pass that completes its
prompt (an early WRITE), its blocks step by step:

    FOLLOWED --(a built step completes the prompt)--> COMPLETING
    FOLLOWED, COMPLETING, UNFOLLOWED --(request_finished)--> gone

Owned by the engine's scheduler thread; no lock. The transitions are the methods below,
and each checks the state it starts from, so ending a request is one `pop`.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from connector.protocol.side_channel import TransferId

if TYPE_CHECKING:
    from connector.vllm_compat import Request

BlockIds = list[list[int]]  # one list per KV-cache group


class PrefillState(enum.Enum):
    UNFOLLOWED = "unfollowed"  # no early WRITE: its blocks are handed over at its end
    FOLLOWED = "followed"  # computing its prompt; its blocks followed step by step
    COMPLETING = "completing"  # a built step completes its prompt: `block_ids` are final


@dataclass(slots=True)
class PrefillPush:
    """P: one push request, from its first scheduled step to its end."""

    request: Request
    transfer_id: TransferId | None
    fail_on_purpose: bool  # fault injection (`fail_write`): its WRITE fails, on purpose
    state: PrefillState
    # FOLLOWED: its WRITE is to go layer by layer while the step that completes its
    # prompt computes it, if D has registered by then (connector/prefill/layers.py).
    layered: bool = False
    # FOLLOWED: all its blocks so far (None before its first step); COMPLETING: the
    # blocks (clipped for the exchange) its last step was given.
    block_ids: BlockIds | None = None
    # A layered one computed in chunks: its first blocks that the steps so far asked
    # P's registry to WRITE as chunks (`PrefillScheduler`, connector/prefill/registry.py).
    chunk_blocks: int = 0


class PrefillPushes:
    """P's push requests, by P's request id."""

    def __init__(self) -> None:
        self._records: dict[str, PrefillPush] = {}

    def scheduled(self, request: Request, transfer_id: TransferId | None, *,
                  fail_on_purpose: bool, follow: bool, layered: bool = False) -> None:
        """A push request's blocks were allocated (again, after a preemption: then its
        record stays as it is)."""
        if request.request_id in self._records:
            return
        self._records[request.request_id] = PrefillPush(
            request, transfer_id, fail_on_purpose,
            PrefillState.FOLLOWED if follow and transfer_id else PrefillState.UNFOLLOWED,
            layered=layered and follow)

    def followed(self) -> Iterator[PrefillPush]:
        """The records whose blocks are followed step by step."""
        return (r for r in list(self._records.values()) if r.state is PrefillState.FOLLOWED)

    def get(self, request_id: str) -> PrefillPush | None:
        return self._records.get(request_id)

    def completing(self, record: PrefillPush, block_ids: BlockIds) -> None:
        """The step being built completes `record`'s prompt, in `block_ids`."""
        if record.state is not PrefillState.FOLLOWED:
            raise ValueError(f"request {record.request.request_id}: completing from "
                             f"{record.state.value}")
        record.state = PrefillState.COMPLETING
        record.block_ids = block_ids

    def finished(self, request_id: str) -> PrefillPush | None:
        """The request ended: its record, gone from here (None: it had none)."""
        return self._records.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._records)
