"""The push side channel over real ZMQ on 127.0.0.1: P's `PrefillChannel` and D's
`DecodeChannel` in either order, refusals, WRITE results, aborts and tombstones, P dying
under a waiting D, deadlines on both sides, bad frames, and clean stops."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import pytest
import zmq

from connector.decode.channel import RELEASE_MARGIN_S, DecodeChannel, PushFailure
from connector.prefill.channel import (
    _BATCH_MESSAGES,
    FreeBlocks,
    PrefillAction,
    PrefillChannel,
    StartWrite,
)
from connector.prefill.early import EarlyInbox, EarlyOutbox
from connector.prefill.registry import PushRegistry, RegistryConfig
from connector.protocol.side_channel import (
    PROTOCOL_VERSION,
    Ack,
    EngineId,
    Grant,
    Ping,
    Pong,
    PullOffer,
    RegisterBlocks,
    TransferId,
    decode,
    encode,
)
from testbed.ports import free_port
from tests.conftest import until_sync

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HOST = "127.0.0.1"
P_ENGINE = EngineId("engine-p0")
BLOCK_SIZE = 16
P_REQ = "p-req-1"  # P's request, holding P_BLOCKS
P_BLOCKS = [[10, 11, 12]]
D_BLOCKS = [[0, 1, 2]]
# Where a P's channel sends early WRITEs: engine id, data-parallel index, ranks (workers).
EARLY_TO = ("engine-p0-early-test", 0, 1)
SOON = 1.0  # "at once": far below every TTL these tests leave at its default (120 s)
T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout: float, what: str) -> T:
    """Poll until `predicate()` is truthy (`tests.conftest.until_sync`); fail after
    `timeout` seconds."""
    return until_sync(predicate, what, timeout)


def port_of(channel: PrefillChannel) -> int:
    return int(channel.address.rsplit(":", 1)[1])


def tcp_connections_at(port: int) -> int:
    """This host's TCP connections whose local end is `port` and still open (neither
    listening nor in TIME_WAIT), from the kernel's table."""
    listen, time_wait = "0A", "06"
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] not in (listen,
                                                                                time_wait):
            count += 1
    return count


def wait_actions(p: PrefillChannel, timeout: float = 2.0, count: int = 1) -> list[PrefillAction]:
    got: list[PrefillAction] = []

    def enough() -> bool:
        got.extend(p.take_actions())
        return len(got) >= count

    wait_for(enough, timeout, f"{count} action(s) from P (got {got})")
    return got


def wait_failures(d: DecodeChannel, timeout: float = 2.0, count: int = 1) -> list[PushFailure]:
    got: list[PushFailure] = []

    def enough() -> bool:
        got.extend(d.take_failures())
        return len(got) >= count

    wait_for(enough, timeout, f"{count} failure(s) on D (got {got})")
    return got


def registration(d: DecodeChannel, tid: str, **overrides: Any) -> RegisterBlocks:
    """D's registration; its engine_id is D's socket identity, so P's answers reach D."""
    fields: dict[str, Any] = {
        "transfer_id": TransferId(tid), "engine_id": d.engine_id, "request_id": f"d-{tid}",
        "tp_size": 1, "tp_rank": 0, "block_ids": D_BLOCKS, "block_size": BLOCK_SIZE,
        "host": HOST, "port": 5601, "ttl_s": 30.0, **overrides,
    }
    return RegisterBlocks(**fields)


class Channels:
    """Makes started channels, and stops every one a test did not stop itself."""

    def __init__(self) -> None:
        self._running: list[PrefillChannel | DecodeChannel] = []
        self._count = 0

    def prefill(self, port: int | None = None, *, early_to: tuple[str, int, int] | None = None,
                **config: Any) -> PrefillChannel:
        values: dict[str, Any] = {"engine_id": P_ENGINE, "block_size": BLOCK_SIZE, **config}
        channel = PrefillChannel(PushRegistry(RegistryConfig(**values)), HOST,
                                 free_port() if port is None else port, early_to=early_to)
        channel.start()
        self._running.append(channel)
        return channel

    def decode(self, **options: float) -> DecodeChannel:
        """A started D; `options`: its timeouts, its `max_peers`."""
        self._count += 1
        values: dict[str, Any] = {"ack_timeout": 2.0, "ping_interval": 0.2,
                                  "peer_timeout": 3.0, "registration_ttl": 30.0, **options}
        channel = DecodeChannel(EngineId(f"engine-d{self._count}"), **values)
        channel.start()
        self._running.append(channel)
        return channel

    def stop(self, channel: PrefillChannel | DecodeChannel) -> None:
        self._running.remove(channel)
        channel.stop()

    def stop_all(self) -> None:
        while self._running:
            self.stop(self._running[-1])


def receive(sock: zmq.Socket[Any], timeout: float = 2.0) -> Any:
    assert sock.poll(int(timeout * 1000), zmq.POLLIN), f"nothing received within {timeout} s"
    return decode(sock.recv(zmq.NOBLOCK))


def grant(sock: zmq.Socket[Any], ack: Ack) -> None:
    """A raw D's grant for the transfer P just acknowledged, with the Ack's lease token
    (what D's channel sends when it registered without a token)."""
    assert ack.lease is not None and not ack.granted
    sock.send(encode(Ping(grant=Grant(token=ack.lease, adds=[ack.transfer_id]))))


