"""Balancing across emulated pools (3 P, 3 D fake servers): each policy's spread, prefix
affinity's stickiness, and least outstanding steering around a slow server."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import httpx
import pytest

from testbed.fake_vllm import Fabric, FakeVLLM, start
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


async def test_a_failing_server_is_retried_around_then_ejected(pools: Pools) -> None:
    """Its 500s are retried on another D (no byte had reached the client), and after 3 in
    a row it is out of the rotation: the client never sees an error."""
    pools.decode[1].behavior.fail_status = 500
    config = pools.config(balance={"decode": "round_robin"},
                          ejection={"consecutive_failures": 3, "base_seconds": 60})
    async with serve_router(**config) as (url, _), httpx.AsyncClient(timeout=10) as client:
        statuses = []
        for i in range(30):
            r = await client.post(f"{url}/v1/completions", json={**BODY, "prompt": f"r{i}"})
            statuses.append(r.status_code)
        metrics = (await client.get(f"{url}/metrics")).text
    assert statuses == [200] * 30
    assert len(pools.decode[1].seen) == 3, "ejected after its third failure in a row"
    assert f'pdproxy_ejections_total{{cluster="decode",endpoint="{pools.d_urls[1]}"}} 1.0' in metrics
    assert 'pdproxy_retries_total{cluster="decode",reason="status_5xx"} 3.0' in metrics


async def test_overload_is_not_retried_and_retries_stop_at_the_budget(pools: Pools) -> None:
    for fake in pools.prefill:
        fake.behavior.fail_status = 503
    config = pools.config(ejection={"consecutive_failures": 0})
    async with serve_router(**config) as (url, _), httpx.AsyncClient(timeout=10) as client:
        r = await client.post(f"{url}/v1/completions", json={**BODY, "prompt": "x"})
        assert r.status_code == 503
        assert sum(len(f.seen) for f in pools.prefill) == 1, "a 503 is not retried"
        for fake in pools.prefill:
            fake.behavior.fail_status = 500
        statuses = [(await client.post(f"{url}/v1/completions",
                                       json={**BODY, "prompt": f"y{i}"})).status_code
                    for i in range(20)]
        metrics = (await client.get(f"{url}/metrics")).text
    # Every P fails. The k-th of these requests (the 503 one came first) may retry while
    # retries so far < 10 + 0.2 * (k + 1): that allows 15 of the 20, and refuses 5.
    assert statuses == [500] * 20
    retried = sum(len(f.seen) for f in pools.prefill) - 1 - 20
    assert retried == 15, retried
    assert 'pdproxy_retries_refused_total{cluster="prefill",reason="status_5xx"} 5.0' in metrics


async def test_a_push_goes_to_a_prefill_that_can_push(pools: Pools) -> None:
    """P0 is known to do pull only: push requests go to the others and are not downgraded;
    pull requests still use all three."""
    coords = [{"url": url, "engine_id": f"engine-p{i}", "side_channel_host": "127.0.0.1",
               "side_channel_port": 5600 + i, "transfer_modes": ["pull"] if i == 0 else ["pull", "push"]}
              for i, url in enumerate(pools.p_urls)]
    config = {"prefill": coords, "decode": pools.d_urls, "mode": "pull",
              "balance": {"prefill": "round_robin"}}
    async with serve_router(**config) as (url, _), httpx.AsyncClient(timeout=10) as client:
        for i in range(6):
            r = await client.post(f"{url}/v1/completions", json={**BODY, "prompt": f"p{i}"},
                                  headers={"X-KV-Transfer-Mode": "push"})
            assert r.status_code == 200 and r.headers["x-kv-transfer-mode"] == "push", r.headers
        assert counts(pools.prefill) == [0, 3, 3]
        for i in range(6):
            await send(client, url, f"q{i}")
    assert counts(pools.prefill) == [2, 5, 5]
