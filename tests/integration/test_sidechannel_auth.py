"""Who may use P's push side channel, over real ZMQ on 127.0.0.1 (no vLLM): CURVE keys
admit known peers only (the others are counted), without keys P works as before and
warns, an abort counts only from the transfer's registrant, and per-peer, global and
per-message limits are answered with a NACK (a registration of more KV-cache groups than
any model has is not even decoded)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
import zmq.auth

from connector.decode.channel import DecodeChannel
from connector.prefill.channel import PrefillChannel, StartWrite
from connector.prefill.registry import PushRegistry, RegistryConfig
from connector.protocol.side_channel import (
    MAX_KV_GROUPS,
    Abort,
    Ack,
    EngineId,
    Nack,
    NackReason,
    Ping,
    Pong,
    RegisterBlocks,
    TransferId,
    encode,
)
from connector.shared.keys import ClientKeys, KeyPair, ServerKeys, load_key_pair, load_public_key
from testbed.ports import free_port
from tests.integration.test_push_channel import (
    BLOCK_SIZE,
    HOST,
    P_BLOCKS,
    P_ENGINE,
    P_REQ,
    plain,
    receive,
    registration,
    wait_actions,
    wait_failures,
    wait_for,
)


class Keys:
    """Key pairs made by zmq's certificate helper: P's, a D's, the router's, and a
    stranger's that P does not allow."""

    def __init__(self, directory: Path) -> None:
        self.pairs: dict[str, KeyPair] = {}
        for name in ("p", "d", "router", "stranger"):
            _, secret = zmq.auth.create_certificates(str(directory), name)
            self.pairs[name] = load_key_pair(secret)
        self.p_public = load_public_key(str(directory / "p.key"))

    def server(self) -> ServerKeys:
        return ServerKeys(self.pairs["p"],
                          frozenset({self.pairs["d"].public, self.pairs["router"].public}))

    def client(self, name: str) -> ClientKeys:
        return ClientKeys(self.pairs[name], self.p_public)


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    return Keys(tmp_path_factory.mktemp("keys"))


class Made:
    """Channels and raw sockets a test made; all stopped or closed at its end."""

    def __init__(self) -> None:
        self.channels: list[PrefillChannel | DecodeChannel] = []
        self.context = zmq.Context()
        self.sockets: list[zmq.Socket[Any]] = []
        self.count = 0

    def prefill(self, curve: ServerKeys | None = None, **config: Any) -> PrefillChannel:
        values: dict[str, Any] = {"engine_id": P_ENGINE, "block_size": BLOCK_SIZE, **config}
        channel = PrefillChannel(PushRegistry(RegistryConfig(**values)), HOST, free_port(),
                                 curve=curve)
        channel.start()
        self.channels.append(channel)
        return channel

    def decode(self, curve: ClientKeys | None = None, **timeouts: float) -> DecodeChannel:
        self.count += 1
        values: dict[str, Any] = {"ack_timeout": 1.0, "ping_interval": 0.2,
                                  "peer_timeout": 3.0, "registration_ttl": 30.0, **timeouts}
        channel = DecodeChannel(EngineId(f"engine-d{self.count}"), curve=curve, **values)
        channel.start()
        self.channels.append(channel)
        return channel

    def dealer(self, address: str, identity: bytes,
               curve: ClientKeys | None = None) -> zmq.Socket[Any]:
        """A bare DEALER, to speak to P byte for byte (as any process could)."""
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, identity)
        if curve is not None:
            sock.setsockopt(zmq.CURVE_SECRETKEY, curve.pair.secret)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.pair.public)
            sock.setsockopt(zmq.CURVE_SERVERKEY, curve.server_public)
        sock.connect(address)
        self.sockets.append(sock)
        return sock

    def close(self) -> None:
        for channel in reversed(self.channels):
            channel.stop()
        for sock in self.sockets:
            sock.close()
        self.context.term()


@pytest.fixture
def made() -> Iterator[Made]:
    things = Made()
    try:
        yield things
    finally:
        things.close()


def raw_registration(tid: str, identity: bytes, **overrides: Any) -> RegisterBlocks:
    fields: dict[str, Any] = {
        "transfer_id": TransferId(tid), "engine_id": EngineId(identity.decode()),
        "request_id": f"d-{tid}", "tp_size": 1, "tp_rank": 0, "block_ids": [[0, 1, 2]],
        "block_size": BLOCK_SIZE, "host": HOST, "port": 5601, "ttl_s": 30.0, **overrides}
    return RegisterBlocks(**fields)


def assert_serves(p: PrefillChannel, made: Made, curve: ClientKeys | None = None) -> None:
    """P still answers a peer it admits."""
    sock = made.dealer(p.address, b"engine-d-check", curve)
    sock.send(encode(Ping()))
    assert isinstance(receive(sock), Pong)


# --- CURVE ---------------------------------------------------------------------------------


