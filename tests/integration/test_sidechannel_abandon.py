"""The router's abandon over real ZMQ on 127.0.0.1 (no vLLM): `proxy.upstream.sidechannel` tells a
P's push channel that a push's D leg failed, and P frees the prompt's blocks at once
(its engine's next `take_actions`), unless a D registered the transfer. Sends never
wait, and everything closes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import zmq.auth

from connector.prefill.channel import FreeBlocks, PrefillChannel, StartWrite
from connector.prefill.registry import PushRegistry, RegistryConfig
from connector.protocol.side_channel import TransferId
from connector.shared.keys import KeyPair, ServerKeys, load_key_pair
from proxy.protocol import new_transfer_id
from proxy.upstream.sidechannel import SEND_QUEUE, SideChannel
from testbed.ports import free_port
from tests.conftest import until
from tests.integration.test_push_channel import (
    BLOCK_SIZE,
    HOST,
    P_BLOCKS,
    P_ENGINE,
    P_REQ,
    SOON,
    Channels,
    plain,
    registration,
    wait_for,
)


@pytest.fixture
async def router() -> AsyncIterator[SideChannel]:
    async with SideChannel() as side:
        yield side


def port_of(p: PrefillChannel) -> int:
    return int(p.address.rsplit(":", 1)[1])


def transfer_id() -> TransferId:
    return TransferId(new_transfer_id())


async def actions(p: PrefillChannel, timeout: float = 2.0) -> list[object]:
    """The engine's next actions, once there are some, within `timeout` (waited for
    with `until`: the loop stays free for the sender)."""
    got: list[object] = []

    def some() -> bool:
        got.extend(p.take_actions())
        return bool(got)

    await until(some, "an action from P's channel", timeout)
    return got


async def test_an_abandon_frees_a_finished_prefill_no_d_claimed(
    channels: Channels, router: SideChannel,
) -> None:
    p = channels.prefill()  # unclaimed_ttl stays at 120 s: only the abandon frees it
    tid = transfer_id()
    p.prefill_finished(tid, P_REQ, P_BLOCKS)
    assert router.abandon(HOST, port_of(p), tid) is True
    assert await actions(p, timeout=SOON) == [FreeBlocks(tid, P_REQ, "aborted")]
    assert len(p.registry) == 0 and p.registry.counters().abandoned == 1
    assert router.sent == 1 and router.dropped == 0


async def test_an_abandon_before_the_prefill_finished_frees_it_when_it_does(
    channels: Channels, router: SideChannel,
) -> None:
    p = channels.prefill()
    tid = transfer_id()
    router.abandon(HOST, port_of(p), tid)
    await asyncio.to_thread(wait_for, lambda: p.registry.counters().abandoned == 1, 2.0,
                            "P took the abandon")
    p.prefill_finished(tid, P_REQ, P_BLOCKS)
    assert await actions(p, timeout=SOON) == [FreeBlocks(tid, P_REQ, "aborted")]


async def test_an_abandon_of_a_transfer_a_d_registered_is_ignored(
    channels: Channels, router: SideChannel,
) -> None:
    p = channels.prefill()
    d = channels.decode()
    reg = registration(d, transfer_id())
    d.register(p.address, reg)
    await asyncio.to_thread(wait_for, lambda: len(p.registry) == 1, 2.0, "P holds it")
    router.abandon(HOST, port_of(p), reg.transfer_id)
    await asyncio.to_thread(wait_for, lambda: p.registry.counters().abandons_ignored == 1,
                            2.0, "P counted the ignored abandon")
    p.prefill_finished(reg.transfer_id, P_REQ, P_BLOCKS)
    assert [plain(a) for a in await actions(p)] == [
        StartWrite(reg.transfer_id, P_REQ, P_BLOCKS, reg)]
    assert d.take_failures() == []


def make_pair(directory: Path, name: str) -> tuple[str, str, KeyPair]:
    public, secret = zmq.auth.create_certificates(str(directory), name)
    return public, secret, load_key_pair(secret)


async def test_with_keys_only_a_router_with_an_allowed_key_abandons(
    tmp_path: Path,
) -> None:
    p_public, _, p_pair = make_pair(tmp_path, "p")
    _, router_secret, router_pair = make_pair(tmp_path, "router")
    _, stranger_secret, _ = make_pair(tmp_path, "stranger")
    p = PrefillChannel(
        PushRegistry(RegistryConfig(engine_id=P_ENGINE, block_size=BLOCK_SIZE)), HOST,
        free_port(), curve=ServerKeys(p_pair, frozenset({router_pair.public})))
    p.start()
    try:
        tid, other = transfer_id(), transfer_id()
        p.prefill_finished(tid, P_REQ, P_BLOCKS)
        p.prefill_finished(other, "p-req-2", P_BLOCKS)
        async with SideChannel(secret_key_file=stranger_secret,
                               server_key_file=p_public) as stranger:
            stranger.abandon(HOST, port_of(p), other)
            await asyncio.to_thread(wait_for, lambda: p.refused_handshakes >= 1, 3.0,
                                    "P refused the stranger")
        async with SideChannel(secret_key_file=router_secret,
                               server_key_file=p_public) as side:
            side.abandon(HOST, port_of(p), tid)
            assert await actions(p, timeout=SOON) == [FreeBlocks(tid, P_REQ, "aborted")]
        assert len(p.registry) == 1, "the stranger's abandon did nothing"
    finally:
        p.stop()


async def test_abandons_to_an_unreachable_p_never_wait_and_are_bounded(
    router: SideChannel,
) -> None:
    port = free_port()  # nothing listens there
    for _ in range(3 * SEND_QUEUE):
        router.abandon(HOST, port, transfer_id())
    assert router.sent + router.dropped == 3 * SEND_QUEUE
    assert SEND_QUEUE <= router.sent < 2 * SEND_QUEUE and router.dropped > 0


async def test_bad_coordinates_are_dropped_and_a_closed_sender_sends_nothing() -> None:
    side = SideChannel()
    for host, port, tid in [("", 5700, "t"), (HOST, 0, "t"), (HOST, 70000, "t"),
                            (HOST, 5700, ""), ("a host", 5700, "t")]:
        assert side.abandon(host, port, tid) is False
    assert side.dropped == 5 and side.sent == 0
    assert side.abandon(HOST, free_port(), "t") is True
    await side.aclose()
    await side.aclose()  # idempotent
    assert side.abandon(HOST, free_port(), "t") is False


async def test_the_sender_keeps_one_socket_per_p_and_at_most_max_peers() -> None:
    async with SideChannel(max_peers=2) as side:
        ports = [free_port() for _ in range(3)]
        for port in ports + ports[-1:]:
            side.abandon(HOST, port, "t")
        assert list(side._sockets) == [f"tcp://{HOST}:{port}" for port in ports[1:]]


def test_keys_go_together() -> None:
    with pytest.raises(ValueError, match="go together"):
        SideChannel(secret_key_file="router.key_secret")
