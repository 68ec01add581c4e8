"""Clients that stop reading, or send their request too slowly, are cut at the listener
(proxy.api.listener), and what they held upstream is released; slow clients that still read
are not cut. Raw sockets with tiny receive buffers play the bad clients."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from proxy.api.app import create_app, serving
from proxy.api.listener import GuardedHttpProtocol, server_config
from proxy.config import build_config
from tests.conftest import until
from tests.integration.conftest import Pair

STALL = 1.0  # timeouts.client_stall in these tests
REQUEST = 1.0  # timeouts.client_request
BOUND = 10.0  # how long past its timeout a cut may take here (a shared, busy machine)
TINY_RCVBUF = 4096


@contextlib.asynccontextmanager
async def router(pair: Pair, **extra: Any) -> AsyncIterator[tuple[str, Any, Any]]:
    """The router with short client timeouts; yields (URL, app, uvicorn server)."""
    config = build_config({
        "prefill": [pair.p_url], "decode": [pair.d_url], "health": {"interval": 0},
        "timeouts": {"health": 10.0, "client_stall": STALL, "client_request": REQUEST},
        **extra,
    }, {})
    app = create_app(config)
    async with serving(app, name="stall-router", config=config) as (url, server):
        yield url, app, server


async def connect(url: str, *, rcvbuf: int | None = None) -> socket.socket:
    """A non-blocking client socket; `rcvbuf` is set before connecting, so the window the
    client offers stays that small."""
    parts = urlsplit(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    await asyncio.get_running_loop().sock_connect(sock, (parts.hostname, parts.port))
    return sock


def stream_request(tokens: int) -> bytes:
    body = (b'{"model": "fake-model", "prompt": "hi", "stream": true, "max_tokens": %d}'
            % tokens)
    return (b"POST /v1/completions HTTP/1.1\r\nHost: router\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (len(body), body))


async def small_send_buffer(server: uvicorn.Server) -> GuardedHttpProtocol:
    """The router's side of the one client connection, its socket's send buffer made
    small: on loopback the kernel would queue megabytes for the client before the
    router's own buffer fills, and a small buffer gets there at once. Made small before
    the client sends its request: set once the answer had begun, the kernel could already
    hold all of a short answer (450 KB), and the router would never wait on the client."""
    await until(lambda: server.server_state.connections, "the router's connection", BOUND)
    (protocol,) = server.server_state.connections
    assert isinstance(protocol, GuardedHttpProtocol)
    protocol.transport.get_extra_info("socket").setsockopt(
        socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
    return protocol


async def wait_closed_by_router(sock: socket.socket, within: float) -> bytes:
    """Read until the router closes or resets the connection (bounded); what it sent."""
    loop = asyncio.get_running_loop()
    received = bytearray()
    async with asyncio.timeout(within):
        while True:
            try:
                data = await loop.sock_recv(sock, 65536)
            except ConnectionResetError:
                return bytes(received)
            if not data:
                return bytes(received)
            received += data


async def metric(url: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` (with these labels) on the router's /metrics."""
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        text = (await client.get("/metrics")).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


async def until_metric(url: str, name: str, value: float, **labels: str) -> None:
    async def reached() -> bool:
        return await metric(url, name, **labels) == value

    await until(reached, f"{name}{labels or ''} at {value}", BOUND)


async def test_a_client_that_never_reads_is_cut_and_its_legs_released(pair: Pair) -> None:
    pair.decode.behavior.tokens = 100_000  # about 15 MB: far more than the buffers hold
    async with router(pair) as (url, _app, _server):
        sock = await connect(url, rcvbuf=TINY_RCVBUF)
        try:
            await asyncio.get_running_loop().sock_sendall(sock, stream_request(100_000))
            await pair.decode.until(lambda seen: len(seen) == 1, timeout=BOUND)
            # The client reads nothing: once the buffers fill, the router waits, then cuts.
            await pair.decode.until(
                lambda seen: seen[0].outcome == "cancelled", timeout=STALL + BOUND
            )
            await until_metric(url, "pdproxy_endpoint_in_flight", 0)
            assert await metric(url, "pdproxy_client_cuts_total", reason="stall") == 1
            assert await metric(url, "pdproxy_client_cuts_total", reason="slow_request") == 0
            await wait_closed_by_router(sock, BOUND)
        finally:
            sock.close()
        # The router still serves.
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            pair.decode.behavior.tokens = 3
            r = await client.post("/v1/completions", json={"model": "fake-model", "prompt": "x"})
            assert r.status_code == 200, r.text


