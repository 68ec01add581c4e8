"""What the router learns about its servers, against emulated pools: the models each
serves, the load its /metrics reports, its health over several checks, and which mode is
faster for `auto`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

import httpx
import pytest
from aiohttp import web

from testbed.fake_vllm import Fabric, FakeVLLM, start
from tests.conftest import serve_router, until

TOKEN = "admin-token-for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Pool:
    def __init__(self) -> None:
        self.fabric = Fabric()
        self.fakes: list[FakeVLLM] = []
        self.urls: dict[int, str] = {}
        self._runners: dict[int, web.AppRunner] = {}
        self._stack = AsyncExitStack()

    async def add(self, role: str, model: str = "fake-model") -> FakeVLLM:
        fake = FakeVLLM(role, engine_id=f"engine-{len(self.fakes)}", fabric=self.fabric, model=model)
        runner, url = await start(fake)
        self._stack.push_async_callback(runner.cleanup)
        self.fakes.append(fake)
        self.urls[id(fake)] = url
        self._runners[id(fake)] = runner
        return fake

    async def kill(self, fake: FakeVLLM) -> None:
        """Stop the server: its port refuses connections from now on."""
        await self._runners[id(fake)].cleanup()

    def url(self, fake: FakeVLLM) -> str:
        return self.urls[id(fake)]


@pytest.fixture
async def pool() -> AsyncIterator[Pool]:
    pool = Pool()
    async with pool._stack:
        yield pool


async def complete(client: httpx.AsyncClient, url: str, model: str = "fake-model",
                   **extra: Any) -> httpx.Response:
    return await client.post(f"{url}/v1/completions",
                             json={"model": model, "max_tokens": 2, "prompt": "hi", **extra})


async def test_each_model_goes_to_its_own_pool_and_models_lists_the_union(pool: Pool) -> None:
    p_a, p_b = await pool.add("prefill", "model-a"), await pool.add("prefill", "model-b")
    d_a, d_b = await pool.add("decode", "model-a"), await pool.add("decode", "model-b")
    config = {"prefill": [pool.url(p_a), pool.url(p_b)], "decode": [pool.url(d_a), pool.url(d_b)],
              "balance": {"prefill": "round_robin", "decode": "round_robin"}}
    async with serve_router(**config) as (url, _), httpx.AsyncClient(timeout=10) as client:
        listed = (await client.get(f"{url}/v1/models")).json()
        assert sorted(card["id"] for card in listed["data"]) == ["model-a", "model-b"]
        for model in ["model-a", "model-b"] * 6:
            r = await complete(client, url, model)
            assert r.status_code == 200, r.text  # a fake answers 404 for a model it lacks
            assert r.json()["model"] == model
        assert [len(f.seen) for f in (p_a, p_b, d_a, d_b)] == [6, 6, 6, 6]
        r = await complete(client, url, "model-c")
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"


async def test_a_retried_leg_stays_with_the_requests_model(pool: Pool) -> None:
    """A model-a P that fails is retried on the other model-a P, never on model-b's
    servers (the retry's pick keeps the first pick's model filter)."""
    broken, p_a = await pool.add("prefill", "model-a"), await pool.add("prefill", "model-a")
    p_b = await pool.add("prefill", "model-b")
    d_a, d_b = await pool.add("decode", "model-a"), await pool.add("decode", "model-b")
    broken.behavior.fail_status = 500
    config = {"prefill": [pool.url(f) for f in (broken, p_a, p_b)],
              "decode": [pool.url(d_a), pool.url(d_b)],
              "balance": {"prefill": "round_robin", "decode": "round_robin"},
              "retry_budget": {"min_per_window": 100}}
    async with serve_router(**config) as (url, _), httpx.AsyncClient(timeout=10) as client:
        for _ in range(12):
            r = await complete(client, url, "model-a")
            assert r.status_code == 200, r.text
            assert r.json()["model"] == "model-a"
        metrics = (await client.get(f"{url}/metrics")).text
    assert len(broken.seen) >= 1, "the broken P took its turns"
    assert 'pdproxy_retries_total{cluster="prefill",reason="status_5xx"}' in metrics
    assert [len(f.seen) for f in (p_b, d_b)] == [0, 0], "model-b's servers saw model-a requests"
    assert len(p_a.seen) == 12 and len(d_a.seen) == 12


async def test_a_model_whose_servers_are_all_down_gives_503(pool: Pool) -> None:
    p_a, p_b = await pool.add("prefill", "model-a"), await pool.add("prefill", "model-b")
    d_a, d_b = await pool.add("decode", "model-a"), await pool.add("decode", "model-b")
    config = {"prefill": [{"url": pool.url(p_a), "models": ["model-a"]}, pool.url(p_b)],
              "decode": [pool.url(d_a), pool.url(d_b)], "admin_token": TOKEN}
    async with serve_router(**config) as (url, _), httpx.AsyncClient(timeout=10) as client:
        assert (await complete(client, url, "model-b")).status_code == 200
        await client.post(f"{url}/admin/endpoints/drain", headers=AUTH,
                          json={"cluster": "decode", "url": pool.url(d_b)})
        r = await complete(client, url, "model-b")
        assert r.status_code == 503, r.text
        assert "serves the model `model-b`" in r.json()["error"]["message"]
        assert (await complete(client, url, "model-a")).status_code == 200


async def test_load_aware_sends_requests_away_from_a_server_with_a_queue(pool: Pool) -> None:
    p = await pool.add("prefill")
    busy, idle = await pool.add("decode"), await pool.add("decode")
    busy.behavior.waiting = 8  # its vLLM says 8 requests wait for a slot
    config = {"prefill": [pool.url(p)], "decode": [pool.url(busy), pool.url(idle)],
              "balance": {"decode": "load_aware", "scrape_interval": 0.05}, "admin_token": TOKEN}
    async with serve_router(**config) as (url, _), httpx.AsyncClient(timeout=10) as client:
        async def scraped() -> bool:
            listing = (await client.get(f"{url}/admin/endpoints", headers=AUTH)).json()
            return any(e["load"] and e["load"]["waiting"] == 8 for e in listing["endpoints"])

        await until(scraped, "the busy D's /metrics scraped")
        for _ in range(10):
            assert (await complete(client, url)).status_code == 200
        assert (len(busy.seen), len(idle.seen)) == (0, 10)

        busy.behavior.waiting, idle.behavior.waiting = 0, 8  # the queue moves
        async def moved() -> bool:  # both servers' new reports, or the two tie for a while
            return (await _waiting_is(client, url, pool.url(idle), 8)
                    and await _waiting_is(client, url, pool.url(busy), 0))

        await until(moved, "the new queues scraped")
        for _ in range(10):
            assert (await complete(client, url)).status_code == 200
        assert len(busy.seen) == 10


async def _waiting_is(client: httpx.AsyncClient, url: str, server: str, waiting: int) -> bool:
    listing = (await client.get(f"{url}/admin/endpoints", headers=AUTH)).json()
    return any(e["url"] == server and e["load"] and e["load"]["waiting"] == waiting
               for e in listing["endpoints"])


async def test_health_thresholds_take_a_server_out_and_back(pool: Pool) -> None:
    p = await pool.add("prefill")
    flaky, steady = await pool.add("decode"), await pool.add("decode")
    config = {"prefill": [pool.url(p)], "decode": [pool.url(flaky), pool.url(steady)],
              "health": {"interval": 0, "unhealthy_threshold": 3, "healthy_threshold": 2}}
    async with serve_router(**config) as (url, app), httpx.AsyncClient(timeout=10) as client:
        router = app.state.router
        flaky_endpoint = router.decode.find(pool.url(flaky))

        async def checks(n: int) -> None:  # the checker's rounds, run by hand here
            for _ in range(n):
                await router.health.check(flaky_endpoint)

        flaky.behavior.health_status = 500
        await checks(2)
        assert flaky_endpoint.healthy, "two failed checks took the server out (threshold 3)"
        await checks(1)
        assert not flaky_endpoint.healthy
        assert "500" in (flaky_endpoint.last_error or "")
        before = len(flaky.seen)
        for _ in range(6):
            assert (await complete(client, url)).status_code == 200
        assert len(flaky.seen) == before, "an unhealthy D got requests"

        flaky.behavior.health_status = 200
        await checks(1)
        assert not flaky_endpoint.healthy, "one passed check brought it back (threshold 2)"
        await checks(1)
        assert flaky_endpoint.healthy
        for _ in range(6):
            assert (await complete(client, url)).status_code == 200
        assert len(flaky.seen) > before


async def test_the_background_checks_take_a_dead_server_out(pool: Pool) -> None:
    p = await pool.add("prefill")
    dead, alive = await pool.add("decode"), await pool.add("decode")
    config = {"prefill": [pool.url(p)], "decode": [pool.url(dead), pool.url(alive)],
              "health": {"interval": 0.05, "unhealthy_threshold": 2}, "admin_token": TOKEN}
    async with serve_router(**config) as (url, _), httpx.AsyncClient(timeout=10) as client:
        dead.behavior.health_status = 503
        await until(lambda: _healthy_is(client, url, pool.url(dead), False), "dead D out")
        for _ in range(6):
            assert (await complete(client, url)).status_code == 200
        assert len(dead.seen) == 0


async def test_a_killed_server_loses_no_request_that_had_not_started(pool: Pool) -> None:
    prefills = [await pool.add("prefill") for _ in range(2)]
    decodes = [await pool.add("decode") for _ in range(2)]
    for fake in decodes:
        fake.behavior.delay = 0.01
    config = {"prefill": [pool.url(f) for f in prefills], "decode": [pool.url(f) for f in decodes],
              "health": {"interval": 0.1, "unhealthy_threshold": 2}, "admin_token": TOKEN}
    victim = decodes[0]
    async with serve_router(**config) as (url, _), httpx.AsyncClient(timeout=10) as client:
        killed_at: list[float] = []

        async def client_loop() -> list[tuple[float, int]]:
            results = []
            for _ in range(40):
                started = time.monotonic()
                results.append((started, (await complete(client, url)).status_code))
            return results

        loops = [asyncio.create_task(client_loop()) for _ in range(4)]
        await victim.until(lambda seen: len(seen) >= 5)
        await pool.kill(victim)
        killed_at.append(time.monotonic())
        await until(lambda: _healthy_is(client, url, pool.url(victim), False),
                    "the killed D marked down", timeout=5.0)
        down_after = time.monotonic() - killed_at[0]
        results = [r for loop in loops for r in await loop]
    after_kill = [status for started, status in results if started > killed_at[0]]
    assert after_kill and set(after_kill) == {200}, after_kill
    assert down_after < 2.0, f"marked down {down_after:.2f} s after the kill"


async def _healthy_is(client: httpx.AsyncClient, url: str, server: str, healthy: bool) -> bool:
    listing = (await client.get(f"{url}/admin/endpoints", headers=AUTH)).json()
    return any(e["url"] == server and e["healthy"] is healthy for e in listing["endpoints"])


async def test_auto_learns_that_pull_is_faster_when_pushes_are_slow(pool: Pool) -> None:
    p, d = await pool.add("prefill"), await pool.add("decode")
    d.behavior.push_delay = 0.05  # every push waits 50 ms more than a pull
    config = {"prefill": [pool.url(p)], "decode": [pool.url(d)], "mode": "auto",
              "auto": {"min_samples": 4, "explore": 0.0}, "admin_token": TOKEN}
    async with serve_router(**config) as (url, _), httpx.AsyncClient(timeout=10) as client:
        modes = []
        for _ in range(20):
            r = await complete(client, url, stream=True)
            assert r.status_code == 200, r.text
            modes.append(r.headers["x-kv-transfer-mode"])
        learning, learned = modes[:8], modes[8:]
        assert sorted(learning) == ["pull"] * 4 + ["push"] * 4, modes
        assert learned == ["pull"] * 12, modes

        metrics = (await client.get(f"{url}/metrics")).text
        assert 'pdproxy_auto_mode_decisions_total{mode="pull",reason="auto_faster_pull"} 12.0' in metrics
        snapshot = (await client.get(f"{url}/admin/auto", headers=AUTH)).json()
        first = {row["mode"]: row for row in snapshot["buckets"] if row["bucket"] == 0}
        assert first["push"]["avg_ms"] > first["pull"]["avg_ms"] + 30


async def test_the_router_learns_whether_a_push_goes_layer_by_layer(pool: Pool) -> None:
    """auto.push_layers: learn, in push mode: pushes take turns whole and by layer, then
    the faster way (here by layer: D waits 50 ms less for it) gets every push whose
    client did not say; P's leg carries the choice, the answer says it; a client's
    X-KV-Push-Layers wins and teaches nothing."""
    p, d = await pool.add("prefill"), await pool.add("decode")
    d.behavior.push_delay, d.behavior.layered_push_delay = 0.05, 0.0
    config = {"prefill": [pool.url(p)], "decode": [pool.url(d)], "mode": "push",
              "auto": {"min_samples": 3, "explore": 0.0, "push_layers": "learn"},
              "admin_token": TOKEN}
    async with serve_router(**config) as (url, _), httpx.AsyncClient(timeout=10) as client:
        said = []
        for _ in range(12):
            r = await complete(client, url, stream=True)
            assert r.status_code == 200, r.text
            assert r.headers["x-kv-transfer-mode"] == "push"
            said.append(r.headers["x-kv-push-layers"])
        assert said[:6] == ["off", "on"] * 3, said
        assert said[6:] == ["on"] * 6, said
        def pushes() -> list[dict[str, Any]]:
            return [s.body["kv_transfer_params"] for s in p.seen
                    if s.body.get("kv_transfer_params", {}).get("transfer_id")]

        assert [params["push_layers"] for params in pushes()] == [v == "on" for v in said]

        r = await client.post(f"{url}/v1/completions", headers={"X-KV-Push-Layers": "off"},
                              json={"model": "fake-model", "max_tokens": 2, "prompt": "hi",
                                    "stream": True})
        assert r.status_code == 200 and "x-kv-push-layers" not in r.headers
        assert pushes()[-1]["push_layers"] is False

        metrics = (await client.get(f"{url}/metrics")).text
        assert ('pdproxy_push_layers_decisions_total{layers="on",reason="layers_faster_on"} 6.0'
                in metrics)
        assert 'pdproxy_push_layers_decisions_total{layers="off",reason="layers_learning"} 3.0' in metrics
        snapshot = (await client.get(f"{url}/admin/auto", headers=AUTH)).json()
        first = {row["layers"]: row for row in snapshot["push_layers"] if row["bucket"] == 0}
        assert first[True]["samples"] == 9 and first[False]["samples"] == 3
        assert first[False]["avg_ms"] > first[True]["avg_ms"] + 30


async def test_auto_never_learns_from_a_pair_that_cannot_push(pool: Pool) -> None:
    p, d = await pool.add("prefill"), await pool.add("decode")
    config = {"prefill": [pool.url(p)],
              "decode": [{"url": pool.url(d), "transfer_modes": ["pull"]}], "mode": "auto"}
    async with serve_router(**config) as (url, _), httpx.AsyncClient(timeout=10) as client:
        for _ in range(4):
            r = await complete(client, url, stream=True)
            assert r.headers["x-kv-transfer-mode"] == "pull"
        metrics = (await client.get(f"{url}/metrics")).text
        assert 'reason="auto_pair_cannot_push"} 4.0' in metrics
        push_legs = [s for s in d.seen if (s.body.get("kv_transfer_params") or {}).get("transfer_id")]
        assert push_legs == []
