"""D's scheduler: one record per push D registered with P, until it arrives or fails:

    AWAITING --(D's request ended first: P told)--> ABORTING
    AWAITING --(the WRITE's notification: received)--> gone
    AWAITING, ABORTING --(the channel reports it failed or released)--> gone

Owned by the engine's scheduler thread; no lock. The transitions are the methods below,
and each checks the state it starts from, so ending a request is one `pop`. D's worker's
records are in `connector.decode.incoming`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from connector.protocol.side_channel import TransferId


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
