"""A small HTTP/1.1 client for the hot path: keep-alive connections on asyncio protocols,
with httptools (the parser uvicorn uses) reading the answers.

Why not aiohttp: measured here, a bare Starlette app relaying to P then D through
aiohttp tops out near 1,000 requests/s on one core, two thirds of it in aiohttp's
request machinery. The router talks to vLLM servers only: plain HTTP/1.1, JSON bodies,
answers with Content-Length or chunked (SSE). That needs far less code than a general
client: one request at a time per connection, a LIFO pool of idle connections per
server, and backpressure on streamed bodies (reading pauses while a slow client lets
chunks pile up).

Only `upstream.py` uses this module; it maps the errors raised here (`ConnectFailed`,
`ConnectionLost`, `httptools.HttpParserError`, TimeoutError from its own bounds) to the
router's own.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import httptools

# Idle connections older than this are closed, not reused: below uvicorn's default
# keep-alive of 5 s, so a server never closes a connection as we send on it.
IDLE_REUSE_S = 4.0
# A streamed body pauses reading from the server above this many buffered bytes.
HIGH_WATER = 256 * 1024


class ConnectionLost(Exception):
    """The server closed the connection before its answer was complete."""


class ConnectFailed(Exception):
    """No connection could be opened (refused, unreachable, or timed out)."""


class Response:
    """An answer being received: status and headers first, then body chunks."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self.status = 0
        self.headers: dict[str, str] = {}
        self.head = asyncio.get_running_loop().create_future()  # set when headers are in
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self.complete = False
        self.error: BaseException | None = None
        # Monotonic time by which the next byte must arrive, enforced by the client's
        # `Deadlines` sweep while someone waits (`awaited`). `idle`, once set, pushes it
        # that far ahead whenever a chunk arrives and whenever a wait for one begins.
        self.deadline = float("inf")
        self.idle: float | None = None

    def expect_within(self, seconds: float, *, per_chunk: bool = False) -> None:
        """Time out unless the next part comes within `seconds` (with `per_chunk`, each
        chunk of the body restarts the clock)."""
        self.deadline = time.monotonic() + seconds
        self.idle = seconds if per_chunk else None

    async def read_chunk(self) -> bytes:
        """The next body chunk; b"" at the end. Raises the connection's error, if any."""
        while not self._chunks:
            if self.error is not None:
                raise self.error
            if self.complete:
                return b""
            if self.idle is not None:  # the server is late only while we wait for it
                self.deadline = time.monotonic() + self.idle
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._take()

    def _take(self) -> bytes:
        """Hand out the oldest buffered chunk (reading resumes below the high water)."""
        chunk = self._chunks.popleft()
        self._buffered -= len(chunk)
        if self._buffered < HIGH_WATER:
            self._connection.resume_reading()
        return chunk

    @property
    def awaited(self) -> bool:
        """Someone waits on the server: for the head, or for a chunk. A streamed body's
        reader that is busy elsewhere (writing to a slow client) does not make the
        server late."""
        return self._waiter is not None or not self.head.done()

    @property
    def at_end(self) -> bool:
        """Every byte of the body has been handed out."""
        return self.complete and not self._chunks

    async def read(self) -> bytes:
        """The rest of the body (at once when it is all in: the usual whole answer)."""
        parts = []
        while chunk := await self.read_chunk():
            parts.append(chunk)
        return b"".join(parts)

    # Called by the connection (the protocol's callbacks):

    def _feed(self, chunk: bytes) -> None:
        if self.idle is not None:
            self.deadline = time.monotonic() + self.idle
        self._chunks.append(chunk)
        self._buffered += len(chunk)
        if self._buffered >= HIGH_WATER:
            self._connection.pause_reading()
        self._wake()

    def _finish(self, error: BaseException | None = None) -> None:
        if self.complete or self.error is not None:
            return
        if error is None:
            self.complete = True
        else:
            self.error = error
            if not self.head.done():
                self.head.set_exception(error)
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class Connection(asyncio.Protocol):
    """One keep-alive connection to a server, carrying one request at a time."""

    def __init__(self, pool: Pool) -> None:
        self._pool = pool
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._response: Response | None = None
        self._header_name = b""
        self._reading_paused = False
        self.closed = False
        self.idle_since = time.monotonic()

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._pool.forget(self)
        if self._response is not None:
            self._response._finish(ConnectionLost(f"connection closed: {exc or 'by the server'}"))
            self._response = None

    # httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._response is not None:
            self._response.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        response = self._response
        if response is not None and not response.head.done():
            response.status = self._parser.get_status_code()
            response.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self._response is not None:
            self._response._feed(body)

    def on_message_complete(self) -> None:
        response, self._response = self._response, None
        keep_alive = self._parser.should_keep_alive()
        if response is not None:
            response._finish()
        if keep_alive and not self.closed:
            self.idle_since = time.monotonic()
            self._pool.put_back(self)
        else:
            self.close()

    # used by Response and Pool

    def send(self, head: bytes, body: bytes) -> Response:
        assert self._transport is not None and self._response is None  # one at a time
        self._response = Response(self)
        self._transport.write(head + body)
        return self._response

    def pause_reading(self) -> None:
        if not self._reading_paused and self._transport is not None:
            self._reading_paused = True
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self._reading_paused and self._transport is not None and not self.closed:
            self._reading_paused = False
            self._transport.resume_reading()

    def close(self) -> None:
        """Close at once: a server sees its client gone and aborts the request."""
        if not self.closed:
            self.closed = True
            self._pool.forget(self)
            if self._transport is not None:
                self._transport.close()

    def _fail(self, exc: BaseException) -> None:
        if self._response is not None:
            self._response._finish(exc)
            self._response = None
        self.close()


