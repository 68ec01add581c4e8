"""P's push registry as a D that holds a fresh lease token drives it: every registration
comes with a grant naming it, from a lease that outlives the test. The tests of matching,
aborts, limits and deadlines use it; the write lease itself (grants that come late or
never, lapses, `write_by`) is tested on the bare registry, in
tests/unit/test_connector_lease.py."""

from __future__ import annotations

import dataclasses
import math
from typing import TypeVar

import msgspec

from connector.prefill.registry import (
    BlockIds,
    Outcome,
    PeerId,
    PushRegistry,
    Ready,
    RegistryConfig,
    RequestId,
    TransferState,
    Waiting,
)
from connector.protocol.side_channel import RegisterBlocks, TransferId

FOREVER = 1e9  # a lease no test outlives
T = TypeVar("T")


def plain(outcome: T) -> T:
    """`outcome`, a Ready's `write_by` (the lease's end plus write_s) left out."""
    if isinstance(outcome, Ready):
        return dataclasses.replace(outcome, write_by=math.inf)
    return outcome


class GrantedRegistry(PushRegistry):
    """Each registration granted as it comes; Ready outcomes without their `write_by`.
    A chunk WRITE the grant asks for (P computed chunks of the prompt before D registered)
    is kept in `granted_chunks`."""

    def __init__(self, config: RegistryConfig) -> None:
        super().__init__(msgspec.structs.replace(config, lease_s=FOREVER))
        self.granted_chunks: list[Ready] = []

    def register(self, reg: RegisterBlocks, *, now: float, peer: PeerId = b"") -> Outcome:
        outcome = super().register(reg, now=now, peer=peer)
        started = self.grant(peer, sent=now, now=now, adds=[reg.transfer_id])
        self.granted_chunks += [plain(o) for o in started if isinstance(o, Ready) and o.chunk]
        started = [o for o in started if not (isinstance(o, Ready) and o.chunk)]
        if isinstance(outcome, Waiting) and outcome.state is TransferState.AWAITING_GRANT:
            (outcome,) = started
        else:
            assert started == [], started
        return plain(outcome)

    def prefill_finished(self, transfer_id: TransferId, block_ids: BlockIds, *,
                         request_id: RequestId, now: float,
                         fail_on_purpose: bool = False) -> Outcome:
        return plain(super().prefill_finished(transfer_id, block_ids, request_id=request_id,
                                              now=now, fail_on_purpose=fail_on_purpose))

    def prefill_completing(self, transfer_id: TransferId, block_ids: BlockIds, *,
                           request_id: RequestId, step: int, now: float = 0.0,
                           fail_on_purpose: bool = False) -> Ready | None:
        return plain(super().prefill_completing(
            transfer_id, block_ids, request_id=request_id, step=step, now=now,
            fail_on_purpose=fail_on_purpose))

    def next_deadline(self) -> float | None:
        """The earliest deadline but the leases' (which outlive the test)."""
        deadline = super().next_deadline()
        return None if deadline is not None and deadline >= FOREVER else deadline