async def test_a_slow_client_that_reads_is_not_cut(pair: Pair) -> None:
    tokens = 3000  # about 450 KB of events
    pair.decode.behavior.tokens = tokens
    async with router(pair) as (url, _app, server):
        sock = await connect(url, rcvbuf=TINY_RCVBUF)
        loop = asyncio.get_running_loop()
        received = bytearray()
        try:
            protocol = await small_send_buffer(server)
            await loop.sock_sendall(sock, stream_request(tokens))
            # the router waits on this client:
            await until(lambda: protocol.flow.write_paused, "writes paused", BOUND)
            # 2 KB every 100 ms for three times client_stall: the router's buffer stays
            # above its low-water mark all along (no resume_writing), yet every check
            # sees the client take bytes.
            for _ in range(int(3 * STALL / 0.1)):
                data = await loop.sock_recv(sock, 2048)
                assert data, "the router closed the connection of a client that reads"
                received += data
                await asyncio.sleep(0.1)
            async with asyncio.timeout(BOUND):  # then the rest, at full speed
                while not received.endswith(b"0\r\n\r\n"):
                    data = await loop.sock_recv(sock, 65536)
                    assert data, "the router closed the connection of a client that reads"
                    received += data
        finally:
            sock.close()
        assert received.startswith(b"HTTP/1.1 200 ")
        assert received.count(b"data: {") == tokens and b"data: [DONE]" in received
        assert await metric(url, "pdproxy_client_cuts_total") == 0
        await pair.decode.until(lambda seen: seen[0].outcome == "ok", timeout=BOUND)


async def test_a_client_that_reads_too_slowly_is_cut_and_its_legs_released(pair: Pair) -> None:
    pair.decode.behavior.tokens = 100_000  # about 15 MB: far more than the buffers hold
    rate = 64 * 1024  # limits.client_min_read_rate: the client reads about a quarter of it
    async with router(pair, limits={"client_min_read_rate": rate}) as (url, _app, server):
        sock = await connect(url, rcvbuf=TINY_RCVBUF)
        loop = asyncio.get_running_loop()
        try:
            protocol = await small_send_buffer(server)
            await loop.sock_sendall(sock, stream_request(100_000))
            await until(lambda: protocol.flow.write_paused, "writes paused", BOUND)
            # 4 KB every 250 ms: it reads, so it is no stall, but at 16 KB/s

            async def read_slowly() -> None:
                while True:
                    try:
                        data = await loop.sock_recv(sock, 4096)
                    except ConnectionResetError:
                        return
                    if not data:
                        return
                    await asyncio.sleep(0.25)

            async with asyncio.timeout(STALL + BOUND):
                await read_slowly()  # until the router cuts it
            await pair.decode.until(lambda seen: seen[0].outcome == "cancelled", timeout=BOUND)
            await until_metric(url, "pdproxy_endpoint_in_flight", 0)
            assert await metric(url, "pdproxy_client_cuts_total", reason="slow_read") == 1
            assert await metric(url, "pdproxy_client_cuts_total", reason="stall") == 0
        finally:
            sock.close()


