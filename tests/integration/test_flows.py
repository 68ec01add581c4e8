"""Pull and push flows through the router against fake P/D servers."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.conftest import serve_router
from tests.integration.conftest import Pair

COMPLETION = {"model": "fake-model", "prompt": "hello there", "max_tokens": 3}
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def sse_texts(raw: str) -> list[str]:
    events = [line[len("data: "):] for line in raw.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return events[:-1]


@pytest.mark.parametrize("route,body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
@pytest.mark.parametrize("stream", [False, True])
async def test_pull_calls_p_then_d_with_p_params(
    pair: Pair, route: str, body: dict[str, object], stream: bool
) -> None:
    async with serve_router(prefill=[pair.p_url], decode=[pair.d_url]) as (url, _):
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.post(route, json={**body, "stream": stream}, headers={"X-Request-Id": "req-1"})
    assert r.status_code == 200, r.text
    assert r.headers["x-kv-transfer-mode"] == "pull"
    assert r.headers["x-request-id"] == "req-1"
    (p_seen,) = pair.prefill.seen
    (d_seen,) = pair.decode.seen
    # P: one token, not streamed, asked to keep the KV for a remote decode.
    assert p_seen.body["max_tokens"] == 1 and p_seen.body["stream"] is False
    assert p_seen.body["kv_transfer_params"]["do_remote_decode"] is True
    assert "transfer_id" not in p_seen.body["kv_transfer_params"]
    # D: only after P answered, with P's params unchanged and the client's own settings.
    assert p_seen.finished is not None and d_seen.arrived >= p_seen.finished
    assert d_seen.body["kv_transfer_params"]["remote_engine_id"] == "engine-p0"
    assert d_seen.body["kv_transfer_params"]["remote_block_ids"] == [[1, 2, 3]]
    assert d_seen.body["max_tokens"] == 3 and d_seen.body.get("stream", False) is stream
    assert p_seen.headers["x-request-id"] == d_seen.headers["x-request-id"] == "req-1"
    assert p_seen.headers["content-type"] == d_seen.headers["content-type"] == "application/json"
    if stream:
        assert len(sse_texts(r.text)) == 3
    else:
        assert r.json()["choices"][0]


@pytest.mark.parametrize("route,prefix", [("/v1/completions", "cmpl-"), ("/v1/chat/completions", "chatcmpl-")])
async def test_push_sends_both_legs_at_once(pair: Pair, route: str, prefix: str) -> None:
    pair.prefill.behavior.delay = 0.3  # P computes; D must already be waiting for the KV
    body = COMPLETION if route == "/v1/completions" else CHAT
    async with serve_router(prefill=[pair.p_url], decode=[pair.d_url], mode="push") as (url, _):
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.post(route, json=body, headers={"X-Request-Id": "abc"})
    assert r.status_code == 200, r.text
    assert r.headers["x-kv-transfer-mode"] == "push"
    probe, p_seen = pair.prefill.seen  # the router probed P's coordinates first
    assert probe.body["kv_transfer_params"]["do_remote_decode"] is True
    (d_seen,) = pair.decode.seen
    assert p_seen.finished is not None
    assert d_seen.arrived < p_seen.finished, "D must get its request while P still computes"
    p_params = p_seen.body["kv_transfer_params"]
    d_params = d_seen.body["kv_transfer_params"]
    assert p_params["transfer_id"] == d_params["transfer_id"]
    assert d_params["remote_engine_id"] == "engine-p0"
    assert d_params["remote_host"] == "127.0.0.1" and d_params["remote_port"] == 5601
    assert d_params["tp_size"] == 1 and d_params["do_remote_prefill"] is True
    assert d_params["remote_request_id"] == prefix + "abc"
    assert "remote_block_ids" not in d_params
    assert p_seen.headers["x-request-id"] == d_seen.headers["x-request-id"] == "abc"


async def test_header_overrides_configured_mode(pair: Pair) -> None:
    async with serve_router(prefill=[pair.p_url], decode=[pair.d_url], mode="pull") as (url, _):
        async with httpx.AsyncClient(base_url=url) as client:
            pushed = await client.post("/v1/completions", json=COMPLETION, headers={"X-KV-Transfer-Mode": "push"})
            auto = await client.post("/v1/completions", json=COMPLETION, headers={"X-KV-Transfer-Mode": "auto"})
            pulled = await client.post("/v1/completions", json=COMPLETION)
    assert [r.headers["x-kv-transfer-mode"] for r in (pushed, auto, pulled)] == ["push", "push", "pull"]


async def test_push_impossible_falls_back_to_pull_and_says_so(pair: Pair) -> None:
    pair.prefill.behavior.transfer_modes = ["pull"]
    async with serve_router(prefill=[pair.p_url], decode=[pair.d_url], mode="push") as (url, _):
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.post("/v1/completions", json=COMPLETION)
            metrics = (await client.get("/metrics")).text
    assert r.status_code == 200
    assert r.headers["x-kv-transfer-mode"] == "pull"
    assert r.headers["x-kv-transfer-mode-reason"] == "prefill_cannot_push"
    assert 'pdproxy_mode_fallbacks_total{reason="prefill_cannot_push",requested="push",used="pull"} 1.0' in metrics


async def test_configured_coordinates_need_no_probe(pair: Pair) -> None:
    prefill = [{"url": pair.p_url, "engine_id": "engine-p0", "side_channel_host": "127.0.0.1",
                "side_channel_port": 5601}]
    async with serve_router(prefill=prefill, decode=[pair.d_url], mode="push") as (url, _):
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.post("/v1/completions", json=COMPLETION)
    assert r.headers["x-kv-transfer-mode"] == "push"
    assert len(pair.prefill.seen) == 1, "no probe when the config names P's coordinates"


async def test_probe_is_done_once_and_refreshed_after_restart(pair: Pair) -> None:
    async with serve_router(prefill=[pair.p_url], decode=[pair.d_url], mode="push") as (url, app):
        async with httpx.AsyncClient(base_url=url) as client:
            for _ in range(3):
                assert (await client.post("/v1/completions", json=COMPLETION)).status_code == 200
            probes = [s for s in pair.prefill.seen if s.body.get("prompt") == "ping"]
            assert len(probes) == 1
            # P restarts with a new engine id: its next answer tells the router.
            pair.prefill.engine_id = "engine-p0-restarted"
            await client.post("/v1/completions", json=COMPLETION)
            await client.post("/v1/completions", json=COMPLETION)
    d_params = pair.decode.seen[-1].body["kv_transfer_params"]
    assert d_params["remote_engine_id"] == "engine-p0-restarted"


async def test_models_lists_upstream_models(pair: Pair) -> None:
    async with serve_router(prefill=[pair.p_url], decode=[pair.d_url]) as (url, _):
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.get("/v1/models")
            health = await client.get("/health")
    assert [m["id"] for m in r.json()["data"]] == ["fake-model"]
    assert health.status_code == 200


async def test_metrics_and_in_flight_return_to_zero(pair: Pair) -> None:
    async with serve_router(prefill=[pair.p_url], decode=[pair.d_url]) as (url, app):
        async with httpx.AsyncClient(base_url=url) as client:
            rs = await asyncio.gather(*(client.post("/v1/completions", json={**COMPLETION, "stream": s})
                                        for s in (True, False, True, False)))
            metrics = (await client.get("/metrics")).text
        router = app.state.router
        assert router.prefill.in_flight() == 0 and router.decode.in_flight() == 0
    assert [r.status_code for r in rs] == [200] * 4, [r.text for r in rs]
    assert 'pdproxy_requests_total{mode="pull",route="/v1/completions",status="200"} 4.0' in metrics
    assert "client_closed" not in metrics
    assert "pdproxy_prefill_latency_seconds_count" in metrics
    assert "pdproxy_time_to_first_byte_seconds_count" in metrics
