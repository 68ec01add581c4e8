"""The write lease (protocol 5), on P's bare registry and P's worker: a registration is
written only once a grant of its registrant names it, under a lease that each grant
renews for `lease_s` from P's token; a lease that lapses ends what it covered and cannot
be renewed; every match carries `write_by`, the lease's end plus `write_s`, and the
worker posts no WRITE after it and cancels the ones still in flight then."""

from __future__ import annotations

import math
import threading
from collections import defaultdict
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from connector.prefill.outgoing import OutgoingState
from connector.prefill.registry import (
    PushRegistry,
    Ready,
    RegistryConfig,
    Release,
    TransferState,
    Waiting,
)
from connector.prefill.worker_side import PrefillWorker
from connector.protocol.side_channel import EngineId, FailReason, RegisterBlocks, TransferId
from connector.protocol.step import PushJob

S = TransferState
T1 = TransferId("t-1")
P_REQ = "p-req-1"
P_BLOCKS = [[10, 11, 12]]
D_BLOCKS = [[0, 1, 2]]
D1, D2 = b"d-one", b"d-two"
LEASE, WRITE = 3.0, 10.0


def registry(**overrides: Any) -> PushRegistry:
    config = {"engine_id": EngineId("p"), "block_size": 16, "lease_s": LEASE,
              "write_s": WRITE, "registration_ttl": 60.0, "unclaimed_ttl": 60.0, **overrides}
    return PushRegistry(RegistryConfig(**config))


def reg(transfer_id: str = T1) -> RegisterBlocks:
    return RegisterBlocks(transfer_id=TransferId(transfer_id), engine_id=EngineId("d"),
                          request_id=f"d-{transfer_id}", tp_size=1, tp_rank=0,
                          block_ids=D_BLOCKS, block_size=16, host="10.0.0.2", port=5601,
                          ttl_s=60.0)


def finish(r: PushRegistry, transfer_id: str = T1, *, now: float) -> Any:
    return r.prefill_finished(TransferId(transfer_id), P_BLOCKS, request_id=P_REQ, now=now)


def ready(transfer_id: str = T1, *, write_by: float, **fields: Any) -> Ready:
    return Ready(TransferId(transfer_id), reg(transfer_id), P_BLOCKS, P_REQ,
                 write_by=write_by, **fields)


# --- a registration is written only under a grant that named it -----------------------------


def test_a_registration_is_written_only_once_a_grant_names_it() -> None:
    r = registry()
    assert r.register(reg(), now=0.0, peer=D1) == Waiting(T1, S.AWAITING_PREFILL)
    assert finish(r, now=1.0) == Waiting(T1, S.AWAITING_GRANT), "both halves, no grant"
    assert not r.granted(T1)
    # The grant echoes the token P sent with its Ack, at 0.1: the lease holds to 3.1.
    assert r.grant(D1, sent=0.1, now=1.2, adds=[T1]) == [ready(write_by=0.1 + LEASE + WRITE)]
    assert r.granted(T1) and r.lease_of(D1) == 0.1 + LEASE


def test_a_grant_that_does_not_name_a_registration_does_not_let_p_write_it() -> None:
    """A D that gave up on a registration before it named it may renew its lease for the
    others: that one stays unwritten, and ends when no grant named it in time."""
    r = registry()
    r.register(reg("other"), now=0.0, peer=D1)
    assert r.grant(D1, sent=0.0, now=0.0, adds=[TransferId("other")]) == []
    r.register(reg(), now=0.5, peer=D1)
    finish(r, now=0.6)
    for at in (1.0, 2.0, 3.0):  # D keeps its lease, never naming T1
        assert r.grant(D1, sent=at, now=at) == []
    assert r.state_of(T1) is S.AWAITING_GRANT
    assert r.next_deadline() == 0.5 + LEASE, "the grant was due within lease_s"
    (release,) = r.expire(0.5 + LEASE)
    assert release == Release(T1, S.EXPIRED, P_BLOCKS, notify=reg(),
                              reason=FailReason.LEASE_EXPIRED, request_id=P_REQ)
    assert r.state_of(TransferId("other")) is S.AWAITING_PREFILL
    assert r.snapshot().counters.lease_expired == 1