async def test_a_client_that_sends_half_its_headers_is_cut(pair: Pair) -> None:
    async with router(pair) as (url, _app, _server):
        sock = await connect(url)
        try:
            head = stream_request(3).split(b"\r\n\r\n")[0]
            await asyncio.get_running_loop().sock_sendall(sock, head[: len(head) // 2])
            received = await wait_closed_by_router(sock, REQUEST + BOUND)
        finally:
            sock.close()
        assert received == b""  # cut, not answered
        assert await metric(url, "pdproxy_client_cuts_total", reason="slow_request") == 1
        assert pair.prefill.seen == [] and pair.decode.seen == []


async def test_a_client_that_sends_half_its_body_is_cut(pair: Pair) -> None:
    async with router(pair) as (url, _app, _server):
        sock = await connect(url)
        try:
            request = stream_request(3)
            await asyncio.get_running_loop().sock_sendall(sock, request[:-10])
            received = await wait_closed_by_router(sock, REQUEST + BOUND)
        finally:
            sock.close()
        assert received == b""
        assert await metric(url, "pdproxy_client_cuts_total", reason="slow_request") == 1
        assert pair.prefill.seen == [] and pair.decode.seen == []


async def test_a_connection_that_sends_nothing_is_closed(pair: Pair) -> None:
    async with router(pair) as (url, _app, _server):
        sock = await connect(url)
        try:
            # uvicorn's keep-alive timeout (5 s) also covers a connection's first request.
            received = await wait_closed_by_router(sock, 5 + BOUND)
        finally:
            sock.close()
        assert received == b""
        assert await metric(url, "pdproxy_client_cuts_total") == 0  # idle: closed, not cut


async def read_whole_answer(sock: socket.socket) -> bytes:
    """One whole (not streamed) answer's head and body, by its Content-Length."""
    loop = asyncio.get_running_loop()

    async def more() -> bytes:
        data = await loop.sock_recv(sock, 65536)
        assert data, "the router closed the connection before its answer was whole"
        return data

    received = b""
    async with asyncio.timeout(BOUND):
        while b"\r\n\r\n" not in received:
            received += await more()
        head, _, body = received.partition(b"\r\n\r\n")
        fields = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:])
        while len(body) < int(fields[b"content-length"]):
            body += await more()
    return head


async def test_an_idle_connection_is_closed_a_keep_alive_timeout_after_its_last_answer(
    pair: Pair,
) -> None:
    """The keep-alive timeout is one deadline per connection (not a timer per answer):
    it counts from the end of the connection's last answer."""
    keep_alive = 1.0
    config = build_config({"prefill": [pair.p_url], "decode": [pair.d_url],
                           "health": {"interval": 0}}, {})
    server = uvicorn.Server(server_config(create_app(config), config, host="127.0.0.1",
                                          port=0, log_level="warning", lifespan="on",
                                          timeout_keep_alive=keep_alive))
    task = asyncio.create_task(server.serve())
    try:
        await until(lambda: server.started, "the router started", BOUND)
        port = server.servers[0].sockets[0].getsockname()[1]
        sock = await connect(f"http://127.0.0.1:{port}")
        loop = asyncio.get_running_loop()
        body = b'{"model": "fake-model", "prompt": "hi", "max_tokens": 2}'
        request = (b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: "
                   b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        try:
            for _ in range(3):  # each within the timeout of the last answer, not the first
                await loop.sock_sendall(sock, request)
                assert (await read_whole_answer(sock)).startswith(b"HTTP/1.1 200")
                last_answer = loop.time()
                await asyncio.sleep(0.6 * keep_alive)
            assert await wait_closed_by_router(sock, keep_alive + BOUND) == b""
            assert loop.time() - last_answer >= 0.9 * keep_alive
        finally:
            sock.close()
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, BOUND)


async def test_the_cli_serves_through_the_same_listener(pair: Pair) -> None:
    config = build_config({
        "prefill": [pair.p_url], "decode": [pair.d_url], "port": 8123,
        "timeouts": {"client_stall": 7.0, "client_request": 3.0},
    }, {})
    uvicorn_config = server_config(create_app(config), config)
    protocol = uvicorn_config.http
    assert isinstance(protocol, type) and issubclass(protocol, GuardedHttpProtocol)
    assert (protocol.limits.client_stall, protocol.limits.client_request) == (7.0, 3.0)
    assert protocol.limits.client_min_read_rate == 1024  # the default
    assert (uvicorn_config.host, uvicorn_config.port, uvicorn_config.loop) == (
        "127.0.0.1", 8123, "uvloop")
