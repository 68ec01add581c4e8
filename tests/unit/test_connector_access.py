"""P's push registry: who may end a transfer, and the limits that bound what a peer can
make P hold. Aborts count only from the registrant; the router's abandon only before any
D registered; registrations are checked against P's layout (KV-cache groups, blocks) before anything
of them is kept; pending registrations are capped per peer and for all peers together
(count and bytes); tombstones are bounded, and cheap whatever their ids."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest

from connector.prefill.registry import (
    Ignored,
    PushRegistry,
    Ready,
    RegistryConfig,
    Rejected,
    Release,
    TransferState,
    Waiting,
    footprint,
)
from connector.protocol.side_channel import (
    MAX_KV_GROUPS,
    EngineId,
    FailReason,
    NackReason,
    RegisterBlocks,
    TransferId,
)
from tests.unit.registry_kit import GrantedRegistry

S = TransferState
T1 = TransferId("t-1")
P_REQ = "p-req-1"
P_BLOCKS = [[10, 11, 12]]
D_BLOCKS = [[0, 1, 2]]
D1, D2 = b"d-one", b"d-two"  # two peers (CURVE keys, or routing identities)


def registry(**overrides: Any) -> PushRegistry:
    config = {"engine_id": EngineId("p"), "block_size": 16, **overrides}
    return GrantedRegistry(RegistryConfig(**config))


def reg(transfer_id: str = T1, **overrides: Any) -> RegisterBlocks:
    fields = {"transfer_id": transfer_id, "engine_id": "d", "request_id": f"d-{transfer_id}",
              "tp_size": 1, "tp_rank": 0, "block_ids": D_BLOCKS, "block_size": 16,
              "host": "10.0.0.2", "port": 5601, "ttl_s": 300.0, **overrides}
    return RegisterBlocks(**fields)


def finish(r: PushRegistry, transfer_id: str = T1, now: float = 0.0) -> Any:
    return r.prefill_finished(TransferId(transfer_id), P_BLOCKS, request_id=P_REQ, now=now)


def assert_empty(r: PushRegistry, *peers: bytes) -> None:
    assert len(r) == 0 and r.next_deadline() is None
    assert all(r.pending_of(peer) == 0 for peer in peers)


# States of a transfer D1 registered.
def registered(r: PushRegistry) -> None:
    assert r.register(reg(), now=0.0, peer=D1) == Waiting(T1, S.AWAITING_PREFILL)


def ready(r: PushRegistry) -> None:
    registered(r)
    assert isinstance(finish(r), Ready)


def writing(r: PushRegistry) -> None:
    ready(r)
    assert r.write_started(T1)


REGISTERED: dict[TransferState, Callable[[PushRegistry], None]] = {
    S.AWAITING_PREFILL: registered, S.READY: ready, S.WRITING: writing,
}


# --- aborts: only from the registrant -----------------------------------------------------


@pytest.mark.parametrize("state", list(REGISTERED), ids=lambda s: s.name)
def test_an_abort_of_a_registered_transfer_from_another_peer_is_ignored_and_counted(
    state: TransferState,
) -> None:
    r = registry()
    REGISTERED[state](r)
    assert r.abort(T1, now=1.0, peer=D2) == Ignored(T1, "aborted by a peer that did not "
                                                        "register it")
    assert r.state_of(T1) is state, "the transfer goes on"
    assert r.counters().foreign_aborts == 1 and r.counters().aborted == 0
    if state is S.WRITING:
        r.write_done(T1)  # the WRITE's end is not turned into an abort
        assert r.counters().done == 1
    else:
        outcome = r.abort(T1, now=1.0, peer=D1)  # the registrant's own abort counts
        assert isinstance(outcome, Release) and outcome.state is S.ABORTED
        assert outcome.reason is FailReason.ABORTED
    r.expire(1e9)
    assert_empty(r, D1, D2)


def test_an_abort_of_a_prefill_no_d_registered_is_honoured_from_anyone() -> None:
    """D whose whole prompt was in its prefix cache never registers; it frees P's
    blocks by naming the transfer."""
    r = registry()
    assert finish(r) == Waiting(T1, S.AWAITING_REGISTRATION)
    outcome = r.abort(T1, now=1.0, peer=D2)
    assert isinstance(outcome, Release) and outcome.block_ids == P_BLOCKS
    assert outcome.notify is None and r.counters().foreign_aborts == 0


# --- the router's abandon: only before any D registered -----------------------------------


def test_an_abandon_frees_a_finished_prefill_no_d_claimed_at_once() -> None:
    r = registry()
    finish(r)
    outcome = r.abandon(T1, now=1.0)
    assert outcome == Release(T1, S.ABORTED, P_BLOCKS, None, FailReason.ABORTED, P_REQ)
    assert r.counters().abandoned == 1
    r.expire(1e9)
    assert_empty(r)


@pytest.mark.parametrize("state", list(REGISTERED), ids=lambda s: s.name)
def test_an_abandon_of_a_registered_transfer_is_ignored_and_counted(
    state: TransferState,
) -> None:
    r = registry()
    REGISTERED[state](r)
    assert isinstance(r.abandon(T1, now=1.0), Ignored)
    assert r.state_of(T1) is state and r.pending_of(D1) == 1
    assert r.counters().abandons_ignored == 1 and r.counters().abandoned == 0


@pytest.mark.parametrize("completing", [False, True], ids=["unknown", "completing"])
def test_an_abandon_before_the_prefill_finished_frees_it_when_it_does(completing: bool) -> None:
    r = registry()
    if completing:
        assert r.prefill_completing(T1, P_BLOCKS, request_id=P_REQ, step=3, now=0.0) is None
    assert r.abandon(T1, now=1.0) is None
    outcome = finish(r, now=2.0)
    assert isinstance(outcome, Release) and outcome.state is S.ABORTED
    assert outcome.block_ids == P_BLOCKS and outcome.request_id == P_REQ
    r.expire(1e9)
    assert_empty(r)


# --- limits ------------------------------------------------------------------------------


def test_pending_registrations_are_limited_per_peer_and_freed_as_transfers_end() -> None:
    r = registry(max_pending_per_peer=2)
    assert isinstance(r.register(reg("a"), now=0.0, peer=D1), Waiting)
    assert isinstance(r.register(reg("b"), now=0.0, peer=D1), Waiting)
    over = r.register(reg("c"), now=0.0, peer=D1)
    assert isinstance(over, Rejected) and over.reason is NackReason.OVER_LIMIT, over
    assert "max_pending_per_peer" in over.message and "2 pending" in over.message
    assert r.state_of(TransferId("c")) is None and r.counters().over_limit == 1
    assert isinstance(r.register(reg("c"), now=0.0, peer=D2), Waiting), "others are not held"
    assert r.pending_of(D1) == 2 and r.pending_of(D2) == 1

    assert isinstance(r.abort(TransferId("a"), now=1.0, peer=D1), Release)
    assert isinstance(r.register(reg("d"), now=1.0, peer=D1), Waiting), "a slot came back"
    r.expire(1e9)  # every registration expires: every slot comes back
    assert_empty(r, D1, D2)
    assert r.register(reg("e"), now=1e9, peer=D1) == Waiting(TransferId("e"),
                                                             S.AWAITING_PREFILL)


def test_a_refused_registration_for_a_finished_prefill_returns_ps_blocks() -> None:
    r = registry(max_pending_per_peer=1)
    r.register(reg("other"), now=0.0, peer=D1)
    finish(r)
    over = r.register(reg(), now=0.0, peer=D1)
    assert isinstance(over, Rejected) and over.reason is NackReason.OVER_LIMIT
    assert (over.block_ids, over.request_id) == (P_BLOCKS, P_REQ), "D recomputes: free them"
    assert r.state_of(T1) is None


@pytest.mark.parametrize("block_ids", [[list(range(5))], [[0, 1, 2], [3, 4]]],
                         ids=["one-group", "two-groups"])
def test_a_registration_naming_more_blocks_than_p_has_is_refused(
    block_ids: list[list[int]],
) -> None:
    r = registry(num_blocks=4)
    refused = r.register(reg(block_ids=block_ids), now=0.0, peer=D1)
    assert isinstance(refused, Rejected) and refused.reason is NackReason.TOO_MANY_BLOCKS
    assert "5 block ids" in refused.message and "4 blocks" in refused.message
    assert r.counters().too_many_blocks == 1 and len(r) == 0
    assert isinstance(r.register(reg(block_ids=[[0, 1], [2, 3]]), now=0.0, peer=D1), Waiting)


@pytest.mark.parametrize(("num_groups", "block_ids"), [
    pytest.param(1, [[0, 1], [2]], id="more-groups"),
    pytest.param(2, [[0, 1, 2]], id="fewer-groups"),
    pytest.param(1, [[] for _ in range(MAX_KV_GROUPS)], id="the-most-empty-groups"),
])
def test_a_registration_with_another_number_of_kv_groups_is_refused_and_not_kept(
    num_groups: int, block_ids: list[list[int]],
) -> None:
    r = registry(num_groups=num_groups, num_blocks=64)
    refused = r.register(reg(block_ids=block_ids), now=0.0, peer=D1)
    assert isinstance(refused, Rejected) and refused.reason is NackReason.TOO_MANY_BLOCKS
    assert f"{len(block_ids)} KV-cache groups" in refused.message, refused
    assert f"this P has {num_groups}" in refused.message, refused
    assert r.counters().too_many_blocks == 1 and r.counters().registered == 0
    assert r.pending() == (0, 0) and r.state_of(T1) is None
    assert_empty(r, D1)
    fits = [[0]] * num_groups
    assert isinstance(r.register(reg(block_ids=fits), now=0.0, peer=D1), Waiting)


def test_a_refused_layout_for_a_finished_prefill_returns_ps_blocks() -> None:
    r = registry(num_groups=1)
    finish(r)
    refused = r.register(reg(block_ids=[[0], [1]]), now=0.0, peer=D1)
    assert isinstance(refused, Rejected) and refused.reason is NackReason.TOO_MANY_BLOCKS
    assert (refused.block_ids, refused.request_id) == (P_BLOCKS, P_REQ)
    assert_empty(r, D1)


def test_pending_registrations_are_limited_for_all_peers_together() -> None:
    """Without CURVE every ZMQ identity is a peer of its own: the global cap holds."""
    r = registry(max_pending_per_peer=2, max_pending=3)
    peers = [f"identity-{i}".encode() for i in range(6)]
    outcomes = [r.register(reg(f"t{i}"), now=0.0, peer=peer) for i, peer in enumerate(peers)]
    assert [type(o) for o in outcomes] == [Waiting] * 3 + [Rejected] * 3, outcomes
    for over in outcomes[3:]:
        assert isinstance(over, Rejected) and over.reason is NackReason.OVER_LIMIT
        assert "all peers together hold 3" in over.message, over
    assert r.pending()[0] == 3 and r.counters().over_limit == 3 and len(r) == 3
    assert all(r.pending_of(peer) == 0 for peer in peers[3:]), "nothing kept of the refused"

    assert isinstance(r.abort(TransferId("t0"), now=1.0, peer=peers[0]), Release)
    assert isinstance(r.register(reg("t9"), now=1.0, peer=b"identity-9"), Waiting)
    r.expire(1e9)
    assert r.pending() == (0, 0)
    assert_empty(r, *peers, b"identity-9")


def test_what_pending_registrations_hold_is_limited_for_all_peers_together() -> None:
    one = footprint(reg("t0"))
    r = registry(max_pending_bytes=2 * one + one // 2)
    assert isinstance(r.register(reg("t0"), now=0.0, peer=D1), Waiting)
    assert isinstance(r.register(reg("t1"), now=0.0, peer=D2), Waiting)
    assert r.pending() == (2, 2 * one)
    over = r.register(reg("t2"), now=0.0, peer=b"d-three")
    assert isinstance(over, Rejected) and over.reason is NackReason.OVER_LIMIT
    assert f"hold {2 * one} bytes" in over.message, over
    big = footprint(reg("t3", block_ids=[list(range(1000))]))
    assert big > one + 1000 * 8, "block ids count in a registration's footprint"

    assert isinstance(r.abort(TransferId("t0"), now=1.0, peer=D1), Release)
    assert r.pending() == (1, one)
    assert isinstance(r.register(reg("t2"), now=1.0, peer=b"d-three"), Waiting)
    r.expire(1e9)
    assert_empty(r, D1, D2, b"d-three")


def test_tombstones_are_bounded_oldest_first() -> None:
    r = registry(max_tombstones=3)
    for tid in ("a", "b", "c", "d"):
        assert r.abort(TransferId(tid), now=0.0, peer=D1) is None
    assert r.tombstones() == 3 and r.counters().tombstones_dropped == 1
    assert isinstance(finish(r, "d"), Release), "the newest tombstone holds"
    assert isinstance(finish(r, "a"), Waiting), "the oldest was evicted"


def test_a_tombstone_buried_again_is_the_newest() -> None:
    r = registry(max_tombstones=2)
    for tid in ("a", "b", "a", "c"):  # "a" again: "b" is now the oldest
        r.abort(TransferId(tid), now=0.0, peer=D1)
    assert isinstance(finish(r, "a"), Release) and isinstance(finish(r, "b"), Waiting)


def test_a_flood_of_aborts_leaves_a_bounded_heap_and_cheap_tombstones() -> None:
    """Aborts of ids P never saw, as anyone may send: at most max_tombstones are kept,
    the deadline heap stays bounded although every eviction leaves an entry behind, and
    a tombstone costs the same whatever its id's length."""
    r = registry(max_tombstones=100, unclaimed_ttl=1e6)
    for i in range(20_000):
        assert r.abort(TransferId(f"flood-{i}"), now=i * 1e-3, peer=D2) is None
    assert r.tombstones() == 100 and r.counters().tombstones_dropped == 19_900
    assert r.deadlines_held() <= 2 * 100 + 1024, r.deadlines_held()

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(100):  # each a 64 KiB id, none kept by the test
            r.abort(TransferId(f"{i:04}" + "x" * (64 << 10)), now=30.0, peer=D2)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 256 << 10, f"100 tombstones of 64 KiB ids hold {held} bytes"
    long_id = "0042" + "x" * (64 << 10)
    assert isinstance(finish(r, long_id, now=31.0), Release), "still matched by its id"


@pytest.mark.parametrize("overrides", [
    {"num_blocks": 0}, {"num_groups": 0}, {"max_pending_per_peer": 0}, {"max_pending": 0},
    {"max_pending_bytes": 0}, {"max_tombstones": 0},
])
def test_bad_limits_are_refused_when_built(overrides: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(overrides))):
        registry(**overrides)
