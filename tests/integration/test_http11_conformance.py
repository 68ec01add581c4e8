"""The upstream HTTP/1.1 client against a raw socket server that plays each case exactly
as scripted (often a byte at a time): interim answers, bytes nobody asked for, a body
ended by the close, oversized headers, a close in the middle of a chunk, a stale
keep-alive connection, a paused streamed answer, the connection cap's bounded wait, and
the control lane beside a full request lane."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from proxy.config import Limits, Timeouts
from proxy.errors import Overloaded, UpstreamError
from proxy.upstream import http11
from proxy.upstream.client import UpstreamClient
from tests.conftest import until

GUARD_S = 5.0  # a bound on every wait of these tests, far above what each should take


class Request:
    def __init__(self, line: str, headers: dict[str, str], body: bytes) -> None:
        self.method, self.path, _ = line.split(" ", 2)
        self.headers = headers
        self.body = body


class Peer:
    """The server's side of one connection, as a script sees it."""

    def __init__(self, server: RawServer, index: int, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.server = server
        self.index = index  # 0 for the first connection the server accepted, ...
        self.reader = reader
        self.writer = writer

    async def read_request(self) -> Request | None:
        """The next request, or None when the client closed the connection."""
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        line, *lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for header in filter(None, lines):
            name, value = header.split(":", 1)
            headers[name.strip().lower()] = value.strip()
        body = await self.reader.readexactly(int(headers.get("content-length", "0")))
        request = Request(line, headers, body)
        self.server.seen.append((self.index, request))
        return request

    async def send(self, data: bytes, *, piece: int = 0) -> None:
        """Write `data` at once, or `piece` bytes at a time (each flushed on its own)."""
        step = piece or len(data) or 1
        for start in range(0, len(data), step):
            self.writer.write(data[start:start + step])
            await self.writer.drain()
            if piece:
                await asyncio.sleep(0)

    async def answer(self, request: Request, body: bytes | None = None, **kw: int) -> None:
        """A plain keep-alive 200 with a Content-Length body (the path by default)."""
        body = request.path.encode() if body is None else body
        await self.send(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body), **kw)
        self.server.answered.append((self.index, request.path))

    async def serve(self) -> None:
        """Answer every request on this connection the plain way."""
        while (request := await self.read_request()) is not None:
            await self.answer(request)

    async def until_closed(self) -> None:
        """Wait (bounded) until the client closes the connection."""
        async with asyncio.timeout(GUARD_S):
            while await self.reader.read(65536):
                pass
        self.server.closed_by_client.append(self.index)


Script = Callable[[Peer], Awaitable[None]]