def plain(write: Any) -> Any:
    """A StartWrite without what the write lease adds to it: its deadline, and the grant
    that came with D's registration (tests/integration/test_write_lease.py has those)."""
    if not isinstance(write, StartWrite):
        return write
    return dataclasses.replace(write, write_by=math.inf, registration=msgspec.structs.replace(
        write.registration, grant=None))


def failures_until_d_passed(d: DecodeChannel, moment: float) -> list[PushFailure]:
    """D's failures once D's own thread has checked its deadlines at `moment` or later.

    The proof is a canary: a push registered now with a port where nothing listens,
    which D fails (no Ack, or a silent P) no sooner than min(ack_timeout, peer_timeout)
    from now, in the same pass over its deadlines that would fail any push of the test
    whose deadline was earlier. Canaries follow until one was registered late enough;
    theirs are left out of the failures returned."""
    got: list[PushFailure] = []
    canaries = 0
    while True:
        canaries += 1
        canary = registration(d, f"canary-{canaries}", request_id=f"canary-{canaries}")
        registered_at = time.monotonic()
        d.register(f"tcp://{HOST}:{free_port()}", canary)

        def canary_failed(tid: TransferId = canary.transfer_id) -> bool:
            got.extend(d.take_failures())
            return any(f.transfer_id == tid for f in got)

        wait_for(canary_failed, min(d.ack_timeout, d.peer_timeout) + 2.0,
                 f"D failed the canary push to a closed port (got {got})")
        if registered_at + min(d.ack_timeout, d.peer_timeout) >= moment:
            return [f for f in got if not f.request_id.startswith("canary-")]


def assert_acked(d: DecodeChannel, registered_at: float) -> None:
    """D holds no failure past its ack_timeout: P's Ack arrived (else D would have failed
    the push with "P did not acknowledge")."""
    assert failures_until_d_passed(d, registered_at + d.ack_timeout) == []
    assert d.has_pending_work(), "D still waits for the WRITE"


def failures_until_p_answered(p: PrefillChannel, d: DecodeChannel) -> list[PushFailure]:
    """D's failures once P has handled everything posted to it and everything D sent it
    so far, and D has read everything P sent back: a probe registration that P refuses
    (a wrong block size) goes after them on D's one connection, and P's refusal comes
    back after any earlier answer on it. The probe's own failure is left out."""
    p.wait_caught_up(SOON)
    probe = registration(d, "probe", request_id="probe", block_size=BLOCK_SIZE + 1)
    d.register(p.address, probe)
    got: list[PushFailure] = []

    def refused() -> bool:
        got.extend(d.take_failures())
        return any(f.transfer_id == probe.transfer_id for f in got)

    wait_for(refused, 2.0, f"P refused the probe registration (got {got})")
    return [f for f in got if f.transfer_id != probe.transfer_id]


# --- matching, in either order -----------------------------------------------------------


@pytest.mark.parametrize("d_first", [True, False], ids=["register-first", "prefill-first"])
def test_registration_and_finished_prefill_start_one_write(
    channels: Channels, d_first: bool
) -> None:
    p = channels.prefill()
    d = channels.decode(ack_timeout=0.5)
    reg = registration(d, "t-1")
    tid = reg.transfer_id
    first: Callable[[], None] = (lambda: d.register(p.address, reg)) if d_first else (
        lambda: p.prefill_finished(tid, P_REQ, P_BLOCKS))
    second: Callable[[], None] = (lambda: p.prefill_finished(tid, P_REQ, P_BLOCKS)) \
        if d_first else (lambda: d.register(p.address, reg))
    first()
    wait_for(lambda: len(p.registry) == 1, 2.0, "P holds the first half")
    assert p.take_actions() == [], "half a transfer starts nothing"
    assert p.has_pending_work()
    registered_at = time.monotonic()
    second()

    (action,) = wait_actions(p)
    assert isinstance(action, StartWrite)
    assert plain(action) == StartWrite(tid, P_REQ, P_BLOCKS, reg), action
    assert action.registration.engine_id == d.engine_id
    assert_acked(d, registered_at)
    assert p.take_actions() == [], "one StartWrite per transfer"
    snapshot = p.registry.snapshot()
    assert snapshot.live == 1 and snapshot.counters.matched == 1

    d.forget(tid)
    wait_for(lambda: not d.has_pending_work(), 5.0, "D stops waiting once it forgets")


class _Note(msgspec.Struct):
    text: str


def test_the_early_outbox_says_when_a_worker_is_connected() -> None:
    """`connected` is false while no inbox is connected, true once one is, and then a
    send goes (at once: no retry) and arrives."""
    where = ("engine-early-connect-test", 0, free_port())
    context: zmq.Context[Any] = zmq.Context()
    outbox = EarlyOutbox(context, *where)
    inbox = None
    try:
        assert not outbox.connected(timeout=0.2)
        assert outbox.send(_Note("no one to take it")) == [0], "no rank took it"
        inbox = EarlyInbox(_Note, *where)
        assert outbox.connected(timeout=5.0)
        assert outbox.connected()  # stays true, without a wait
        assert outbox.send(_Note("write this")) == []
        wait_for(lambda: inbox.take() == [_Note("write this")], 5.0, "the message arrives")
    finally:
        if inbox is not None:
            inbox.close()
        outbox.close()
        context.term()