def test_a_grant_of_another_peer_or_for_a_gone_transfer_names_nothing() -> None:
    r = registry()
    r.register(reg(), now=0.0, peer=D1)
    r.register(reg("theirs"), now=0.0, peer=D2)
    assert r.grant(D2, sent=0.0, now=0.0, adds=[T1, TransferId("gone")]) == []
    assert not r.granted(T1) and r.lease_of(D1) is None


def test_a_grant_whose_lease_already_ended_is_ignored_and_counted() -> None:
    r = registry()
    r.register(reg(), now=10.0, peer=D1)
    finish(r, now=10.0)
    assert r.grant(D1, sent=10.0 - LEASE, now=10.0, adds=[T1]) == []
    assert not r.granted(T1) and r.snapshot().counters.stale_grants == 1


def test_a_peer_with_nothing_registered_holds_no_lease() -> None:
    r = registry()
    assert r.grant(D1, sent=0.0, now=0.0) == []
    assert r.lease_of(D1) is None and r.next_deadline() is None


# --- renewals, and a lease that lapses -------------------------------------------------------


def granted(r: PushRegistry, transfer_id: str = T1, *, now: float = 0.0,
            peer: bytes = D1) -> None:
    r.register(reg(transfer_id), now=now, peer=peer)
    assert r.grant(peer, sent=now, now=now, adds=[TransferId(transfer_id)]) == []


def test_each_grant_renews_the_lease_and_the_match_writes_by_the_lease_then() -> None:
    r = registry()
    granted(r)
    for at in (1.0, 2.0, 3.0, 4.0):
        r.grant(D1, sent=at, now=at + 0.01)
        assert r.expire(at + 0.5) == []
    assert r.lease_of(D1) == 4.0 + LEASE
    assert finish(r, now=4.5) == ready(write_by=4.0 + LEASE + WRITE)


def test_a_lapsed_lease_ends_what_it_covered_and_frees_a_late_prefill_at_once() -> None:
    r = registry()
    granted(r)
    granted(r, "writing")
    assert isinstance(finish(r, "writing", now=0.5), Ready)
    assert r.write_started(TransferId("writing"))
    (release,) = r.expire(LEASE)
    assert release == Release(T1, S.EXPIRED, None, notify=reg(),
                              reason=FailReason.LEASE_EXPIRED)
    assert r.state_of(TransferId("writing")) is S.WRITING, "its write_by bounds it"
    assert finish(r, now=LEASE + 1) == Release(T1, S.ABORTED, P_BLOCKS, request_id=P_REQ)
    assert r.snapshot().counters.lease_expired == 1


def test_a_grant_that_comes_after_the_lease_ended_does_not_bring_it_back() -> None:
    """P's thread may read a grant before it runs the expiry that ends the lease: the
    lapse is taken first, so what it ended stays ended, and only what the new grant
    names is written."""
    r = registry()
    granted(r)
    late = LEASE + 0.5
    (release,) = r.grant(D1, sent=late, now=late)  # no expire() ran in between
    assert isinstance(release, Release) and release.reason is FailReason.LEASE_EXPIRED
    assert r.state_of(T1) is None and r.lease_of(D1) is None, "nothing left to lease"


def test_the_lease_is_per_peer() -> None:
    r = registry()
    granted(r, "mine", peer=D1)
    granted(r, "theirs", peer=D2)
    r.grant(D2, sent=2.0, now=2.0)
    assert [x.transfer_id for x in r.expire(LEASE)] == ["mine"]
    assert r.state_of(TransferId("theirs")) is S.AWAITING_PREFILL


# --- early matching waits for the grant ------------------------------------------------------


def test_a_prompt_completing_before_the_grant_is_matched_early_when_it_comes() -> None:
    r = registry()
    r.register(reg(), now=0.0, peer=D1)
    assert r.prefill_completing(T1, P_BLOCKS, request_id=P_REQ, step=7, now=0.1) is None
    assert r.grant(D1, sent=0.2, now=0.3, adds=[T1]) == [
        ready(write_by=0.2 + LEASE + WRITE, early_step=7)]
    assert r.write_started(T1)
    assert finish(r, now=0.4) == Waiting(T1, S.WRITING), "the known prefill"
    assert r.snapshot().counters.early == 1


def test_a_prompt_completing_after_the_grant_is_matched_early_under_the_lease() -> None:
    r = registry()
    granted(r)
    assert r.prefill_completing(T1, P_BLOCKS, request_id=P_REQ, step=7, now=0.5) == ready(
        write_by=LEASE + WRITE, early_step=7)