class RawServer:
    """A TCP server on 127.0.0.1 that runs `script` on each connection it accepts."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.seen: list[tuple[int, Request]] = []  # (connection index, request) as read
        self.answered: list[tuple[int, str]] = []  # (connection index, path) answered
        self.closed_by_client: list[int] = []
        self.url = ""
        self._server: asyncio.Server | None = None
        self._scripts: set[asyncio.Task[None]] = set()

    async def start(self) -> RawServer:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def stop(self) -> None:
        """Stop listening, and end the scripts still running (their connections close)."""
        if self._server is not None:
            self._server.close()
        for task in self._scripts:
            task.cancel()
        await asyncio.gather(*self._scripts, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        index, self.connections = self.connections, self.connections + 1
        task = asyncio.current_task()
        assert task is not None
        self._scripts.add(task)
        task.add_done_callback(self._scripts.discard)
        try:
            await self.script(Peer(self, index, reader, writer))
        except ConnectionError:  # writing to a connection that the client closed
            self.closed_by_client.append(index)
        finally:
            writer.close()


@pytest.fixture
async def start() -> AsyncIterator[Callable[[Script], Awaitable[RawServer]]]:
    servers: list[RawServer] = []

    async def start_server(script: Script) -> RawServer:
        servers.append(await RawServer(script).start())
        return servers[-1]

    yield start_server
    for server in servers:
        await server.stop()


async def serve(peer: Peer) -> None:
    await peer.serve()


async def fetch(client: http11.Client, url: str, *, timeout: float = GUARD_S) -> tuple[int, bytes]:
    pool, path = client.pool(url)
    connection, response = await pool.request("GET", path, b"", {}, connect_timeout=GUARD_S,
                                              timeout=timeout)
    try:
        await response.head  # done already with this client; the old one returned before
        return response.status, await response.read()
    finally:
        pool.release(connection, response)


async def test_interim_answers_are_skipped_for_the_final_one(start: Callable[[Script], Awaitable[RawServer]]) -> None:
    async def script(peer: Peer) -> None:
        request = await peer.read_request()
        assert request is not None
        await peer.send(b"HTTP/1.1 100 Continue\r\n\r\n"
                        b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n"
                        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-Final: yes\r\n\r\nfinal",
                        piece=1)
        await peer.serve()  # the connection stays usable

    server = await start(script)
    client = http11.Client()
    pool, path = client.pool(f"{server.url}/a")
    connection, response = await pool.request("GET", path, b"", {}, connect_timeout=GUARD_S,
                                              timeout=GUARD_S)
    await response.head
    assert response.status == 200
    assert response.headers.get("x-final") == "yes" and "link" not in response.headers
    assert await response.read() == b"final"
    pool.release(connection, response)
    assert await fetch(client, f"{server.url}/b") == (200, b"/b")
    assert server.connections == 1
    client.close()


async def test_bytes_nobody_asked_for_close_an_idle_connection(start: Callable[[Script], Awaitable[RawServer]]) -> None:
    released = asyncio.Event()

    async def script(peer: Peer) -> None:
        if peer.index > 0:
            return await peer.serve()
        request = await peer.read_request()
        assert request is not None
        await peer.answer(request)
        async with asyncio.timeout(GUARD_S):
            await released.wait()
        await peer.send(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", piece=1)  # unasked
        await peer.until_closed()

    server = await start(script)
    client = http11.Client()
    pool, path = client.pool(f"{server.url}/a")
    connection, response = await pool.request("GET", path, b"", {}, connect_timeout=GUARD_S,
                                              timeout=GUARD_S)
    assert await response.read() == b"/a"
    pool.release(connection, response)  # idle now
    released.set()
    await until(lambda: connection.closed, "closed after the unasked bytes")
    await until(lambda: server.closed_by_client == [0], "seen closed by the server")
    # Two requests at once: each gets a connection of its own, neither the closed one.
    results = await asyncio.gather(fetch(client, f"{server.url}/b"), fetch(client, f"{server.url}/c"))
    assert sorted(results) == [(200, b"/b"), (200, b"/c")]
    assert server.connections == 3
    client.close()


async def test_body_ended_by_the_close_is_a_complete_answer(start: Callable[[Script], Awaitable[RawServer]]) -> None:
    async def script(peer: Peer) -> None:
        assert await peer.read_request() is not None
        await peer.send(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nhello, ", piece=1)
        await peer.send(b"world")
        peer.writer.close()

    server = await start(script)
    client = http11.Client(max_connections=1)
    assert await fetch(client, f"{server.url}/a") == (200, b"hello, world")
    await until(lambda: client.slots.used == 0, "the slot freed")
    client.close()


async def test_cut_content_length_body_is_still_lost(start: Callable[[Script], Awaitable[RawServer]]) -> None:
    async def script(peer: Peer) -> None:
        assert await peer.read_request() is not None
        await peer.send(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part", piece=1)
        peer.writer.close()

    server = await start(script)
    client = http11.Client()
    with pytest.raises(http11.ConnectionLost):
        await fetch(client, f"{server.url}/a")
    client.close()


@pytest.mark.parametrize("piece", [0, 512], ids=["at-once", "in-pieces"])
async def test_oversized_headers_are_a_broken_answer(
    start: Callable[[Script], Awaitable[RawServer]], piece: int
) -> None:
    """At once: the whole head arrives in one read and is measured as parsed. In pieces
    (never ending): the client gives up past the cap instead of waiting for the end."""
    pad = b"".join(b"X-Pad-%d: %s\r\n" % (i, b"a" * 100) for i in range(40))  # ~4.5 KB

    async def script(peer: Peer) -> None:
        assert await peer.read_request() is not None
        if piece:
            await peer.send(b"HTTP/1.1 200 OK\r\n" + pad * 4, piece=piece)  # no end
        else:
            await peer.send(b"HTTP/1.1 200 OK\r\n" + pad + b"Content-Length: 2\r\n\r\nok")
        await peer.until_closed()

    server = await start(script)
    client = http11.Client(max_header_bytes=2048, max_connections=1)
    with pytest.raises(http11.MalformedAnswer, match="over 2048 bytes"):
        await fetch(client, f"{server.url}/a", timeout=30)
    await until(lambda: server.closed_by_client == [0], "closed by the client")
    assert client.slots.used == 0
    client.close()


async def test_close_in_the_middle_of_a_chunk(start: Callable[[Script], Awaitable[RawServer]]) -> None:
    async def script(peer: Peer) -> None:
        assert await peer.read_request() is not None
        await peer.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                        b"5\r\nhello\r\n10\r\nabc", piece=1)
        peer.writer.close()

    server = await start(script)
    client = http11.Client()
    pool, path = client.pool(f"{server.url}/a")
    connection, response = await pool.request("GET", path, b"", {}, connect_timeout=GUARD_S,
                                              timeout=GUARD_S)
    received = b""
    with pytest.raises(http11.ConnectionLost):
        while chunk := await response.read_chunk():
            received += chunk
    assert received.startswith(b"hello") and not response.complete
    pool.release(connection, response)
    assert connection.closed
    client.close()


async def test_stale_keep_alive_connection_is_retried_once_on_a_new_one(
    start: Callable[[Script], Awaitable[RawServer]]
) -> None:
    """The server closes its idle connection just as the next request crosses it (it
    reads it, then closes with no answer): the client sends it again, on a new
    connection, and the server answers it once."""
    async def script(peer: Peer) -> None:
        if peer.index > 0:
            return await peer.serve()
        request = await peer.read_request()
        assert request is not None
        await peer.answer(request)
        assert await peer.read_request() is not None
        peer.writer.close()  # the close crossed the request: no byte of an answer

    server = await start(script)
    client = http11.Client()
    assert await fetch(client, f"{server.url}/one") == (200, b"/one")
    assert await fetch(client, f"{server.url}/two") == (200, b"/two")
    assert server.answered == [(0, "/one"), (1, "/two")]
    assert server.connections == 2
    client.close()


async def test_no_retry_on_a_new_connection_or_after_a_byte_of_answer(
    start: Callable[[Script], Awaitable[RawServer]]
) -> None:
    async def script(peer: Peer) -> None:
        request = await peer.read_request()
        assert request is not None
        if request.path == "/new":  # a new connection closed with no answer
            peer.writer.close()
            return
        await peer.answer(request)
        assert await peer.read_request() is not None
        await peer.send(b"HTTP/1.1 200 OK\r\nContent-Len")  # a byte of an answer, then gone
        peer.writer.close()

    server = await start(script)
    client = http11.Client()
    with pytest.raises(http11.ConnectionLost):
        await fetch(client, f"{server.url}/new")
    assert server.connections == 1
    assert await fetch(client, f"{server.url}/first") == (200, b"/first")
    with pytest.raises(http11.ConnectionLost):
        await fetch(client, f"{server.url}/second")
    assert server.connections == 2 and [path for _, path in server.answered] == ["/first"]
    client.close()


async def test_paused_answer_is_not_reused_before_it_is_read(
    start: Callable[[Script], Awaitable[RawServer]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole answer arrives in one read, which also pauses reading (buffered over
    the high water): the parser has seen its end, but its reader has not. Its
    connection must not carry another request until the reader is done with it."""
    monkeypatch.setattr(http11.connection, "HIGH_WATER", 16)

    async def script(peer: Peer) -> None:
        while (request := await peer.read_request()) is not None:
            await peer.answer(request, request.path.encode() * 32)  # 64+ bytes, one write

    server = await start(script)
    client = http11.Client()
    pool, path = client.pool(f"{server.url}/a")
    first, response = await pool.request("GET", path, b"", {}, connect_timeout=GUARD_S,
                                         timeout=GUARD_S)
    await until(lambda: response.complete, "the first answer parsed to its end")
    assert await fetch(client, f"{server.url}/b", timeout=2) == (200, b"/b" * 32)
    assert server.connections == 2  # the paused one was not lent
    assert await response.read() == b"/a" * 32
    pool.release(first, response)
    assert not first.closed
    assert await fetch(client, f"{server.url}/c", timeout=2) == (200, b"/c" * 32)
    assert server.connections == 2  # released: reused, its reading resumed
    client.close()


