"""One keep-alive HTTP/1.1 connection to a server, as an asyncio protocol, and the answer
it reads (`Response`), parsed by httptools; the errors a call can end with. The rules
they follow are in the package's docstring (`proxy.upstream.http11`)."""

from __future__ import annotations

import asyncio
import collections
from asyncio import get_running_loop
from time import monotonic
from typing import Protocol

import httptools

# A streamed body pauses reading from the server above this many buffered bytes.
HIGH_WATER = 256 * 1024


class ConnectionLost(Exception):
    """The server closed the connection before its answer was complete."""


class ConnectFailed(Exception):
    """No connection could be opened (refused, unreachable, or timed out)."""


class MalformedAnswer(Exception):
    """The server's answer breaks our rules: headers too large, an unasked-for upgrade."""


class AnswerTooLarge(MalformedAnswer):
    """A whole answer's body is larger than its reader's cap."""


class PoolTimeout(Exception):
    """No room for a connection under the client's cap within its pool timeout."""


class Incoming:
    """What the connection reads for one request: the answer's status and headers, then
    its body. `Response` hands the body out in parts as they come (a stream); `Fetch`
    gathers it and wakes its caller once, at the end (a whole answer). Both are timed out
    by the client's `Deadlines` sweep while someone waits on them (`awaited`)."""

    # What an answer starts with, as class attributes: set on an answer only when they
    # change, not stored by every constructor (`scripts.bench_path --bytecodes`).
    status = 0
    headed = False  # the final status and headers are in
    complete = False
    error: BaseException | None = None
    # Monotonic time by which the next byte must arrive, enforced by the client's
    # `Deadlines` sweep while someone waits (`awaited`). `idle`, once set, pushes it
    # that far ahead whenever a chunk arrives (and, for a Response, whenever a wait for
    # one begins).
    deadline = float("inf")
    idle: float | None = None

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        # Set when its sender can go on: a Response's head is in, a Fetch's whole answer.
        self.arrived: asyncio.Future[None] = connection.loop.create_future()
        # The headers as they came: names and values as sent (`header` looks one up).
        self.raw_headers: list[tuple[bytes, bytes]] = []

    def header(self, name: bytes) -> str | None:
        """The value of the header `name` (lowercase), the last one if repeated."""
        found = None
        for key, value in self.raw_headers:  # a few headers: a scan, no dict per answer
            # (lowercased only when its length matches: a call a header, an answer from
            # vLLM has five)
            if len(key) == len(name) and key.lower() == name:
                found = value
        return None if found is None else found.decode("latin-1")

    @property
    def headers(self) -> dict[str, str]:
        """Every header, names lowercased (built on each call: `header` for one)."""
        return {key.decode("latin-1").lower(): value.decode("latin-1")
                for key, value in self.raw_headers}

    @property
    def awaited(self) -> bool:
        """Someone waits on the server now."""
        raise NotImplementedError

    # Called by the connection (the protocol's callbacks):

    def _headed(self, status: int) -> None:
        raise NotImplementedError

    def _feed(self, chunk: bytes) -> None:
        raise NotImplementedError

    def _finish(self, error: BaseException | None = None) -> None:
        raise NotImplementedError


