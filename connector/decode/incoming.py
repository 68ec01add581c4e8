"""Push requests, one record per request with its state: the scheduler's on P and on D,
and D's worker's (`IncomingPushes`, described there). P's worker's are in
`connector.outgoing`.

P (`PrefillPushes`): a push request computing its prompt, from the step that schedules it
to its end. Its record carries its transfer, whether its WRITE is to fail on purpose
(`fail_write`), and, for a request whose WRITE may start right after the forward pass
that completes its prompt (an early WRITE), its blocks step by step:

    FOLLOWED --(a built step completes the prompt)--> COMPLETING
    FOLLOWED, COMPLETING, UNFOLLOWED --(request_finished)--> gone

D (`DecodePushes`): a push D registered with P, until it arrives or fails:

    AWAITING --(D's request ended first: P told)--> ABORTING
    AWAITING --(the WRITE's notification: received)--> gone
    AWAITING, ABORTING --(the channel reports it failed or released)--> gone

Both are owned by the engine's scheduler thread; no lock. The transitions are the
methods below, and each checks the state it starts from, so ending a request is one
`pop`.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from connector.messages import TransferId

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
    # FOLLOWED: all its blocks so far (None before its first step); COMPLETING: the
    # blocks (clipped for the exchange) its last step was given.
    block_ids: BlockIds | None = None


class PrefillPushes:
    """P's push requests, by P's request id."""

    def __init__(self) -> None:
        self._records: dict[str, PrefillPush] = {}

    def scheduled(self, request: Request, transfer_id: TransferId | None, *,
                  fail_on_purpose: bool, follow: bool) -> None:
        """A push request's blocks were allocated (again, after a preemption: then its
        record stays as it is)."""
        if request.request_id in self._records:
            return
        self._records[request.request_id] = PrefillPush(
            request, transfer_id, fail_on_purpose,
            PrefillState.FOLLOWED if follow and transfer_id else PrefillState.UNFOLLOWED)

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


class DecodeState(enum.Enum):
    AWAITING = "awaiting"  # registered with P; waiting for the WRITE
    ABORTING = "aborting"  # D's request ended first: P was told; D's blocks wait for P


@dataclass(slots=True)
class DecodePush:
    """D: one push registered with P."""

    transfer_id: TransferId
    state: DecodeState = DecodeState.AWAITING


class DecodePushes:
    """D's registered pushes, by D's request id."""

    def __init__(self) -> None:
        self._records: dict[str, DecodePush] = {}
        self._awaiting = 0  # records in AWAITING

    def registered(self, request_id: str, transfer_id: TransferId) -> None:
        old = self._records.get(request_id)
        if old is not None:  # registered again: the new transfer replaces the old one
            self._drop(request_id, old)
        self._records[request_id] = DecodePush(transfer_id)
        self._awaiting += 1

    def aborting(self, request_id: str) -> TransferId | None:
        """D's request ended: the transfer to abort at P, if it still awaits one."""
        record = self._records.get(request_id)
        if record is None or record.state is not DecodeState.AWAITING:
            return None
        record.state = DecodeState.ABORTING
        self._awaiting -= 1
        return record.transfer_id

    def received(self, request_id: str) -> TransferId | None:
        """The WRITE's notification came: the transfer, if it was awaited."""
        record = self._records.get(request_id)
        if record is None or record.state is not DecodeState.AWAITING:
            return None
        self._drop(request_id, record)
        return record.transfer_id

    def ended(self, request_id: str) -> DecodePush | None:
        """The channel reports the push failed, or released after an abort: its record,
        gone from here."""
        record = self._records.get(request_id)
        if record is not None:
            self._drop(request_id, record)
        return record

    def awaiting(self) -> bool:
        """Whether any push is still awaited."""
        return self._awaiting > 0

    def _drop(self, request_id: str, record: DecodePush) -> None:
        del self._records[request_id]
        self._awaiting -= record.state is DecodeState.AWAITING

    def __len__(self) -> int:
        return len(self._records)


class IncomingState(enum.Enum):
    AWAITING = "awaiting"  # waiting for the notifications of P's WRITEs
    LANDED = "landed"  # every notification came; waits for D's handshake with P


@dataclass(slots=True)
class IncomingPush:
    """D's worker: one push its engine receives."""

    notifications: int = 0  # P's ranks whose WRITE is done
    state: IncomingState = IncomingState.AWAITING


class IncomingPushes:
    """D's worker: the pushes it receives, by D's request id, from the step that orders
    the wait (`expect`) until the push is reported received or failed:

        AWAITING --(P's last rank's notification)--> LANDED --(reported)--> gone
        AWAITING --(failed, or read from P instead)--> gone

    Owned by the engine thread; the poller thread reads only `awaiting` (an int)."""

    def __init__(self) -> None:
        self._records: dict[str, IncomingPush] = {}
        self.awaiting = 0  # records in AWAITING
        self._landed = 0  # records in LANDED (the engine asks each step: mostly none)

    def expect(self, request_id: str) -> None:
        self._remove(request_id)
        self._records[request_id] = IncomingPush()
        self.awaiting += 1

    def is_awaited(self, request_id: str) -> bool:
        record = self._records.get(request_id)
        return record is not None and record.state is IncomingState.AWAITING

    def cancel(self, request_id: str) -> bool:
        """Stop awaiting the push (it failed, or is read from P instead): True if it was
        awaited, False if it had landed already or is unknown."""
        if not self.is_awaited(request_id):
            return False
        self._remove(request_id)
        return True

    def notified(self, request_id: str, expected: int) -> bool:
        """One of P's ranks finished its WRITE: True when that makes `expected`, and the
        push LANDED."""
        record = self._records[request_id]
        if record.state is not IncomingState.AWAITING:
            raise ValueError(f"request {request_id}: notified while {record.state.value}")
        record.notifications += 1
        if record.notifications < expected:
            return False
        record.state = IncomingState.LANDED
        self.awaiting -= 1
        self._landed += 1
        return True

    def landed(self) -> list[str]:
        if not self._landed:
            return []
        return [rid for rid, r in self._records.items() if r.state is IncomingState.LANDED]

    def reported(self, request_id: str) -> None:
        """A LANDED push was reported received (or failed): gone."""
        if self._records[request_id].state is not IncomingState.LANDED:
            raise ValueError(f"request {request_id}: reported before it landed")
        self._remove(request_id)

    def _remove(self, request_id: str) -> None:
        record = self._records.pop(request_id, None)
        if record is not None:
            self.awaiting -= record.state is IncomingState.AWAITING
            self._landed -= record.state is IncomingState.LANDED

    def __len__(self) -> int:
        return len(self._records)
