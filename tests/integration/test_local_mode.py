"""The local mode against fake servers: a local request goes to D alone, with the
client's body as it is, also while every P is down; the answer, the metrics and the
access log say local; auto with `auto.local` learns local where it is fastest, and stops
choosing it while D's inter-token latency is over its budget."""

from __future__ import annotations

import collections
import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

import httpx
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from testbed.fake_vllm import Fabric, FakeVLLM, start
from tests.conftest import serve_router

TOKEN = "admin-token-for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LOCAL = {"X-KV-Transfer-Mode": "local"}
CLIENT_MODES = ["pull", "push", "auto", "local"]  # local is not a client's by default


class Servers:
    """Fake P and D servers on 127.0.0.1, each of which can be stopped."""

    def __init__(self, stack: AsyncExitStack) -> None:
        self.fabric = Fabric()
        self._stack = stack
        self._runners: dict[int, web.AppRunner] = {}
        self._urls: dict[int, str] = {}

    async def add(self, role: str) -> FakeVLLM:
        fake = FakeVLLM(role, engine_id=f"engine-{role}-{len(self._urls)}", fabric=self.fabric)
        runner, url = await start(fake)
        self._stack.push_async_callback(runner.cleanup)
        self._runners[id(fake)], self._urls[id(fake)] = runner, url
        return fake

    async def stop(self, fake: FakeVLLM) -> None:
        """Its port refuses connections from now on."""
        await self._runners[id(fake)].cleanup()

    def url(self, fake: FakeVLLM) -> str:
        return self._urls[id(fake)]


@pytest.fixture
async def servers() -> AsyncIterator[Servers]:
    async with AsyncExitStack() as stack:
        yield Servers(stack)


def body(stream: bool, tokens: int = 4) -> dict[str, Any]:
    return {"model": "fake-model", "prompt": "hello there", "max_tokens": tokens,
            "stream": stream}


