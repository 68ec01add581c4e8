"""A small HTTP/1.1 client for the hot path: keep-alive connections on asyncio protocols,
with httptools (the parser uvicorn uses) reading the answers.

Why not aiohttp: measured here, a bare Starlette app relaying to P then D through
aiohttp tops out near 1,000 requests/s on one core, two thirds of it in aiohttp's
request machinery. The router talks to vLLM servers only: plain HTTP/1.1, JSON bodies,
answers with Content-Length or chunked (SSE). That needs far less code than a general
client, and these rules:

- One request at a time per connection; a LIFO list of idle connections per server,
  reused only while idle less than `idle_reuse` seconds (set it below the servers' own
  keep-alive, so that a server rarely closes a connection as we send on it).
- A connection goes back for reuse only when its answer has ended *and* every byte of
  it has been handed to its reader (or its caller released it): a streamed answer whose
  reading is paused by backpressure (a slow client lets chunks pile up) is never lent
  to another request. An idle connection that
  receives any byte (nobody asked for it) or is closed by its server is closed and
  forgotten.
- `max_connections` caps a client's open connections, idle ones included. A request
  waits for room at most `pool_timeout` seconds, first come first served, then fails
  with `PoolTimeout` (our overload, not the server's fault). A connection that closes
  passes its slot straight to the first waiter, and one that goes idle while requests
  wait goes to the first of them (closed instead when that one is for another server,
  so that its slot does): nobody waits while a connection sits idle.
- Interim answers (100 Continue, 103 Early Hints) are skipped; a body without
  Content-Length or chunked encoding ends when the server closes the connection (a
  complete answer, not a lost one); status lines and headers over `max_header_bytes`
  are a broken answer (`MalformedAnswer`).
- A request sent on a reused connection that its server closes before any byte of an
  answer arrived (it timed the idle connection out as we sent) is sent once more, on a
  new connection: the server closed without reading it.

Only `upstream.py` uses this module; it maps the errors raised here (`PoolTimeout`,
`ConnectFailed`, `ConnectionLost`, `MalformedAnswer`, `httptools.HttpParserError`,
TimeoutError from its own bounds) to the router's own.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from urllib.parse import SplitResult, urlsplit

import httptools

# A streamed body pauses reading from the server above this many buffered bytes.
HIGH_WATER = 256 * 1024


class ConnectionLost(Exception):
    """The server closed the connection before its answer was complete."""


class ConnectFailed(Exception):
    """No connection could be opened (refused, unreachable, or timed out)."""


class MalformedAnswer(Exception):
    """The server's answer breaks our rules: headers too large, an unasked-for upgrade."""


