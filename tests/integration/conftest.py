from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest
import zmq

from testbed.fake_vllm import Fabric, FakeVLLM, start

if TYPE_CHECKING:
    from tests.integration.test_push_channel import Channels


class Pair:
    def __init__(self, prefill: FakeVLLM, decode: FakeVLLM, p_url: str, d_url: str) -> None:
        self.prefill = prefill
        self.decode = decode
        self.p_url = p_url
        self.d_url = d_url


@contextlib.asynccontextmanager
async def fake_pair(**prefill_options: Any) -> AsyncIterator[Pair]:
    """A fake P and a fake D in this process, sharing a fabric (so push really waits);
    `prefill_options` go to P's `FakeVLLM` (data-parallel ranks, push port, ...)."""
    fabric = Fabric()
    p = FakeVLLM("prefill", engine_id="engine-p0", side_channel_port=5601, fabric=fabric,
                 **prefill_options)
    d = FakeVLLM("decode", engine_id="engine-d0", fabric=fabric)
    p_runner, p_url = await start(p)
    d_runner, d_url = await start(d)
    try:
        yield Pair(p, d, p_url, d_url)
    finally:
        await p_runner.cleanup()
        await d_runner.cleanup()


@pytest.fixture
async def pair() -> AsyncIterator[Pair]:
    async with fake_pair() as made:
        yield made


@pytest.fixture
def channels() -> Iterator[Channels]:
    """P's and D's real side channels, started by the test and all stopped after it
    (`Channels` lives with the push channel's own tests)."""
    from tests.integration.test_push_channel import Channels

    made = Channels()
    try:
        yield made
    finally:
        made.stop_all()


@pytest.fixture
def raw_dealer() -> Iterator[Callable[[str, bytes], zmq.Socket[Any]]]:
    """A bare DEALER (its own context) to speak to P's ROUTER byte for byte."""
    context = zmq.Context()
    sockets: list[zmq.Socket[Any]] = []

    def connect(address: str, identity: bytes) -> zmq.Socket[Any]:
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, identity)
        sock.connect(address)
        sockets.append(sock)
        return sock

    try:
        yield connect
    finally:
        for sock in sockets:
            sock.close()
        context.term()