@pytest.fixture
def early_inbox() -> Iterator[Callable[[PrefillChannel], EarlyInbox]]:
    """P's worker's end of the early WRITEs, connected to a P made with
    `early_to=EARLY_TO` (make the P first: the worker connects to P's bound socket)."""
    made: list[EarlyInbox] = []

    def connect(p: PrefillChannel) -> EarlyInbox:
        made.append(EarlyInbox(StartWrite, *EARLY_TO[:2], port_of(p)))
        # ZMQ connects the inbox in the background; until P's end sees it, the early
        # WRITE would go to P's engine instead, and the test would fail.
        assert p.early_connected(timeout=5.0), "P's channel never saw the inbox connect"
        return made[-1]

    try:
        yield connect
    finally:
        for inbox in made:
            inbox.close()


def take_early(inbox: EarlyInbox, timeout: float = 2.0) -> list[StartWrite]:
    got: list[StartWrite] = []

    def some() -> bool:
        got.extend(inbox.take())
        return bool(got)

    wait_for(some, timeout, "an early WRITE at P's worker")
    return got


@pytest.mark.parametrize("d_first", [True, False],
                         ids=["registered-before-the-step", "registered-during-the-step"])
def test_a_prompt_d_registered_for_by_its_last_step_is_written_early_by_the_worker(
    channels: Channels, early_inbox: Callable[[PrefillChannel], EarlyInbox], d_first: bool
) -> None:
    """The StartWrite goes straight to P's worker, with the step after whose forward
    pass it may start; the finished prefill that follows is a known one."""
    p = channels.prefill(early_to=EARLY_TO)
    inbox = early_inbox(p)
    d = channels.decode()
    reg = registration(d, "t-early")
    tid = reg.transfer_id
    if d_first:
        d.register(p.address, reg)
        wait_for(lambda: len(p.registry) == 1, 2.0, "P holds the registration")
    p.prefill_completing(tid, P_REQ, P_BLOCKS, 7, fail_on_purpose=True)
    if not d_first:
        p.wait_caught_up(SOON)
        assert inbox.take() == [] and len(p.registry) == 0, "nothing to match yet"
        d.register(p.address, reg)
    (write,) = take_early(inbox)
    assert plain(write) == StartWrite(tid, P_REQ, P_BLOCKS, reg, early_step=7,
                                      fail_on_purpose=True)
    p.prefill_finished(tid, P_REQ, P_BLOCKS)  # the step is over: a known prefill
    p.wait_caught_up(SOON)
    assert p.take_actions() == [], "no second WRITE, and no blocks freed mid-WRITE"
    snapshot = p.registry.snapshot()
    assert snapshot.counters.duplicates == 0 and snapshot.counters.early == 1
    p.write_ended(tid, None)
    wait_for(lambda: len(p.registry) == 0, 2.0, "the transfer ends with its WRITE")
    assert p.take_actions() == [], "P's worker frees the written blocks itself"
    assert inbox.take() == []


def test_a_chunk_p_computes_before_d_registers_goes_to_the_worker_with_the_grant(
    channels: Channels, early_inbox: Callable[[PrefillChannel], EarlyInbox]
) -> None:
    """P asked for its first chunk's WRITE before D's registration came (the router sends
    both legs at once): D's registration, with its grant, sends that chunk's WRITE to P's
    worker, for the chunk's step; the registry answers nothing else for it."""
    p = channels.prefill(early_to=EARLY_TO)
    inbox = early_inbox(p)
    d = channels.decode()
    reg = registration(d, "t-chunk-late", block_ids=[[0, 1, 2]])
    tid = reg.transfer_id
    p.prefill_progress(tid, P_REQ, [[10, 11]], 3, 5)
    p.wait_caught_up(SOON)
    assert inbox.take() == [] and p.registry.snapshot().chunking == 1
    d.register(p.address, reg)
    (write,) = take_early(inbox)
    assert write.chunk and write.early_step == 5 and write.block_ids == [[10, 11]]
    assert write.registration.block_ids == [[0, 1]]
    assert p.take_actions() == [] and p.registry.snapshot().counters.chunks == 1


def test_a_prompt_that_finished_before_d_registered_is_written_by_the_engine(
    channels: Channels, early_inbox: Callable[[PrefillChannel], EarlyInbox]
) -> None:
    p = channels.prefill(early_to=EARLY_TO)
    inbox = early_inbox(p)
    d = channels.decode()
    reg = registration(d, "t-late")
    tid = reg.transfer_id
    p.prefill_completing(tid, P_REQ, P_BLOCKS, 7)
    p.prefill_finished(tid, P_REQ, P_BLOCKS)
    d.register(p.address, reg)
    (action,) = wait_actions(p)
    assert plain(action) == StartWrite(tid, P_REQ, P_BLOCKS, reg), action
    assert inbox.take() == [] and p.registry.snapshot().counters.early == 0


def test_a_write_to_fail_on_purpose_says_so_when_it_starts_after_the_prefill(
    channels: Channels,
) -> None:
    p = channels.prefill()
    d = channels.decode()
    reg = registration(d, "t-fail")
    p.prefill_finished(reg.transfer_id, P_REQ, P_BLOCKS, fail_on_purpose=True)
    d.register(p.address, reg)
    (action,) = wait_actions(p)
    assert plain(action) == StartWrite(reg.transfer_id, P_REQ, P_BLOCKS, reg,
                                       fail_on_purpose=True)


