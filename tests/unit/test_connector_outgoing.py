"""P's worker's per-push records (`connector.prefill.outgoing`): each path from a job (or an
early WRITE) to the step that hands its blocks back, what each end reports, and that
no path leaves a record behind."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace
from typing import Any

import pytest

from connector.prefill.channel import StartWrite
from connector.prefill.outgoing import OutgoingPushes, OutgoingState
from connector.prefill.worker_side import PrefillWorker
from connector.protocol.side_channel import EngineId, RegisterBlocks, TransferId
from connector.protocol.step import PushEnd, PushJob

S = OutgoingState
TID = TransferId("t-1")
RID = "p-1"


def job(rid: str = RID, tid: str = TID, *, fail_on_purpose: bool = False) -> PushJob:
    return PushJob(transfer_id=TransferId(tid), request_id=rid, block_ids=[[1, 2], [3]],
                   decode_engine_id="d", decode_request_id="d-1", decode_host="127.0.0.1",
                   decode_port=5600, decode_tp_size=1, decode_block_ids=[[7, 8], [9]],
                   fail_on_purpose=fail_on_purpose)


def state(pushes: OutgoingPushes, rid: str = RID) -> OutgoingState | None:
    record = pushes.get(rid)
    return None if record is None else record.state


@pytest.mark.parametrize("handshaking", [False, True], ids=["handshake-cached", "handshake"])
def test_a_written_push_is_released_reported_and_gone(handshaking: bool) -> None:
    pushes = OutgoingPushes()
    record = pushes.start(job(), handshaking=handshaking, now=10.0)
    assert record.state is (S.HANDSHAKING if handshaking else S.WRITING)
    if handshaking:
        pushes.handshaken(record)
        assert record.state is S.WRITING
    pushes.ended(record, None, now=10.5, lease_ttl=30.0)
    assert state(pushes) is S.RELEASED
    assert pushes.take_held() == []
    assert pushes.take_released() == {RID} and len(pushes) == 0
    report = pushes.take_report()
    assert report is not None and report.ended == {TID: PushEnd(None, 0.5, 3)}
    assert pushes.take_report() is None and pushes.take_released() == set()


def test_a_failed_write_holds_its_blocks_for_the_pull_lease_then_is_gone() -> None:
    pushes = OutgoingPushes()
    record = pushes.start(job(), handshaking=False, now=1.0)
    pushes.failed([RID, "unknown"])
    assert record.failed
    pushes.ended(record, "WRITE failed", now=2.0, lease_ttl=30.0)
    assert state(pushes) is S.HELD and pushes.take_released() == set()
    assert pushes.take_held() == [(RID, 32.0)] and len(pushes) == 0
    report = pushes.take_report()
    assert report is not None
    assert report.ended == {TID: PushEnd("WRITE failed", 1.0, 3, holding_ranks=1)}


def test_a_failed_write_without_a_pull_lease_is_released() -> None:
    pushes = OutgoingPushes()
    record = pushes.start(job(fail_on_purpose=True), handshaking=True, now=1.0)
    pushes.ended(record, "handshake with D failed", now=1.0, lease_ttl=0.0)
    assert pushes.take_released() == {RID} and len(pushes) == 0
    report = pushes.take_report()
    assert report is not None and report.ended[TID].holding_ranks == 0


@pytest.mark.parametrize("step", [5, None], ids=["step-5", "no-step-at-once"])
def test_an_early_write_waits_for_its_steps_forward_pass(step: int | None) -> None:
    pushes = OutgoingPushes()
    pushes.early(job(fail_on_purpose=True), step)
    pushes.early(job("p-2", "t-2"), 9)
    if step is not None:
        assert pushes.early_due(step - 1) == []
    (record,) = pushes.early_due(step or 0)
    assert record.request_id == RID and record.early_step == step
    assert record.job is not None and record.job.fail_on_purpose
    started = pushes.start(record.job, handshaking=False, now=0.0)
    assert started is record and record.state is S.WRITING
    assert [r.request_id for r in pushes.early_due(100)] == ["p-2"]


@pytest.mark.parametrize(("before", "was"), [
    pytest.param(None, None, id="unknown"),
    pytest.param(S.HELD, S.HELD, id="held"),
    pytest.param(S.RELEASED, S.RELEASED, id="released"),
])
def test_a_release_order_reports_the_blocks_finished_sending(
        before: OutgoingState | None, was: OutgoingState | None) -> None:
    pushes = OutgoingPushes()
    if before is not None:
        record = pushes.start(job(), handshaking=False, now=0.0)
        pushes.ended(record, None if before is S.RELEASED else "boom", now=0.0, lease_ttl=1.0)
    assert pushes.release(RID) is was
    assert state(pushes) is S.RELEASED and pushes.take_held() == []
    assert pushes.take_released() == {RID} and len(pushes) == 0


@pytest.mark.parametrize("in_flight", [S.EARLY, S.HANDSHAKING, S.WRITING])
def test_a_release_order_leaves_a_job_in_flight_alone(in_flight: OutgoingState) -> None:
    pushes = OutgoingPushes()
    if in_flight is S.EARLY:
        pushes.early(job(), 3)
    else:
        pushes.start(job(), handshaking=in_flight is S.HANDSHAKING, now=0.0)
    assert pushes.release(RID) is in_flight
    assert state(pushes) is in_flight and pushes.take_released() == set()


def test_wrong_transitions_are_refused() -> None:
    pushes = OutgoingPushes()
    record = pushes.start(job(), handshaking=False, now=0.0)
    with pytest.raises(ValueError, match="writing -> writing"):
        pushes.handshaken(record)
    with pytest.raises(ValueError, match="a second record"):
        pushes.early(job(), 1)
    pushes.ended(record, None, now=0.0, lease_ttl=0.0)
    with pytest.raises(ValueError, match="released -> released"):
        pushes.ended(record, None, now=0.0, lease_ttl=0.0)
    with pytest.raises(ValueError, match="released -> writing"):
        pushes.start(job(), handshaking=False, now=0.0)
    pushes.failed([RID])
    assert not record.failed, "only a WRITE in flight can fail"
    assert pushes.take_released() == {RID} and len(pushes) == 0


# --- P's worker: the early WRITEs it takes, each step ------------------------------------


def start_write(rid: str, tid: str, early_step: int) -> StartWrite:
    registration = RegisterBlocks(
        transfer_id=TransferId(tid), engine_id=EngineId("d"), request_id="d-1", tp_size=1,
        tp_rank=0, block_ids=[[7]], block_size=16, host="127.0.0.1", port=5600, ttl_s=60.0)
    return StartWrite(TransferId(tid), rid, [[1]], registration, early_step=early_step)


def test_the_worker_starts_early_writes_only_after_their_forward_pass() -> None:
    """Two early WRITEs, for this step and the next: the first starts once this step's
    forward pass is done (`write_early`; on a GPU after waiting for the pass's kernels),
    the other a step later."""
    inbox = [start_write(RID, TID, 4), start_write("p-2", "t-2", 5)]
    started: list[str] = []
    waits: list[int] = []
    worker: Any = SimpleNamespace(_outgoing=OutgoingPushes(), _step_number=4, _chunk_jobs=[])
    worker._take_chunk_jobs = partial(PrefillWorker._take_chunk_jobs, worker)
    worker._early_inbox = SimpleNamespace(take=lambda: [inbox.pop(0)] if inbox else [])
    worker._fence = SimpleNamespace(wait_for_forward=lambda: waits.append(worker._step_number))

    def start_job(j: PushJob) -> None:
        started.append(j.request_id)
        worker._outgoing.start(j, handshaking=True, now=0.0)

    worker._start_job = start_job
    PrefillWorker._start_early(worker, forward_done=False)  # step 4's start: no forward yet
    assert started == [] and state(worker._outgoing) is S.EARLY
    PrefillWorker._start_early(worker, forward_done=True)
    assert started == [RID]
    PrefillWorker._start_early(worker, forward_done=True)  # takes p-2: due after step 5's
    assert started == [RID] and state(worker._outgoing, "p-2") is S.EARLY
    worker._step_number = 5
    PrefillWorker._start_early(worker, forward_done=False)
    assert started == [RID]
    PrefillWorker._start_early(worker, forward_done=True)
    assert started == [RID, "p-2"] and state(worker._outgoing, "p-2") is S.HANDSHAKING
    assert waits == [4, 5], "an early WRITE of this pass's prompt went before the pass's end"


def test_a_rank_starts_only_the_jobs_for_it_the_rest_it_had_early() -> None:
    """A job names the ranks that start it when the others had its early WRITE already
    (P with several workers); a job for every rank names none."""
    import dataclasses

    from connector.protocol.step import PushStep

    started: list[str] = []
    waits: list[list[str]] = []
    worker: Any = SimpleNamespace(_rank=0, _start_job=lambda j: started.append(j.request_id),
                                  write_handshaken=lambda: None, _vllm=None)
    worker._fence = SimpleNamespace(wait_for_forward=lambda: waits.append(started[-1:]))
    step = PushStep(jobs=[dataclasses.replace(job("for-rank-1"), ranks=(1,), early_step=3),
                          dataclasses.replace(job("for-ranks-0-1"), ranks=(0, 1), early_step=3),
                          job("for-all")])
    PrefillWorker.take_step(worker, step)
    assert started == ["for-ranks-0-1", "for-all"]
    # An early WRITE that came through the engine waits for its pass on a GPU (with
    # vLLM's async scheduling it may still run), once, before it starts.
    assert waits == [[]]


def test_an_early_write_that_came_late_waits_for_its_pass_on_a_gpu() -> None:
    """An early WRITE of step 4 that reaches the worker after step 4's end starts at step
    5's start; with vLLM's async scheduling step 4's kernels may still run on a GPU, so
    the worker waits for them first (the fence; nothing on CPU)."""
    inbox = [start_write(RID, TID, 4)]
    started: list[str] = []
    waits: list[int] = []
    worker: Any = SimpleNamespace(_outgoing=OutgoingPushes(), _step_number=5, _chunk_jobs=[])
    worker._take_chunk_jobs = partial(PrefillWorker._take_chunk_jobs, worker)
    worker._early_inbox = SimpleNamespace(take=lambda: [inbox.pop(0)] if inbox else [])
    worker._fence = SimpleNamespace(wait_for_forward=lambda: waits.append(len(started)))

    def start_job(j: PushJob) -> None:
        started.append(j.request_id)
        worker._outgoing.start(j, handshaking=True, now=0.0)

    worker._start_job = start_job
    PrefillWorker._start_early(worker, forward_done=False)
    assert started == [RID] and waits == [0], "started before waiting for its pass"
