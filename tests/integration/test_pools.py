"""Balancing across emulated pools (3 P, 3 D fake servers): each policy's spread, prefix
affinity's stickiness, and least outstanding steering around a slow server."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import httpx
import pytest

from scripts.fake_vllm import Fabric, FakeVLLM, start
from tests.conftest import serve_router

BODY = {"model": "fake-model", "max_tokens": 2}


class Pools:
    def __init__(self, prefill: list[FakeVLLM], decode: list[FakeVLLM],
                 p_urls: list[str], d_urls: list[str]) -> None:
        self.prefill, self.decode, self.p_urls, self.d_urls = prefill, decode, p_urls, d_urls

    def config(self, **extra: object) -> dict[str, object]:
        return {"prefill": self.p_urls, "decode": self.d_urls, "mode": "pull", **extra}


@pytest.fixture
async def pools() -> AsyncIterator[Pools]:
    fabric = Fabric()
    prefill = [FakeVLLM("prefill", engine_id=f"engine-p{i}", fabric=fabric) for i in range(3)]
    decode = [FakeVLLM("decode", engine_id=f"engine-d{i}", fabric=fabric) for i in range(3)]
    async with AsyncExitStack() as stack:
        urls = []
        for fake in prefill + decode:
            runner, url = await start(fake)
            stack.push_async_callback(runner.cleanup)
            urls.append(url)
        yield Pools(prefill, decode, urls[:3], urls[3:])


def counts(fakes: list[FakeVLLM]) -> list[int]:
    return [len(f.seen) for f in fakes]


async def send(client: httpx.AsyncClient, url: str, prompt: str) -> None:
    r = await client.post(f"{url}/v1/completions", json={**BODY, "prompt": prompt})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("policy", ["round_robin", "least_outstanding", "power_of_two"])
async def test_each_policy_spreads_even_traffic_over_the_pool(pools: Pools, policy: str) -> None:
    config = pools.config(balance={"prefill": policy, "decode": policy})
    async with serve_router(**config) as (url, _), httpx.AsyncClient(timeout=10) as client:
        for wave in range(10):  # 10 waves of 6 concurrent requests
            await asyncio.gather(*(send(client, url, f"w{wave} r{i}") for i in range(6)))
    for fakes in (pools.prefill, pools.decode):
        seen = counts(fakes)
        assert sum(seen) == 60
        assert min(seen) >= 10 and max(seen) <= 30, (policy, seen)  # even share: 20


async def test_prefix_affinity_keeps_a_repeated_prefix_on_one_prefill(pools: Pools) -> None:
    config = pools.config(balance={"prefill": "prefix_affinity", "prefix_chars": 40})
    system = "You are a careful assistant for the billing team. "
    async with serve_router(**config) as (url, _), httpx.AsyncClient(timeout=10) as client:
        for i in range(12):  # one at a time: no load, so nothing overflows the bound
            await send(client, url, system + f"question {i}")
        same_prefix = counts(pools.prefill)
        assert sorted(same_prefix) == [0, 0, 12], same_prefix
        for i in range(30):
            await send(client, url, f"{i} unrelated conversation about topic {i}")
    spread = Counter({i: n - same_prefix[i] for i, n in enumerate(counts(pools.prefill))})
    assert len(+spread) == 3, f"distinct prefixes should reach every P: {spread}"


async def test_least_outstanding_sends_less_to_a_slow_server(pools: Pools) -> None:
    pools.decode[0].behavior.delay = 0.3  # this D takes 0.3 s before its first token
    config = pools.config(balance={"decode": "least_outstanding"})
    async with serve_router(**config) as (url, _), httpx.AsyncClient(timeout=10) as client:
        async def stream_of_requests(worker: int) -> None:
            for i in range(8):
                await send(client, url, f"worker {worker} request {i}")
        await asyncio.gather(*(stream_of_requests(w) for w in range(4)))
    slow, *fast = counts(pools.decode)
    assert sum([slow, *fast]) == 32
    assert slow < min(fast) / 2, (slow, fast)


async def test_a_failing_server_is_ejected_after_failures_in_a_row(pools: Pools) -> None:
    pools.decode[1].behavior.fail_status = 500
    config = pools.config(balance={"decode": "round_robin"},
                          ejection={"consecutive_failures": 3, "base_seconds": 60})
    async with serve_router(**config) as (url, _), httpx.AsyncClient(timeout=10) as client:
        statuses = []
        for i in range(30):
            r = await client.post(f"{url}/v1/completions", json={**BODY, "prompt": f"r{i}"})
            statuses.append(r.status_code)
        metrics = (await client.get(f"{url}/metrics")).text
    assert statuses.count(500) == 3, statuses  # then it was out of the rotation
    assert statuses[-15:] == [200] * 15
    assert len(pools.decode[1].seen) == 3
    assert 'pdproxy_ejections_total{cluster="decode",endpoint="' + pools.d_urls[1] + '"} 1.0' in metrics
