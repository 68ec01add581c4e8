"""P's push registry: matching in either order, exact ids, duplicates, deadlines, aborts,
WRITE results, and that every path leaves nothing behind."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from connector.messages import EngineId, FailReason, NackReason, RegisterBlocks, TransferId
from connector.registry import (
    LIVE_STATES,
    InvalidTransition,
    PushRegistry,
    Ready,
    RegistryConfig,
    RegistryCounters,
    Rejected,
    Release,
    TransferState,
    Waiting,
)

T1 = TransferId("t-1")
P_BLOCKS = [[10, 11, 12], [20]]
D_BLOCKS = [[0, 1, 2], [5]]
REG_TTL, UNCLAIMED_TTL = 60.0, 20.0
S = TransferState


def registry(**overrides: Any) -> PushRegistry:
    config = {"engine_id": EngineId("p"), "block_size": 16, "tp_size": 2, "tp_rank": 1,
              "registration_ttl": REG_TTL, "unclaimed_ttl": UNCLAIMED_TTL, **overrides}
    return PushRegistry(RegistryConfig(**config))


def reg(transfer_id: str = T1, **overrides: Any) -> RegisterBlocks:
    fields = {"transfer_id": transfer_id, "engine_id": "d", "tp_size": 2, "tp_rank": 1,
              "block_ids": D_BLOCKS, "block_size": 16, "host": "10.0.0.2", "port": 5601,
              "ttl_s": 300.0, **overrides}
    return RegisterBlocks(**fields)


def assert_empty(r: PushRegistry) -> None:
    """Nothing leaked: no live record, every state count back to zero."""
    snapshot = r.snapshot()
    assert len(r) == 0 and snapshot.live == 0
    assert snapshot.by_state == dict.fromkeys(LIVE_STATES, 0)


def counters(**nonzero: int) -> RegistryCounters:
    return RegistryCounters(**nonzero)


# --- states reached by a few steps, shared by the tables below ------------------------------


def to_awaiting_prefill(r: PushRegistry) -> None:
    assert r.register(reg(), now=0.0) == Waiting(T1, S.AWAITING_PREFILL)


def to_awaiting_registration(r: PushRegistry) -> None:
    assert r.prefill_finished(T1, P_BLOCKS, now=0.0) == Waiting(T1, S.AWAITING_REGISTRATION)


def to_ready(r: PushRegistry) -> None:
    to_awaiting_prefill(r)
    assert r.prefill_finished(T1, P_BLOCKS, now=1.0) == Ready(T1, reg(), P_BLOCKS)


def to_writing(r: PushRegistry) -> None:
    to_ready(r)
    assert r.write_started(T1) is True


STATES: dict[TransferState, Callable[[PushRegistry], None]] = {
    S.AWAITING_PREFILL: to_awaiting_prefill,
    S.AWAITING_REGISTRATION: to_awaiting_registration,
    S.READY: to_ready,
    S.WRITING: to_writing,
}


# --- matching -------------------------------------------------------------------------------


@pytest.mark.parametrize("d_first", [True, False], ids=["register-first", "prefill-first"])
def test_a_registration_and_a_finished_prefill_match_in_either_order(d_first: bool) -> None:
    r = registry()
    if d_first:
        first = r.register(reg(), now=0.0)
        second = r.prefill_finished(T1, P_BLOCKS, now=1.0)
    else:
        first = r.prefill_finished(T1, P_BLOCKS, now=0.0)
        second = r.register(reg(), now=1.0)
    waiting = S.AWAITING_PREFILL if d_first else S.AWAITING_REGISTRATION
    assert first == Waiting(T1, waiting)
    assert second == Ready(T1, reg(), P_BLOCKS)
    assert r.state_of(T1) is S.READY and r.next_deadline() is None
    assert r.write_started(T1) is True
    assert r.write_done(T1) == Release(T1, S.DONE, P_BLOCKS, notify=reg())
    assert_empty(r)
    assert r.snapshot().counters == counters(registered=1, prefills=1, matched=1, done=1)


@pytest.mark.parametrize("other", ["t-1-abcd", "t-", "T-1", "t-1 ", "cmpl-t-1"])
def test_only_the_exact_transfer_id_matches(other: str) -> None:
    r = registry()
    to_awaiting_prefill(r)
    assert r.prefill_finished(TransferId(other), P_BLOCKS, now=0.0) == Waiting(
        TransferId(other), S.AWAITING_REGISTRATION)
    assert r.snapshot().by_state[S.AWAITING_PREFILL] == 1
    assert r.snapshot().by_state[S.AWAITING_REGISTRATION] == 1
    assert r.snapshot().counters.matched == 0


@pytest.mark.parametrize("d_first", [True, False], ids=["register-first", "prefill-first"])
def test_a_match_with_another_number_of_kv_groups_fails_and_tells_d(d_first: bool) -> None:
    r = registry()
    one_group = reg(block_ids=[[0, 1, 2]])
    if d_first:
        r.register(one_group, now=0.0)
        outcome = r.prefill_finished(T1, P_BLOCKS, now=0.0)
    else:
        r.prefill_finished(T1, P_BLOCKS, now=0.0)
        outcome = r.register(one_group, now=0.0)
    assert outcome == Release(T1, S.FAILED, P_BLOCKS, notify=one_group,
                              reason=FailReason.LAYOUT_MISMATCH)
    assert_empty(r)
    assert r.snapshot().counters.failed == 1


# --- refusals -------------------------------------------------------------------------------


@pytest.mark.parametrize("state", [S.AWAITING_PREFILL, S.READY, S.WRITING])
def test_a_second_registration_is_a_duplicate_and_changes_nothing(state: TransferState) -> None:
    r = registry()
    STATES[state](r)
    outcome = r.register(reg(port=7000), now=2.0)
    assert isinstance(outcome, Rejected) and outcome.reason is NackReason.DUPLICATE
    assert outcome.block_ids is None
    assert r.state_of(T1) is state and r.snapshot().counters.duplicates == 1


@pytest.mark.parametrize("state", [S.AWAITING_REGISTRATION, S.READY, S.WRITING])
def test_a_second_finished_prefill_is_a_duplicate_whose_blocks_come_back(
    state: TransferState,
) -> None:
    r = registry()
    STATES[state](r)
    assert r.prefill_finished(T1, [[99]], now=2.0) == Rejected(
        T1, NackReason.DUPLICATE, f"prefill for transfer {T1!r} already finished; these "
        "blocks are not kept", block_ids=[[99]])
    assert r.state_of(T1) is state and r.snapshot().counters.duplicates == 1


@pytest.mark.parametrize(("overrides", "reason", "named"), [
    pytest.param({"block_size": 32}, NackReason.BLOCK_SIZE_MISMATCH, "decode 32, prefill 16",
                 id="block-size"),
    pytest.param({"tp_size": 4, "tp_rank": 1}, NackReason.TP_MISMATCH, "decode tp 4 rank 1",
                 id="tp-size"),
    pytest.param({"tp_rank": 0}, NackReason.TP_MISMATCH, "prefill tp 2 rank 1", id="tp-rank"),
])
@pytest.mark.parametrize("p_finished", [False, True], ids=["p-running", "p-finished"])
def test_an_incompatible_registration_is_refused_with_both_values(
    overrides: dict[str, Any], reason: NackReason, named: str, p_finished: bool
) -> None:
    r = registry()
    if p_finished:
        to_awaiting_registration(r)
    outcome = r.register(reg(**overrides), now=1.0)
    assert isinstance(outcome, Rejected) and outcome.reason is reason
    assert named in outcome.message
    assert outcome.block_ids == (P_BLOCKS if p_finished else None)
    assert_empty(r)
    assert r.snapshot().counters.rejected == 1 and r.snapshot().counters.registered == 0


# --- deadlines ------------------------------------------------------------------------------


@pytest.mark.parametrize(("d_ttl", "deadline"), [
    pytest.param(300.0, 100.0 + REG_TTL, id="registry-ttl-is-shorter"),
    pytest.param(5.0, 105.0, id="d-ttl-is-shorter"),
])
def test_a_registration_expires_at_its_deadline_and_not_before(
    d_ttl: float, deadline: float
) -> None:
    r = registry()
    registration = reg(ttl_s=d_ttl)
    r.register(registration, now=100.0)
    assert r.next_deadline() == deadline
    assert r.expire(deadline - 1e-6) == []
    assert r.state_of(T1) is S.AWAITING_PREFILL
    assert r.expire(deadline) == [Release(T1, S.EXPIRED, None, notify=registration,
                                          reason=FailReason.EXPIRED)]
    assert_empty(r)
    assert r.snapshot().counters == counters(registered=1, expired_registrations=1)


def test_an_unclaimed_prefill_expires_at_its_deadline_and_frees_ps_blocks() -> None:
    r = registry()
    r.prefill_finished(T1, P_BLOCKS, now=100.0)
    deadline = 100.0 + UNCLAIMED_TTL
    assert r.next_deadline() == deadline
    assert r.expire(deadline - 1e-6) == []
    assert r.expire(deadline) == [Release(T1, S.EXPIRED, P_BLOCKS, notify=None,
                                          reason=FailReason.EXPIRED)]
    assert_empty(r)
    assert r.snapshot().counters == counters(prefills=1, expired_unclaimed=1)


def test_expiry_ends_only_the_transfers_that_are_due() -> None:
    r = registry()
    r.register(reg("early"), now=0.0)  # due at REG_TTL
    r.prefill_finished(TransferId("late"), P_BLOCKS, now=REG_TTL)  # due at REG_TTL + 20
    to_writing(r)  # T1: no deadline while writing
    assert [x.transfer_id for x in r.expire(REG_TTL)] == ["early"]
    assert r.next_deadline() == REG_TTL + UNCLAIMED_TTL
    assert [x.transfer_id for x in r.expire(1e9)] == ["late"]
    assert r.state_of(T1) is S.WRITING and r.next_deadline() is None


# --- aborts and WRITE results ---------------------------------------------------------------


@pytest.mark.parametrize(("state", "freed"), [
    pytest.param(S.AWAITING_PREFILL, None, id="awaiting-prefill"),
    pytest.param(S.AWAITING_REGISTRATION, P_BLOCKS, id="awaiting-registration"),
    pytest.param(S.READY, P_BLOCKS, id="ready"),
])
def test_an_abort_frees_exactly_the_blocks_held(
    state: TransferState, freed: list[list[int]] | None
) -> None:
    r = registry()
    STATES[state](r)
    assert r.abort(T1) == Release(T1, S.ABORTED, freed, notify=None)
    assert_empty(r)
    assert r.snapshot().counters.aborted == 1
    assert r.write_started(T1) is False, "an aborted transfer is not written"


@pytest.mark.parametrize("write_ends", [
    pytest.param(lambda r: r.write_done(T1), id="write-done"),
    pytest.param(lambda r: r.write_failed(T1, FailReason.WRITE_ERROR), id="write-failed"),
])
def test_an_abort_during_a_write_frees_when_the_write_ends_and_tells_no_one(
    write_ends: Callable[[PushRegistry], Release | None],
) -> None:
    r = registry()
    to_writing(r)
    assert r.abort(T1) is None, "P's blocks are still being read: not freed yet"
    assert r.state_of(T1) is S.WRITING
    assert write_ends(r) == Release(T1, S.ABORTED, P_BLOCKS, notify=None)
    assert_empty(r)
    assert r.snapshot().counters.aborted == 1 and r.snapshot().counters.done == 0


def test_an_abort_for_an_unknown_transfer_does_nothing() -> None:
    r = registry()
    assert r.abort(T1) is None
    assert_empty(r)
    assert r.snapshot().counters == counters()


@pytest.mark.parametrize("state", [S.READY, S.WRITING])
def test_a_failed_or_never_started_write_frees_and_tells_d(state: TransferState) -> None:
    r = registry()
    STATES[state](r)
    assert r.write_failed(T1, FailReason.HANDSHAKE_ERROR) == Release(
        T1, S.FAILED, P_BLOCKS, notify=reg(), reason=FailReason.HANDSHAKE_ERROR)
    assert_empty(r)
    assert r.snapshot().counters.failed == 1
    assert r.write_failed(T1, FailReason.WRITE_ERROR) is None, "already gone"


@pytest.mark.parametrize(("state", "event"), [
    pytest.param(S.WRITING, lambda r: r.write_started(T1), id="write_started-twice"),
    pytest.param(S.AWAITING_PREFILL, lambda r: r.write_started(T1), id="start-before-match"),
    pytest.param(S.READY, lambda r: r.write_done(T1), id="done-before-start"),
    pytest.param(None, lambda r: r.write_done(T1), id="done-for-unknown"),
    pytest.param(S.AWAITING_REGISTRATION, lambda r: r.write_failed(T1, FailReason.WRITE_ERROR),
                 id="failed-before-match"),
])
def test_an_event_the_state_does_not_allow_is_a_loud_bug(
    state: TransferState | None, event: Callable[[PushRegistry], object]
) -> None:
    r = registry()
    if state is not None:
        STATES[state](r)
    with pytest.raises(InvalidTransition, match="write_"):
        event(r)
    assert r.state_of(T1) is state, "the record is left as it was"


# --- nothing leaks --------------------------------------------------------------------------


@pytest.mark.parametrize("state", list(STATES))
def test_snapshot_counts_the_live_state(state: TransferState) -> None:
    r = registry()
    STATES[state](r)
    assert r.snapshot().by_state == {s: int(s is state) for s in LIVE_STATES}
    assert r.snapshot().live == len(r) == 1


def test_a_snapshot_is_a_copy() -> None:
    r = registry()
    snapshot = r.snapshot()
    r.register(reg(), now=0.0)
    assert snapshot.counters.registered == 0 and snapshot.live == 0


def test_many_transfers_on_every_path_leave_nothing_behind() -> None:
    r = registry()
    for i in range(50):
        tid = TransferId(f"t{i}")
        r.register(reg(tid), now=0.0)
        r.prefill_finished(tid, P_BLOCKS, now=0.0)
        r.write_started(tid)
        if i % 2:
            r.write_done(tid)
        else:
            r.write_failed(tid, FailReason.WRITE_ERROR)
        r.prefill_finished(TransferId(f"u{i}"), P_BLOCKS, now=0.0)
        r.register(reg(f"v{i}"), now=0.0)
    r.abort(TransferId("u0"))
    r.expire(1e9)
    assert_empty(r)
    c = r.snapshot().counters
    assert (c.done, c.failed, c.aborted, c.expired_unclaimed, c.expired_registrations) == (
        25, 25, 1, 49, 50)


@pytest.mark.parametrize(("overrides", "named"), [
    pytest.param({"engine_id": ""}, "engine_id", id="empty-engine-id"),
    pytest.param({"block_size": 0}, "block_size=0", id="block-size-0"),
    pytest.param({"tp_size": 0}, "tp_size=0", id="tp-size-0"),
    pytest.param({"tp_rank": 2}, "tp_rank=2", id="rank-out-of-range"),
    pytest.param({"registration_ttl": 0.0}, "registration_ttl", id="registration-ttl-0"),
    pytest.param({"unclaimed_ttl": float("inf")}, "unclaimed_ttl", id="unclaimed-ttl-inf"),
])
def test_a_bad_config_is_refused_when_built(overrides: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        registry(**overrides)


def test_config_is_a_frozen_value() -> None:
    config = RegistryConfig(engine_id=EngineId("p"), block_size=16)
    assert config == RegistryConfig(engine_id=EngineId("p"), block_size=16)
    with pytest.raises(AttributeError):
        config.block_size = 8  # type: ignore[misc]
    assert msgspec.structs.asdict(config)["unclaimed_ttl"] > 0
