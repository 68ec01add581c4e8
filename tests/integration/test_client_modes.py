"""Which modes a client may force with X-KV-Transfer-Mode (`client_modes`), and the ITL
budget on every local request: a mode the operator did not allow is a 400 naming the
allowed ones, before any server is called; a local request on a D over its inter-token
latency budget runs as a pull."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.cli import build_parser
from proxy.serve import load_config
from tests.conftest import serve_router
from tests.integration.conftest import Pair

HEADER = "X-KV-Transfer-Mode"


def body(stream: bool = False) -> dict[str, Any]:
    return {"model": "fake-model", "prompt": "hello there", "max_tokens": 4, "stream": stream}


def metric(text: str, name: str, **labels: str) -> float:
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


async def test_local_is_refused_by_default_with_a_400_naming_the_allowed_modes(pair: Pair) -> None:
    async with serve_router(prefill=[pair.p_url], decode=[pair.d_url]) as (url, _), \
            httpx.AsyncClient(base_url=url, timeout=10) as client:
        r = await client.post("/v1/completions", json=body(), headers={HEADER: "local"})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == HEADER
        assert "local is not allowed" in error["message"]
        assert "pull, push, auto (client_modes)" in error["message"]
        assert pair.prefill.seen == [] and pair.decode.seen == [], "no server was called"
        # the modes allowed by default are served
        for mode in ("pull", "push", "auto"):
            r = await client.post("/v1/completions", json=body(), headers={HEADER: mode})
            assert r.status_code == 200, (mode, r.text)


async def test_client_modes_say_what_a_client_may_ask_for(pair: Pair) -> None:
    config = {"prefill": [pair.p_url], "decode": [pair.d_url], "mode": "push",
              "client_modes": ["pull", "local"]}
    async with serve_router(**config) as (url, _), \
            httpx.AsyncClient(base_url=url, timeout=10) as client:
        for mode in ("auto", "push", "pull", "local"):
            r = await client.post("/v1/completions", json=body(), headers={HEADER: mode})
            if mode == "auto":
                assert r.status_code == 400, r.text
                assert "a client may ask for pull, local (client_modes)" in r.text
                assert "the router's mode (push)" in r.text
                continue
            # allowed, or the router's own mode
            assert r.status_code == 200, (mode, r.text)
            assert r.headers["x-kv-transfer-mode"] == mode


async def test_no_client_mode_at_all(pair: Pair) -> None:
    config = {"prefill": [pair.p_url], "decode": [pair.d_url], "client_modes": []}
    async with serve_router(**config) as (url, _), \
            httpx.AsyncClient(base_url=url, timeout=10) as client:
        r = await client.post("/v1/completions", json=body(), headers={HEADER: "push"})
        assert r.status_code == 400 and "a client may ask for no mode" in r.text, r.text
        r = await client.post("/v1/completions", json=body(), headers={HEADER: "pull"})
        assert r.status_code == 200, r.text  # the router's own mode


@pytest.mark.parametrize("asked_by", ["client", "config"])
async def test_a_local_request_on_a_d_over_its_itl_budget_runs_as_a_pull(
        pair: Pair, asked_by: str) -> None:
    config: dict[str, Any] = {"prefill": [pair.p_url], "decode": [pair.d_url]}
    if asked_by == "client":
        config["client_modes"] = ["pull", "push", "local"]
        headers = {HEADER: "local"}
    else:
        config["mode"] = "local"
        headers = {}
    async with serve_router(**config) as (url, app), \
            httpx.AsyncClient(base_url=url, timeout=10) as client:
        router = app.state.router
        (decode,) = router.decode.endpoints
        # Within budget, or not measured yet: local, D alone.
        r = await client.post("/v1/completions", json=body(stream=True), headers=headers)
        assert r.status_code == 200 and r.headers["x-kv-transfer-mode"] == "local", r.text
        assert pair.prefill.seen == []
        # D's recent inter-token latency at twice its clean one, over the 1.25 budget.
        streams = router.local_budget.of(decode)
        streams.clean_itl, streams.recent_itl = 0.010, 0.020
        r = await client.post("/v1/completions", json=body(), headers=headers)
        assert r.status_code == 200, r.text
        assert r.headers["x-kv-transfer-mode"] == "pull"
        assert r.headers["x-kv-transfer-mode-reason"] == "itl_budget"
        assert len(pair.prefill.seen) == 1, "P computed the prompt"
        text = (await client.get("/metrics")).text
        assert metric(text, "pdproxy_mode_fallbacks_total", requested="local", used="pull",
                      reason="itl_budget") == 1
        # Back within budget: local again.
        streams.recent_itl = 0.011
        r = await client.post("/v1/completions", json=body(), headers=headers)
        assert r.headers["x-kv-transfer-mode"] == "local", r.text
        assert len(pair.prefill.seen) == 1


def test_the_cli_sets_client_modes() -> None:
    args = build_parser().parse_args(["serve", "--prefill", "http://127.0.0.1:9", "--decode",
                                      "http://127.0.0.1:10", "--client-modes", "pull, LOCAL"])
    assert [m.value for m in load_config(args).client_modes] == ["pull", "local"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--client-modes", "pull,sideways"])
