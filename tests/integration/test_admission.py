"""Who gets in: client API keys on the inference routes, the in-flight limit that sheds
load, and the admin API's refused logins, on fake backends."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import pytest

from proxy.api.app import create_app
from proxy.config import Limits, build_config
from tests.conftest import serve_router, until
from tests.integration.conftest import Pair

BODY = {"model": "fake-model", "prompt": "hello", "max_tokens": 3}


def config(pair: Pair, **extra: Any) -> dict[str, Any]:
    return {"prefill": [pair.p_url], "decode": [pair.d_url], **extra}


async def test_over_max_in_flight_a_request_gets_503_with_retry_after(pair: Pair) -> None:
    pair.decode.behavior.delay = 1.0  # D holds each request a second
    async with serve_router(**config(pair, limits={"max_in_flight": 2})) as (url, app), \
            httpx.AsyncClient(base_url=url, timeout=10) as client:
        held = [asyncio.create_task(client.post("/v1/completions", json=BODY)) for _ in range(2)]
        await until(lambda: app.in_flight == 2, "two requests in flight")
        r = await client.post("/v1/completions", json=BODY)
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "service_unavailable"
        assert "max_in_flight" in r.json()["error"]["message"]
        assert [t.status_code for t in await asyncio.gather(*held)] == [200, 200]
        assert app.in_flight == 0
        assert (await client.post("/v1/completions", json=BODY)).status_code == 200
        metrics = (await client.get("/metrics")).text
    assert 'pdproxy_rejected_total{reason="max_in_flight"} 1.0' in metrics
    assert "pdproxy_requests_in_flight 0.0" in metrics
    assert len(pair.decode.seen) == 3, "the refused request reached no server"


async def test_by_default_max_in_flight_is_twice_the_upstream_connections(pair: Pair) -> None:
    pair.decode.behavior.delay = 1.0  # D holds each request a second
    async with serve_router(**config(pair, limits={"max_connections": 2})) as (url, app), \
            httpx.AsyncClient(base_url=url, timeout=20) as client:
        # two on D's connections, two waiting for one (within timeouts.pool)
        held = [asyncio.create_task(client.post("/v1/completions", json=BODY)) for _ in range(4)]
        await until(lambda: app.in_flight == 4, "four requests in flight")
        r = await client.post("/v1/completions", json=BODY)
        assert r.status_code == 503, r.text
        assert "(limits.max_in_flight: 4)" in r.json()["error"]["message"]
        assert [t.status_code for t in await asyncio.gather(*held)] == [200] * 4


def test_the_in_flight_cap_follows_the_connection_limit() -> None:
    assert Limits().in_flight_cap == 2 * Limits().max_connections == 2048
    assert Limits(max_connections=10).in_flight_cap == 20
    assert Limits(max_connections=0).in_flight_cap == 0, "no connection limit: no cap"
    assert Limits(max_connections=10, max_in_flight=3).in_flight_cap == 3
    assert Limits(max_in_flight=0).in_flight_cap == 0, "0: no limit, as configured"


async def test_client_api_keys_guard_the_inference_routes(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SECOND_CLIENT_KEY", "key-two")
    keys = {"auth": {"client_api_keys": ["key-one", "env:SECOND_CLIENT_KEY"]}}
    async with serve_router(**config(pair, **keys)) as (url, _app), \
            httpx.AsyncClient(base_url=url, timeout=10) as client:
        missing = await client.post("/v1/completions", json=BODY)
        wrong = await client.post("/v1/chat/completions", headers={"Authorization": "Bearer x"},
                                  json={"model": "fake-model", "max_tokens": 2,
                                        "messages": [{"role": "user", "content": "hi"}]})
        models = await client.get("/v1/models")
        right = await client.post("/v1/completions", json=BODY,
                                  headers={"Authorization": "Bearer key-two"})
        listed = await client.get("/v1/models", headers={"Authorization": "Bearer key-one"})
        health = await client.get("/health")
        metrics = (await client.get("/metrics")).text
    for refused in (missing, wrong, models):
        assert refused.status_code == 401, refused.text
        assert refused.json()["error"]["type"] == "authentication_error"
        assert refused.headers["www-authenticate"] == "Bearer"
    assert right.status_code == 200 and listed.status_code == 200
    assert health.status_code == 200, "health stays open for load balancers' probes"
    assert 'pdproxy_rejected_total{reason="unauthorized"} 3.0' in metrics
    assert len(pair.decode.seen) == 1


async def test_client_api_keys_from_the_environment(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDPROXY_CLIENT_API_KEYS", "alpha, beta")
    async with serve_router(**config(pair)) as (url, _app), \
            httpx.AsyncClient(base_url=url, timeout=10) as client:
        refused = await client.post("/v1/completions", json=BODY)
        served = await client.post("/v1/completions", json=BODY,
                                   headers={"Authorization": "Bearer beta"})
    assert (refused.status_code, served.status_code) == (401, 200)


async def test_the_router_says_at_start_whether_clients_need_a_key(
    pair: Pair, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("PDPROXY_CLIENT_API_KEYS", raising=False)
    with caplog.at_level(logging.INFO, logger="pdproxy.app"):
        async with serve_router(**config(pair, auth={"client_api_keys": ["key-one"]})):
            pass
        async with serve_router(**config(pair)):
            pass
    said = [(r.levelname, r.getMessage()) for r in caplog.records
            if r.name == "pdproxy.app" and "client API keys" in r.getMessage()]
    assert [level for level, _ in said] == ["INFO", "WARNING"], said
    assert "/v1/completions, /v1/chat/completions and /v1/models need one" in said[0][1]
    assert "open to every client" in said[1][1]


def test_a_client_key_gone_blank_after_the_config_was_read_stops_the_start(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The keys are read again when the app is built: blank by then, it does not start
    open."""
    monkeypatch.setenv("PDPROXY_CLIENT_API_KEYS", "alpha")
    monkeypatch.setenv("CLIENT_KEY_VARIABLE", "beta")
    from_variable = build_config(config(pair), {})
    in_auth = build_config(config(pair, auth={"client_api_keys": ["env:CLIENT_KEY_VARIABLE"]}), {})
    monkeypatch.setenv("PDPROXY_CLIENT_API_KEYS", " , ")
    monkeypatch.setenv("CLIENT_KEY_VARIABLE", "")
    with pytest.raises(ValueError, match="PDPROXY_CLIENT_API_KEYS has an empty key"):
        create_app(from_variable)
    with pytest.raises(ValueError, match="auth.client_api_keys has an empty key"):
        create_app(in_auth)


