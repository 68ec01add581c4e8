"""The client over `connection`: pools of keep-alive connections per server under one cap
on open connections (`Slots`, first come first served), one deadline sweep for every
answer (`Deadlines`), and the `Client` that `proxy.upstream.client` uses. The rules they follow
are in the package's docstring (`proxy.upstream.http11`)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
from asyncio import get_running_loop
from dataclasses import dataclass
from time import monotonic
from urllib.parse import SplitResult, urlsplit

from proxy.upstream.http11.connection import (
    ConnectFailed,
    Connection,
    ConnectionLost,
    Fetch,
    Incoming,
    PoolTimeout,
    Response,
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
        self._host_line = f"Host: {authority(host, port)}\r\n"
        self._json_lines = f"{self._host_line}Content-Type: application/json\r\n"
        self.closed = False  # its client forgot it: a connection given back is closed
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
        json: bool = False,
    ) -> tuple[Connection, Response]:
        """Send a request and wait for its answer's status and headers (interim answers
        skipped), at most `timeout` seconds; return the connection and the response,
        whose body is then read with `read_chunk` or `read`. `json`: the body is JSON
        (sent with `Content-Type: application/json`).

        The caller must `release(connection, response)` when done with the response.
        On failure nothing is left to release: PoolTimeout (no room under the cap),
        ConnectFailed, ConnectionLost, MalformedAnswer, httptools.HttpParserError or
        TimeoutError."""
        connection, response = await self._send(self._message(method, path, body, headers, json),
                                                connect_timeout, monotonic() + timeout)
        assert isinstance(response, Response)
        return connection, response

    async def fetch(
        self,
        method: str,
        path: str,
        body: bytes,
        headers: dict[str, str],
        *,
        connect_timeout: float,
        timeout: float,
        limit: int,
        idle: float | None = None,
        json: bool = False,
    ) -> Fetch:
        """Send a request and wait for its whole answer (interim answers skipped): its
        head within `timeout` seconds, and its body by then too, or with `idle` each part
        of it within `idle` seconds of the head or the part before. A body over `limit`
        bytes is AnswerTooLarge. Its connection is back in the pool when this returns:
        nothing to release. It fails as `request` does; `json` as there."""
        _, fetch = await self._send(self._message(method, path, body, headers, json),
                                    connect_timeout, monotonic() + timeout, limit, idle)
        assert isinstance(fetch, Fetch)
        return fetch

    async def _send(self, data: bytes, connect_timeout: float, deadline: float,
                    limit: int | None = None, idle: float | None = None,
                    ) -> tuple[Connection, Incoming]:
        """Send `data` (a request's head and body) and wait, until `deadline`, for its
        answer's head (a Response: `limit` None) or its whole (a Fetch: see `fetch`).
        A kept-alive connection that its server closed as we sent, with no byte of an
        answer, closed without reading the request: it is sent once more, on a new one."""
        connection = self._idle_connection() or await self._lease(connect_timeout, fresh=False)
        while True:  # at most twice: the second time on a new connection
            reused = connection.requests > 0
            incoming = Response(connection) if limit is None else Fetch(connection, limit)
            incoming.deadline, incoming.idle = deadline, idle
            connection.send(incoming, data)
            self._deadlines.watch(incoming)
            try:
                await incoming.arrived
                return connection, incoming
            except BaseException as exc:
                self.release(connection, incoming)
                if not (isinstance(exc, ConnectionLost) and reused and connection.dropped
                        and connection.head_bytes == 0):
                    raise
            connection = await self._lease(connect_timeout, fresh=True)

    def release(self, connection: Connection, response: Incoming) -> None:
        """Done with a response, on every path: a complete answer's connection goes back
        for reuse (its reading resumed), an unfinished one is closed (which is how a
        server learns that the request was abandoned). Releasing twice does nothing."""
        if connection.leased is not response:
            return
        connection.leased = None
        self._deadlines.forget(response)
        if response.complete and connection.reusable and not connection.closed:
            if connection.reading_paused:
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
        self.closed = True
        for connection in list(self._all):
            connection.close()

    def _message(self, method: str, path: str, body: bytes, headers: dict[str, str],
                 json: bool) -> bytes:
        """The request as sent: its head formatted as one string and encoded once (a line
        at a time was 1% of the router's CPU per request, the profile scenario), then
        head, credentials and body joined in one copy (concatenated, three). A JSON
        body's Content-Type is a line of the pool's own (a header of each call's was
        1,200 instructions a leg, callgrind: its dict merged, its line formatted)."""
        lines = self._json_lines if json else self._host_line
        head = f"{method} {path} HTTP/1.1\r\n{lines}Content-Length: {len(body)}\r\n"
        for name, value in headers.items():  # a loop: a comprehension is a call more
            head += f"{name}: {value}\r\n"
        return b"".join((head.encode("latin-1"), self.extra_headers, b"\r\n", body))

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
                deadline = get_running_loop().time() + slots.wait_s
            handed = await self._wait(deadline, fresh=fresh)
            if handed is None:
                break  # a slot was passed to us
            if not handed.closed:
                return handed
            # It closed before we could use it; its slot went on. Look again.
        return await self._open(connect_timeout)

    async def _wait(self, deadline: float, *, fresh: bool) -> Connection | None:
        """Queue for a connection of ours going idle or a slot freeing, until `deadline`."""
        future: asyncio.Future[Connection | None] = get_running_loop().create_future()
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
                    f"no connection to {authority(self.host, self.port)} free within "
                    f"{self._slots.wait_s:g} s (at the cap of {self._slots.cap})"
                ) from None
            raise

    async def _open(self, connect_timeout: float) -> Connection:
        """Open a connection in a slot already taken (given back if this fails)."""
        try:
            async with asyncio.timeout(connect_timeout):
                _transport, connection = await get_running_loop().create_connection(
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
        server, closed if it is for another (its slot passes to it) or this pool was
        forgotten, else idle."""
        if self.closed:
            connection.close()
            return
        waiter = self._slots.first_waiter() if self._slots.waiters else None
        if waiter is None:
            connection.idle_since = monotonic()
            self._idle.append(connection)
        elif waiter[0] is self:
            self._slots.waiters.popleft()
            waiter[1].set_result(connection)
        else:
            connection.close()

    def _idle_connection(self) -> Connection | None:
        now = monotonic()
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
        self._watched: set[Incoming] = set()
        self._timer: asyncio.TimerHandle | None = None

    def watch(self, response: Incoming) -> None:
        self._watched.add(response)
        if self._timer is None:
            self._timer = get_running_loop().call_later(self.TICK_S, self._sweep)

    def forget(self, response: Incoming) -> None:
        """`response` is released: no more waits on it. Dropped now rather than at the
        next sweep, so that the set holds the answers in flight, not every answer of the
        last tick (at thousands of requests a second its table grew with the rate)."""
        self._watched.discard(response)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._watched.clear()

    def _sweep(self) -> None:
        now = monotonic()
        for response in list(self._watched):
            if response.complete or response.error is not None:
                self._watched.discard(response)
            elif response.deadline <= now and response.awaited:
                self._watched.discard(response)
                response._finish(TimeoutError("no answer within the time limit"))
                response._connection.close()
        self._timer = (
            get_running_loop().call_later(self.TICK_S, self._sweep)
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
        each URL once; `forget` drops a server's pool with the URLs remembered for it."""
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

    def forget(self, url: str) -> None:
        """Drop the server of `url` (a server that left): its pool, whose connections
        close (an answer still coming fails), and its credentials. A later request to it
        starts afresh, without them."""
        key, _ = _server(url)
        self._extra_headers.pop(key, None)
        pool = self._pools.pop(key, None)
        if pool is None:
            return
        pool.close()
        for remembered in [u for u, (p, _) in self._by_url.items() if p is pool]:
            del self._by_url[remembered]

    def evict_idle(self) -> None:
        """At the connection cap, a request to one server must not wait for idle
        keep-alive connections to other servers (a burst of P legs would otherwise hold
        every slot that the D legs then need): close one."""
        for pool in self._pools.values():
            if pool.close_oldest_idle():
                return

    def connections(self) -> ConnectionCounts:
        """How many connections are open and idle, and how many slots are taken (each
        open connection holds one): with no request in flight, every open connection is
        idle and holds the only slots taken (the soak's leak check, scripts/soak.py)."""
        pools = self._pools.values()
        return ConnectionCounts(open=sum(len(pool._all) for pool in pools),
                                idle=sum(len(pool._idle) for pool in pools),
                                slots=self.slots.used)

    def close(self) -> None:
        self.slots.close(ConnectFailed("the client is closed"))
        self.deadlines.close()
        for pool in self._pools.values():
            pool.close()


@dataclass(frozen=True)
class ConnectionCounts:
    open: int
    idle: int
    slots: int

    def __add__(self, other: ConnectionCounts) -> ConnectionCounts:
        return ConnectionCounts(open=self.open + other.open, idle=self.idle + other.idle,
                                slots=self.slots + other.slots)


def authority(host: str, port: int) -> str:
    """`host:port` as a Host header and a URL write it: an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _server(url: str) -> tuple[tuple[str, str, int], SplitResult]:
    """An absolute http(s) URL's server (scheme, host, port), and its parts."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or parts.hostname is None:
        raise ValueError(f"not an http(s) URL: {url!r}")
    return (parts.scheme, parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)), parts