async def test_released_unread_answer_resumes_its_connection(
    start: Callable[[Script], Awaitable[RawServer]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An answer received whole but not handed out, released: its connection goes back
    with its reading resumed, and carries the next request."""
    monkeypatch.setattr(http11.connection, "HIGH_WATER", 16)

    async def script(peer: Peer) -> None:
        while (request := await peer.read_request()) is not None:
            await peer.answer(request, request.path.encode() * 32)

    server = await start(script)
    client = http11.Client()
    pool, path = client.pool(f"{server.url}/a")
    connection, response = await pool.request("GET", path, b"", {}, connect_timeout=GUARD_S,
                                              timeout=GUARD_S)
    await until(lambda: response.complete, "the answer parsed to its end")
    pool.release(connection, response)
    assert await fetch(client, f"{server.url}/b", timeout=2) == (200, b"/b" * 32)
    assert server.connections == 1
    client.close()


def holding_script(finish: asyncio.Event) -> Script:
    """/hold answers its head and one chunk, and ends once `finish` is set; the rest
    are answered at once."""
    async def script(peer: Peer) -> None:
        while (request := await peer.read_request()) is not None:
            if request.path != "/hold":
                await peer.answer(request)
                continue
            await peer.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
            async with asyncio.timeout(GUARD_S):
                await finish.wait()
            await peer.send(b"4\r\nlast\r\n0\r\n\r\n")
            peer.server.answered.append((peer.index, request.path))
    return script


async def test_pool_timeout_then_the_slot_is_free_again(start: Callable[[Script], Awaitable[RawServer]]) -> None:
    server = await start(holding_script(asyncio.Event()))
    client = http11.Client(max_connections=1, pool_timeout=0.3)
    pool, path = client.pool(f"{server.url}/hold")
    holder, held = await pool.request("GET", path, b"", {}, connect_timeout=GUARD_S, timeout=GUARD_S)
    async with asyncio.timeout(GUARD_S):
        with pytest.raises(http11.PoolTimeout, match="within 0.3 s"):
            await fetch(client, f"{server.url}/quick")
    pool.release(holder, held)  # abandoned mid-answer: closed, its slot freed
    async with asyncio.timeout(GUARD_S):
        assert await fetch(client, f"{server.url}/quick") == (200, b"/quick")
    assert client.slots.used == 1 and not client.slots.waiters  # the idle connection's
    client.close()


async def test_a_waiter_gets_the_connection_that_goes_idle(start: Callable[[Script], Awaitable[RawServer]]) -> None:
    """At the cap, a request waits; when the holder's answer ends and is released, its
    connection passes to the waiter at once (not after the pool timeout)."""
    finish = asyncio.Event()
    server = await start(holding_script(finish))
    client = http11.Client(max_connections=1, pool_timeout=60)
    pool, path = client.pool(f"{server.url}/hold")
    holder, held = await pool.request("GET", path, b"", {}, connect_timeout=GUARD_S, timeout=GUARD_S)
    waiting = asyncio.create_task(fetch(client, f"{server.url}/next"))
    await until(lambda: len(client.slots.waiters) == 1, "queued")
    finish.set()
    assert await held.read() == b"firstlast"
    pool.release(holder, held)
    async with asyncio.timeout(GUARD_S):
        assert await waiting == (200, b"/next")
    assert server.connections == 1  # handed over, not reopened
    client.close()


async def test_a_waiter_for_another_server_gets_the_slot(start: Callable[[Script], Awaitable[RawServer]]) -> None:
    finish = asyncio.Event()
    server_a = await start(holding_script(finish))
    server_b = await start(serve)
    client = http11.Client(max_connections=1, pool_timeout=60)
    pool, path = client.pool(f"{server_a.url}/hold")
    holder, held = await pool.request("GET", path, b"", {}, connect_timeout=GUARD_S, timeout=GUARD_S)
    waiting = asyncio.create_task(fetch(client, f"{server_b.url}/b"))
    await until(lambda: len(client.slots.waiters) == 1, "queued")
    finish.set()
    assert await held.read() == b"firstlast"
    pool.release(holder, held)  # would go idle: closed instead, its slot to the waiter
    async with asyncio.timeout(GUARD_S):
        assert await waiting == (200, b"/b")
    assert holder.closed and client.slots.used == 1
    client.close()


async def test_cancelled_waiter_leaves_no_trace(start: Callable[[Script], Awaitable[RawServer]]) -> None:
    server = await start(holding_script(asyncio.Event()))
    client = http11.Client(max_connections=1, pool_timeout=60)
    pool, path = client.pool(f"{server.url}/hold")
    holder, held = await pool.request("GET", path, b"", {}, connect_timeout=GUARD_S, timeout=GUARD_S)
    waiting = asyncio.create_task(fetch(client, f"{server.url}/next"))
    await until(lambda: len(client.slots.waiters) == 1, "queued")
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert not client.slots.waiters
    pool.release(holder, held)
    assert client.slots.used == 0
    client.close()


async def test_idle_connections_are_reused_only_within_idle_reuse(start: Callable[[Script], Awaitable[RawServer]]) -> None:
    server = await start(serve)
    client = http11.Client(idle_reuse=0.2)
    pool, path = client.pool(f"{server.url}/a")
    connection, response = await pool.request("GET", path, b"", {}, connect_timeout=GUARD_S,
                                              timeout=GUARD_S)
    await response.read()
    pool.release(connection, response)
    assert await fetch(client, f"{server.url}/b") == (200, b"/b")
    assert server.connections == 1  # reused at once
    await until(lambda: time.monotonic() - connection.idle_since > 0.25, "idle past idle_reuse")
    assert await fetch(client, f"{server.url}/c") == (200, b"/c")
    assert server.connections == 2 and connection.closed
    client.close()


# The upstream client: its lanes, Overloaded, credentials.


async def test_control_lane_is_not_blocked_by_a_full_request_lane(
    start: Callable[[Script], Awaitable[RawServer]]
) -> None:
    finish = asyncio.Event()
    server = await start(holding_script(finish))
    upstream = UpstreamClient(Timeouts(pool=60), Limits(max_connections=1, control_connections=1))
    try:
        async with upstream.stream(f"{server.url}/hold", {}, headers={}, endpoint=server.url,
                                   cluster="decode") as held:
            async with asyncio.timeout(GUARD_S):  # far below the pool timeout
                await upstream.get_json(f"{server.url}/health", endpoint=server.url,
                                        cluster="decode", timeout=GUARD_S, expect_json=False)
                assert await upstream.get_text(f"{server.url}/metrics", endpoint=server.url,
                                               cluster="decode", timeout=GUARD_S) == "/metrics"
                with pytest.raises(UpstreamError):  # a probe: its answer is no JSON, but it came
                    await upstream.post_json(f"{server.url}/v1/completions", {}, headers={},
                                             endpoint=server.url, cluster="prefill",
                                             timeout=GUARD_S, control=True)
            finish.set()
            assert [await held.read_chunk(), await held.read_chunk()] == [b"first", b"last"]
            assert await held.read_chunk() == b""
    finally:
        await upstream.aclose()


async def test_no_room_in_time_is_overloaded_naming_server_and_limit(
    start: Callable[[Script], Awaitable[RawServer]]
) -> None:
    server = await start(holding_script(asyncio.Event()))
    upstream = UpstreamClient(Timeouts(pool=0.2), Limits(max_connections=1))
    upstream.set_name(server.url, "3")  # clients are told its name, not its URL
    try:
        async with upstream.stream(f"{server.url}/hold", {}, headers={}, endpoint=server.url,
                                   cluster="decode"):
            calls: list[Callable[[], Awaitable[object]]] = [
                lambda: upstream.post_json(f"{server.url}/x", {}, headers={}, endpoint=server.url,
                                           cluster="decode", timeout=GUARD_S),
                lambda: upstream.stream(f"{server.url}/x", {}, headers={}, endpoint=server.url,
                                        cluster="decode").__aenter__(),
            ]
            for call in calls:
                async with asyncio.timeout(GUARD_S):
                    with pytest.raises(Overloaded) as caught:
                        await call()
                error = caught.value
                assert error.reason == "pool_timeout" and not isinstance(error, UpstreamError)
                assert error.status == 503 and error.headers() == {"Retry-After": "1"}
                assert error.message == ("no upstream connection to decode server 3 "
                                         "free within 0.2 s (limits.max_connections=1)")
    finally:
        await upstream.aclose()


async def test_api_key_goes_with_every_request_to_its_server(
    start: Callable[[Script], Awaitable[RawServer]]
) -> None:
    keyed = await start(serve)
    other = await start(serve)
    upstream = UpstreamClient(Timeouts(), Limits())
    upstream.set_api_key(f"{keyed.url}/v1", "s3cret")  # the server, whatever the path
    try:
        for server in (keyed, other):
            await upstream.get_text(f"{server.url}/metrics", endpoint=server.url,
                                    cluster="decode", timeout=GUARD_S)
            with pytest.raises(UpstreamError):  # not JSON; the request is what counts
                await upstream.post_json(f"{server.url}/v1/completions", {}, headers={},
                                         endpoint=server.url, cluster="decode", timeout=GUARD_S)
        upstream.set_api_key(keyed.url, None)
        await upstream.get_text(f"{keyed.url}/after", endpoint=keyed.url, cluster="decode",
                                timeout=GUARD_S)
        assert [r.headers.get("authorization") for _, r in keyed.seen] == [
            "Bearer s3cret", "Bearer s3cret", None]
        assert [r.headers.get("authorization") for _, r in other.seen] == [None, None]
        with pytest.raises(ValueError):
            upstream.set_api_key(keyed.url, "bad\r\nX-Injected: 1")
    finally:
        await upstream.aclose()