async def test_failed_admin_logins_are_logged_and_counted(
    pair: Pair, caplog: pytest.LogCaptureFixture
) -> None:
    async with serve_router(**config(pair, admin_token="the-admin-token")) as (url, _app), \
            httpx.AsyncClient(base_url=url, timeout=10) as client:
        with caplog.at_level(logging.WARNING, logger="pdproxy.admin"):
            bad = await client.get("/admin/endpoints", headers={"Authorization": "Bearer no"})
            none = await client.get("/admin/endpoints")
        good = await client.get("/admin/endpoints",
                                headers={"Authorization": "Bearer the-admin-token"})
        metrics = (await client.get("/metrics")).text
    assert (bad.status_code, none.status_code, good.status_code) == (401, 401, 200)
    assert "pdproxy_admin_auth_failures_total 2.0" in metrics
    refusals = [r.getMessage() for r in caplog.records if r.name == "pdproxy.admin"]
    assert len(refusals) == 2 and "127.0.0.1" in refusals[0] and "wrong token" in refusals[0]


async def test_upstreams_started_with_an_api_key_get_it_on_every_call(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P's key from the cluster setting, D's from its own entry (via the environment):
    model lists (control lane) and both legs pass vLLM's --api-key check."""
    pair.prefill.api_key, pair.decode.api_key = "p-key", "d-key"
    monkeypatch.setenv("TEST_D_KEY", "d-key")
    settings = {"prefill": [pair.p_url], "decode": [{"url": pair.d_url, "api_key": "env:TEST_D_KEY"}],
                "auth": {"prefill_api_key": "p-key"}}
    async with serve_router(**settings) as (url, _app), \
            httpx.AsyncClient(base_url=url, timeout=10) as client:
        listed = await client.get("/v1/models")
        r = await client.post("/v1/completions", json=BODY)
    assert listed.status_code == 200 and [m["id"] for m in listed.json()["data"]] == ["fake-model"]
    assert r.status_code == 200, r.text
    assert pair.prefill.seen[0].headers["authorization"] == "Bearer p-key"
    assert pair.decode.seen[0].headers["authorization"] == "Bearer d-key"
    assert pair.prefill.refused_keys == pair.decode.refused_keys == 0


async def test_no_upstream_connection_free_in_time_gives_503_not_silence(pair: Pair) -> None:
    """One upstream connection, held by a slow answer: the next request waits at most
    timeouts.pool for one, then gets 503 with Retry-After (counted), and the router
    serves again once the slot is free."""
    pair.decode.behavior.delay = 1.5
    settings = config(pair, limits={"max_connections": 1}, timeouts={"pool": 0.3, "health": 10.0})
    async with serve_router(**settings) as (url, app), \
            httpx.AsyncClient(base_url=url, timeout=10) as client:
        held = asyncio.create_task(client.post("/v1/completions", json=BODY))
        await pair.decode.until(lambda seen: len(seen) == 1)
        r = await client.post("/v1/completions", json=BODY)
        answered_while_held = not held.done()
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] == "1"
        assert "limits.max_connections=1" in r.json()["error"]["message"]
        assert answered_while_held, "the 503 came before the held request freed its connection"
        assert (await held).status_code == 200
        pair.decode.behavior.delay = 0
        assert (await client.post("/v1/completions", json=BODY)).status_code == 200
        metrics = (await client.get("/metrics")).text
    assert 'pdproxy_rejected_total{reason="pool_timeout"} 1.0' in metrics
    assert app.state.router.decode.in_flight() == 0