class Response(Incoming):
    """An answer being received: status and headers first (`head`), then body chunks."""

    def __init__(self, connection: Connection) -> None:
        super().__init__(connection)
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None

    def expect_within(self, seconds: float, *, per_chunk: bool = False) -> None:
        """Time out unless the next part comes within `seconds` (with `per_chunk`, each
        chunk of the body restarts the clock)."""
        self.deadline = monotonic() + seconds
        self.idle = seconds if per_chunk else None

    async def read_chunk(self) -> bytes:
        """The next body chunk; b"" at the end. Raises the connection's error, if any."""
        while not self._chunks:
            if self.error is not None:
                raise self.error
            if self.complete:
                return b""
            if self.idle is not None:  # the server is late only while we wait for it
                self.deadline = monotonic() + self.idle
            self._waiter = self._connection.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._take()

    def _take(self) -> bytes:
        """Hand out the oldest buffered chunk (reading resumes below the high water)."""
        chunk = self._chunks.popleft()
        self._buffered -= len(chunk)
        if self._buffered < HIGH_WATER and self._connection.reading_paused:
            self._connection.resume_reading()
        if self.complete and not self._chunks:
            self._connection.handed_out(self)
        return chunk

    @property
    def head(self) -> asyncio.Future[None]:
        """Set when the status and headers are in."""
        return self.arrived

    @property
    def awaited(self) -> bool:
        """Someone waits on the server: for the head, or for a chunk. A streamed body's
        reader that is busy elsewhere (writing to a slow client) does not make the
        server late."""
        return self._waiter is not None or not self.headed

    @property
    def at_end(self) -> bool:
        """Every byte of the body has been handed out."""
        return self.complete and not self._chunks

    async def read(self, limit: int | None = None) -> bytes:
        """The rest of the body (at once when it is all in: the usual whole answer). A
        body over `limit` bytes raises AnswerTooLarge as soon as that is known (its
        Content-Length, else the bytes read so far): at most `limit` bytes are kept."""
        declared = self.header(b"content-length") or ""
        if limit is not None and declared.isdigit() and int(declared) > limit:
            raise AnswerTooLarge(f"Content-Length {declared} over {limit} bytes")
        if self.complete:  # all in (the usual whole answer): handed out in one piece
            if limit is not None and self._buffered > limit:
                raise AnswerTooLarge(f"body over {limit} bytes")
            body = b"".join(self._chunks)
            self._chunks.clear()
            self._buffered = 0
            self._connection.handed_out(self)
            return body
        parts = []
        size = 0
        while chunk := await self.read_chunk():
            size += len(chunk)
            if limit is not None and size > limit:
                raise AnswerTooLarge(f"body over {limit} bytes")
            parts.append(chunk)
        return b"".join(parts)

    # Called by the connection (the protocol's callbacks):

    def _headed(self, status: int) -> None:
        self.status = status
        self.headed = True
        self.arrived.set_result(None)

    def _feed(self, chunk: bytes) -> None:
        if self.idle is not None:
            self.deadline = monotonic() + self.idle
        self._chunks.append(chunk)
        self._buffered += len(chunk)
        if self._buffered >= HIGH_WATER:
            self._connection.pause_reading()
        if self._waiter is not None:
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
            if not self.arrived.done():
                self.arrived.set_exception(error)
        if self._waiter is not None:
            self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class Fetch(Incoming):
    """A request whose whole answer is wanted (P's leg, a non-streamed D's, the control
    calls): its body is gathered as it comes, at most `limit` bytes (AnswerTooLarge as
    soon as it passes them), and `arrived` is set once its last byte is in, so that its
    caller wakes once per answer. Nobody reads it in parts, so its connection goes back
    to its pool as the answer ends.

    Measured on `python -m scripts.bench_path`'s path, by instructions counted (the time
    moves more between runs than this): on a `Response` (a future for the head, a deque
    for the body, a read after the wake-up) a request took 2.4% more."""

    awaited = True  # its caller waits on it from the request to the answer's end
    body = b""  # the whole body, once complete
    _size = 0

    def __init__(self, connection: Connection, limit: int) -> None:
        super().__init__(connection)
        self._parts: list[bytes] = []
        self._limit = limit

    def _headed(self, status: int) -> None:
        # No look at its Content-Length: `_feed` refuses the body once over the limit.
        self.status = status
        self.headed = True
        if self.idle is not None:
            self.deadline = monotonic() + self.idle

    def _feed(self, chunk: bytes) -> None:
        self._size += len(chunk)
        if self._size > self._limit:
            raise AnswerTooLarge(f"body over {self._limit} bytes")
        self._parts.append(chunk)
        if self.idle is not None:
            self.deadline = monotonic() + self.idle

    def _finish(self, error: BaseException | None = None) -> None:
        if self.complete or self.error is not None:
            return
        done = self.arrived
        if error is None:
            self.complete = True
            parts = self._parts
            self.body = parts[0] if len(parts) == 1 else b"".join(parts)
            self._parts = []
            self._connection.handed_out(self)  # free at once: nothing more to hand out
            if not done.done():
                done.set_result(None)
        else:
            self.error = error
            if not done.done():
                done.set_exception(error)


class Owner(Protocol):
    """What a connection needs of the pool that owns it (`proxy.upstream.http11.pool.Pool`)."""

    max_header_bytes: int

    def release(self, connection: Connection, response: Incoming) -> None:
        """The answer ended and every byte was handed over: idle, or closed."""

    def forget(self, connection: Connection) -> None:
        """The connection closed."""


