"""The floor router (`scripts.floor_router`), the benchmarks' yardstick for the least a
Python router spends on a pull: it must do a pull's work, or its figures mean nothing.
Real HTTP: the floor in its own process, aiohttp as P, D and the client."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from scripts.benchkit import process
from testbed.ports import free_port

P_PARAMS = {"remote_engine_id": "engine-0", "remote_block_ids": [[1, 2, 3]]}


@pytest.fixture
async def upstreams() -> AsyncIterator[tuple[str, str, list[dict[str, Any]], list[dict[str, Any]]]]:
    """A fake P and D that keep the bodies they were sent."""
    p_seen: list[dict[str, Any]] = []
    d_seen: list[dict[str, Any]] = []

    async def prefill(request: web.Request) -> web.Response:
        p_seen.append(await request.json())
        return web.json_response({"choices": [{"text": "p"}], "kv_transfer_params": P_PARAMS})

    async def decode(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        d_seen.append(body)
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": "from D"}]})
        answer = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await answer.prepare(request)
        for event in (b'data: {"text": "a"}\n\n', b'data: {"text": "b"}\n\n', b"data: [DONE]\n\n"):
            await answer.write(event)
        await answer.write_eof()
        return answer

    runners = []
    urls = []
    for handler in (prefill, decode):
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{port}")
    try:
        yield urls[0], urls[1], p_seen, d_seen
    finally:
        for runner in runners:
            await runner.cleanup()


@pytest.mark.parametrize("tasks", [False, True], ids=["callbacks", "tasks"])
async def test_the_floor_does_a_pulls_work(upstreams: tuple[str, str, list[dict[str, Any]], list[dict[str, Any]]],
                                           tasks: bool) -> None:
    p_url, d_url, p_seen, d_seen = upstreams
    port = free_port()
    command = [sys.executable, "-m", "scripts.floor_router", "--prefill", p_url,
               "--decode", d_url, "--port", str(port), *(["--tasks"] if tasks else [])]
    # started, and waited for until it listens (bounded), by the benchmarks' own helper
    with process(command, f"http://127.0.0.1:{port}", "the floor router"):
        url = f"http://127.0.0.1:{port}/v1/completions"
        async with aiohttp.ClientSession() as client:
            async with client.post(url, json={"prompt": "hi", "max_tokens": 5}) as answer:
                assert answer.status == 200
                assert await answer.json() == {"choices": [{"text": "from D"}]}
            async with client.post(url, json={"prompt": "hi", "max_tokens": 5,
                                              "stream": True}) as answer:
                assert answer.status == 200
                assert answer.headers["content-type"] == "text/event-stream"
                streamed = await answer.read()
        assert streamed == b'data: {"text": "a"}\n\ndata: {"text": "b"}\n\ndata: [DONE]\n\n'
        # P was asked for one token with the KV kept for D; D got P's kv_transfer_params
        assert [(b["max_tokens"], b["stream"], b["kv_transfer_params"]["do_remote_decode"])
                for b in p_seen] == [(1, False, True)] * 2
        assert [(b["max_tokens"], b.get("stream"), b["kv_transfer_params"]) for b in d_seen] \
            == [(5, None, P_PARAMS), (5, True, P_PARAMS)]
