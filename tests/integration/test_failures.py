"""The failure rules: a failed leg cancels the other, a client that leaves cancels both,
P without kv_transfer_params is never a silent recompute, and nothing stays in flight."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from tests.conftest import serve_router
from tests.integration.conftest import Pair

BODY = {"model": "fake-model", "prompt": "hello", "max_tokens": 3}
PREFILL_COORDS = {"engine_id": "engine-p0", "side_channel_host": "127.0.0.1", "side_channel_port": 5601}


def push_config(pair: Pair, **extra: Any) -> dict[str, Any]:
    """Push mode with P's coordinates configured (no probe request to get in the way)."""
    return {"prefill": [{"url": pair.p_url, **PREFILL_COORDS}], "decode": [pair.d_url], "mode": "push", **extra}


def assert_openai_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    return error


def assert_nothing_in_flight(app: Any) -> None:
    router = app.state.router
    assert router.prefill.in_flight() == 0 and router.decode.in_flight() == 0


async def test_push_prefill_error_cancels_decode_at_once(pair: Pair) -> None:
    pair.prefill.behavior.delay = 0.2
    pair.prefill.behavior.fail_status = 500
    async with serve_router(**push_config(pair)) as (url, app):
        async with httpx.AsyncClient(base_url=url) as client:
            started = time.perf_counter()
            r = await client.post("/v1/completions", json=BODY)
            elapsed = time.perf_counter() - started
        await pair.decode.until(lambda seen: seen and seen[0].outcome == "cancelled")
        assert_nothing_in_flight(app)
    assert r.status_code == 500  # P's own status and body are relayed
    assert r.json()["error"]["message"] == "injected failure"
    assert elapsed < 5, "D must not be waited out (its push wait would be 30 s)"


async def test_push_prefill_connection_drop_gives_502_and_cancels_decode(pair: Pair) -> None:
    pair.prefill.behavior.drop_connection = True
    async with serve_router(**push_config(pair)) as (url, app):
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.post("/v1/completions", json={**BODY, "stream": True})
        await pair.decode.until(lambda seen: seen and seen[0].outcome == "cancelled")
        assert_nothing_in_flight(app)
    assert_openai_error(r, 502)


async def test_push_decode_error_cancels_prefill(pair: Pair) -> None:
    pair.prefill.behavior.delay = 10  # P still computing when D fails
    pair.decode.behavior.fail_status = 503
    async with serve_router(**push_config(pair)) as (url, app):
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.post("/v1/completions", json=BODY)
        await pair.prefill.until(lambda seen: seen and seen[0].outcome == "cancelled")
        assert_nothing_in_flight(app)
    assert r.status_code == 503


async def test_pull_prefill_failure_never_reaches_decode(pair: Pair) -> None:
    pair.prefill.behavior.fail_status = 400
    async with serve_router(prefill=[pair.p_url], decode=[pair.d_url]) as (url, app):
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.post("/v1/completions", json=BODY)
        assert_nothing_in_flight(app)
    assert r.status_code == 400
    assert pair.decode.seen == []


async def test_prefill_timeout_gives_504(pair: Pair) -> None:
    pair.prefill.behavior.hang = True
    async with serve_router(prefill=[pair.p_url], decode=[pair.d_url], timeouts={"prefill": 0.5}) as (url, app):
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.post("/v1/completions", json=BODY)
        await pair.prefill.until(lambda seen: seen[0].outcome == "cancelled")
        assert_nothing_in_flight(app)
    assert assert_openai_error(r, 504)["type"] == "timeout"


async def test_missing_kv_params_is_an_error_by_default(pair: Pair) -> None:
    pair.prefill.behavior.omit_kv_params = True
    async with serve_router(prefill=[pair.p_url], decode=[pair.d_url]) as (url, _):
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.post("/v1/completions", json=BODY)
            metrics = (await client.get("/metrics")).text
    assert "kv_transfer_params" in assert_openai_error(r, 502)["message"]
    assert pair.decode.seen == []
    assert 'pdproxy_missing_kv_transfer_params_total{action="error"} 1.0' in metrics


async def test_missing_kv_params_recompute_is_counted(pair: Pair) -> None:
    pair.prefill.behavior.omit_kv_params = True
    config = {"prefill": [pair.p_url], "decode": [pair.d_url], "missing_kv_params": "recompute"}
    async with serve_router(**config) as (url, _):
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.post("/v1/completions", json=BODY)
            metrics = (await client.get("/metrics")).text
    assert r.status_code == 200
    assert "kv_transfer_params" not in pair.decode.seen[0].body
    assert 'pdproxy_missing_kv_transfer_params_total{action="recompute"} 1.0' in metrics


