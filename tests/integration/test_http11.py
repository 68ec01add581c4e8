"""The upstream HTTP/1.1 client against a real server: reuse, chunked bodies, abandoning
a response closes its connection, backpressure on a slow reader, broken answers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httptools
import pytest
from aiohttp import web

from proxy.upstream.http11 import AnswerTooLarge, Client, ConnectFailed, ConnectionLost
from tests.conftest import until

BIG_CHUNK = b"x" * 65536


class Server:
    def __init__(self) -> None:
        self.peers: set[object] = set()  # one per TCP connection seen
        self.stream_finished: asyncio.Event = asyncio.Event()
        self.stream_aborted = asyncio.Event()
        self.chunks_written = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/json", self.json)
        app.router.add_get("/stream", self.stream)
        app.router.add_get("/cut", self.cut)
        app.router.add_get("/stall", self.stall)
        return app

    async def json(self, request: web.Request) -> web.Response:
        self.peers.add(request.transport)
        return web.json_response({"echo": (await request.read()).decode()})

    async def stream(self, request: web.Request) -> web.StreamResponse:
        self.peers.add(request.transport)
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        try:
            for _ in range(int(request.query.get("n", "3"))):
                await response.write(BIG_CHUNK if request.query.get("big") else b"data: x\n\n")
                self.chunks_written += 1
            await response.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            self.stream_aborted.set()
            raise
        self.stream_finished.set()
        return response

    async def cut(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Length": "100"})
        await response.prepare(request)
        await response.write(b"only part")
        assert request.transport is not None
        request.transport.close()
        return response


    async def stall(self, request: web.Request) -> web.StreamResponse:
        """A head and a first part at once, then nothing (until the client leaves)."""
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        await response.write(b"part")
        await asyncio.Event().wait()  # cancelled when the client leaves
        return response


@pytest.fixture
async def server() -> AsyncIterator[tuple[Server, str]]:
    state = Server()
    runner = web.AppRunner(state.app(), handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield state, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def fetch(client: Client, url: str, method: str = "GET", body: bytes = b"") -> tuple[int, bytes]:
    pool, path = client.pool(url)
    connection, response = await pool.request(method, path, body, {}, connect_timeout=5, timeout=30)
    try:
        await response.head
        return response.status, await response.read()
    finally:
        pool.release(connection, response)


async def test_keep_alive_reuses_one_connection(server: tuple[Server, str]) -> None:
    state, url = server
    client = Client()
    for i in range(5):
        status, body = await fetch(client, f"{url}/json", "POST", str(i).encode())
        assert status == 200 and body == b'{"echo": "%d"}' % i
    assert len(state.peers) == 1
    client.close()


async def test_chunked_body_is_decoded(server: tuple[Server, str]) -> None:
    _, url = server
    client = Client()
    status, body = await fetch(client, f"{url}/stream?n=3")
    assert status == 200 and body == b"data: x\n\n" * 3
    client.close()


async def test_abandoned_response_closes_its_connection(server: tuple[Server, str]) -> None:
    state, url = server
    client = Client()
    pool, path = client.pool(f"{url}/stream?n=100000&big=1")
    connection, response = await pool.request("GET", path, b"", {}, connect_timeout=5, timeout=30)
    await response.head
    await response.read_chunk()
    pool.release(connection, response)  # the caller gives up mid-answer
    assert connection.closed
    async with asyncio.timeout(5):
        await state.stream_aborted.wait()  # the server saw its client go
    client.close()


async def test_slow_reader_pauses_the_server(server: tuple[Server, str]) -> None:
    state, url = server
    client = Client()
    pool, path = client.pool(f"{url}/stream?n=400&big=1")  # 25 MiB if nobody pushed back
    connection, response = await pool.request("GET", path, b"", {}, connect_timeout=5, timeout=30)
    await response.head

    def server_paused() -> bool:
        """The server's transport holds more than its high-water mark: the kernel's
        buffers are full and the server's writes wait for the reader."""
        (transport,) = state.peers
        assert isinstance(transport, asyncio.WriteTransport)
        return transport.get_write_buffer_size() >= transport.get_write_buffer_limits()[1]

    await until(server_paused, "the server's writes wait for the reader")  # reading nothing
    assert state.chunks_written < 200, "the server kept writing into an unread connection"
    total = 0
    while chunk := await response.read_chunk():
        total += len(chunk)
    assert total == 400 * len(BIG_CHUNK)
    pool.release(connection, response)
    client.close()


async def test_cut_answer_and_refused_connection_raise(server: tuple[Server, str]) -> None:
    _, url = server
    client = Client()
    with pytest.raises((ConnectionLost, httptools.HttpParserError)):
        await fetch(client, f"{url}/cut")
    with pytest.raises(ConnectFailed):
        await fetch(client, "http://127.0.0.1:9/json")
    client.close()