def test_a_keyed_p_drops_an_unkeyed_peers_registration_and_counts_it(
    made: Made, keys: Keys,
) -> None:
    p = made.prefill(curve=keys.server())
    sock = made.dealer(p.address, b"engine-d-raw")
    sock.send(encode(raw_registration("t-raw", b"engine-d-raw")))
    d = made.decode()  # a D without keys: the same, through the real channel
    d.register(p.address, registration(d, "t-d"))
    wait_for(lambda: p.refused_handshakes >= 2, 3.0, "P refused both handshakes")
    (failure,) = wait_failures(d, timeout=3.0)
    assert "did not acknowledge" in failure.why, failure
    assert len(p.registry) == 0 and p.registry.counters().registered == 0
    assert not sock.poll(100), "nothing came back to the unkeyed peer"
    assert_serves(p, made, keys.client("d"))


def test_a_keyed_p_drops_a_peer_with_an_unknown_key_and_counts_it(
    made: Made, keys: Keys,
) -> None:
    p = made.prefill(curve=keys.server())
    d = made.decode(curve=keys.client("stranger"))
    d.register(p.address, registration(d, "t-1"))
    wait_for(lambda: p.refused_handshakes >= 1, 3.0, "P refused the stranger's handshake")
    (failure,) = wait_failures(d, timeout=3.0)
    assert "did not acknowledge" in failure.why, failure
    assert len(p.registry) == 0 and p.registry.counters().registered == 0
    assert p.unidentified == 0


def test_a_d_with_a_known_key_pushes_and_is_known_by_its_key(made: Made, keys: Keys) -> None:
    p = made.prefill(curve=keys.server())
    d = made.decode(curve=keys.client("d"))
    reg = registration(d, "t-1")
    d.register(p.address, reg)
    wait_for(lambda: len(p.registry) == 1, 3.0, "P holds the registration")
    assert p.registry.pending_of(keys.pairs["d"].public) == 1, "the registrant is its key"
    p.prefill_finished(reg.transfer_id, P_REQ, P_BLOCKS)
    (action,) = wait_actions(p)
    assert plain(action) == StartWrite(reg.transfer_id, P_REQ, P_BLOCKS, reg)
    assert d.take_failures() == [] and p.refused_handshakes == 0


def test_without_keys_p_works_as_before_and_warns_once_that_it_is_open(
    made: Made, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="vllm.pd_connector.channel")
    p = made.prefill()
    d = made.decode()
    reg = registration(d, "t-1")
    d.register(p.address, reg)
    p.prefill_finished(reg.transfer_id, P_REQ, P_BLOCKS)
    (action,) = wait_actions(p)
    assert isinstance(action, StartWrite) and action.registration == reg
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "not authenticated" in warnings[0], warnings
    assert "curve_secret_key_file" in warnings[0]


# --- aborts: only from the registrant ------------------------------------------------------


def test_an_abort_from_a_peer_that_did_not_register_is_ignored(made: Made) -> None:
    p = made.prefill()
    d = made.decode()
    reg = registration(d, "t-1")
    d.register(p.address, reg)
    wait_for(lambda: len(p.registry) == 1, 3.0, "P holds the registration")
    intruder = made.dealer(p.address, b"engine-intruder")
    intruder.send(encode(Abort(transfer_id=reg.transfer_id)))
    wait_for(lambda: p.registry.counters().foreign_aborts == 1, 3.0, "P counted the abort")
    assert len(p.registry) == 1 and p.take_actions() == []
    assert not intruder.poll(100), "the intruder hears nothing"
    assert d.take_failures() == [], "D's push goes on"

    p.prefill_finished(reg.transfer_id, P_REQ, P_BLOCKS)
    (action,) = wait_actions(p)
    assert isinstance(action, StartWrite), "the push is written"


def test_with_keys_the_registrant_is_its_key_not_its_routing_identity(
    made: Made, keys: Keys,
) -> None:
    """The router's key is allowed, but it did not register the transfer: its abort is
    ignored. The same key under another routing identity is the registrant."""
    p = made.prefill(curve=keys.server())
    reg = raw_registration("t-1", b"engine-d-raw")
    d = made.dealer(p.address, b"engine-d-raw", keys.client("d"))
    d.send(encode(reg))
    receive(d)  # the Ack
    router = made.dealer(p.address, b"engine-d-raw-2", keys.client("router"))
    router.send(encode(Abort(transfer_id=reg.transfer_id)))
    wait_for(lambda: p.registry.counters().foreign_aborts == 1, 3.0, "P counted the abort")
    assert len(p.registry) == 1

    same_key = made.dealer(p.address, b"engine-d-raw-3", keys.client("d"))
    same_key.send(encode(Abort(transfer_id=reg.transfer_id)))
    wait_for(lambda: len(p.registry) == 0, 3.0, "the registrant's key aborted it")
    assert p.registry.counters().aborted == 1


# --- a D that connects again -------------------------------------------------------------