def samples(metrics: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """One metric's samples from Prometheus text, by their sorted labels."""
    return {tuple(sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(metrics) for s in family.samples
            if s.name == name}


async def metrics_of(client: httpx.AsyncClient, url: str) -> str:
    return (await client.get(f"{url}/metrics")).text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_local_request_goes_to_d_alone_with_the_clients_body(
        servers: Servers, stream: bool, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pdproxy.access")
    p, d = await servers.add("prefill"), await servers.add("decode")
    config = {"prefill": [servers.url(p)], "decode": [servers.url(d)], "mode": "pull",
              "client_modes": CLIENT_MODES}
    async with serve_router(**config) as (url, _), httpx.AsyncClient(timeout=10) as client:
        sent = body(stream)
        r = await client.post(f"{url}/v1/completions", json=sent, headers=LOCAL)
        assert r.status_code == 200, r.text
        assert r.headers["x-kv-transfer-mode"] == "local"
        assert "x-kv-transfer-mode-reason" not in r.headers, "asked and used: no fallback"
        if stream:
            assert r.text.rstrip().endswith("data: [DONE]") and "t3" in r.text
        else:
            assert r.json()["choices"][0]["text"] == "t0 t1 t2 t3"
        assert p.seen == [], "P got nothing: no leg, no probe"
        assert [seen.body for seen in d.seen] == [sent], "D got the client's body, unchanged"
        assert "kv_transfer_params" not in d.seen[0].body
        metrics = await metrics_of(client, url)
    requests = samples(metrics, "pdproxy_requests_total")
    assert requests == {(("mode", "local"), ("route", "/v1/completions"), ("status", "200")): 1.0}
    ttfb = samples(metrics, "pdproxy_time_to_first_byte_seconds_count")
    assert ttfb == {(("mode", "local"),): 1.0}
    assert samples(metrics, "pdproxy_prefill_latency_seconds_count") == {}, "no P leg"
    lines = [r.getMessage() for r in caplog.records if r.name == "pdproxy.access"]
    assert len(lines) == 1 and " mode=local requested=local " in lines[0], lines


async def test_local_is_served_while_every_p_is_down_and_is_the_configured_default(
        servers: Servers) -> None:
    p, d = await servers.add("prefill"), await servers.add("decode")
    await servers.stop(p)
    # health checks on (a refused connection takes a server out only then), not due soon
    config = {"prefill": [servers.url(p)], "decode": [servers.url(d)], "mode": "local",
              "health": {"interval": 60}}
    async with serve_router(**config) as (url, _), httpx.AsyncClient(timeout=10) as client:
        # a pull finds P's port closed: P is taken out, and a pull has nowhere to go
        pulled = await client.post(f"{url}/v1/completions", json=body(False),
                                   headers={"X-KV-Transfer-Mode": "pull"})
        assert pulled.status_code in (502, 503), pulled.text
        again = await client.post(f"{url}/v1/completions", json=body(False),
                                  headers={"X-KV-Transfer-Mode": "pull"})
        assert again.status_code == 503 and "no healthy prefill server" in again.text
        # with no P, local still serves: the router reports itself healthy
        health = await client.get(f"{url}/health")
        assert health.status_code == 200, health.text
        assert health.json()["healthy"] == {"prefill": 0, "decode": 1}
        for stream in (False, True):
            r = await client.post(f"{url}/v1/completions", json=body(stream))  # no header
            assert r.status_code == 200, r.text
            assert r.headers["x-kv-transfer-mode"] == "local"
        assert len(d.seen) == 2 and all("kv_transfer_params" not in s.body for s in d.seen)
        requests = samples(await metrics_of(client, url), "pdproxy_requests_total")
    assert requests[("mode", "local"), ("route", "/v1/completions"), ("status", "200")] == 2.0


async def test_a_local_request_whose_d_refuses_is_retried_on_another_d(
        servers: Servers, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pdproxy.access")
    p = await servers.add("prefill")
    gone, d = await servers.add("decode"), await servers.add("decode")
    await servers.stop(gone)
    config = {"prefill": [servers.url(p)], "decode": [servers.url(gone), servers.url(d)],
              "balance": {"decode": "round_robin"}, "health": {"interval": 60},
              "client_modes": CLIENT_MODES}
    async with serve_router(**config) as (url, _), httpx.AsyncClient(timeout=10) as client:
        for stream in (True, False, True):
            r = await client.post(f"{url}/v1/completions", json=body(stream), headers=LOCAL)
            assert r.status_code == 200, r.text
            assert r.headers["x-kv-transfer-mode"] == "local"
        retries = samples(await metrics_of(client, url), "pdproxy_retries_total")
    assert retries == {(("cluster", "decode"), ("reason", "connect")): 1.0}
    assert len(d.seen) == 3 and p.seen == []
    # each request's legs, in the access log: the refused first try and its retry
    legs = [r.getMessage().split(" legs=")[1].split()[0]
            for r in caplog.records if r.name == "pdproxy.access"]
    assert legs == ["decode#1=failed,decode#2=done", "decode#1=done", "decode#1=done"]


AUTO_LOCAL: dict[str, Any] = {"mode": "auto", "admin_token": TOKEN,
              "auto": {"local": True, "min_samples": 2, "explore": 0.0, "smoothing": 0.5,
                       "local_itl_budget": 1.25, "bucket_edges": []}}


async def auto_request(client: httpx.AsyncClient, url: str, stream: bool = True) -> str:
    r = await client.post(f"{url}/v1/completions", json=body(stream))
    assert r.status_code == 200, r.text
    return r.headers["x-kv-transfer-mode"]


async def test_auto_learns_local_where_it_is_fastest_and_keeps_within_the_itl_budget(
        servers: Servers) -> None:
    p, d = await servers.add("prefill"), await servers.add("decode")
    p.behavior.delay = 0.05  # P's prompt: pull and push wait for it, local does not
    d.behavior.token_delay = 0.005
    config = {"prefill": [servers.url(p)], "decode": [servers.url(d)], **AUTO_LOCAL}
    async with serve_router(**config) as (url, app), httpx.AsyncClient(timeout=10) as client:
        learning = [await auto_request(client, url) for _ in range(6)]
        assert learning[:3] == ["push", "pull", "local"], learning
        assert sorted(learning) == ["local"] * 2 + ["pull"] * 2 + ["push"] * 2
        assert [await auto_request(client, url) for _ in range(4)] == ["local"] * 4
        assert p.seen[-1].body["prompt"] == "hello there"
        p_calls = len(p.seen)
        snapshot = (await client.get(f"{url}/admin/auto", headers=AUTH)).json()
        rows = {row["mode"]: row for row in snapshot["buckets"]}
        assert rows["local"]["samples"] == 6 and rows["local"]["avg_ms"] < rows["pull"]["avg_ms"]
        # one request at a time: every stream was clean, so recent and clean ITL agree
        router = app.state.router
        (itl,) = router.learner.local_budget.snapshot(router.decode.endpoints)
        assert snapshot["local_budget"]["decode"] == [itl]  # what the admin API shows
        assert snapshot["local_budget"]["ratio"] == AUTO_LOCAL["auto"]["local_itl_budget"]
        assert itl["decode"] == servers.url(d) and itl["within_budget"] is True
        assert itl["recent_itl_ms"] == itl["clean_itl_ms"] > 0, itl
        assert itl["local_prefills"] == 0

        # D's streams slow down while D computes a local prompt: a stream that runs
        # across one comes out at 10x the inter-token latency of the clean ones.
        d.behavior.token_delay = 0.05
        async with client.stream("POST", f"{url}/v1/completions", json=body(True, tokens=6),
                                 headers={"X-KV-Transfer-Mode": "pull"}) as slow:
            lines = slow.aiter_lines()
            assert (await anext(lines)).startswith("data: "), "the slow stream has begun"
            # a whole (unmeasured) auto request meanwhile: local, the learned fastest
            assert await auto_request(client, url, stream=False) == "local"
            async for _line in lines:
                pass
        d.behavior.token_delay = 0.005
        assert len(p.seen) == p_calls + 1, "P saw only the slow stream's pull"

        # over budget: auto gives local's requests to the next fastest mode, and every
        # stream is clean again, so D's recent ITL comes back and local resumes
        after = [await auto_request(client, url)]
        assert after[0] in ("pull", "push"), after
        while after[-1] != "local":
            assert len(after) < 20, f"local never resumed: {after}"
            after.append(await auto_request(client, url))
        assert len(after) >= 3, f"local resumed too soon for a 10x slower stream: {after}"
        metrics = await metrics_of(client, url)
    decisions = samples(metrics, "pdproxy_auto_mode_decisions_total")
    by_reason: dict[str, float] = collections.defaultdict(float)
    for labels, value in decisions.items():
        by_reason[dict(labels)["reason"]] += value
    assert by_reason["auto_learning"] == 6
    assert by_reason["auto_itl_budget"] == len(after) - 1, (by_reason, after)
    assert by_reason["auto_faster_local"] == 4 + 1 + 1
    requests = samples(metrics, "pdproxy_requests_total")
    assert requests[("mode", "local"), ("route", "/v1/completions"), ("status", "200")] == 2 + 4 + 1 + 1


async def test_auto_without_local_never_goes_local(servers: Servers) -> None:
    p, d = await servers.add("prefill"), await servers.add("decode")
    p.behavior.delay = 0.02
    config = {"prefill": [servers.url(p)], "decode": [servers.url(d)], "mode": "auto",
              "admin_token": TOKEN, "auto": {"min_samples": 2, "explore": 0.0}}
    async with serve_router(**config) as (url, _), httpx.AsyncClient(timeout=10) as client:
        modes = {await auto_request(client, url) for _ in range(6)}
        assert modes <= {"pull", "push"}
        snapshot = (await client.get(f"{url}/admin/auto", headers=AUTH)).json()
    assert {row["mode"] for row in snapshot["buckets"]} == {"pull", "push"}


async def test_auto_with_local_goes_local_when_no_p_is_to_be_had(servers: Servers) -> None:
    p, d = await servers.add("prefill"), await servers.add("decode")
    await servers.stop(p)
    config = {"prefill": [servers.url(p)], "decode": [servers.url(d)], **AUTO_LOCAL,
              "health": {"interval": 60}}
    async with serve_router(**config) as (url, _), httpx.AsyncClient(timeout=10) as client:
        # the first request may still try the P (not yet known down); then P is out
        first = await client.post(f"{url}/v1/completions", json=body(True))
        assert first.status_code in (200, 502, 503), first.text
        assert [await auto_request(client, url) for _ in range(3)] == ["local"] * 3
        decisions = samples(await metrics_of(client, url), "pdproxy_auto_mode_decisions_total")
    assert decisions[("mode", "local"), ("reason", "auto_no_prefill")] >= 3