def test_an_early_write_goes_to_every_rank_and_a_rank_not_reached_has_it_next_step(
    channels: Channels,
) -> None:
    """A P with two workers (tensor parallel): each rank's worker gets the early WRITE;
    with rank 1's inbox not connected, rank 0 takes it early and the engine's next step
    carries it for rank 1 alone."""
    engine, dp_index = "engine-p0-early-ranks", 0
    p = channels.prefill(early_to=(engine, dp_index, 2))
    d = channels.decode()
    rank0 = EarlyInbox(StartWrite, engine, dp_index, port_of(p), rank=0)
    rank1: EarlyInbox | None = None
    try:
        assert p.early_connected(timeout=0.5) is False, "rank 1 is not connected yet"
        reg = registration(d, "t-rank0")
        d.register(p.address, reg)
        wait_for(lambda: len(p.registry) == 1, 2.0, "P holds the registration")
        p.prefill_completing(reg.transfer_id, P_REQ, P_BLOCKS, 7)
        (write,) = take_early(rank0)
        assert plain(write) == StartWrite(reg.transfer_id, P_REQ, P_BLOCKS, reg, early_step=7)
        (action,) = wait_actions(p)
        assert plain(action) == StartWrite(reg.transfer_id, P_REQ, P_BLOCKS, reg,
                                           early_step=7, ranks=(1,)), action

        rank1 = EarlyInbox(StartWrite, engine, dp_index, port_of(p), rank=1)
        assert p.early_connected(timeout=5.0), "P never saw both ranks connect"
        reg2 = registration(d, "t-both")
        d.register(p.address, reg2)
        wait_for(lambda: len(p.registry) == 2, 2.0, "P holds the second registration")
        p.prefill_completing(reg2.transfer_id, "p-req-2", P_BLOCKS, 8)
        for inbox in (rank0, rank1):
            (got,) = take_early(inbox)
            assert got.transfer_id == reg2.transfer_id and got.ranks is None
        p.wait_caught_up(SOON)
        assert p.take_actions() == [], "every rank had it early: nothing for the engine"
    finally:
        rank0.close()
        if rank1 is not None:
            rank1.close()


def test_an_early_write_no_worker_takes_goes_to_the_engine_for_the_next_step(
    channels: Channels,
) -> None:
    p = channels.prefill(early_to=EARLY_TO)  # and no inbox connected
    d = channels.decode()
    reg = registration(d, "t-alone")
    d.register(p.address, reg)
    wait_for(lambda: len(p.registry) == 1, 2.0, "P holds the registration")
    p.prefill_completing(reg.transfer_id, P_REQ, P_BLOCKS, 7)
    (action,) = wait_actions(p)
    assert plain(action) == StartWrite(reg.transfer_id, P_REQ, P_BLOCKS, reg,
                                       early_step=7), action
    assert d.take_failures() == []


def test_a_block_size_mismatch_is_nacked_and_d_fails_the_push(channels: Channels) -> None:
    p = channels.prefill()
    d = channels.decode()
    reg = registration(d, "t-1", block_size=BLOCK_SIZE * 2)
    started = time.monotonic()
    d.register(p.address, reg)
    (failure,) = wait_failures(d, timeout=2.0)
    assert time.monotonic() - started < 2.0
    assert failure.request_id == reg.request_id and failure.transfer_id == reg.transfer_id
    assert "block_size_mismatch" in failure.why and "block size mismatch" in failure.why, failure
    assert f"decode {BLOCK_SIZE * 2}, prefill {BLOCK_SIZE}" in failure.why, failure
    wait_for(lambda: not d.has_pending_work(), 2.0, "D no longer waits")
    assert len(p.registry) == 0 and p.registry.snapshot().counters.rejected == 1
    assert p.take_actions() == []


# --- WRITE results --------------------------------------------------------------------------


def start_write(channels: Channels, **decode_timeouts: float) -> tuple[
        PrefillChannel, DecodeChannel, RegisterBlocks]:
    p = channels.prefill()
    d = channels.decode(**decode_timeouts)
    reg = registration(d, "t-1")
    d.register(p.address, reg)
    p.prefill_finished(reg.transfer_id, P_REQ, P_BLOCKS)
    (action,) = wait_actions(p)
    assert isinstance(action, StartWrite) and action.transfer_id == reg.transfer_id
    return p, d, reg


def test_a_failed_write_fails_the_push_on_d(channels: Channels) -> None:
    p, d, reg = start_write(channels)
    p.write_ended(reg.transfer_id, "boom")
    (failure,) = wait_failures(d)
    assert failure.request_id == reg.request_id and failure.transfer_id == reg.transfer_id
    assert "P will not write" in failure.why and "write_error" in failure.why, failure
    assert "boom" in failure.why, failure
    wait_for(lambda: not p.has_pending_work(), 2.0, "P is idle")
    assert p.take_actions() == [], "the engine's WRITE path frees P's blocks itself"
    assert len(p.registry) == 0 and p.registry.snapshot().counters.failed == 1
    wait_for(lambda: not d.has_pending_work(), 2.0, "D no longer waits")