async def test_at_the_cap_an_idle_connection_to_another_server_makes_room(
    server: tuple[Server, str]
) -> None:
    """Both slots hold idle keep-alive connections to server A: a request to server B
    closes one of them instead of waiting for A to drop it (a burst of P legs must not
    starve the D legs that follow)."""
    state_a, url_a = server
    other = Server()
    runner = web.AppRunner(other.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url_b = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    client = Client(max_connections=2)
    try:
        await asyncio.gather(*(fetch(client, f"{url_a}/json", "POST", b"a") for _ in range(2)))
        assert len(state_a.peers) == 2  # two connections, now idle in A's pool
        async with asyncio.timeout(2):
            status, body = await fetch(client, f"{url_b}/json", "POST", b"b")
        assert status == 200 and body == b'{"echo": "b"}'
        status, _ = await fetch(client, f"{url_a}/json", "POST", b"a")  # A still has one
        assert status == 200 and len(state_a.peers) == 2
    finally:
        client.close()
        await runner.cleanup()


async def test_a_forgotten_server_gives_back_its_slots_and_credentials(
    server: tuple[Server, str]
) -> None:
    """`forget` (a server that left): its connections close, their slots free, one opened after through its old pool closes when given back
    instead of idling where nobody reaches it, and a request after starts afresh, without
    its credentials."""
    state, url = server
    client = Client(max_connections=2)
    client.set_bearer_token(url, "s3cret")
    try:
        pool, path = client.pool(f"{url}/json")  # held, as by a request under way
        await fetch(client, f"{url}/json", "POST", b"idle")  # a connection, idle now
        assert client.slots.used == 1
        client.forget(url)
        assert client.slots.used == 0
        late, answer = await pool.request("POST", path, b"late", {}, connect_timeout=5,
                                          timeout=30)
        await answer.head
        assert await answer.read() == b'{"echo": "late"}'
        pool.release(late, answer)  # a whole answer: reusable, but not in a forgotten pool
        assert late.closed and client.slots.used == 0
        new, _ = client.pool(f"{url}/json")
        assert new is not pool and new.extra_headers == b""
    finally:
        client.close()


async def test_a_fetch_gets_the_whole_answer_and_frees_its_connection_at_once(
    server: tuple[Server, str]
) -> None:
    """`Pool.fetch`: the whole body (chunked or not), its headers, and the connection idle
    again by the time the caller wakes (nothing to release): the next fetch reuses it."""
    state, url = server
    client = Client()
    try:
        pool, path = client.pool(f"{url}/json")
        answer = await pool.fetch("POST", path, b"one", {}, connect_timeout=5, timeout=30,
                                  limit=1000)
        assert (answer.status, answer.body) == (200, b'{"echo": "one"}')
        assert answer.header(b"content-type") == "application/json; charset=utf-8"
        assert len(pool._idle) == 1
        stream_pool, stream_path = client.pool(f"{url}/stream?n=3")
        streamed = await stream_pool.fetch("GET", stream_path, b"", {}, connect_timeout=5,
                                           timeout=30, limit=1000)
        assert streamed.body == b"data: x\n\n" * 3
        again = await pool.fetch("POST", path, b"two", {}, connect_timeout=5, timeout=30,
                                 limit=1000)
        assert again.body == b'{"echo": "two"}' and len(state.peers) == 1
    finally:
        client.close()


async def test_a_fetch_over_its_limit_or_idle_too_long_fails_and_closes(
    server: tuple[Server, str]
) -> None:
    """A body over the fetch's limit is AnswerTooLarge as soon as it passes it, with a
    Content-Length or chunked; a body whose next part is later than `idle` times out.
    Each closes its connection (the server sees its client go)."""
    state, url = server
    client = Client()
    try:
        pool, path = client.pool(f"{url}/json")
        with pytest.raises(AnswerTooLarge, match="body over 20 bytes"):
            await pool.fetch("POST", path, b"x" * 50, {}, connect_timeout=5, timeout=30, limit=20)
        stream_pool, stream_path = client.pool(f"{url}/stream?n=100000&big=1")
        with pytest.raises(AnswerTooLarge, match="body over 100000 bytes"):
            await stream_pool.fetch("GET", stream_path, b"", {}, connect_timeout=5,
                                    timeout=30, limit=100_000)
        async with asyncio.timeout(5):
            await state.stream_aborted.wait()
        stall_pool, stall_path = client.pool(f"{url}/stall")
        async with asyncio.timeout(10):  # the test's own bound (a failure): the fetch's is 0.3 s
            with pytest.raises(TimeoutError):
                await stall_pool.fetch("GET", stall_path, b"", {}, connect_timeout=5,
                                       timeout=30, limit=1000, idle=0.3)
        assert client.slots.used == 0  # every connection above closed
    finally:
        client.close()