class PoolTimeout(Exception):
    """No room for a connection under the client's cap within its pool timeout."""


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
        if self.complete and not self._chunks:
            self._connection.handed_out(self)
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
            if not self._chunks:
                self._connection.handed_out(self)
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
        self._max_header_bytes = pool.max_header_bytes
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._response: Response | None = None  # the answer being parsed
        self.leased: Response | None = None  # the answer its caller has not released yet
        self.reusable = False  # the last answer ended and the server keeps the connection
        self.requests = 0  # requests sent on it (one sent when this is not 0 reuses it)
        # Bytes received for the current request while its final head was not in yet
        # (0: no byte of an answer arrived), and the head's size as parsed.
        self.head_bytes = 0
        self._head_size = 0
        self._interim = False  # the message being parsed is a 1xx interim answer
        self._reading_paused = False
        self.closed = False
        self.dropped = False  # closed by the server (or the network), not by us
        self.idle_since = time.monotonic()

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        response = self._response
        if response is None:
            # Nobody asked for these bytes (the connection is idle, or its answer has
            # ended): the server is out of step with us, so the connection is done.
            self.close()
            return
        heading = not response.head.done()
        if heading:
            self.head_bytes += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__  # what our callback raised
            self._fail(cause if isinstance(cause, MalformedAnswer) else exc)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._fail(exc)
        else:
            # A head still incomplete past the cap (arriving in pieces) is not waited out.
            if heading and self.head_bytes > self._max_header_bytes and not response.head.done():
                self._fail(self._too_large())

    def connection_lost(self, exc: Exception | None) -> None:
        self.dropped = not self.closed
        self.closed = True
        self._pool.forget(self)
        response, self._response = self._response, None
        if response is None:
            return
        if exc is None and response.head.done() and _ends_at_close(response):
            response._finish()  # its body was delimited by the end of the connection
        else:
            response._finish(ConnectionLost(f"connection closed: {exc or 'by the server'}"))

    # httptools callbacks

    def on_message_begin(self) -> None:
        if self._response is None:
            raise MalformedAnswer("bytes after the end of the answer")

    def on_status(self, status: bytes) -> None:
        self._head_size += len(status) + 15  # "HTTP/1.1 200 " and CRLF around the reason

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._response is not None:
            self._head_size += len(name) + len(value) + 4
            self._response.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        response = self._response
        if response is None or response.head.done():
            return
        if self._head_size > self._max_header_bytes:
            raise self._too_large()
        status = self._parser.get_status_code()
        if status < 200:
            if status == 101:
                raise MalformedAnswer("101 Switching Protocols to a request that asked for none")
            # An interim answer: the final one follows on the same connection.
            self._interim = True
            response.headers = {}
            return
        response.status = status
        response.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self._response is not None:
            self._response._feed(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        response, self._response = self._response, None
        if response is not None:
            # Reused once every chunk is handed out, or its caller releases it (see
            # `handed_out`), not before: chunks may still wait, with reading paused.
            self.reusable = self._parser.should_keep_alive()
            response._finish()

    # used by Response and Pool

    def handed_out(self, response: Response) -> None:
        """The answer ended and its reader has every byte: nothing more is read from
        the connection for it, so it is free at once, while the caller may still be
        passing the last chunk on (its release then does nothing)."""
        self._pool.release(self, response)

    def send(self, head: bytes, body: bytes) -> Response:
        assert self._transport is not None and self.leased is None  # one at a time
        response = self._response = self.leased = Response(self)
        self.requests += 1
        self.reusable = False
        self.head_bytes = self._head_size = 0
        self._transport.write(head + body)
        return response

    def pause_reading(self) -> None:
        if not self._reading_paused and self._transport is not None:
            self._reading_paused = True
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self._reading_paused and self._transport is not None and not self.closed:
            self._reading_paused = False
            self._transport.resume_reading()

    def close(self) -> None:
        """Close at once: a server sees its client gone and aborts the request. An answer
        still being received fails with ConnectionLost."""
        if not self.closed:
            self.closed = True
            self._pool.forget(self)
            response, self._response = self._response, None
            if response is not None:
                response._finish(ConnectionLost("connection closed by the router"))
            if self._transport is not None:
                self._transport.close()

    def _fail(self, exc: BaseException) -> None:
        if self._response is not None:
            self._response._finish(exc)
            self._response = None
        self.close()

    def _too_large(self) -> MalformedAnswer:
        return MalformedAnswer(
            f"status line and headers over {self._max_header_bytes} bytes "
            "(limits.max_upstream_header_bytes)"
        )


def _ends_at_close(response: Response) -> bool:
    """Whether the answer's body is delimited by the end of the connection: neither
    Content-Length nor chunked, and a status that has a body."""
    headers = response.headers
    return (
        response.status not in (204, 304)
        and "content-length" not in headers
        and "chunked" not in headers.get("transfer-encoding", "").lower()
    )


class Slots:
    """The cap on a client's open connections (0: none), shared by its pools, and the
    requests waiting for room under it, first come first served.

    Each open connection holds a slot, idle ones included. A waiter is `(pool, future)`:
    the future gets an idle connection of `pool` handed over, or None when a slot is
    passed to it (to open a connection of its own; `pool` None: it wants only that)."""

    def __init__(self, cap: int, wait_s: float) -> None:
        self.cap = cap
        self.wait_s = wait_s
        self.used = 0
        self.waiters: collections.deque[
            tuple[Pool | None, asyncio.Future[Connection | None]]
        ] = collections.deque()

    def take(self) -> bool:
        """Take a free slot, if any."""
        if self.cap and self.used >= self.cap:
            return False
        self.used += 1
        return True

    def release(self) -> None:
        """A connection closed: its slot passes to the first waiter, else is free."""
        waiter = self.first_waiter()
        if waiter is None:
            self.used -= 1
        else:
            self.waiters.popleft()
            waiter[1].set_result(None)

    def first_waiter(self) -> tuple[Pool | None, asyncio.Future[Connection | None]] | None:
        waiters = self.waiters
        while waiters and waiters[0][1].done():  # gave up (timed out or cancelled)
            waiters.popleft()
        return waiters[0] if waiters else None

    def close(self, error: BaseException) -> None:
        """Fail every waiter (the client is closing)."""
        while self.waiters:
            future = self.waiters.popleft()[1]
            if not future.done():
                future.set_exception(error)


class Pool:
    """Keep-alive connections to one server (host, port), under its client's cap."""

    def __init__(self, client: Client, host: str, port: int, *, ssl: bool) -> None:
        self._client = client
        self._slots = client.slots
        self._deadlines = client.deadlines
        self._idle_reuse = client.idle_reuse
        self.max_header_bytes = client.max_header_bytes
        self.host = host
        self.port = port
        self._ssl = ssl
        self._host_header = f"{host}:{port}".encode("latin-1")
        # Header lines sent with every request to this server, pre-encoded (credentials).
        self.extra_headers = b""
        self._idle: list[Connection] = []
        self._all: set[Connection] = set()

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
        """Send a request and wait for its answer's status and headers (interim answers
        skipped), at most `timeout` seconds; return the connection and the response,
        whose body is then read with `read_chunk` or `read`.

        The caller must `release(connection, response)` when done with the response.
        On failure nothing is left to release: PoolTimeout (no room under the cap),
        ConnectFailed, ConnectionLost, MalformedAnswer, httptools.HttpParserError or
        TimeoutError."""
        head = self._head(method, path, body, headers)
        deadline = time.monotonic() + timeout
        connection = self._idle_connection() or await self._lease(connect_timeout, fresh=False)
        reused = connection.requests > 0
        try:
            return connection, await self._exchange(connection, head, body, deadline)
        except ConnectionLost:
            if not (reused and connection.dropped and connection.head_bytes == 0):
                raise
        # A stale keep-alive connection: its server closed it as we sent, with no byte
        # of an answer. It closed without reading the request: send it once more.
        connection = await self._lease(connect_timeout, fresh=True)
        return connection, await self._exchange(connection, head, body, deadline)

    def release(self, connection: Connection, response: Response) -> None:
        """Done with a response, on every path: a complete answer's connection goes back
        for reuse (its reading resumed), an unfinished one is closed (which is how a
        server learns that the request was abandoned). Releasing twice does nothing."""
        if connection.leased is not response:
            return
        connection.leased = None
        if response.complete and connection.reusable and not connection.closed:
            connection.resume_reading()
            self._put_back(connection)
        else:
            connection.close()

    def close_oldest_idle(self) -> bool:
        """Close the connection idle the longest, if any (its slot under the cap frees)."""
        if not self._idle:
            return False
        self._idle[0].close()  # _put_back appends: the first is the oldest
        return True

    def forget(self, connection: Connection) -> None:
        """A connection closed: its slot passes on (see `Slots.release`)."""
        if connection in self._all:
            self._all.discard(connection)
            self._slots.release()
        if connection in self._idle:
            self._idle.remove(connection)

    def close(self) -> None:
        for connection in list(self._all):
            connection.close()

    def _head(self, method: str, path: str, body: bytes, headers: dict[str, str]) -> bytes:
        lines = [f"{method} {path} HTTP/1.1\r\n".encode("latin-1"), b"Host: ", self._host_header,
                 b"\r\nContent-Length: ", str(len(body)).encode("latin-1"), b"\r\n",
                 self.extra_headers]  # fmt: skip
        for name, value in headers.items():
            lines.append(f"{name}: {value}\r\n".encode("latin-1"))
        lines.append(b"\r\n")
        return b"".join(lines)

    async def _exchange(self, connection: Connection, head: bytes, body: bytes,
                        deadline: float) -> Response:
        """Send on `connection` and wait for the answer's head (released on failure)."""
        response = connection.send(head, body)
        response.deadline = deadline
        self._deadlines.watch(response)
        try:
            await response.head
        except BaseException:
            self.release(connection, response)
            raise
        return response

    async def _lease(self, connect_timeout: float, *, fresh: bool) -> Connection:
        """A connection for one request: an idle one (unless `fresh`), else a new one
        once there is room under the cap (waiting at most the pool timeout)."""
        slots = self._slots
        deadline: float | None = None
        while True:
            if not fresh and (connection := self._idle_connection()) is not None:
                return connection
            if slots.take():
                break
            self._client.evict_idle()  # an idle connection to any server makes room
            if slots.take():
                break
            if deadline is None:
                deadline = asyncio.get_running_loop().time() + slots.wait_s
            handed = await self._wait(deadline, fresh=fresh)
            if handed is None:
                break  # a slot was passed to us
            if not handed.closed:
                return handed
            # It closed before we could use it; its slot went on. Look again.
        return await self._open(connect_timeout)

    async def _wait(self, deadline: float, *, fresh: bool) -> Connection | None:
        """Queue for a connection of ours going idle or a slot freeing, until `deadline`."""
        future: asyncio.Future[Connection | None] = asyncio.get_running_loop().create_future()
        waiter = (None if fresh else self, future)
        self._slots.waiters.append(waiter)
        try:
            async with asyncio.timeout_at(deadline):
                return await future
        except BaseException as exc:
            if future.done() and not future.cancelled() and future.exception() is None:
                # Handed to us as we gave up (cancelled, or timed out): pass it on.
                handed = future.result()
                if handed is None:
                    self._slots.release()
                else:
                    self._put_back(handed)
            else:
                future.cancel()
                with contextlib.suppress(ValueError):
                    self._slots.waiters.remove(waiter)
            if isinstance(exc, TimeoutError):
                raise PoolTimeout(
                    f"no connection to {self.host}:{self.port} free within "
                    f"{self._slots.wait_s:g} s (at the cap of {self._slots.cap})"
                ) from None
            raise

    async def _open(self, connect_timeout: float) -> Connection:
        """Open a connection in a slot already taken (given back if this fails)."""
        try:
            async with asyncio.timeout(connect_timeout):
                _transport, connection = await asyncio.get_running_loop().create_connection(
                    lambda: Connection(self), self.host, self.port, ssl=self._ssl
                )
        except (OSError, TimeoutError) as exc:
            self._slots.release()
            raise ConnectFailed(f"{type(exc).__name__}: {exc}".rstrip(": ")) from exc
        except BaseException:
            self._slots.release()
            raise
        if connection.closed:  # lost before we saw it: `forget` did not count it
            self._slots.release()
            raise ConnectFailed("the connection closed as it opened")
        self._all.add(connection)
        return connection

    def _put_back(self, connection: Connection) -> None:
        """A connection free for another request: to the first waiter if it is for this
        server, closed if it is for another (its slot passes to it), else idle."""
        waiter = self._slots.first_waiter()
        if waiter is None:
            connection.idle_since = time.monotonic()
            self._idle.append(connection)
        elif waiter[0] is self:
            self._slots.waiters.popleft()
            waiter[1].set_result(connection)
        else:
            connection.close()

    def _idle_connection(self) -> Connection | None:
        now = time.monotonic()
        while self._idle:
            connection = self._idle.pop()
            if not connection.closed and now - connection.idle_since < self._idle_reuse:
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
    """Pools by server, created as needed, sharing one cap on open connections
    (`max_connections`, 0 = none; waiting for room at most `pool_timeout` seconds) and
    one deadline sweep. Idle connections are reused while idle less than `idle_reuse`
    seconds; answers' heads are bounded by `max_header_bytes`."""

    URL_MEMORY = 4096  # URLs remembered by `pool` (forgotten all at once past it)

    def __init__(
        self,
        *,
        max_connections: int = 0,
        pool_timeout: float = 5.0,
        idle_reuse: float = 4.0,
        max_header_bytes: int = 64 * 1024,
    ) -> None:
        self.slots = Slots(max_connections, pool_timeout)
        self.deadlines = Deadlines()
        self.idle_reuse = idle_reuse
        self.max_header_bytes = max_header_bytes
        self._pools: dict[tuple[str, str, int], Pool] = {}
        self._by_url: dict[str, tuple[Pool, str]] = {}
        self._extra_headers: dict[tuple[str, str, int], bytes] = {}

    def pool(self, url: str) -> tuple[Pool, str]:
        """The pool for an absolute http URL, and the URL's path (with query).

        Remembered by URL (a few per server: its routes), so that the hot path parses
        each URL once; pools are never dropped, so a remembered answer stays right."""
        found = self._by_url.get(url)
        if found is not None:
            return found
        key, parts = _server(url)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = Pool(self, key[1], key[2], ssl=key[0] == "https")
            pool.extra_headers = self._extra_headers.get(key, b"")
        path = parts.path or "/"
        found = pool, f"{path}?{parts.query}" if parts.query else path
        if len(self._by_url) >= self.URL_MEMORY:
            self._by_url.clear()
        self._by_url[url] = found
        return found

    def set_bearer_token(self, url: str, token: str | None) -> None:
        """Send `Authorization: Bearer <token>` with every request to the server of
        `url` (any path), from now on; None: send none."""
        key, _ = _server(url)
        if token is None:
            line = b""
        elif not token or any(c in token for c in "\r\n\0") or not token.isprintable():
            raise ValueError("an API key must be printable text on one line")
        else:
            line = f"Authorization: Bearer {token}\r\n".encode("latin-1")
        self._extra_headers[key] = line
        if key in self._pools:
            self._pools[key].extra_headers = line

    def evict_idle(self) -> None:
        """At the connection cap, a request to one server must not wait for idle
        keep-alive connections to other servers (a burst of P legs would otherwise hold
        every slot that the D legs then need): close one."""
        for pool in self._pools.values():
            if pool.close_oldest_idle():
                return

    def close(self) -> None:
        self.slots.close(ConnectFailed("the client is closed"))
        self.deadlines.close()
        for pool in self._pools.values():
            pool.close()


def _server(url: str) -> tuple[tuple[str, str, int], SplitResult]:
    """An absolute http(s) URL's server (scheme, host, port), and its parts."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or parts.hostname is None:
        raise ValueError(f"not an http(s) URL: {url!r}")
    return (parts.scheme, parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)), parts
