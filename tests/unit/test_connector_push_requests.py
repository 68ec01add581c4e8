"""The scheduler's per-request push records (`connector.prefill.prompts`,
`connector.decode.registered`, `connector.decode.incoming`): each side's
states and transitions, and that ending a request leaves nothing behind."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from connector.decode.incoming import IncomingPushes
from connector.decode.registered import DecodePushes, DecodeState
from connector.prefill.prompts import PrefillPushes, PrefillState
from connector.protocol.side_channel import TransferId

TID = TransferId("t-1")


def request(rid: str = "p-1") -> Any:
    return SimpleNamespace(request_id=rid)


# --- P ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("follow", "tid", "state"), [
    pytest.param(True, TID, PrefillState.FOLLOWED, id="early-write"),
    pytest.param(False, TID, PrefillState.UNFOLLOWED, id="no-early-write"),
    pytest.param(True, None, PrefillState.UNFOLLOWED, id="no-transfer-id"),
])
def test_a_scheduled_prefill_is_followed_only_for_an_early_write(
        follow: bool, tid: TransferId | None, state: PrefillState) -> None:
    pushes = PrefillPushes()
    pushes.scheduled(request(), tid, fail_on_purpose=False, follow=follow)
    record = pushes.get("p-1")
    assert record is not None and record.state is state
    assert [r.request.request_id for r in pushes.followed()] == (
        ["p-1"] if state is PrefillState.FOLLOWED else [])


def test_a_prefill_completes_then_finishes_with_its_flags() -> None:
    pushes = PrefillPushes()
    pushes.scheduled(request(), TID, fail_on_purpose=True, follow=True)
    record = pushes.get("p-1")
    assert record is not None
    pushes.completing(record, [[4, 5]])
    assert list(pushes.followed()) == []
    pushes.scheduled(request(), TID, fail_on_purpose=False, follow=True)  # preempted: kept
    finished = pushes.finished("p-1")
    assert finished is not None
    assert (finished.state, finished.block_ids, finished.fail_on_purpose) == (
        PrefillState.COMPLETING, [[4, 5]], True)
    assert len(pushes) == 0 and pushes.finished("p-1") is None


def test_only_a_followed_prefill_can_complete() -> None:
    pushes = PrefillPushes()
    pushes.scheduled(request(), TID, fail_on_purpose=False, follow=False)
    record = pushes.get("p-1")
    assert record is not None
    with pytest.raises(ValueError, match="unfollowed"):
        pushes.completing(record, [[1]])


# --- D ---------------------------------------------------------------------------------


def test_a_push_that_arrives_is_gone() -> None:
    pushes = DecodePushes()
    pushes.registered("d-1", TID)
    assert pushes.awaiting()
    assert pushes.received("d-1") == TID
    assert not pushes.awaiting() and len(pushes) == 0
    assert pushes.received("d-1") is None


def test_an_aborted_push_waits_for_ps_answer_and_is_not_awaited() -> None:
    pushes = DecodePushes()
    pushes.registered("d-1", TID)
    assert pushes.aborting("d-1") == TID
    assert not pushes.awaiting() and len(pushes) == 1
    assert pushes.aborting("d-1") is None  # told P once
    assert pushes.received("d-1") is None  # a late notification changes nothing
    ended = pushes.ended("d-1")
    assert ended is not None and ended.state is DecodeState.ABORTING
    assert len(pushes) == 0


def test_a_failed_push_is_gone_and_unknown_ones_are_none() -> None:
    pushes = DecodePushes()
    pushes.registered("d-1", TID)
    pushes.registered("d-2", TransferId("t-2"))
    ended = pushes.ended("d-1")
    assert ended is not None and ended.state is DecodeState.AWAITING
    assert pushes.awaiting()  # d-2 still is
    assert pushes.ended("d-1") is None and pushes.aborting("nobody") is None
    assert pushes.received("d-2") == TransferId("t-2")
    assert not pushes.awaiting()


def test_registering_again_replaces_and_keeps_the_count() -> None:
    pushes = DecodePushes()
    pushes.registered("d-1", TID)
    pushes.registered("d-1", TransferId("t-2"))
    assert len(pushes) == 1
    assert pushes.received("d-1") == TransferId("t-2")
    assert not pushes.awaiting()


# --- D's worker --------------------------------------------------------------------------


def test_an_incoming_push_lands_after_every_ranks_notification() -> None:
    incoming = IncomingPushes()
    incoming.expect("d-1")
    assert incoming.awaiting == 1 and incoming.is_awaited("d-1")
    assert not incoming.notified("d-1", expected=2)
    assert incoming.notified("d-1", expected=2)
    assert incoming.awaiting == 0 and not incoming.is_awaited("d-1")
    assert incoming.landed() == ["d-1"]
    assert not incoming.cancel("d-1")  # landed: a late failure order changes nothing
    incoming.reported("d-1")
    assert len(incoming) == 0 and incoming.landed() == []


def test_a_cancelled_incoming_push_is_gone() -> None:
    incoming = IncomingPushes()
    incoming.expect("d-1")
    incoming.expect("d-2")
    assert incoming.cancel("d-1") and not incoming.cancel("d-1")
    assert incoming.awaiting == 1 and len(incoming) == 1
    with pytest.raises(ValueError, match="before it landed"):
        incoming.reported("d-2")


def test_expecting_again_restarts_the_count() -> None:
    incoming = IncomingPushes()
    incoming.expect("d-1")
    assert incoming.notified("d-1", expected=1)
    incoming.expect("d-1")
    assert incoming.awaiting == 1 and incoming.landed() == []
