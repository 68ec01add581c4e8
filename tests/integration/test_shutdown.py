"""Graceful shutdown: on SIGTERM the router stops taking requests, lets the running ones
finish (within `shutdown_grace`), and exits cleanly."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys

import httpx

from tests.integration.conftest import Pair

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_sigterm_lets_a_running_stream_finish(pair: Pair) -> None:
    pair.decode.behavior.tokens = 10
    pair.decode.behavior.token_delay = 0.15
    port = free_port()
    router = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "serve", "--prefill", pair.p_url, "--decode", pair.d_url,
        "--port", str(port), "--log-level", "warning", cwd=REPO,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            async with asyncio.timeout(20):
                while True:  # bounded by the timeout above
                    try:
                        if (await client.get("/health")).status_code == 200:
                            break
                    except httpx.TransportError:
                        await asyncio.sleep(0.1)
            body = {"model": "fake-model", "prompt": "hi", "max_tokens": 10, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as r:
                lines = r.aiter_lines()
                first = await anext(lines)
                router.send_signal(signal.SIGTERM)  # mid-stream
                rest = [line async for line in lines]
            events = [x for x in [first, *rest] if x.startswith("data: ")]
            assert len(events) == 11 and events[-1] == "data: [DONE]", events
            async with asyncio.timeout(10):
                # uvicorn re-raises the signal once it has shut down gracefully.
                assert await router.wait() in (0, -signal.SIGTERM)
            try:
                await client.get("/health")
                raise AssertionError("the router still accepts connections after SIGTERM")
            except httpx.TransportError:
                pass
    finally:
        if router.returncode is None:
            router.kill()
            await router.wait()
