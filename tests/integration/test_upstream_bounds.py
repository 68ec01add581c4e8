"""A misbehaving upstream is bounded: a whole answer over `limits.max_upstream_body_bytes`
and an SSE event over `limits.max_upstream_event_bytes` are 502s counted by kind (the
router keeps no more of them); a P that says it has thousands of data-parallel ranks
costs at most `limits.max_dp_ranks` probes, a few at a time; and clients are told a
server's name, never its URL, unless `show_upstream_urls`, while the log keeps the URL."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from testbed.fake_vllm import MODEL, FakeVLLM
from tests.conftest import serve_router, until
from tests.integration.conftest import fake_pair
from tests.integration.fault_kit import router_config, serve

CAP = 64 * 1024  # the body and event caps in these tests


def metric(text: str, name: str, **labels: str) -> float:
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


class HugeDecode:
    """A D whose answers are too large: `body_bytes` of JSON object (announced with its
    Content-Length, or chunked), or a stream with one small event, then an event of
    `event_bytes` sent in 1 KiB pieces that never ends with a blank line."""

    def __init__(self) -> None:
        self.body_bytes = 4 * CAP
        self.chunked = False
        self.event_bytes = 16 * CAP
        self.first_event = True  # the stream starts with one small, whole event
        self.sent = 0  # bytes of the huge part written so far
        self.outcomes: list[str] = []
        self.app = web.Application()
        self.app.router.add_post("/v1/completions", self._infer)

    async def _infer(self, request: web.Request) -> web.StreamResponse:
        body = msgspec.json.decode(await request.read())
        try:
            if body.get("stream"):
                response = await self._stream(request)
            else:
                response = await self._whole(request)
        except (asyncio.CancelledError, ConnectionResetError, OSError):
            self.outcomes.append("cancelled")
            raise
        self.outcomes.append("ok")
        return response

    async def _whole(self, request: web.Request) -> web.StreamResponse:
        answer = msgspec.json.encode({"object": "text_completion", "model": MODEL,
                                      "choices": [{"index": 0, "text": "t0"}],
                                      "pad": "x" * self.body_bytes})
        headers = {"Content-Type": "application/json"}
        if not self.chunked:
            headers["Content-Length"] = str(len(answer))
        response = web.StreamResponse(headers=headers)
        if self.chunked:
            response.enable_chunked_encoding()
        await response.prepare(request)
        for start in range(0, len(answer), 1024):
            await response.write(answer[start:start + 1024])
            self.sent += 1024
        await response.write_eof()
        return response

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if self.first_event:
            await response.write(b'data: {"choices": [{"index": 0, "text": "t0"}]}\n\n')
        await response.write(b'data: {"choices": [{"index": 0, "text": "')
        while self.sent < self.event_bytes:
            await response.write(b"y" * 1024)
            self.sent += 1024
            await asyncio.sleep(0)
        await response.write(b'"}]}\n\ndata: [DONE]\n\n')
        await response.write_eof()
        return response


@pytest.fixture
async def huge() -> AsyncIterator[tuple[FakeVLLM, str, HugeDecode, str]]:
    p = FakeVLLM("prefill", engine_id="engine-p0", side_channel_port=5601)
    d = HugeDecode()
    p_runner, p_url = await serve(p.app)
    d_runner, d_url = await serve(d.app)
    try:
        yield p, p_url, d, d_url
    finally:
        await d_runner.cleanup()
        await p_runner.cleanup()


LIMITS = {"limits": {"max_upstream_body_bytes": CAP, "max_upstream_event_bytes": CAP}}


@pytest.mark.parametrize("chunked", [False, True], ids=["content_length", "chunked"])
async def test_a_whole_answer_over_the_body_cap_is_a_502(
        huge: tuple[FakeVLLM, str, HugeDecode, str], chunked: bool) -> None:
    _p, p_url, d, d_url = huge
    d.chunked = chunked
    async with serve_router(**router_config(p_url, d_url, **LIMITS)) as (url, _), \
            httpx.AsyncClient(base_url=url, timeout=10) as client:
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
        assert r.status_code == 502, r.text
        error = r.json()["error"]
        assert error["type"] == "upstream_error"
        assert "decode server 1 sent an answer larger than the router accepts" in error["message"]
        assert d_url.removeprefix("http://") not in r.text
        text = (await client.get("/metrics")).text
        assert metric(text, "pdproxy_upstream_errors_total", kind="body_too_large") == 1
        # what the router took of it stays near the cap (the connection was closed)
        assert d.sent <= CAP + 512 * 1024, d.sent
        # the answers of others still go through
        d.body_bytes = 100
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
        assert r.status_code == 200, r.text


async def test_an_event_over_the_event_cap_ends_the_stream_with_an_error_event(
        huge: tuple[FakeVLLM, str, HugeDecode, str]) -> None:
    _p, p_url, d, d_url = huge
    async with serve_router(**router_config(p_url, d_url, **LIMITS)) as (url, _), \
            httpx.AsyncClient(base_url=url, timeout=10) as client:
        r = await client.post("/v1/completions",
                              json={"model": MODEL, "prompt": "hi", "stream": True})
        assert r.status_code == 200  # the stream had started
        events = [e for e in r.text.split("\n\n") if e]
        assert events[0] == 'data: {"choices": [{"index": 0, "text": "t0"}]}'
        error = msgspec.json.decode(events[1].removeprefix("data: "))["error"]
        assert error["type"] == "upstream_error"
        assert "decode server 1 sent a stream event larger" in error["message"]
        assert events[2:] == ["data: [DONE]"]
        assert len(r.content) < 2048, "no part of the huge event reached the client"
        await until(lambda: d.outcomes == ["cancelled"], "D's stream closed by the router")
        assert d.sent < 2 * CAP, d.sent
        text = (await client.get("/metrics")).text
        assert metric(text, "pdproxy_upstream_errors_total", kind="event_too_large") == 1


async def test_a_first_event_over_the_cap_is_a_502(
        huge: tuple[FakeVLLM, str, HugeDecode, str]) -> None:
    _p, p_url, d, d_url = huge
    d.first_event = False
    async with serve_router(**router_config(p_url, d_url, **LIMITS)) as (url, _), \
            httpx.AsyncClient(base_url=url, timeout=10) as client:
        r = await client.post("/v1/completions",
                              json={"model": MODEL, "prompt": "hi", "stream": True})
        assert r.status_code == 502, r.text
        assert r.json()["error"]["type"] == "upstream_error"


async def test_a_p_saying_it_has_more_ranks_than_the_cap_costs_a_few_probes_at_a_time() -> None:
    async with fake_pair(dp_size=40, push_port=5700) as pair:
        pair.prefill.behavior.delay = 0.05  # probes overlap while they run
        config = {"prefill": [pair.p_url], "decode": [pair.d_url], "mode": "push",
                  "limits": {"max_dp_ranks": 8}}
        async with serve_router(**config) as (url, app), \
                httpx.AsyncClient(base_url=url, timeout=20) as client:
            (p,) = app.state.router.prefill.endpoints

            def probed() -> list[Any]:
                return [s for s in pair.prefill.seen
                        if s.body.get("kv_transfer_params", {}).get("probe")]

            await until(lambda: p.learned_ranks is not None and p.learned_ranks.missing() == [],
                        "the first 8 ranks learned", 10)
            assert p.learned_ranks.size == 8
            ranks = sorted(int(s.headers["x-data-parallel-rank"]) for s in probed())
            assert ranks == list(range(8)), ranks
            # at most 4 rank probes at once (after rank 0's)
            spans = [(s.arrived, s.finished or time.perf_counter()) for s in probed()]
            most = max(sum(1 for a, b in spans if a <= start < b) for start, _ in spans)
            assert most <= 4, most
            # requests run, pinned to the ranks used; answers of other ranks do no harm
            for _ in range(6):
                r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
                assert r.status_code == 200, r.text
            r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"},
                                  headers={"X-KV-Transfer-Mode": "pull"})
            assert r.status_code == 200, r.text
            assert len(probed()) == 8


@pytest.mark.parametrize("name", [None, "d-east"])
async def test_errors_name_the_server_not_its_url(
        name: str | None, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pdproxy.access")
    async with fake_pair() as pair:
        gone = "http://127.0.0.1:9"  # nothing listens there
        decode: dict[str, Any] = {"url": gone} if name is None else {"url": gone, "name": name}
        config = {"prefill": [pair.p_url], "decode": [decode], "models": [MODEL]}
        async with serve_router(**config) as (url, _), \
                httpx.AsyncClient(base_url=url, timeout=10) as client:
            r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert r.status_code == 502, r.text
    message = r.json()["error"]["message"]
    assert message == f"cannot connect to decode server {name or 1}"
    assert "127.0.0.1" not in r.text
    # the log keeps the URL and the transport's detail
    (line,) = [rec.getMessage() for rec in caplog.records if rec.name == "pdproxy.access"]
    assert f"error=\"cannot connect to decode server {gone} (" in line, line


async def test_show_upstream_urls_gives_clients_the_logs_text() -> None:
    async with fake_pair() as pair:
        config = {"prefill": [pair.p_url], "decode": ["http://127.0.0.1:9"], "models": [MODEL],
                  "show_upstream_urls": True}
        async with serve_router(**config) as (url, _), \
                httpx.AsyncClient(base_url=url, timeout=10) as client:
            r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert r.status_code == 502, r.text
    assert r.json()["error"]["message"].startswith(
        "cannot connect to decode server http://127.0.0.1:9 (")


async def test_a_servers_model_list_reaches_clients_only_within_bounds() -> None:
    """A server (or any pod with the selector's labels) answering /v1/models with
    thousands of cards, huge names or extra fields shows clients its first
    MAX_MODELS_PER_SERVER plain cards, with the OpenAI card's fields only."""
    from proxy.pool.models import MAX_MODEL_NAME_CHARS, MAX_MODELS_PER_SERVER

    cards: list[dict[str, Any]] = [
        {"id": MODEL, "object": "model", "owned_by": "vllm", "max_model_len": 1024,
         "secret": "leak", "permission": [{"id": "x" * 100_000}]},
        {"id": "n" * (MAX_MODEL_NAME_CHARS + 1), "object": "model"},
        *({"id": f"m{i}", "object": "model"} for i in range(5000)),
    ]

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": cards})

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="")

    async with fake_pair() as pair:
        app = web.Application()
        app.router.add_get("/v1/models", models)
        app.router.add_get("/health", health)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        flood_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:
            async with serve_router(prefill=[pair.p_url], decode=[flood_url]) as (url, _), \
                    httpx.AsyncClient(timeout=10) as client:
                listed = (await client.get(f"{url}/v1/models")).json()["data"]
        finally:
            await runner.cleanup()
    by_id = {card["id"]: card for card in listed}
    assert by_id[MODEL] == {"id": MODEL, "object": "model", "owned_by": "vllm",
                            "max_model_len": 1024}
    assert "n" * (MAX_MODEL_NAME_CHARS + 1) not in by_id
    from_flood = [name for name in by_id if name.startswith("m") and name[1:].isdigit()]
    assert len(from_flood) == MAX_MODELS_PER_SERVER - 2  # its first 256 cards, 2 of them above