def test_a_failed_write_whose_blocks_p_kept_is_offered_to_d_for_reading(
    channels: Channels,
) -> None:
    p, d, reg = start_write(channels)
    p.write_ended(reg.transfer_id, "boom", pull_ttl=12.5)
    (failure,) = wait_failures(d)
    assert failure.request_id == reg.request_id and "boom" in failure.why, failure
    assert failure.pull == PullOffer(request_id=P_REQ, block_ids=P_BLOCKS, ttl_s=12.5)
    wait_for(lambda: not p.has_pending_work(), 2.0, "P is idle")
    assert p.take_actions() == [], "P's workers keep the blocks, under their pull lease"
    assert len(p.registry) == 0 and p.registry.snapshot().counters.failed == 1
    wait_for(lambda: not d.has_pending_work(), 2.0, "D no longer waits")


def test_a_failed_write_after_ds_abort_frees_the_kept_blocks_at_once(
    channels: Channels,
) -> None:
    p, d, reg = start_write(channels, ack_timeout=3.0)
    d.abort(reg.transfer_id)
    # P has D's abort (nobody will read the blocks), and has not answered it yet
    assert failures_until_p_answered(p, d) == []
    p.write_ended(reg.transfer_id, "boom", pull_ttl=12.5)
    (failure,) = wait_failures(d)
    assert "aborted" in failure.why and failure.pull is None, failure
    (action,) = wait_actions(p)
    assert action == FreeBlocks(reg.transfer_id, P_REQ, "aborted"), action
    wait_for(lambda: len(p.registry) == 0, 2.0, "P holds nothing")


def test_blocks_kept_for_a_d_that_is_gone_are_freed_at_once(channels: Channels) -> None:
    p, d, reg = start_write(channels)
    channels.stop(d)  # D's process ends: its connection to P closes
    wait_for(lambda: not tcp_connections_at(port_of(p)), 2.0,
             "P's end of D's connection closed")
    p.write_ended(reg.transfer_id, "boom", pull_ttl=12.5)
    (action,) = wait_actions(p)
    assert action == FreeBlocks(reg.transfer_id, P_REQ, "decode_gone"), action
    wait_for(lambda: len(p.registry) == 0, 2.0, "P holds nothing")


def test_a_successful_write_fails_nothing_and_empties_p(channels: Channels) -> None:
    p, d, reg = start_write(channels)
    p.write_ended(reg.transfer_id, None)
    wait_for(lambda: not p.has_pending_work(), 2.0, "P is idle")
    assert len(p.registry) == 0 and p.registry.snapshot().live == 0
    assert p.registry.snapshot().counters.done == 1
    assert p.take_actions() == [], "the engine's WRITE path frees P's blocks itself"
    assert failures_until_p_answered(p, d) == [], "a (wrong) PushFailed reached D"
    assert d.has_pending_work(), "D waits for the WRITE's own notification, not PushDone"
    d.forget(reg.transfer_id)
    wait_for(lambda: not d.has_pending_work(), 5.0, "D stops waiting once it forgets")


def test_an_abort_during_the_write_is_answered_only_when_the_write_ends(
    channels: Channels,
) -> None:
    p, d, reg = start_write(channels, ack_timeout=3.0)
    d.abort(reg.transfer_id)
    assert failures_until_p_answered(p, d) == [], (
        "P still reads into D's blocks: D must keep them")
    assert d.has_pending_work()
    p.write_ended(reg.transfer_id, None)
    (failure,) = wait_failures(d)
    assert failure.transfer_id == reg.transfer_id and "aborted" in failure.why, failure
    wait_for(lambda: not d.has_pending_work(), 2.0, "D no longer waits")
    wait_for(lambda: len(p.registry) == 0, 2.0, "P holds nothing")
    assert p.take_actions() == []


# --- aborts and tombstones ------------------------------------------------------------------


def test_an_abort_after_registration_releases_d_and_frees_the_late_prefill_at_once(
    channels: Channels,
) -> None:
    p = channels.prefill()
    d = channels.decode()
    reg = registration(d, "t-1")
    d.register(p.address, reg)
    wait_for(lambda: len(p.registry) == 1, 2.0, "P holds the registration")
    started = time.monotonic()
    d.abort(reg.transfer_id)
    (failure,) = wait_failures(d, timeout=SOON)
    assert time.monotonic() - started < SOON
    assert failure.request_id == reg.request_id and failure.transfer_id == reg.transfer_id
    assert "P will not write: aborted" in failure.why, failure
    wait_for(lambda: not d.has_pending_work(), 2.0, "D no longer waits")
    assert len(p.registry) == 0

    p.prefill_finished(reg.transfer_id, P_REQ, P_BLOCKS)
    (action,) = wait_actions(p, timeout=SOON)
    assert action == FreeBlocks(reg.transfer_id, P_REQ, "aborted"), action
    wait_for(lambda: not p.has_pending_work(), 2.0, "P holds nothing for the aborted transfer")


def test_an_abort_without_registration_frees_the_late_prefill_at_once(
    channels: Channels,
) -> None:
    p = channels.prefill()
    d = channels.decode()
    tid = TransferId("t-aborted")
    d.abort(tid, peer=p.address)
    # P reads one DEALER's messages in order: once the next registration is held there,
    # the Abort was handled before it.
    other = registration(d, "t-other")
    d.register(p.address, other)
    wait_for(lambda: len(p.registry) == 1, 2.0, "P handled the Abort, then a registration")
    assert p.take_actions() == []

    p.prefill_finished(tid, P_REQ, P_BLOCKS)
    (action,) = wait_actions(p, timeout=SOON)
    assert action == FreeBlocks(tid, P_REQ, "aborted"), action
    assert len(p.registry) == 1, "only the other transfer is left"
    assert d.take_failures() == [], "D waited for nothing: nothing to report"
    assert p.registry.snapshot().counters.aborted == 1


