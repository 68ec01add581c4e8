"""P's push port under a flood, over real ZMQ on 127.0.0.1: a frame longer than P's layout
allows ends its connection unread, a connection queues at most a few dozen messages on
P, past its handling share P drops the messages of peers it does not know and serves
those it does, and a flood of small messages from ever new ZMQ identities (another
process, as scripts/drill_flood sends them) is shed while P keeps handling its engine's
events and a new D's registration."""

from __future__ import annotations

import multiprocessing
import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from connector.prefill import channel as prefill_channel
from connector.prefill.channel import (
    _RECEIVE_HWM,
    _STRANGER_MESSAGES,
    PrefillChannel,
    StartWrite,
    max_frame_bytes,
)
from connector.prefill.registry import PushRegistry, RegistryConfig
from connector.protocol.side_channel import (
    MAX_TRANSFER_ID_CHARS,
    MAX_WITHHELD,
    Ack,
    EngineId,
    Grant,
    LeaseToken,
    Nack,
    Ping,
    Pong,
    RegisterBlocks,
    TransferId,
    encode,
)
from scripts import drill_flood
from testbed.ports import free_port
from tests.integration.test_push_channel import (
    BLOCK_SIZE,
    HOST,
    P_BLOCKS,
    P_ENGINE,
    P_REQ,
    Channels,
    receive,
    registration,
    wait_actions,
    wait_for,
)

NUM_BLOCKS = 64  # P's KV cache in these tests: one group of 64 blocks


def raw_registration(identity: bytes, tid: str, block_ids: list[list[int]], *,
                     grant: Grant | None = None) -> RegisterBlocks:
    return RegisterBlocks(
        transfer_id=TransferId(tid), engine_id=EngineId(identity.decode()),
        request_id=f"d-{tid}", tp_size=1, tp_rank=0, block_ids=block_ids,
        block_size=BLOCK_SIZE, host=HOST, port=5601, ttl_s=30.0, grant=grant)


def wait_disconnected(sock: zmq.Socket[Any], send: bytes, timeout: float) -> None:
    """Send `send` on `sock`, and wait until its peer ends the connection (ZMQ's monitor
    says so)."""
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        sock.send(send)

        def cut() -> bool:
            return bool(monitor.poll(0)) and (
                recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED)

        wait_for(cut, timeout, "P ended the connection")
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)


def test_a_frame_longer_than_ps_layout_allows_ends_its_connection_unread(
    channels: Channels, raw_dealer: Callable[[str, bytes], zmq.Socket[Any]],
) -> None:
    """The longest frame a D may send (every block of P, a grant naming the most ids it
    may, each as long as it may be) is read and acknowledged; the flood drill's
    degenerate registration, 50,000 block ids, is cut by ZMQ before P reads it."""
    p = channels.prefill(num_blocks=NUM_BLOCKS, num_groups=1)
    honest = raw_dealer(p.address, b"engine-d-honest")
    token = LeaseToken(instance=1, sent=0.0, lease_s=3.0, write_s=10.0)
    longest_id = "x" * MAX_TRANSFER_ID_CHARS
    full = raw_registration(b"engine-d-honest", longest_id, [list(range(NUM_BLOCKS))],
                            grant=Grant(token=token,
                                        adds=[TransferId(f"{i:064d}")
                                              for i in range(MAX_WITHHELD)],
                                        withheld=[TransferId(f"{i:064x}")
                                                  for i in range(MAX_WITHHELD)]))
    assert len(encode(full)) <= max_frame_bytes(NUM_BLOCKS, 1)
    honest.send(encode(full))
    answers = [receive(honest) for _ in range(MAX_WITHHELD + 1)]  # withheld: PushFailed
    assert [a for a in answers if isinstance(a, Ack)][0].transfer_id == full.transfer_id

    flooder = raw_dealer(p.address, b"flooder")
    degenerate = raw_registration(b"flooder", "t-big", [list(range(50_000))])
    assert len(encode(degenerate)) > max_frame_bytes(NUM_BLOCKS, 1)
    received = p.received
    wait_disconnected(flooder, encode(degenerate), 5.0)
    honest.send(encode(Ping()))  # after the cut: P answers it, having read nothing more
    assert isinstance(receive(honest), Pong)
    assert p.received == received + 1, "P read the ping, never the long frame"
    assert p.counters.too_many_blocks == 0
    assert not flooder.poll(0), "no Nack: P never read the registration"


def test_a_frame_p_can_read_but_not_hold_is_refused_with_a_nack(
    channels: Channels, raw_dealer: Callable[[str, bytes], zmq.Socket[Any]],
) -> None:
    """Under the frame limit yet more blocks than P has: read, and refused by P's layout."""
    p = channels.prefill(num_blocks=NUM_BLOCKS, num_groups=1)
    sock = raw_dealer(p.address, b"engine-d-raw")
    sock.send(encode(raw_registration(b"engine-d-raw", "t-1", [list(range(NUM_BLOCKS + 1))])))
    answer = receive(sock)
    assert isinstance(answer, Nack) and answer.reason.value == "too_many_blocks", answer


@pytest.fixture
def unstarted() -> Iterator[PrefillChannel]:
    """P's channel without its thread: nothing reads its socket until the test does."""
    channel = PrefillChannel(PushRegistry(RegistryConfig(
        engine_id=P_ENGINE, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, num_groups=1)),
        HOST, free_port())
    try:
        yield channel
    finally:
        channel.stop()


