"""No late WRITE lands in blocks D reused: the write lease, with a stalled side channel and
a working data path.

P's and D's real channels talk through a TCP relay on 127.0.0.1, which the test stalls
(the side channel's link congested or cut, both ways) once P has matched a push and
ordered its WRITE. NIXL's data path does not go through the relay: P's WRITE is posted by
P's worker's own code (`PrefillWorker._write` and its poll, on a bare worker) with a real
NIXL agent into a real agent's buffer standing for D's KV cache, as late as the test
makes it (a long engine step, a slow handshake). D, cut off from P, gives up on the push
(its request ended, or P went silent) and reports it; the test then reuses D's blocks at
once, as vLLM would, by writing a mark into them. The mark must survive: D reports the
failure only after P's deadline for that WRITE (`write_by`), and P's worker posts nothing
after it. Needs NIXL installed: without it these fail."""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq

from connector.decode.channel import RELEASE_MARGIN_S
from connector.prefill.channel import FreeBlocks, StartWrite
from connector.prefill.registry import TransferState
from connector.protocol.side_channel import (
    Ack,
    EngineId,
    FailReason,
    Grant,
    Ping,
    Pong,
    PushFailed,
    RegisterBlocks,
    TransferId,
    encode,
)
from connector.protocol.step import PushJob
from scripts import bench_nixl
from tests.integration.nixl_kit import AgentPair
from tests.integration.test_push_channel import (
    HOST,
    P_REQ,
    Channels,
    port_of,
    receive,
    registration,
    wait_actions,
    wait_for,
)
from tests.unit.test_connector_lease import bare_worker

LEASE_S, WRITE_S = 1.0, 2.5  # P's terms
BLOCK_BYTES = 4096
PARAMS = bench_nixl.Params(device="cpu", block_bytes=BLOCK_BYTES, blocks=8, iterations=1,
                           warmup=0, noncontiguous=False, one_block_rounds=0,
                           progress_thread=False, timeout=30.0)
P_SLOTS = [2, 4, 6]  # P's blocks of the prompt, in P's buffer
D_SLOTS = [1, 3, 5]  # D's blocks, as D registered them
KV = 0xAB  # what P's blocks hold
REUSED = 0x11  # what D's blocks hold once D gave them to another request


class Relay:
    """A TCP relay on 127.0.0.1 to P's push port: the side channel's link. `stall` stops
    it forwarding, both ways; NIXL's data path does not go through it."""

    def __init__(self, port: int) -> None:
        self._target = port
        self._listener = socket.create_server((HOST, 0))
        self.address = f"tcp://{HOST}:{self._listener.getsockname()[1]}"
        self._stalled = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-relay", daemon=True)
        self._thread.start()

    def stall(self) -> None:
        self._stalled.set()

    def close(self) -> None:
        self._stopped.set()
        self._thread.join(5.0)
        self._listener.close()

    def _run(self) -> None:
        peers: dict[socket.socket, socket.socket] = {}
        try:
            while not self._stopped.is_set():
                watched = [self._listener] + ([] if self._stalled.is_set() else list(peers))
                readable, _, _ = select.select(watched, [], [], 0.02)
                for sock in readable:
                    if sock is self._listener:
                        near, _ = self._listener.accept()
                        far = socket.create_connection((HOST, self._target))
                        peers[near], peers[far] = far, near
                        continue
                    data = sock.recv(1 << 16)
                    if data:
                        peers[sock].sendall(data)
                    else:
                        for end in (sock, peers.pop(sock)):
                            peers.pop(end, None)
                            end.close()
        finally:
            for sock in peers:
                sock.close()