class Pool:
    """Keep-alive connections to one server (host, port)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        ssl: bool,
        limit: asyncio.Semaphore | None,
        deadlines: Deadlines,
        evict_idle: Callable[[], None] = lambda: None,
    ) -> None:
        self._deadlines = deadlines
        self._evict_idle = evict_idle
        self.host = host
        self.port = port
        self._ssl = ssl
        self._host_header = f"{host}:{port}".encode("latin-1")
        self._idle: list[Connection] = []
        self._all: set[Connection] = set()
        self._limit = limit

    async def request(
        self,
        method: str,
        path: str,
        body: bytes,
        headers: dict[str, str],
        *,
        connect_timeout: float,
        timeout: float,
    ) -> tuple[Connection, Response]:
        """Send a request; return its connection and the response (head not yet awaited),
        which times out unless it comes within `timeout` (see `Response.expect_within`).

        The caller must `release(connection, response)` when done with the response."""
        connection = self._idle_connection()
        if connection is None:
            if self._limit is not None:
                if self._limit.locked():  # at the cap: an idle connection to any server makes room
                    self._evict_idle()
                await self._limit.acquire()
            try:
                async with asyncio.timeout(connect_timeout):
                    _transport, connection = await asyncio.get_running_loop().create_connection(
                        lambda: Connection(self), self.host, self.port, ssl=self._ssl
                    )
            except (OSError, TimeoutError) as exc:
                if self._limit is not None:
                    self._limit.release()
                raise ConnectFailed(f"{type(exc).__name__}: {exc}".rstrip(": ")) from exc
            except BaseException:
                if self._limit is not None:
                    self._limit.release()
                raise
            self._all.add(connection)
        lines = [f"{method} {path} HTTP/1.1\r\n".encode("latin-1"), b"Host: ", self._host_header,
                 b"\r\nContent-Length: ", str(len(body)).encode("latin-1"), b"\r\n"]
        for name, value in headers.items():
            lines.append(f"{name}: {value}\r\n".encode("latin-1"))
        lines.append(b"\r\n")
        response = connection.send(b"".join(lines), body)
        response.expect_within(timeout)
        self._deadlines.watch(response)
        return connection, response

    def release(self, connection: Connection, response: Response) -> None:
        """Done with a response: an unfinished one closes its connection (which is how
        a server learns that the request was abandoned); a finished one was already
        put back for reuse by the protocol."""
        if not response.complete:
            connection.close()

    def put_back(self, connection: Connection) -> None:
        self._idle.append(connection)

    def close_oldest_idle(self) -> bool:
        """Close the connection idle the longest, if any (its slot under the cap frees)."""
        if not self._idle:
            return False
        self._idle[0].close()  # put_back appends: the first is the oldest
        return True

    def forget(self, connection: Connection) -> None:
        if connection in self._all:
            self._all.discard(connection)
            if self._limit is not None:
                self._limit.release()
        if connection in self._idle:
            self._idle.remove(connection)

    def close(self) -> None:
        for connection in list(self._all):
            connection.close()

    def _idle_connection(self) -> Connection | None:
        now = time.monotonic()
        while self._idle:
            connection = self._idle.pop()
            if not connection.closed and now - connection.idle_since < IDLE_REUSE_S:
                return connection
            connection.close()
        return None


class Deadlines:
    """Times out responses whose `deadline` passed, checking every `TICK_S`.

    One timer for all requests instead of one per wait: arming an asyncio timer per
    request was a tenth of the router's CPU. Only a response someone is waiting on can
    time out. Precision is a tick, fine for limits given in seconds. A timed-out response
    fails with TimeoutError and its connection closes (the server then aborts the
    request)."""

    TICK_S = 0.05

    def __init__(self) -> None:
        self._watched: set[Response] = set()
        self._timer: asyncio.TimerHandle | None = None

    def watch(self, response: Response) -> None:
        self._watched.add(response)
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.TICK_S, self._sweep)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._watched.clear()

    def _sweep(self) -> None:
        now = time.monotonic()
        for response in list(self._watched):
            if response.complete or response.error is not None:
                self._watched.discard(response)
            elif response.deadline <= now and response.awaited:
                self._watched.discard(response)
                response._finish(TimeoutError("no answer within the time limit"))
                response._connection.close()
        self._timer = (
            asyncio.get_running_loop().call_later(self.TICK_S, self._sweep)
            if self._watched
            else None
        )


class Client:
    """Pools by server, created as needed. `max_connections` (0 = none) caps them all."""

    def __init__(self, *, max_connections: int = 0) -> None:
        self._pools: dict[tuple[str, str, int], Pool] = {}
        self._limit = asyncio.Semaphore(max_connections) if max_connections > 0 else None
        self._deadlines = Deadlines()

    def pool(self, url: str) -> tuple[Pool, str]:
        """The pool for an absolute http URL, and the URL's path (with query)."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or parts.hostname is None:
            raise ValueError(f"not an http(s) URL: {url!r}")
        tls = parts.scheme == "https"
        key = (parts.scheme, parts.hostname, parts.port or (443 if tls else 80))
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = Pool(
                key[1], key[2], ssl=tls, limit=self._limit, deadlines=self._deadlines,
                evict_idle=self._evict_idle,
            )
        path = parts.path or "/"
        return pool, f"{path}?{parts.query}" if parts.query else path

    def _evict_idle(self) -> None:
        """At the connection cap, a request to one server must not wait for idle
        keep-alive connections to other servers (a burst of P legs would otherwise hold
        every slot that the D legs then need): close one."""
        for pool in self._pools.values():
            if pool.close_oldest_idle():
                return

    def close(self) -> None:
        self._deadlines.close()
        for pool in self._pools.values():
            pool.close()