# --- P dying under a waiting D ----------------------------------------------------------------

CHILD_LEASE_S, CHILD_WRITE_S = 1.0, 0.5  # the write lease of P's process below
P_SCRIPT = f"""
import sys, time
from connector.prefill.channel import PrefillChannel
from connector.prefill.registry import PushRegistry, RegistryConfig
channel = PrefillChannel(
    PushRegistry(RegistryConfig(engine_id="engine-p-child", block_size=int(sys.argv[2]),
                                lease_s={CHILD_LEASE_S}, write_s={CHILD_WRITE_S})),
    "127.0.0.1", int(sys.argv[1]))
channel.start()
print("ready", flush=True)
while True:
    channel.take_actions()
    time.sleep(0.05)  # P's engine steps this often
"""


@pytest.fixture
def p_process() -> Iterator[tuple[subprocess.Popen[str], str]]:
    """P's channel in a process of its own, to be killed; yields (process, address)."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-c", P_SCRIPT, str(port), str(BLOCK_SIZE)],
        cwd=REPO, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert process.stdout is not None
        readable, _, _ = select.select([process.stdout], [], [], 15.0)
        assert readable and process.stdout.readline().strip() == "ready", (
            f"P's process did not start (exit code {process.poll()})")
        yield process, f"tcp://{HOST}:{port}"
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(5)
        if process.stdout is not None:
            process.stdout.close()


def test_p_killed_after_d_registered_ends_d_wait_once_p_is_surely_done(
    channels: Channels, p_process: tuple[subprocess.Popen[str], str],
) -> None:
    """D gives up on a silent P after peer_timeout, and frees the blocks once P's write
    lease and write time have passed since P's last word (P cannot say so: it is dead)."""
    process, address = p_process
    d = channels.decode(ack_timeout=1.5, ping_interval=0.2, peer_timeout=1.0)
    reg = registration(d, "t-1")
    registered_at = time.monotonic()
    d.register(address, reg)
    assert_acked(d, registered_at)
    assert failures_until_d_passed(d, registered_at + d.peer_timeout) == [], (
        "a P that answers pings is alive past peer_timeout")

    killed_at = time.monotonic()
    process.send_signal(signal.SIGKILL)
    surely_done = CHILD_LEASE_S + CHILD_WRITE_S + RELEASE_MARGIN_S
    (failure,) = wait_failures(d, timeout=surely_done + 1.0)
    elapsed = time.monotonic() - killed_at
    assert max(d.peer_timeout, surely_done - d.ping_interval) <= elapsed, elapsed
    assert elapsed < surely_done + 0.5, elapsed
    assert failure.request_id == reg.request_id and failure.transfer_id == reg.transfer_id
    assert f"P at {address} silent for" in failure.why, failure
    wait_for(lambda: not d.has_pending_work(), 2.0, "D no longer waits")


# --- deadlines --------------------------------------------------------------------------------


def test_an_unclaimed_prefill_expires_and_p_frees_its_blocks(channels: Channels) -> None:
    p = channels.prefill(unclaimed_ttl=0.3)
    tid = TransferId("t-unclaimed")
    started = time.monotonic()
    p.prefill_finished(tid, P_REQ, P_BLOCKS)
    assert p.has_pending_work()
    p.wait_caught_up(SOON)  # P has handled the finished prefill
    assert p.take_actions() == [] and p.has_pending_work(), "P holds it, for unclaimed_ttl"
    (action,) = wait_actions(p, timeout=1.0)
    elapsed = time.monotonic() - started
    assert action == FreeBlocks(tid, P_REQ, "expired"), action
    assert 0.25 <= elapsed < 1.0, elapsed
    wait_for(lambda: not p.has_pending_work(), 1.0, "P is idle")
    assert len(p.registry) == 0
    assert p.registry.snapshot().counters.expired_unclaimed == 1


def test_no_ack_fails_the_push_after_ack_timeout(channels: Channels) -> None:
    d = channels.decode(ack_timeout=0.5, peer_timeout=3.0)
    reg = registration(d, "t-1")
    started = time.monotonic()
    d.register(f"tcp://{HOST}:{free_port()}", reg)  # nothing listens there
    (failure,) = wait_failures(d, timeout=1.5)
    elapsed = time.monotonic() - started
    assert 0.45 <= elapsed < 1.5, elapsed
    assert failure.request_id == reg.request_id and failure.transfer_id == reg.transfer_id
    assert "P did not acknowledge the registration within 0.5 s" in failure.why, failure
    wait_for(lambda: not d.has_pending_work(), 2.0, "D no longer waits")


# --- bad input ----------------------------------------------------------------------------------