class DataPath(AgentPair):
    """P's and D's NIXL agents in this process, and their buffers: P's blocks hold KV,
    D's start empty. `post` is vLLM's push code for the bare worker: one WRITE of the
    job's blocks into D's, with its notification."""

    def __init__(self) -> None:
        super().__init__("lease-test", PARAMS, np.full(1, KV, dtype=np.uint8))
        self.posted_at: list[float] = []

    def post(self, worker: Any, rid: str, meta: Any) -> None:
        handle = self.p_agent.make_prepped_xfer(
            "WRITE", self.local, np.array(meta.local_block_ids[0], dtype=np.int32), self.remote,
            np.array(meta.remote.block_ids[0], dtype=np.int32), f"{rid}:1".encode())
        assert self.p_agent.transfer(handle) in ("PROC", "DONE")
        self.posted_at.append(time.monotonic())
        worker._vllm._sending_transfers[rid].append(handle)

    def progress(self) -> None:
        """Poll D's agent, as D's worker does while it awaits a push."""
        self.d_agent.get_new_notifs()

    def d_blocks(self) -> np.ndarray:
        return np.asarray(self.d_buffer.read_back()[D_SLOTS])

    def reuse_d_blocks(self) -> None:
        self.d_buffer.array[D_SLOTS] = REUSED


@pytest.fixture
def data_path() -> Iterator[DataPath]:
    path = DataPath()
    try:
        yield path
    finally:
        path.close()


@pytest.mark.parametrize("ends", ["request-ended", "p-silent"])
@pytest.mark.parametrize("late", ["within-the-lease", "past-write-by"])
def test_no_write_lands_in_blocks_d_reused_after_the_side_channel_stalled(
    channels: Channels, data_path: DataPath, ends: str, late: str,
) -> None:
    p = channels.prefill(lease_s=LEASE_S, write_s=WRITE_S)
    relay = Relay(port_of(p))
    try:
        d = channels.decode(ack_timeout=1.0, ping_interval=0.2, peer_timeout=1.0)
        reg = registration(d, "t-late", block_ids=[D_SLOTS])
        d.register(relay.address, reg)  # D's first: named in a grant once P's Ack comes
        p.prefill_finished(reg.transfer_id, P_REQ, [P_SLOTS])
        (write,) = wait_actions(p)
        assert isinstance(write, StartWrite) and write.transfer_id == reg.transfer_id
        relay.stall()
        stalled_at = time.monotonic()
        assert stalled_at + LEASE_S / 2 < write.write_by <= stalled_at + LEASE_S + WRITE_S
        if ends == "request-ended":
            d.abort(reg.transfer_id)  # its client left: the Abort never reaches P
        # P's engine takes the WRITE late (a long forward pass before its next step):
        # within the lease (after D's former 1 s wait for a silent P), or past write_by.
        start_at = stalled_at + 2.0 if late == "within-the-lease" else write.write_by + 0.2
        worker = bare_worker(data_path.p_agent, data_path.post)

        released_at: float | None = None
        started = writing = False
        deadline = write.write_by + RELEASE_MARGIN_S + 3.0
        while released_at is None or not started or writing:
            now = time.monotonic()
            assert now < deadline, f"released {released_at}, started {started}"
            failures = d.take_failures()
            if failures:
                assert released_at is None and [f.transfer_id for f in failures] == ["t-late"]
                released_at = now
                data_path.reuse_d_blocks()  # vLLM gives them to another request at once
            if not started and now >= start_at:  # the step is built, its worker starts it
                worker._start_job(PushJob.of(write, time.monotonic()))
                started = writing = True
            if writing:
                writing = worker.poll_writes()
            data_path.progress()
            time.sleep(0.005)
        for _ in range(20):  # a WRITE in flight would have landed by now
            data_path.progress()
            time.sleep(0.005)

        assert (data_path.d_blocks() == REUSED).all(), "a WRITE landed in reused blocks"
        assert released_at >= write.write_by, "D reused its blocks before P's deadline"
        if late == "within-the-lease":
            (posted_at,) = data_path.posted_at
            assert stalled_at + 1.5 < posted_at < released_at, "the late WRITE was made"
        else:
            assert data_path.posted_at == [], "posted past its write_by"
            (end,) = worker._outgoing.take_report().ended.values()
            assert end.error is not None and "write lease ended" in end.error
    finally:
        relay.close()


# --- the lease on the real channels ------------------------------------------------------------


