"""D's worker: one record per push it receives, from the step that orders the wait until
the push is reported received or failed (`IncomingPushes`, described there). D's
scheduler's records are in `connector.decode.registered`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


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