async def test_garbage_from_prefill_gives_502(pair: Pair) -> None:
    pair.prefill.behavior.garbage = True
    async with serve_router(prefill=[pair.p_url], decode=[pair.d_url]) as (url, _):
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.post("/v1/completions", json=BODY)
    assert_openai_error(r, 502)


async def test_stream_cut_by_decode_ends_with_an_sse_error(pair: Pair) -> None:
    pair.decode.behavior.tokens = 6
    pair.decode.behavior.cut_stream_after = 2
    async with serve_router(prefill=[pair.p_url], decode=[pair.d_url]) as (url, app):
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.post("/v1/completions", json={**BODY, "max_tokens": 6, "stream": True})
        assert_nothing_in_flight(app)
    assert r.status_code == 200  # the head went out with the first token
    events = [line for line in r.text.splitlines() if line.startswith("data: ")]
    assert len(events) == 4  # two tokens, the error, [DONE]
    assert '"error"' in events[-2] and events[-1] == "data: [DONE]"


async def test_decode_unreachable_gives_502(pair: Pair) -> None:
    async with serve_router(prefill=[pair.p_url], decode=["http://127.0.0.1:9"]) as (url, app):
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.post("/v1/completions", json=BODY)
            metrics = (await client.get("/metrics")).text
        assert_nothing_in_flight(app)
    assert_openai_error(r, 502)
    assert 'pdproxy_upstream_errors_total{cluster="decode",endpoint="http://127.0.0.1:9",kind="connect"} 1.0' in metrics


@pytest.mark.parametrize("mode", ["pull", "push"])
async def test_client_leaving_during_prefill_cancels_the_legs(pair: Pair, mode: str) -> None:
    pair.prefill.behavior.delay = 30
    async with serve_router(**push_config(pair, mode=mode)) as (url, app):
        async with httpx.AsyncClient(base_url=url) as client:
            call = asyncio.create_task(client.post("/v1/completions", json=BODY))
            await pair.prefill.until(lambda seen: len(seen) == 1)
            if mode == "push":
                await pair.decode.until(lambda seen: len(seen) == 1)
            call.cancel()  # the client goes away
            await asyncio.gather(call, return_exceptions=True)
        await pair.prefill.until(lambda seen: seen[0].outcome == "cancelled")
        if mode == "push":
            await pair.decode.until(lambda seen: seen[0].outcome == "cancelled")
        else:
            assert pair.decode.seen == []
        await asyncio.sleep(0)  # let the router's response task account for the exchange
        assert_nothing_in_flight(app)


async def test_client_leaving_mid_stream_cancels_decode(pair: Pair) -> None:
    pair.decode.behavior.tokens = 50
    pair.decode.behavior.token_delay = 0.2
    async with serve_router(prefill=[pair.p_url], decode=[pair.d_url]) as (url, app):
        async with httpx.AsyncClient(base_url=url) as client:
            async with client.stream("POST", "/v1/completions", json={**BODY, "max_tokens": 50, "stream": True}) as r:
                async for _ in r.aiter_bytes():
                    break  # first token in: leave
        await pair.decode.until(lambda seen: seen[0].outcome == "cancelled")
        assert_nothing_in_flight(app)


@pytest.mark.parametrize("cluster", ["prefill", "decode"])
async def test_unreachable_server_is_replaced_before_any_byte(pair: Pair, cluster: str) -> None:
    dead = "http://127.0.0.1:9"  # nothing listens: the connection is refused
    config = {
        "prefill": [dead, pair.p_url] if cluster == "prefill" else [pair.p_url],
        "decode": [dead, pair.d_url] if cluster == "decode" else [pair.d_url],
    }
    async with serve_router(**config) as (url, app):
        async with httpx.AsyncClient(base_url=url) as client:
            rs = [await client.post("/v1/completions", json={**BODY, "stream": s}) for s in (False, True) * 2]
            metrics = (await client.get("/metrics")).text
        assert_nothing_in_flight(app)
    assert [r.status_code for r in rs] == [200] * 4
    alive = pair.prefill if cluster == "prefill" else pair.decode
    assert len(alive.seen) == 4
    # The dead server was tried (and replaced) at least once; ties are taken in turn.
    assert f'pdproxy_retries_total{{cluster="{cluster}",reason="connect"}}' in metrics