def test_garbage_and_another_version_are_refused_and_p_keeps_serving(
    channels: Channels, raw_dealer: Callable[[str, bytes], zmq.Socket[Any]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="vllm.pd_connector.channel")
    p = channels.prefill()
    identity = b"engine-d-raw"
    sock = raw_dealer(p.address, identity)
    reg = RegisterBlocks(
        transfer_id=TransferId("t-1"), engine_id=EngineId(identity.decode()),
        request_id="d-req-1", tp_size=1, tp_rank=0, block_ids=D_BLOCKS,
        block_size=BLOCK_SIZE, host=HOST, port=5601, ttl_s=30.0)
    future = msgspec.to_builtins(reg)
    future["version"] = PROTOCOL_VERSION + 1
    sock.send(b"\x00not msgpack at all")
    sock.send(msgspec.msgpack.encode(future))  # the same transfer, in another version
    sock.send_multipart([b"two", b"frames"])  # not [identity, payload] on P's side
    sock.send(encode(reg))

    answer = receive(sock)
    assert msgspec.structs.replace(answer, lease=None) == Ack(
        transfer_id=reg.transfer_id, engine_id=P_ENGINE, block_size=BLOCK_SIZE,
        tp_size=1), answer
    assert len(p.registry) == 1
    assert p.registry.snapshot().counters.registered == 1, "the newer copy was refused"
    sock.send(encode(Ping()))
    assert isinstance(receive(sock), Pong)
    refused = [r.getMessage() for r in caplog.records if "refused a message" in r.getMessage()]
    assert len(refused) == 3, refused
    assert "malformed side-channel message" in refused[0], refused
    assert "protocol version mismatch" in refused[1], refused
    assert f"version {PROTOCOL_VERSION + 1}" in refused[1], refused
    assert "2 frames, not one" in refused[2], refused
    assert p.bad_messages == 3


# --- a flood on P's push port --------------------------------------------------------------


@pytest.fixture
def unstarted() -> Iterator[Callable[..., PrefillChannel]]:
    """P's channel without its thread: the test runs its passes (`_wake`) one by one."""
    made: list[PrefillChannel] = []

    def make(**config: Any) -> PrefillChannel:
        values: dict[str, Any] = {"engine_id": P_ENGINE, "block_size": BLOCK_SIZE, **config}
        made.append(PrefillChannel(PushRegistry(RegistryConfig(**values)), HOST, free_port()))
        return made[-1]

    try:
        yield make
    finally:
        for channel in made:
            channel.stop()


def one_pass(p: PrefillChannel) -> int:
    """Run one pass of P's thread as if its socket polled readable; what it read."""
    before = p.received
    p._wake({p._socket: zmq.POLLIN})
    return p.received - before


def test_a_flood_of_garbage_holds_up_engine_events_and_expiry_by_one_batch_at_most(
    unstarted: Callable[..., PrefillChannel],
    raw_dealer: Callable[[str, bytes], zmq.Socket[Any]],
) -> None:
    """Deterministic: the flood and a Ping behind it are queued on D's one connection, so
    P answers the Ping only once it has read the whole flood. Each pass reads at most a
    batch; the first already starts the WRITE the engine's event asks for, and an
    unclaimed prefill expires in a later pass, while most of the flood is still unread."""
    p = unstarted(unclaimed_ttl=0.05)
    identity = b"engine-d-raw"
    sock = raw_dealer(p.address, identity)
    reg = RegisterBlocks(
        transfer_id=TransferId("t-1"), engine_id=EngineId(identity.decode()),
        request_id="d-req-1", tp_size=1, tp_rank=0, block_ids=D_BLOCKS,
        block_size=BLOCK_SIZE, host=HOST, port=5601, ttl_s=30.0)
    sock.send(encode(reg))
    wait_for(lambda: (one_pass(p), sock.poll(0))[1], 2.0, "P read the registration, answered")
    grant(sock, receive(sock))
    wait_for(lambda: (one_pass(p), sock.poll(0))[1], 2.0, "P read the grant, answered")
    assert isinstance(receive(sock), Pong)

    flood = 4 * _BATCH_MESSAGES
    for _ in range(flood):
        sock.send(b"\x00garbage")
    sock.send(encode(Ping()))
    p.prefill_finished(reg.transfer_id, P_REQ, P_BLOCKS)
    p.prefill_finished(TransferId("t-unclaimed"), "p-req-2", P_BLOCKS)
    assert one_pass(p) <= _BATCH_MESSAGES
    (write,) = p.take_actions()
    assert isinstance(write, StartWrite) and write.transfer_id == reg.transfer_id
    deadline = p.registry.next_deadline()
    assert deadline is not None
    wait_for(lambda: time.monotonic() >= deadline, 1.0, "the unclaimed prefill is due")
    assert one_pass(p) <= _BATCH_MESSAGES
    assert p.take_actions() == [FreeBlocks(TransferId("t-unclaimed"), "p-req-2", "expired")]
    assert not sock.poll(0), "no Pong yet: most of the flood is still unread"

    passes = [0]

    def answered() -> bool:
        got = one_pass(p)
        assert got <= _BATCH_MESSAGES, got
        passes[0] += 1
        return bool(sock.poll(0))

    wait_for(answered, 5.0, "P read through the flood and answered the Ping")
    assert isinstance(receive(sock), Pong)
    assert passes[0] + 2 >= (flood + 1) / _BATCH_MESSAGES
    assert p.bad_messages == flood


def test_a_flood_of_garbage_from_one_peer_does_not_starve_a_push(
    channels: Channels, raw_dealer: Callable[[str, bytes], zmq.Socket[Any]],
) -> None:
    """P's thread, running: garbage as fast as a peer can send it, for as long as the
    test waits. A D's registration and P's finished prefill still start their WRITE, and
    an unclaimed prefill still expires, while the flood goes on."""
    p = channels.prefill(unclaimed_ttl=0.2)
    flooder = raw_dealer(p.address, b"flooder")
    d = channels.decode()
    stop, sent = threading.Event(), [0]

    def flood() -> None:
        deadline = time.monotonic() + 30.0  # the test's waits end long before
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                flooder.send(b"\x00garbage", zmq.NOBLOCK)
                sent[0] += 1
            except zmq.Again:
                pass

    thread = threading.Thread(target=flood, name="test-flood", daemon=True)
    thread.start()
    try:
        wait_for(lambda: p.bad_messages > 10 * _BATCH_MESSAGES, 5.0, "P reads the flood")
        reg = registration(d, "t-1")
        d.register(p.address, reg)
        wait_for(lambda: len(p.registry) == 1, 5.0, "P holds the registration")
        p.prefill_finished(reg.transfer_id, P_REQ, P_BLOCKS)
        p.prefill_finished(TransferId("t-unclaimed"), "p-req-2", P_BLOCKS)
        actions = wait_actions(p, timeout=5.0, count=2)
        assert thread.is_alive(), "the flood went on all along"
    finally:
        stop.set()
        thread.join(5.0)
    assert sorted(type(a).__name__ for a in actions) == ["FreeBlocks", "StartWrite"], actions
    assert FreeBlocks(TransferId("t-unclaimed"), "p-req-2", "expired") in actions


# --- stopping -----------------------------------------------------------------------------------


def channel_threads(name: str) -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == name}