def test_a_registration_is_granted_with_it_once_d_holds_a_token(channels: Channels) -> None:
    """D's first registration to a P goes without a grant (D has no token yet): P's Ack
    says so, D names it in a grant at once, and only then may P write it. The next one
    carries D's grant itself."""
    p = channels.prefill(lease_s=LEASE_S, write_s=WRITE_S)
    d = channels.decode()
    first, second = registration(d, "t-first"), registration(d, "t-second")
    d.register(p.address, first)
    wait_for(lambda: p.registry.granted(first.transfer_id), 2.0, "D named the first")
    d.register(p.address, second)
    wait_for(lambda: p.registry.granted(second.transfer_id), 2.0, "D granted the second")
    p.prefill_finished(second.transfer_id, P_REQ, [P_SLOTS])
    (write,) = wait_actions(p)
    assert isinstance(write, StartWrite) and write.registration.grant is not None
    assert p.registry.counters().stale_grants == 0


def test_a_waiting_d_keeps_ps_lease_and_a_gone_d_loses_it(channels: Channels) -> None:
    """D pings at least three times per lease (here more often than its ping_interval
    says), so a registration outlives many leases while P computes; once D is gone, P
    ends it when the lease runs out, and frees the prefill that comes late at once."""
    lease = 0.6
    p = channels.prefill(lease_s=lease, write_s=WRITE_S)
    d = channels.decode(ping_interval=1.0, peer_timeout=3.0)
    reg = registration(d, "t-1")
    d.register(p.address, reg)
    wait_for(lambda: p.registry.granted(reg.transfer_id), 2.0, "D named it")
    kept_until = time.monotonic() + 4 * lease
    wait_for(lambda: time.monotonic() >= kept_until, 5.0, "four leases passed")
    assert p.registry.state_of(reg.transfer_id) is not None, "D's pings kept the lease"
    channels.stop(d)
    wait_for(lambda: p.registry.state_of(reg.transfer_id) is None, 2 * lease + 1.0,
             "P ended the transfer of a D that stopped granting")
    assert p.registry.counters().lease_expired == 1
    p.prefill_finished(reg.transfer_id, P_REQ, [P_SLOTS])
    (action,) = wait_actions(p, timeout=1.0)
    assert action == FreeBlocks(reg.transfer_id, P_REQ, "aborted"), action


def test_a_grant_withholds_what_d_gave_up_on_even_when_its_abort_was_lost(
    channels: Channels, raw_dealer: Callable[[str, bytes], zmq.Socket[Any]],
) -> None:
    """A D whose Abort was lost on a broken connection still withholds that transfer in
    every grant: P ends it before it takes the grant, and says so, so no later grant
    keeps it writable."""
    p = channels.prefill(lease_s=LEASE_S, write_s=WRITE_S)
    identity = b"engine-d-raw"
    sock = raw_dealer(p.address, identity)
    given_up, kept = (RegisterBlocks(
        transfer_id=TransferId(tid), engine_id=EngineId(identity.decode()),
        request_id=f"d-{tid}", tp_size=1, tp_rank=0, block_ids=[D_SLOTS], block_size=16,
        host=HOST, port=5601, ttl_s=30.0) for tid in ("t-given-up", "t-kept"))
    sock.send(encode(given_up))
    ack = receive(sock)
    assert isinstance(ack, Ack) and ack.lease is not None and not ack.granted
    sock.send(encode(msgspec.structs.replace(kept, grant=Grant(
        token=ack.lease, adds=[given_up.transfer_id]))))
    assert isinstance(receive(sock), Ack)
    assert p.registry.granted(given_up.transfer_id) and p.registry.granted(kept.transfer_id)
    sock.send(encode(Ping(grant=Grant(token=ack.lease, withheld=[given_up.transfer_id]))))
    answers = [receive(sock), receive(sock)]
    assert PushFailed(transfer_id=given_up.transfer_id, reason=FailReason.ABORTED) in answers
    assert any(isinstance(answer, Pong) for answer in answers)
    assert p.registry.state_of(given_up.transfer_id) is None
    assert p.registry.state_of(kept.transfer_id) is TransferState.AWAITING_PREFILL
