"""Graceful shutdown: on SIGTERM the router stops taking requests, lets the running ones
finish (within `shutdown_grace`), and exits cleanly."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import httpx

from testbed.ports import free_port
from tests.integration.conftest import Pair

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


async def test_the_admin_api_on_its_own_listener(pair: Pair, tmp_path: object) -> None:
    """admin_listen: /admin is served there only (404 on the public port), with the
    token; SIGTERM stops both listeners."""
    import pathlib

    assert isinstance(tmp_path, pathlib.Path)
    port, admin_port = free_port(), free_port()
    config = tmp_path / "router.yaml"
    config.write_text(f"prefill: [{pair.p_url}]\ndecode: [{pair.d_url}]\nport: {port}\n"
                      f"admin_token: t0ken\nadmin_listen: 127.0.0.1:{admin_port}\n"
                      "log_level: warning\n")
    router = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "serve", "--config", str(config), cwd=REPO)
    auth = {"Authorization": "Bearer t0ken"}
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            async with asyncio.timeout(20):
                while True:  # bounded by the timeout above
                    try:
                        admin = await client.get(f"http://127.0.0.1:{admin_port}/admin/endpoints",
                                                 headers=auth)
                        break
                    except httpx.TransportError:
                        await asyncio.sleep(0.1)
            public = await client.get(f"http://127.0.0.1:{port}/admin/endpoints", headers=auth)
            refused = await client.get(f"http://127.0.0.1:{admin_port}/admin/endpoints")
            assert admin.status_code == 200, admin.text
            assert {e["url"] for e in admin.json()["endpoints"]} == {pair.p_url, pair.d_url}
            assert public.status_code == 404
            assert refused.status_code == 401
            metrics = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
            assert "pdproxy_admin_auth_failures_total 1.0" in metrics
            router.send_signal(signal.SIGTERM)
            async with asyncio.timeout(10):
                assert await router.wait() in (0, -signal.SIGTERM)
    finally:
        if router.returncode is None:
            router.kill()
            await router.wait()
