from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from scripts.fake_vllm import Fabric, FakeVLLM, start


class Pair:
    def __init__(self, prefill: FakeVLLM, decode: FakeVLLM, p_url: str, d_url: str) -> None:
        self.prefill = prefill
        self.decode = decode
        self.p_url = p_url
        self.d_url = d_url


@pytest.fixture
async def pair() -> AsyncIterator[Pair]:
    """A fake P and a fake D in this process, sharing a fabric (so push really waits)."""
    fabric = Fabric()
    p = FakeVLLM("prefill", engine_id="engine-p0", side_channel_port=5601, fabric=fabric)
    d = FakeVLLM("decode", engine_id="engine-d0", fabric=fabric)
    p_runner, p_url = await start(p)
    d_runner, d_url = await start(d)
    try:
        yield Pair(p, d, p_url, d_url)
    finally:
        await p_runner.cleanup()
        await d_runner.cleanup()
