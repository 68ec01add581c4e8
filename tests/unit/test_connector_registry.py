"""P's push registry: matching in either order, exact ids, duplicates, deadlines, aborts,
tombstones, WRITE results, and that every path leaves nothing behind."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from connector.prefill.registry import (
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
from connector.protocol.side_channel import (
    EngineId,
    FailReason,
    NackReason,
    RegisterBlocks,
    TransferId,
)
from tests.unit.registry_kit import GrantedRegistry

T1 = TransferId("t-1")
P_REQ = "p-req-1"  # P's request holding P_BLOCKS
P_BLOCKS = [[10, 11, 12], [20]]
D_BLOCKS = [[0, 1, 2], [5]]
REG_TTL, UNCLAIMED_TTL = 60.0, 20.0
S = TransferState


def registry(**overrides: Any) -> PushRegistry:
    config = {"engine_id": EngineId("p"), "block_size": 16, "tp_size": 2, "kv_heads": 8,
              "registration_ttl": REG_TTL, "unclaimed_ttl": UNCLAIMED_TTL, **overrides}
    return GrantedRegistry(RegistryConfig(**config))


def reg(transfer_id: str = T1, **overrides: Any) -> RegisterBlocks:
    fields = {"transfer_id": transfer_id, "engine_id": "d", "request_id": "d-req",
              "tp_size": 2, "tp_rank": 0,
              "block_ids": D_BLOCKS, "block_size": 16, "host": "10.0.0.2", "port": 5601,
              "ttl_s": 300.0, **overrides}
    return RegisterBlocks(**fields)


def assert_empty(r: PushRegistry) -> None:
    """Nothing leaked: no live record, every state count back to zero, no deadline left
    (a tombstone's included)."""
    snapshot = r.snapshot()
    assert len(r) == 0 and snapshot.live == 0 and snapshot.completing == snapshot.chunking == 0
    assert snapshot.by_state == dict.fromkeys(LIVE_STATES, 0)
    assert r.next_deadline() is None


def finish(r: PushRegistry, transfer_id: str = T1, *, now: float = 0.0,
           blocks: list[list[int]] = P_BLOCKS, request_id: str = P_REQ) -> Any:
    return r.prefill_finished(TransferId(transfer_id), blocks, request_id=request_id, now=now)


def counters(**nonzero: int) -> RegistryCounters:
    return RegistryCounters(**nonzero)


# --- states reached by a few steps, shared by the tables below ------------------------------


def to_awaiting_prefill(r: PushRegistry) -> None:
    assert r.register(reg(), now=0.0) == Waiting(T1, S.AWAITING_PREFILL)


def to_awaiting_registration(r: PushRegistry) -> None:
    assert finish(r) == Waiting(T1, S.AWAITING_REGISTRATION)


def to_ready(r: PushRegistry) -> None:
    to_awaiting_prefill(r)
    assert finish(r, now=1.0) == Ready(T1, reg(), P_BLOCKS, P_REQ)


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
        second = finish(r, now=1.0)
    else:
        first = finish(r, now=0.0)
        second = r.register(reg(), now=1.0)
    waiting = S.AWAITING_PREFILL if d_first else S.AWAITING_REGISTRATION
    assert first == Waiting(T1, waiting)
    assert second == Ready(T1, reg(), P_BLOCKS, P_REQ)
    assert r.state_of(T1) is S.READY and r.next_deadline() is None
    assert r.write_started(T1) is True
    assert r.write_done(T1) == Release(T1, S.DONE, P_BLOCKS, notify=reg(), request_id=P_REQ)
    assert_empty(r)
    assert r.snapshot().counters == counters(registered=1, prefills=1, matched=1, done=1)


@pytest.mark.parametrize("other", ["t-1-abcd", "t-", "T-1", "t-1 ", "cmpl-t-1"])
def test_only_the_exact_transfer_id_matches(other: str) -> None:
    r = registry()
    to_awaiting_prefill(r)
    assert finish(r, other) == Waiting(TransferId(other), S.AWAITING_REGISTRATION)
    assert r.snapshot().by_state[S.AWAITING_PREFILL] == 1
    assert r.snapshot().by_state[S.AWAITING_REGISTRATION] == 1
    assert r.snapshot().counters.matched == 0


@pytest.mark.parametrize("d_first", [True, False], ids=["register-first", "prefill-first"])
def test_a_match_with_another_number_of_kv_groups_fails_and_tells_d(d_first: bool) -> None:
    r = registry()
    one_group = reg(block_ids=[[0, 1, 2]])
    if d_first:
        r.register(one_group, now=0.0)
        outcome = finish(r)
    else:
        finish(r)
        outcome = r.register(one_group, now=0.0)
    assert outcome == Release(T1, S.FAILED, P_BLOCKS, notify=one_group,
                              reason=FailReason.LAYOUT_MISMATCH, request_id=P_REQ)
    assert_empty(r)
    assert r.snapshot().counters.failed == 1


# --- early matching: the step that completes the prompt is being scheduled ------------------


STEP = 7  # the engine step that completes the prompt


def complete(r: PushRegistry, *, blocks: list[list[int]] = P_BLOCKS,
             fail_on_purpose: bool = False) -> Ready | None:
    return r.prefill_completing(T1, blocks, request_id=P_REQ, step=STEP, now=0.0,
                                fail_on_purpose=fail_on_purpose)


# How P's request ends after the step that completed its prompt (the scheduler reports a
# finished prefill then, whatever ended the request; an aborted one must change nothing).
P_ENDS = [
    pytest.param(lambda r: finish(r, now=1.0), id="prefill-finished"),
    pytest.param(lambda r: r.prefill_aborted(T1, now=1.0), id="prefill-aborted"),
]


def test_a_prompt_completing_after_d_registered_matches_early_and_its_finish_is_known() -> None:
    r = registry()
    to_awaiting_prefill(r)
    assert complete(r) == Ready(T1, reg(), P_BLOCKS, P_REQ, early_step=STEP)
    assert r.next_deadline() is None, "matched: no deadline"
    write_early_match_to_the_end(r)


def write_early_match_to_the_end(r: PushRegistry) -> None:
    """T1 matched early: its WRITE starts, the prefill's finish is known, not a duplicate,
    and the WRITE's end frees everything."""
    assert r.write_started(T1) is True
    assert finish(r, now=1.0) == Waiting(T1, S.WRITING), "the finish of a known prefill"
    assert r.state_of(T1) is S.WRITING
    assert r.write_done(T1) == Release(T1, S.DONE, P_BLOCKS, notify=reg(), request_id=P_REQ)
    assert_empty(r)
    assert r.snapshot().counters == counters(registered=1, prefills=1, matched=1, early=1,
                                             done=1)


def test_d_registering_while_the_prompt_completes_matches_early() -> None:
    r = registry()
    assert complete(r) is None, "no registration yet"
    assert len(r) == 0 and r.next_deadline() is None and r.snapshot().completing == 1
    assert r.register(reg(), now=0.5) == Ready(T1, reg(), P_BLOCKS, P_REQ, early_step=STEP)
    write_early_match_to_the_end(r)


def test_a_prompt_that_completed_before_d_registered_waits_as_usual() -> None:
    r = registry()
    assert complete(r) is None
    to_awaiting_registration(r)
    assert r.snapshot().completing == 0, "its finish ends the early window"
    assert r.register(reg(), now=1.0) == Ready(T1, reg(), P_BLOCKS, P_REQ)
    assert r.snapshot().counters == counters(registered=1, prefills=1, matched=1)


@pytest.mark.parametrize("p_ends", P_ENDS)
def test_d_aborting_while_the_prompt_completes_frees_it_when_it_ends(
    p_ends: Callable[[PushRegistry], Any],
) -> None:
    r = registry()
    complete(r)
    assert r.abort(T1, now=0.5) is None
    assert r.snapshot().completing == 0
    outcome = p_ends(r)
    if outcome is not None:  # finished: its blocks are freed at once
        assert outcome == Release(T1, S.ABORTED, P_BLOCKS, request_id=P_REQ)
    r.expire(1.0 + UNCLAIMED_TTL)
    assert_empty(r)


@pytest.mark.parametrize("d_first", [True, False], ids=["register-first", "complete-first"])
def test_an_early_match_carries_the_prefills_fault_injection(d_first: bool) -> None:
    r = registry()
    if d_first:
        to_awaiting_prefill(r)
    assert (complete(r, fail_on_purpose=True) is None) is not d_first
    ready = Ready(T1, reg(), P_BLOCKS, P_REQ, early_step=STEP, fail_on_purpose=True)
    if not d_first:
        assert r.state_of(T1) is S.COMPLETING and len(r) == 0
        assert r.register(reg(), now=0.5) == ready
    assert r.state_of(T1) is S.READY and r.snapshot().completing == 0
    write_early_match_to_the_end(r)


@pytest.mark.parametrize("d_first", [True, False], ids=["register-first", "prefill-first"])
@pytest.mark.parametrize("fail_on_purpose", [True, False])
def test_a_match_after_the_prefill_carries_its_fault_injection_not_a_step(
        d_first: bool, fail_on_purpose: bool) -> None:
    r = registry()
    if d_first:
        to_awaiting_prefill(r)
    outcome = r.prefill_finished(T1, P_BLOCKS, request_id=P_REQ, now=1.0,
                                 fail_on_purpose=fail_on_purpose)
    if not d_first:
        outcome = r.register(reg(), now=1.0)
    assert outcome == Ready(T1, reg(), P_BLOCKS, P_REQ, fail_on_purpose=fail_on_purpose)


def test_a_prompt_that_completes_then_finishes_is_not_early_any_more() -> None:
    r = registry()
    assert complete(r, fail_on_purpose=True) is None
    r.prefill_finished(T1, P_BLOCKS, request_id=P_REQ, now=1.0, fail_on_purpose=True)
    assert r.register(reg(), now=1.0) == Ready(T1, reg(), P_BLOCKS, P_REQ,
                                               fail_on_purpose=True)


def test_a_registration_refused_while_the_prompt_completes_leaves_it_to_match() -> None:
    r = registry()
    complete(r)
    refused = r.register(reg(block_size=32), now=0.5)
    assert isinstance(refused, Rejected) and refused.block_ids is None
    assert r.state_of(T1) is S.COMPLETING and r.snapshot().completing == 1
    assert r.register(reg(), now=0.6) == Ready(T1, reg(), P_BLOCKS, P_REQ, early_step=STEP)


@pytest.mark.parametrize("state", [S.AWAITING_REGISTRATION, S.READY, S.WRITING])
def test_a_prompt_completing_in_any_other_state_changes_nothing(state: TransferState) -> None:
    r = registry()
    STATES[state](r)
    before = r.snapshot()
    assert complete(r) is None
    assert r.state_of(T1) is state and r.snapshot() == before


@pytest.mark.parametrize("d_first", [True, False], ids=["register-first", "complete-first"])
def test_a_prompt_completing_with_another_number_of_kv_groups_is_left_to_its_finish(
    d_first: bool,
) -> None:
    """Not matched early; the finish that follows fails it and frees P's blocks, which
    only then may be freed."""
    r = registry()
    one_group = reg(block_ids=[[0, 1, 2]])
    if d_first:
        r.register(one_group, now=0.0)
        assert complete(r) is None
    else:
        assert complete(r) is None
        assert r.register(one_group, now=0.0) == Waiting(T1, S.AWAITING_PREFILL)
    assert r.state_of(T1) is S.AWAITING_PREFILL
    assert finish(r) == Release(T1, S.FAILED, P_BLOCKS, notify=one_group,
                                reason=FailReason.LAYOUT_MISMATCH, request_id=P_REQ)
    assert_empty(r)


@pytest.mark.parametrize("p_ends", P_ENDS)
def test_an_abort_during_an_early_write_frees_when_the_write_ends(
    p_ends: Callable[[PushRegistry], Any],
) -> None:
    r = registry()
    to_awaiting_prefill(r)
    complete(r)
    r.write_started(T1)
    assert r.abort(T1, now=0.5) is None, "P's blocks are being read: not freed yet"
    p_ends(r)
    assert r.state_of(T1) is S.WRITING
    assert r.write_done(T1) == Release(T1, S.ABORTED, P_BLOCKS, notify=reg(),
                                       reason=FailReason.ABORTED, request_id=P_REQ)
    assert_empty(r)


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
    assert finish(r, now=2.0, blocks=[[99]], request_id="p-req-2") == Rejected(
        T1, NackReason.DUPLICATE, f"prefill for transfer {T1!r} already finished; these "
        "blocks are not kept", block_ids=[[99]], request_id="p-req-2")
    assert r.state_of(T1) is state and r.snapshot().counters.duplicates == 1


@pytest.mark.parametrize(("overrides", "reason", "named"), [
    pytest.param({"block_size": 32}, NackReason.BLOCK_SIZE_MISMATCH, "decode 32, prefill 16",
                 id="block-size"),
    pytest.param({"tp_size": 3}, NackReason.TP_MISMATCH, "decode tp 3, prefill tp 2",
                 id="tp-size"),
    pytest.param({"tp_size": 16}, NackReason.TP_MISMATCH, "exceeds the model's 8 KV heads",
                 id="tp-replicating-heads"),
    pytest.param({"tp_size": 4, "tp_rank": 1}, NackReason.TP_MISMATCH, "rank 1 of decode tp 4",
                 id="tp-rank"),
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
    assert outcome.request_id == (P_REQ if p_finished else None)
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
    finish(r, now=100.0)
    deadline = 100.0 + UNCLAIMED_TTL
    assert r.next_deadline() == deadline
    assert r.expire(deadline - 1e-6) == []
    assert r.expire(deadline) == [Release(T1, S.EXPIRED, P_BLOCKS, notify=None,
                                          reason=FailReason.EXPIRED, request_id=P_REQ)]
    assert_empty(r)
    assert r.snapshot().counters == counters(prefills=1, expired_unclaimed=1)


def test_expiry_ends_only_the_transfers_that_are_due() -> None:
    r = registry()
    r.register(reg("early"), now=0.0)  # due at REG_TTL
    finish(r, "late", now=REG_TTL)  # due at REG_TTL + 20
    to_writing(r)  # T1: no deadline while writing
    assert [x.transfer_id for x in r.expire(REG_TTL)] == ["early"]
    assert r.next_deadline() == REG_TTL + UNCLAIMED_TTL
    assert [x.transfer_id for x in r.expire(1e9)] == ["late"]
    assert r.state_of(T1) is S.WRITING and r.next_deadline() is None


def scanned(r: PushRegistry, now: float) -> tuple[set[TransferId], int, float | None]:
    """What a scan of every record and tombstone finds: the transfers due at `now`, the
    tombstones left after `now`, and the earliest deadline (what the heap replaced)."""
    records = {x.transfer_id: x.deadline for x in r._transfers.values()
               if x.deadline is not None}
    graves = [deadline for _, deadline in r._tombstones.values()]
    due = {tid for tid, deadline in records.items() if now >= deadline}
    left = sum(1 for deadline in graves if now < deadline)
    return due, left, min([*records.values(), *graves], default=None)


def churn(r: PushRegistry, rng: random.Random, now: float) -> None:
    """One random event, of any kind, for one of a few dozen transfers."""
    tid = TransferId(f"t{rng.randrange(40)}")
    peer = rng.choice([b"d1", b"d2"])
    kind = rng.randrange(9)
    outcome: object = None
    if kind == 0:
        outcome = r.register(reg(tid, ttl_s=rng.uniform(1.0, 90.0)), now=now, peer=peer)
    elif kind == 1:
        outcome = finish(r, tid, now=now, request_id=f"p-{tid}")
    elif kind == 2:
        outcome = r.prefill_completing(tid, P_BLOCKS, request_id=f"p-{tid}",
                                       step=rng.randrange(9), now=now)
    elif kind == 3:
        outcome = r.abort(tid, now=now, peer=peer)
    elif kind == 4:
        outcome = r.abandon(tid, now=now)
    elif kind == 5:
        outcome = r.prefill_aborted(tid, now=now)
    elif kind == 8:  # a chunk of its prompt: a CHUNKING record, or a chunk's WRITE
        r.prefill_progress(tid, [P_BLOCKS[0][:rng.randrange(1, 3)]], request_id=f"p-{tid}",
                           prompt_blocks=3, step=rng.randrange(9), now=now)
    elif r.state_of(tid) is S.WRITING:
        (r.write_done(tid) if kind == 6 else r.write_failed(tid, FailReason.WRITE_ERROR))
    if isinstance(outcome, Ready):
        r.write_started(tid)


@pytest.mark.parametrize("seed", range(4))
def test_expiry_from_the_heap_ends_exactly_what_a_scan_finds_due(seed: int) -> None:
    """Random events, tombstones evicted at a small cap, and time that moves on: every
    expire ends just the transfers a scan finds due and keeps just the tombstones a scan
    keeps; next_deadline is the scan's earliest; stale heap entries stay bounded."""
    rng = random.Random(seed)
    r = registry(max_tombstones=8)
    now = 0.0
    for _ in range(3000):
        churn(r, rng, now)
        if rng.random() < 0.2:
            now += rng.uniform(0.0, 15.0)
            due, left, earliest = scanned(r, now)
            assert r.next_deadline() == earliest
            assert {x.transfer_id for x in r.expire(now)} == due
            assert r.tombstones() == left
            assert all(r.state_of(TransferId(tid)) is None for tid in due)
        assert r.deadlines_held() <= 2 * (len(r._transfers) + r.tombstones()) + 1024
        assert len(r) == r.snapshot().live, "the count of not-live records drifted"
    r.expire(1e9)
    assert r.next_deadline() is None and r.tombstones() == 0


# --- aborts and WRITE results ---------------------------------------------------------------


@pytest.mark.parametrize(("state", "freed", "notify", "request_id"), [
    pytest.param(S.AWAITING_PREFILL, None, reg(), None, id="awaiting-prefill"),
    pytest.param(S.AWAITING_REGISTRATION, P_BLOCKS, None, P_REQ, id="awaiting-registration"),
    pytest.param(S.READY, P_BLOCKS, reg(), P_REQ, id="ready"),
])
def test_an_abort_frees_exactly_the_blocks_held_and_answers_a_registered_d(
    state: TransferState, freed: list[list[int]] | None, notify: RegisterBlocks | None,
    request_id: str | None,
) -> None:
    r = registry()
    STATES[state](r)
    assert r.abort(T1, now=2.0) == Release(T1, S.ABORTED, freed, notify=notify,
                                           reason=FailReason.ABORTED, request_id=request_id)
    if state is S.AWAITING_PREFILL:
        # P's prefill may still finish: a tombstone frees its blocks at once when it does.
        assert r.next_deadline() == 2.0 + UNCLAIMED_TTL
        assert r.prefill_finished(T1, P_BLOCKS, request_id=P_REQ, now=3.0) == Release(
            T1, S.ABORTED, P_BLOCKS, notify=None, reason=None, request_id=P_REQ)
    assert_empty(r)
    assert r.snapshot().counters.aborted == 1 + (state is S.AWAITING_PREFILL)
    assert r.write_started(T1) is False, "an aborted transfer is not written"


@pytest.mark.parametrize("write_ends", [
    pytest.param(lambda r: r.write_done(T1), id="write-done"),
    pytest.param(lambda r: r.write_failed(T1, FailReason.WRITE_ERROR), id="write-failed"),
])
def test_an_abort_during_a_write_frees_when_the_write_ends_and_answers_d_aborted(
    write_ends: Callable[[PushRegistry], Release | None],
) -> None:
    r = registry()
    to_writing(r)
    assert r.abort(T1, now=2.0) is None, "P's blocks are still being read: not freed yet"
    assert r.state_of(T1) is S.WRITING
    assert r.next_deadline() is None, "no tombstone for a known transfer"
    assert write_ends(r) == Release(T1, S.ABORTED, P_BLOCKS, notify=reg(),
                                    reason=FailReason.ABORTED, request_id=P_REQ)
    assert_empty(r)
    c = r.snapshot().counters
    assert (c.aborted, c.done, c.failed) == (1, 0, 0)


# --- tombstones: an end that comes before its transfer is known ------------------------------


def test_an_abort_for_an_unknown_transfer_returns_nothing_and_leaves_only_a_tombstone() -> None:
    r = registry()
    assert r.abort(T1, now=5.0) is None
    assert len(r) == 0 and r.snapshot().live == 0
    assert r.next_deadline() == 5.0 + UNCLAIMED_TTL
    assert r.snapshot().counters == counters()


@pytest.mark.parametrize("late", [0.0, UNCLAIMED_TTL - 1e-6], ids=["at-once", "just-in-time"])
def test_an_abort_before_the_prefill_frees_the_late_prefill_at_once(late: float) -> None:
    r = registry()
    r.abort(T1, now=10.0)
    assert finish(r, now=10.0 + late) == Release(T1, S.ABORTED, P_BLOCKS, notify=None,
                                                 reason=None, request_id=P_REQ)
    assert_empty(r)
    assert r.snapshot().counters == counters(prefills=1, aborted=1)
    assert finish(r, now=11.0 + late) == Waiting(T1, S.AWAITING_REGISTRATION), (
        "the tombstone is used up")


def test_an_abort_tombstone_frees_only_its_own_transfer() -> None:
    r = registry()
    r.abort(T1, now=0.0)
    assert finish(r, "t-2") == Waiting(TransferId("t-2"), S.AWAITING_REGISTRATION)
    assert finish(r, T1) == Release(T1, S.ABORTED, P_BLOCKS, request_id=P_REQ)
    assert r.state_of(TransferId("t-2")) is S.AWAITING_REGISTRATION


def test_a_prefill_aborted_tells_a_waiting_d_at_once() -> None:
    r = registry()
    to_awaiting_prefill(r)
    assert r.prefill_aborted(T1, now=3.0) == Release(
        T1, S.FAILED, None, notify=reg(), reason=FailReason.PREFILL_ABORTED, request_id=None)
    assert_empty(r)
    assert r.snapshot().counters == counters(registered=1, failed=1)
    assert r.expire(1e9) == [], "nothing is left to expire"


@pytest.mark.parametrize("state", [S.AWAITING_REGISTRATION, S.READY, S.WRITING])
def test_a_prefill_aborted_after_its_prefill_finished_changes_nothing(
    state: TransferState,
) -> None:
    r = registry()
    STATES[state](r)
    before = r.snapshot()
    assert r.prefill_aborted(T1, now=3.0) is None
    assert r.state_of(T1) is state and r.snapshot() == before


@pytest.mark.parametrize("late", [0.0, UNCLAIMED_TTL - 1e-6], ids=["at-once", "just-in-time"])
def test_a_prefill_aborted_before_registration_refuses_the_later_registration(
    late: float,
) -> None:
    r = registry()
    assert r.prefill_aborted(T1, now=10.0) is None
    assert len(r) == 0 and r.next_deadline() == 10.0 + UNCLAIMED_TTL
    outcome = r.register(reg(), now=10.0 + late)
    assert isinstance(outcome, Rejected)
    assert outcome == Rejected(T1, NackReason.PREFILL_ABORTED, outcome.message)
    assert T1 in outcome.message and "without its KV" in outcome.message
    assert_empty(r)
    assert r.snapshot().counters == counters(rejected=1)
    assert r.register(reg(), now=11.0 + late) == Waiting(T1, S.AWAITING_PREFILL), (
        "the tombstone is used up")


def test_a_prefill_aborted_tombstone_wins_over_a_layout_refusal() -> None:
    r = registry()
    r.prefill_aborted(T1, now=0.0)
    outcome = r.register(reg(block_size=32), now=0.0)
    assert isinstance(outcome, Rejected) and outcome.reason is NackReason.PREFILL_ABORTED
    assert r.snapshot().counters == counters(rejected=1)


# Each tombstone's cause, and the event it would change: (leave it, then the event).
TOMBSTONES = [
    pytest.param(lambda r, now: r.abort(T1, now=now),
                 lambda r, now: finish(r, now=now),
                 Waiting(T1, S.AWAITING_REGISTRATION), id="abort-then-prefill"),
    pytest.param(lambda r, now: r.prefill_aborted(T1, now=now),
                 lambda r, now: r.register(reg(), now=now),
                 Waiting(T1, S.AWAITING_PREFILL), id="prefill-aborted-then-register"),
]


@pytest.mark.parametrize(("leave", "event", "normal"), TOMBSTONES)
def test_a_tombstone_expires_after_unclaimed_ttl_and_a_later_event_is_normal(
    leave: Callable[[PushRegistry, float], object],
    event: Callable[[PushRegistry, float], object], normal: Waiting,
) -> None:
    r = registry()
    assert leave(r, 100.0) is None
    deadline = 100.0 + UNCLAIMED_TTL
    assert r.expire(deadline - 1e-6) == []
    assert r.next_deadline() == deadline, "not purged before its deadline"
    assert r.expire(deadline) == [], "a tombstone ends no transfer"
    assert r.next_deadline() is None, "purged at its deadline"
    assert event(r, deadline + 1.0) == normal
    c = r.snapshot().counters
    assert (c.aborted, c.rejected) == (0, 0)


@pytest.mark.parametrize("leave", [p.values[0] for p in TOMBSTONES],
                         ids=[p.id for p in TOMBSTONES])
def test_next_deadline_includes_a_tombstone(
    leave: Callable[[PushRegistry, float], object],
) -> None:
    r = registry()
    r.register(reg("later"), now=50.0)  # due at 50 + REG_TTL = 110
    assert r.next_deadline() == 50.0 + REG_TTL
    leave(r, 10.0)  # due at 10 + UNCLAIMED_TTL = 30: the earliest
    assert r.next_deadline() == 10.0 + UNCLAIMED_TTL
    assert r.expire(10.0 + UNCLAIMED_TTL) == []
    assert r.next_deadline() == 50.0 + REG_TTL
    assert r.state_of(TransferId("later")) is S.AWAITING_PREFILL


@pytest.mark.parametrize("state", [S.READY, S.WRITING])
def test_a_failed_or_never_started_write_frees_and_tells_d(state: TransferState) -> None:
    r = registry()
    STATES[state](r)
    assert r.write_failed(T1, FailReason.HANDSHAKE_ERROR) == Release(
        T1, S.FAILED, P_BLOCKS, notify=reg(), reason=FailReason.HANDSHAKE_ERROR,
        request_id=P_REQ)
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
        finish(r, tid, request_id=f"p{i}")
        r.write_started(tid)
        if i % 2:
            r.write_done(tid)
        else:
            r.write_failed(tid, FailReason.WRITE_ERROR)
        finish(r, f"u{i}", request_id=f"q{i}")
        r.register(reg(f"v{i}"), now=0.0)
    r.abort(TransferId("u0"), now=0.0)
    r.abort(TransferId("w0"), now=0.0)  # unknown: a tombstone, purged by expire
    r.prefill_aborted(TransferId("x0"), now=0.0)  # unknown: a tombstone too
    r.expire(1e9)
    assert_empty(r)
    c = r.snapshot().counters
    assert (c.done, c.failed, c.aborted, c.expired_unclaimed, c.expired_registrations) == (
        25, 25, 1, 49, 50)


@pytest.mark.parametrize(("overrides", "named"), [
    pytest.param({"engine_id": ""}, "engine_id", id="empty-engine-id"),
    pytest.param({"block_size": 0}, "block_size=0", id="block-size-0"),
    pytest.param({"tp_size": 0}, "tp_size=0", id="tp-size-0"),
    pytest.param({"kv_heads": 0}, "kv_heads=0", id="kv-heads-0"),
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


# --- chunks: a prompt computed in several steps, written while later chunks compute -------


def progress(r: PushRegistry, blocks: list[int], *, prompt_blocks: int = 6,
             step: int = 3) -> Ready | None:
    from tests.unit.registry_kit import plain

    return plain(r.prefill_progress(T1, [blocks], request_id=P_REQ,
                                    prompt_blocks=prompt_blocks, step=step, now=0.0))


def test_a_chunk_d_registered_for_is_written_and_the_transfer_waits_on() -> None:
    """D registered for its 4 uncached blocks of a 6-block prompt (a 2-block prefix hit
    on D): P's blocks from the third pair with D's from the first, as vLLM's push code
    pairs them for the whole prompt; each chunk writes only what no chunk did."""
    r = registry()
    d_tail = reg(block_ids=[[30, 31, 32, 33]])
    r.register(d_tail, now=0.0)
    assert progress(r, [10, 11]) is None, "all of it cached on D: nothing to write"
    first = progress(r, [10, 11, 12, 13])
    assert first == Ready(T1, reg(block_ids=[[30, 31]]), [[12, 13]], P_REQ, early_step=3,
                          chunk=True)
    second = progress(r, [10, 11, 12, 13, 14], step=4)
    assert second == Ready(T1, reg(block_ids=[[32]]), [[14]], P_REQ, early_step=4,
                           chunk=True)
    assert progress(r, [10, 11, 12, 13, 14], step=5) is None, "nothing new"
    snapshot = r.snapshot()
    assert snapshot.by_state[S.AWAITING_PREFILL] == 1 and snapshot.counters.chunks == 2
    assert snapshot.counters.matched == 0, "a chunk is no match: the final WRITE is to come"
    final = r.prefill_completing(T1, [[10, 11, 12, 13, 14, 15]], request_id=P_REQ, step=6,
                                 now=0.0)
    assert final is not None and not final.chunk and final.block_ids == [[10, 11, 12, 13, 14, 15]]


@pytest.mark.parametrize("blocks, prompt_blocks", [
    ([10, 11, 12], 2),  # more blocks than the prompt has: not this prompt's pairing
    ([10], 2),          # D's registration names more blocks than the prompt has
], ids=["past-the-prompt", "d-holds-more"])
def test_a_chunk_that_cannot_be_paired_with_d_is_not_written(
    blocks: list[int], prompt_blocks: int,
) -> None:
    r = registry()
    r.register(reg(block_ids=[[30, 31, 32]]), now=0.0)
    assert progress(r, blocks, prompt_blocks=prompt_blocks) is None


def test_no_chunk_with_several_kv_groups() -> None:
    r = registry()
    assert progress(r, [10, 11]) is None  # nobody registered yet
    r.register(reg(), now=0.0)  # two KV-cache groups
    assert isinstance(r, GrantedRegistry) and r.granted_chunks == []
    assert r.prefill_progress(T1, [[10], [20]], request_id=P_REQ, prompt_blocks=3, step=1,
                              now=0.0) is None


def test_a_chunk_computed_before_d_registered_is_written_when_its_grant_comes() -> None:
    """The router sends P and D at once, so D's registration mostly comes while P computes
    the first chunk: the registry remembers the chunk (CHUNKING, not live), and the grant
    asks for it, for its step (P's workers drop it if that step is over)."""
    r = registry()
    assert isinstance(r, GrantedRegistry)
    assert progress(r, [10, 11, 12], step=3) is None
    assert progress(r, [10, 11, 12, 13], step=4) is None, "the latest progress is kept"
    assert r.state_of(T1) is S.CHUNKING and len(r) == 0 and r.snapshot().chunking == 1
    assert r.next_deadline() is None, "P's alone: its prefill's end forgets it"
    assert r.register(reg(block_ids=[[30, 31, 32, 33, 34]]), now=0.0) == Waiting(
        T1, S.AWAITING_PREFILL)
    assert r.granted_chunks == [Ready(T1, reg(block_ids=[[30, 31, 32]]), [[11, 12, 13]],
                                      P_REQ, early_step=4, chunk=True)]
    snapshot = r.snapshot()
    assert snapshot.chunking == 0 and snapshot.by_state[S.AWAITING_PREFILL] == 1
    assert progress(r, [10, 11, 12, 13, 14], step=5) == Ready(
        T1, reg(block_ids=[[33]]), [[14]], P_REQ, early_step=5, chunk=True)
    final = r.prefill_completing(T1, [[10, 11, 12, 13, 14, 15]], request_id=P_REQ, step=6)
    assert final is not None and not final.chunk


def test_a_chunk_computed_before_the_grant_is_written_when_it_comes() -> None:
    """A registration whose grant has not come yet: its chunk waits for the grant."""
    r = PushRegistry(RegistryConfig(engine_id=EngineId("p"), block_size=16))
    r.register(reg(block_ids=[[30, 31, 32]]), now=0.0, peer=b"d")
    assert r.prefill_progress(T1, [[10, 11]], request_id=P_REQ, prompt_blocks=3, step=2,
                              now=0.1) is None
    (chunk,) = r.grant(b"d", sent=0.1, now=0.2, adds=[T1])
    assert isinstance(chunk, Ready) and chunk.chunk and chunk.early_step == 2
    assert chunk.block_ids == [[10, 11]] and chunk.registration.block_ids == [[30, 31]]
    assert chunk.write_by == 0.1 + r.config.lease_s + r.config.write_s
    assert r.grant(b"d", sent=0.3, now=0.3, adds=[T1]) == [], "asked once"


@pytest.mark.parametrize("end", ["prefill_aborted", "prefill_finished", "d_abort",
                                 "abandon"])
def test_a_chunking_record_goes_with_its_prefill_or_its_transfer(end: str) -> None:
    r = registry()
    progress(r, [10, 11])
    if end == "prefill_aborted":
        assert r.prefill_aborted(T1, now=0.0) is None
        assert isinstance(r.register(reg(), now=0.0), Rejected), "P's request ended"
    elif end == "prefill_finished":
        assert r.prefill_finished(T1, [[10, 11, 12]], request_id=P_REQ, now=0.0) == Waiting(
            T1, S.AWAITING_REGISTRATION)
    elif end == "d_abort":
        assert r.abort(T1, now=0.0) is None
        assert progress(r, [10, 11, 12], step=4) is None
    else:
        assert r.abandon(T1, now=0.0) is None
    snapshot = r.snapshot()
    assert snapshot.chunking == 0 and r.state_of(T1) is not S.CHUNKING
    assert len(r) == snapshot.live, "the count of not-live records drifted"


def test_a_registration_refused_leaves_the_chunking_record_to_its_prefill() -> None:
    r = registry()
    progress(r, [10, 11])
    refused = r.register(reg(block_size=32), now=0.0)
    assert isinstance(refused, Rejected) and refused.block_ids is None
    assert r.state_of(T1) is S.CHUNKING and len(r) == 0 == r.snapshot().live
    assert r.prefill_aborted(T1, now=0.0) is None
    assert r.snapshot().chunking == 0 and len(r) == 0


def test_a_chunking_record_completes_and_matches_early_with_no_chunk() -> None:
    r = registry()
    assert isinstance(r, GrantedRegistry)
    progress(r, [10, 11], step=3)
    assert r.prefill_completing(T1, [[10, 11, 12]], request_id=P_REQ, step=4) is None
    assert r.state_of(T1) is S.COMPLETING and r.snapshot().chunking == 0
    ready = r.register(reg(block_ids=[[30, 31, 32]]), now=0.0)
    assert isinstance(ready, Ready) and ready.early_step == 4 and not ready.chunk
    assert r.granted_chunks == [], "the final WRITE carries every block"
    assert len(r) == r.snapshot().live == 1


def test_d_hears_of_an_end_before_the_final_write_only_once_chunks_cannot_be_in_flight(
) -> None:
    """A transfer that ends while AWAITING_PREFILL after a chunk WRITE (D's abort, P's
    request gone, an expiry): D frees its blocks on P's word, so the word must wait for
    the chunk's write_by; without a chunk, D hears at once."""
    r = registry()
    r.register(reg(block_ids=[[30, 31, 32]]), now=0.0)
    chunk = r.prefill_progress(T1, [[10, 11]], request_id=P_REQ, prompt_blocks=3, step=1,
                               now=0.0)
    assert chunk is not None and chunk.chunk
    release = r.abort(T1, now=1.0)
    assert isinstance(release, Release) and release.notify is not None
    assert release.notify_after == chunk.write_by
    plain_one = registry()
    plain_one.register(reg(), now=0.0)
    release = plain_one.abort(T1, now=1.0)
    assert isinstance(release, Release) and release.notify_after is None