@pytest.mark.parametrize("curve", [False, True], ids=["plain", "curve"])
def test_a_d_that_connects_again_is_answered_on_its_new_connection(
    made: Made, keys: Keys, curve: bool,
) -> None:
    """D closes its socket to a P that was slow to answer and opens another, with the same
    routing identity (its engine's, where P sends its answers). P may not have seen the
    old connection go yet: the new one takes the identity over (ZMQ's ROUTER_HANDOVER)
    and P's Ack comes on it. Here the old socket stays open, the case where P has not
    seen it closed; without handover P refused the new connection and the registration
    sent on it went unanswered (a loaded machine showed it as an Ack that never came)."""
    p = made.prefill(curve=keys.server() if curve else None)
    client = keys.client("d") if curve else None
    identity = b"engine-d-again"
    old = made.dealer(p.address, identity, client)
    old.send(encode(raw_registration("t-old", identity)))
    assert isinstance(receive(old), Ack)
    new = made.dealer(p.address, identity, client)
    new.send(encode(raw_registration("t-new", identity)))
    ack = receive(new)
    assert isinstance(ack, Ack) and ack.transfer_id == "t-new", ack


# --- limits ----------------------------------------------------------------------------------


def test_registrations_over_the_per_peer_limit_are_nacked(made: Made) -> None:
    p = made.prefill(max_pending_per_peer=2)
    d = made.decode(ack_timeout=3.0)
    for tid in ("t-1", "t-2", "t-3"):
        d.register(p.address, registration(d, tid))
    started = time.monotonic()
    (failure,) = wait_failures(d, timeout=2.0)
    assert time.monotonic() - started < 2.0, "a NACK, not the Ack's timeout"
    assert failure.transfer_id == "t-3" and "over_limit" in failure.why, failure
    assert len(p.registry) == 2 and p.registry.counters().over_limit == 1
    other = made.decode()
    other.register(p.address, registration(other, "t-4"))
    wait_for(lambda: len(p.registry) == 3, 3.0, "another peer is not held by the limit")


def test_a_registration_naming_more_blocks_than_p_has_is_nacked(made: Made) -> None:
    p = made.prefill(num_blocks=8)
    d = made.decode(ack_timeout=3.0)
    d.register(p.address, registration(d, "t-1", block_ids=[list(range(9))]))
    (failure,) = wait_failures(d, timeout=2.0)
    assert "too_many_blocks" in failure.why and "9 block ids" in failure.why, failure
    assert len(p.registry) == 0 and p.registry.counters().too_many_blocks == 1
    d.register(p.address, registration(d, "t-2", block_ids=[list(range(8))]))
    wait_for(lambda: len(p.registry) == 1, 3.0, "a registration within P's blocks is held")
    assert_serves(p, made)


def test_registrations_over_the_limit_of_all_peers_together_are_nacked(made: Made) -> None:
    """Without CURVE, each new ZMQ identity is a new peer: the per-peer limit alone would
    let a flood of identities make P hold anything."""
    p = made.prefill(max_pending_per_peer=2, max_pending=3)
    answers = []
    for i in range(6):
        identity = f"engine-d-{i}".encode()
        sock = made.dealer(p.address, identity)
        sock.send(encode(raw_registration(f"t-{i}", identity)))
        answers.append(receive(sock))
    assert [type(a) for a in answers] == [Ack] * 3 + [Nack] * 3, answers
    for nack in answers[3:]:
        assert nack.reason is NackReason.OVER_LIMIT and "all peers together" in nack.message
    assert len(p.registry) == 3 and p.registry.counters().over_limit == 3
    assert_serves(p, made)


def test_degenerate_registrations_are_refused_and_nothing_of_them_is_kept(made: Made) -> None:
    """Checked against P's layout (1 KV-cache group, 8 blocks) before anything is kept:
    another number of groups, or more block ids than P has, is NACKed with the reason;
    more groups than any model has (one byte each: within the frame cap) is dropped
    undecoded. (A million of them would pass P's frame cap, which ends the connection:
    tests/integration/test_sidechannel_flood.py.)"""
    p = made.prefill(num_groups=1, num_blocks=8)
    identity = b"engine-d-raw"
    sock = made.dealer(p.address, identity)
    for tid, block_ids, says in [("t-groups", [[0], [1]], "2 KV-cache groups"),
                                 ("t-blocks", [list(range(9))], "9 block ids")]:
        sock.send(encode(raw_registration(tid, identity, block_ids=block_ids)))
        nack = receive(sock)
        assert isinstance(nack, Nack) and nack.transfer_id == tid, nack
        assert nack.reason is NackReason.TOO_MANY_BLOCKS and says in nack.message, nack
    many = msgspec.to_builtins(raw_registration("t-many-groups", identity))
    many["block_ids"] = [[]] * (MAX_KV_GROUPS + 1)
    sock.send(msgspec.msgpack.encode(many))
    sock.send(encode(Ping()))
    assert isinstance(receive(sock), Pong), "dropped, not answered: it is no valid message"
    assert p.bad_messages == 1 and p.registry.counters().too_many_blocks == 2
    assert len(p.registry) == 0 and p.registry.pending() == (0, 0)
    sock.send(encode(raw_registration("t-fits", identity, block_ids=[list(range(8))])))
    assert isinstance(receive(sock), Ack)