def test_each_connection_queues_a_bounded_number_of_messages_on_p(
    unstarted: PrefillChannel, raw_dealer: Callable[[str, bytes], zmq.Socket[Any]],
) -> None:
    """While P reads nothing, a peer's connection takes at most _RECEIVE_HWM messages
    from it, and ZMQ stops reading that connection: the rest wait in the sender's own
    queue (and the kernel's buffers), not in P's memory. Frames as long as P allows, so
    that the kernel's buffers hold few of them. (ZMQ's default, 1000 a connection, let P
    grow by gigabytes under the flood drill's new identity every 1000 messages.)"""
    big = b"\x00" * (max_frame_bytes(NUM_BLOCKS, 1) - 1)  # garbage, as long as P allows
    sock = raw_dealer(unstarted.address, b"engine-d-raw")
    sock.setsockopt(zmq.SNDHWM, 1)
    sent = [0]

    def sender_stuck() -> bool:
        """Send while ZMQ takes frames; True once it took none for 200 ms."""
        while sock.poll(200, zmq.POLLOUT) and sent[0] <= 5000:
            sock.send(big, zmq.NOBLOCK)
            sent[0] += 1
        return True

    wait_for(sender_stuck, 30.0, "the sender can send no more")
    kernel_frames = (16 << 20) // len(big)  # loopback buffers: a few MiB each way
    assert sent[0] <= _RECEIVE_HWM + kernel_frames + 2, sent[0]
    got = 0  # all of it reaches P once P reads: queued, not lost
    while unstarted._socket.poll(2000):
        got += len(unstarted._socket.recv_multipart()) // 2
    assert got == sent[0], (got, sent[0])


def after_a_pass(p: PrefillChannel, condition: Callable[[], bool]) -> Callable[[], bool]:
    """A condition for wait_for: one pass of P's thread (as if its socket polled readable,
    on the test's thread), then `condition`."""
    def check() -> bool:
        p._wake({p._socket: zmq.POLLIN})
        return condition()
    return check


def test_past_its_share_p_sheds_unknown_peers_and_still_serves_known_ones(
    unstarted: PrefillChannel, raw_dealer: Callable[[str, bytes], zmq.Socket[Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """P's passes, one by one on the test's thread, with its handling share spent (and
    earning almost nothing back): a peer P does not know has its first messages
    answered (_STRANGER_MESSAGES: a new D's registration), the rest read and dropped
    unanswered (`shed`), while a D whose registration P accepted before is still
    answered, and the engine's events are handled."""
    p = unstarted
    p._setup()
    d = raw_dealer(p.address, b"engine-d-known")
    d.send(encode(raw_registration(b"engine-d-known", "t-1", [[0, 1]])))
    wait_for(after_a_pass(p, lambda: bool(d.poll(0))), 5.0, "P answered D")
    assert isinstance(receive(d), Ack)

    monkeypatch.setattr(prefill_channel, "_HANDLING_SHARE", 1e-9)
    p._budget = -1.0  # spent: as after a flood's worth of handling
    stranger = raw_dealer(p.address, b"stranger")
    for _ in range(_STRANGER_MESSAGES + 3):
        stranger.send(encode(Ping()))
    wait_for(after_a_pass(p, lambda: p.shed == 3), 5.0, "P read the stranger's pings")
    for _ in range(_STRANGER_MESSAGES):
        assert isinstance(receive(stranger), Pong)
    d.send(encode(Ping()))
    p.prefill_aborted(TransferId("t-engine"))  # an engine event
    wait_for(after_a_pass(p, lambda: bool(d.poll(0))), 5.0, "P answered D")
    assert isinstance(receive(d), Pong)
    assert not p._events_pending(), "the engine's event was handled"
    assert not stranger.poll(0), "the stranger got no more answers"
    assert p.shed == 3 and p.bad_messages == 0


def small_flood(address: str, seed: int, stop: Any, sent: Any) -> None:
    """scripts/drill_flood's flood (a new ZMQ identity every 1000 messages), without its
    long registrations: pings, aborts and abandons of random ids, degenerate small
    registrations and garbage, each short enough to pass P's frame limit."""
    whole = drill_flood.flood_frames

    def short(rng: random.Random) -> list[bytes]:
        while True:
            frames = whole(rng)
            if sum(len(frame) for frame in frames) < max_frame_bytes(NUM_BLOCKS, 1):
                return frames

    drill_flood.flood_frames = short
    drill_flood.flood(address, seed, 1000, stop, sent)


def test_a_flood_from_new_identities_is_shed_while_a_new_d_is_served(
    channels: Channels,
) -> None:
    """Another process floods P's push port as the drill does, with short messages only,
    from a new ZMQ identity every 1000 messages. P reads on (what it leaves unread would
    stay in ZMQ) and sheds what its handling share cannot take, while a D new to it
    registers (its first messages are handled), is acknowledged, and P's finished
    prefill starts its WRITE."""
    p = channels.prefill(num_blocks=NUM_BLOCKS, num_groups=1)
    spawn = multiprocessing.get_context("spawn")
    stop, sent = spawn.Event(), spawn.Value("q", 0)
    flooder = spawn.Process(target=small_flood, args=(p.address, 1, stop, sent), daemon=True)
    flooder.start()
    try:
        wait_for(lambda: p.shed > 10 * 128, 30.0, "P sheds the flood")
        d = channels.decode()
        reg = registration(d, "t-1")
        d.register(p.address, reg)
        wait_for(lambda: p.registry.state_of(reg.transfer_id) is not None, 5.0,
                 "P holds D's registration")
        p.prefill_finished(reg.transfer_id, P_REQ, P_BLOCKS)
        (write,) = wait_actions(p, timeout=5.0)
        assert isinstance(write, StartWrite) and write.transfer_id == reg.transfer_id
        assert flooder.is_alive(), "the flood went on"
        assert d.take_failures() == [], "D's push did not fail"
    finally:
        stop.set()
        flooder.join(10)
        if flooder.is_alive():
            flooder.kill()