# --- P's worker: no WRITE posted past its deadline, none left in flight --------------------------


def job(write_within: float) -> PushJob:
    return PushJob(transfer_id=T1, request_id=P_REQ, block_ids=P_BLOCKS,
                   decode_engine_id="d", decode_request_id="d-1", decode_host="127.0.0.1",
                   decode_port=5600, decode_tp_size=1, decode_block_ids=D_BLOCKS,
                   write_within=write_within)


class FakeAgent:
    """NIXL's agent as the worker's poller sees it: transfers stay in flight until
    released; a release may be refused (NIXL could not cancel yet)."""

    def __init__(self, refusals: int = 0) -> None:
        self.released: list[int] = []
        self.refusals = refusals

    def check_xfer_state(self, handle: int) -> str:
        return "PROC"

    def release_xfer_handle(self, handle: int) -> None:
        if self.refusals:
            self.refusals -= 1
            raise RuntimeError("cannot cancel yet")
        self.released.append(handle)


def bare_worker(agent: Any, post: Callable[[Any, str, Any], None]) -> Any:
    """P's half of a worker (`PrefillWorker`) over a vLLM worker with only what its WRITE
    path and poller use, its NIXL agent `agent`, and vLLM's push code
    (`_xfer_blocks_for_req`) replaced by `post(worker, rid, meta)`, which must add the
    WRITE's handle to `worker._vllm._sending_transfers[rid]`. D's agent is known already
    (no handshake)."""
    vllm: Any = SimpleNamespace(
        _sending_transfers=defaultdict(list), _sending_transfers_lock=threading.Lock(),
        _send_failures=set(), _engine_last_active={}, world_size=1,
        _physical_blocks_per_logical_kv_block=1, nixl_wrapper=agent)
    vllm._logical_to_kernel_block_ids = lambda ids, _ratio: ids

    def try_release(rid: str, handle: Any) -> bool:  # vLLM's: False keeps the handle
        try:
            vllm.nixl_wrapper.release_xfer_handle(handle)
        except Exception:
            return False
        return True

    vllm._try_release_xfer_handle = try_release
    vllm._ensure_handshake = lambda *args: None
    w: Any = PrefillWorker(vllm, pull_fallback_ttl=30.0, early_at=None,
                           wake_poller=lambda: None)
    vllm._xfer_blocks_for_req = lambda rid, meta: post(w, rid, meta)
    return w


def worker(agent: FakeAgent | None = None) -> Any:
    """A bare worker whose posts are recorded (`posted`), each a handle of `agent`."""

    def post(w: Any, rid: str, meta: Any) -> None:
        w.posted.append(rid)
        w._vllm._sending_transfers[rid].append(100 + len(w.posted))

    w = bare_worker(agent or FakeAgent(), post)
    w.posted = []
    return w


def test_a_job_whose_deadline_passed_is_not_posted() -> None:
    w = worker()
    w._start_job(job(write_within=-0.001))
    assert w.posted == []
    assert w._outgoing.get(P_REQ).state is OutgoingState.HELD, "kept for D to READ"
    (end,) = w._outgoing.take_report().ended.values()
    assert end.error is not None and "write lease ended" in end.error


def test_a_job_within_its_deadline_is_posted_and_its_deadline_is_kept() -> None:
    w = worker()
    w._start_job(job(write_within=60.0))
    assert w.posted == [P_REQ]
    assert P_REQ in w._write_deadlines and math.isfinite(w._write_deadlines[P_REQ])


@pytest.mark.parametrize("refusals", [0, 2], ids=["cancelled", "cancelled-on-a-retry"])
def test_a_write_still_in_flight_at_its_deadline_is_cancelled(refusals: int) -> None:
    agent = FakeAgent(refusals)
    w = worker(agent)
    w._start_job(job(write_within=60.0))
    assert w.poll_writes() is True and agent.released == [], "in flight, within its lease"
    w._write_deadlines[P_REQ] = 0.0  # its deadline has passed
    for _ in range(refusals):
        assert w.poll_writes() is True, "NIXL refused to cancel: still in flight"
    assert w.poll_writes() is False
    assert agent.released == [101] and w._vllm._sending_transfers[P_REQ] == []
    assert P_REQ in w._cancelled and P_REQ in w._vllm._send_failures