class Connection(asyncio.Protocol):
    """One keep-alive connection to a server, carrying one request at a time."""

    def __init__(self, pool: Owner) -> None:
        # Its event loop, for its answers' futures: read once (3.11's
        # `get_running_loop()` makes a getpid system call each time).
        self.loop = get_running_loop()
        self._pool = pool
        self._max_header_bytes = pool.max_header_bytes
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._response: Incoming | None = None  # the answer being parsed
        self._headers: list[tuple[bytes, bytes]] = []  # its headers, as they are parsed
        self.leased: Incoming | None = None  # the answer its caller has not released yet
        self.reusable = False  # the last answer ended and the server keeps the connection
        self.requests = 0  # requests sent on it (one sent when this is not 0 reuses it)
        # Bytes received for the current request while its final head was not in yet
        # (0: no byte of an answer arrived), and its status line's size.
        self.head_bytes = 0
        self._status_size = 0
        self._interim = False  # the message being parsed is a 1xx interim answer
        self.reading_paused = False  # public: Response and Pool skip a call when not
        self.closed = False
        self.dropped = False  # closed by the server (or the network), not by us
        self.idle_since = monotonic()

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
        heading = not response.headed
        if heading:
            self.head_bytes += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__  # what our callback raised
            self._fail(cause if isinstance(cause, MalformedAnswer) else exc)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as broken:
            self._fail(broken)  # (a name of its own: compiled, `exc` keeps its type above)
        else:
            # A head still incomplete past the cap (arriving in pieces) is not waited out.
            if heading and self.head_bytes > self._max_header_bytes and not response.headed:
                self._fail(self._too_large())

    def connection_lost(self, exc: Exception | None) -> None:
        self.dropped = not self.closed
        self.closed = True
        self._pool.forget(self)
        response, self._response = self._response, None
        if response is None:
            return
        if exc is None and response.headed and _ends_at_close(response):
            response._finish()  # its body was delimited by the end of the connection
        else:
            response._finish(ConnectionLost(f"connection closed: {exc or 'by the server'}"))

    # httptools callbacks

    def on_message_begin(self) -> None:
        if self._response is None:
            raise MalformedAnswer("bytes after the end of the answer")

    def on_status(self, status: bytes) -> None:
        self._status_size = len(status) + 15  # "HTTP/1.1 200 " and CRLF around the reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))  # (on_message_begin made sure of an answer)

    def on_headers_complete(self) -> None:
        response = self._response
        if response is None or response.headed:
            return
        # Past the cap only if the bytes received so far are (they hold the head): the
        # head's own size is summed then, not per header.
        if self.head_bytes > self._max_header_bytes and self._status_size + sum(
                [len(name) + len(value) + 4 for name, value in self._headers]) \
                > self._max_header_bytes:
            raise self._too_large()
        status = self._parser.get_status_code()
        if status < 200:
            if status == 101:
                raise MalformedAnswer("101 Switching Protocols to a request that asked for none")
            # An interim answer: the final one follows on the same connection.
            self._interim = True
            self._headers.clear()
            return
        response._headed(status)

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

    def handed_out(self, response: Incoming) -> None:
        """The answer ended and its reader has every byte: nothing more is read from
        the connection for it, so it is free at once, while the caller may still be
        passing the last chunk on (its release then does nothing)."""
        self._pool.release(self, response)

    def send(self, incoming: Incoming, data: bytes) -> None:
        """Send a request (`data`: its head and body); its answer is read into `incoming`."""
        assert self._transport is not None and self.leased is None  # one at a time
        self._response = self.leased = incoming
        self._headers = incoming.raw_headers
        self.requests += 1
        self.reusable = False
        self.head_bytes = 0
        self._transport.write(data)

    def pause_reading(self) -> None:
        if not self.reading_paused and self._transport is not None:
            self.reading_paused = True
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self.reading_paused and self._transport is not None and not self.closed:
            self.reading_paused = False
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


def _ends_at_close(response: Incoming) -> bool:
    """Whether the answer's body is delimited by the end of the connection: neither
    Content-Length nor chunked, and a status that has a body."""
    return (
        response.status not in (204, 304)
        and response.header(b"content-length") is None
        and "chunked" not in (response.header(b"transfer-encoding") or "").lower()
    )
