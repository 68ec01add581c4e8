from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from scripts.fake_vllm import Fabric, FakeVLLM, start


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