def test_channels_stop_promptly_and_free_the_port(channels: Channels) -> None:
    before = channel_threads(PrefillChannel.name) | channel_threads(DecodeChannel.name)
    port = free_port()
    p = channels.prefill(port=port)
    d = channels.decode()
    d.register(p.address, registration(d, "t-1"))  # D now owns a socket and a deadline
    p.prefill_finished(TransferId("t-2"), P_REQ, P_BLOCKS)  # P now holds a deadline
    wait_for(lambda: len(p.registry) == 2, 2.0, "P holds both transfers")
    threads = (channel_threads(PrefillChannel.name)
               | channel_threads(DecodeChannel.name)) - before
    assert len(threads) == 2, threads

    started = time.monotonic()
    channels.stop(d)
    channels.stop(p)
    assert time.monotonic() - started < 2.0
    assert not any(t.is_alive() for t in threads)
    again = channels.prefill(port=port)  # the port is free again
    assert again.address == p.address


def test_a_second_prefill_channel_on_a_busy_port_names_push_port(channels: Channels) -> None:
    port = free_port()
    p = channels.prefill(port=port)
    with pytest.raises(OSError, match="push_port") as excinfo:
        channels.prefill(port=port)
    assert p.address in str(excinfo.value)
    d = channels.decode()  # the first channel still serves
    d.register(p.address, registration(d, "t-1"))
    wait_for(lambda: len(p.registry) == 1, 2.0, "the first channel holds the registration")


def test_a_prefill_channel_never_started_stops_promptly() -> None:
    channel = PrefillChannel(
        PushRegistry(RegistryConfig(engine_id=P_ENGINE, block_size=BLOCK_SIZE)), HOST,
        free_port())
    stopper = threading.Thread(target=channel.stop, name="test-stop", daemon=True)
    stopper.start()
    stopper.join(1.0)
    hung = stopper.is_alive()
    if hung:
        channel._socket.close()  # what term() waits for; lets the stuck stop() return
        stopper.join(5.0)
    assert not hung, "stop() without start() hangs"


def test_a_refused_bind_leaks_no_file_descriptor(channels: Channels) -> None:
    port = free_port()
    channels.prefill(port=port)

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    with pytest.raises(OSError):
        channels.prefill(port=port)  # warm-up: whatever zmq opens once per process
    before = open_fds()
    for _ in range(3):
        with pytest.raises(OSError):
            channels.prefill(port=port)
    assert open_fds() == before, f"{open_fds() - before} fds leaked in 3 refused binds"


def test_after_a_chunk_ds_abort_is_answered_only_once_the_chunk_cannot_be_in_flight(
    channels: Channels,
) -> None:
    """D frees its blocks on P's word: after a chunk's WRITE (a prompt in chunks), P's
    answer to D's abort waits for that WRITE's write_by (the lease's end plus write_s),
    when P's worker has cancelled whatever of it was still in flight."""
    p = channels.prefill(early_to=EARLY_TO, lease_s=0.6, write_s=0.6)
    d = channels.decode(ack_timeout=5.0)
    reg = registration(d, "t-chunk", block_ids=[[0, 1, 2]])
    d.register(p.address, reg)
    wait_for(lambda: len(p.registry) == 1, 2.0, "P holds the registration")
    p.prefill_progress(reg.transfer_id, P_REQ, [[10, 11]], 3, 1)
    wait_for(lambda: p.registry.snapshot().counters.chunks == 1, 2.0, "P's chunk WRITE")
    aborted = time.monotonic()
    d.abort(reg.transfer_id)
    (failure,) = wait_failures(d, timeout=4.0)
    waited = time.monotonic() - aborted
    assert "aborted" in failure.why, failure
    assert waited >= 0.4, f"D heard of the end {waited:.2f} s after its abort, before the " \
                          "chunk's write_by"
