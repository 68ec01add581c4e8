"""An inference request's request-response cycle on the router's listener, without ASGI's
per-request machinery.

uvicorn runs every request through its `RequestResponseCycle`: a scope dict with a copy
of the app's state, an asyncio.Event for the body, ASGI message dicts both ways and every
header of the answer checked on the way out. For a POST to an inference route over
HTTP/1.1 the listener (`listener.GuardedHttpProtocol`) makes an `InferenceCycle` instead,
and `InferenceRoutes.serve_inference` (`proxy.api.inference`) serves it:

- the body is read from the cycle (`read_body`), waiting only while it is still coming;
- the cycle is the request's `relay.ClientAnswer`: a whole answer is framed and written
  in one write with its head, a stream's head goes with its first event, and no ASGI
  message is built (a flow answers the same way under any ASGI server through
  `relay.AsgiAnswer`);
- the listener's `ClientConnection` tells the flow of a client gone.

Everything else stays the listener's and uvicorn's: parsing, keep-alive, pipelining,
flow control, shutdown and the client limits. The cycle stands in for uvicorn's where
uvicorn's protocol touches one, by the same names: `body`, `more_body` and
`message_event.set()` (the body arriving), `disconnected` (the client gone),
`response_complete` and `keep_alive` (pipelining, shutdown) and `run_asgi` (the task).
Any other request, and every request while uvicorn's access log is on (it writes the
log lines), takes uvicorn's own cycle.

Measured with `python -m scripts.bench profile` on the 2-core machine of
docs/benchmarks.md: uvicorn's cycle (the scope, the body's Event, the task's wrapper and
the two `send` calls) was about a tenth of the router's CPU per request. Then, by
instructions counted on `python -m scripts.bench_path`'s path: the ASGI messages of an
answer, and their framing and checks, were 7% of a request's.
"""

from __future__ import annotations

import asyncio
import logging
from asyncio import get_running_loop
from collections.abc import Awaitable, Callable
from typing import Any, Final

from uvicorn.protocols.http.httptools_impl import HEADER_VALUE_RE, STATUS_LINE

from proxy.errors import InvalidRequest
from proxy.flow.relay import CLIENT_CONNECTION, ClientConnection, Headers
from proxy.protocol import Route, body_too_large, refuse_declared_too_large

logger = logging.getLogger("uvicorn.error")  # where uvicorn's own cycle logs an app's failure

# The paths served on this cycle, as the request line spells them (no query string).
INFERENCE_PATHS = {route.value.encode("ascii"): route for route in Route}

_CHUNKED_END = b"0\r\n\r\n"
_INTERNAL_ERROR = b"Internal Server Error"


class _Arrival:
    """The body's arrival, as uvicorn's protocol signals it (`set()` per chunk and at the
    end): a waiter wakes; with none waiting nothing is kept, since the reader checks the
    cycle's state before it waits. A future only while someone waits, not an Event per
    request."""

    __slots__ = ("_waiter",)

    def __init__(self) -> None:
        self._waiter: asyncio.Future[None] | None = None

    def set(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self) -> None:
        self._waiter = get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None


class InferenceCycle:
    """One inference request on the listener, from its head to its answer's last byte."""

    # Its state as a request starts, as class attributes: set on the cycle only when it
    # changes (a store per attribute per request, in a constructor on every request).
    more_body = True  # until the body's last byte (uvicorn's protocol clears it)
    disconnected = False
    response_started = False
    response_complete = False
    _head: bytes | None = None  # a stream's head, sent with its first bytes

    def __init__(
        self,
        route: Route,
        headers: list[tuple[bytes, bytes]],
        *,
        transport: Any,
        flow: Any,
        server_state: Any,
        extensions: dict[str, Any],
        on_response: Callable[[], None],
        keep_alive: bool,
        expect_100_continue: bool,
        serve: Callable[[InferenceCycle], Awaitable[None]],
    ) -> None:
        """What it uses of the connection, given as uvicorn gives its own cycle (not the
        protocol: a cycle that held its protocol would keep a closed connection, and its
        last body, alive until a full garbage collection): the client's transport (its
        socket's, which sends what it is given at once), uvicorn's FlowControl
        (write_paused, drain, resume_reading) and ServerState (default_headers), the
        request's ASGI extensions (the listener's `ClientConnection` among them), and
        what to call when the answer is complete."""
        self.route = route
        self.headers = headers  # lowercase names, as uvicorn's protocol collects them
        self.transport = transport
        self.flow = flow
        self.server_state = server_state
        self.keep_alive = keep_alive
        self.waiting_for_100_continue = expect_100_continue
        self.body = bytearray()  # the request's body so far (uvicorn's protocol appends)
        self.message_event = _Arrival()
        self.connection: ClientConnection | None = extensions.get(CLIENT_CONNECTION)
        self.on_response = on_response
        self._serve = serve

    # The task: uvicorn's protocol starts it by this name (`_start_asgi_task`)

    async def run_asgi(self, app: object) -> None:
        """Serve the request, answering 500 if the app fails before its answer begins,
        as uvicorn's own cycle does (`app` is uvicorn's; this cycle serves its own)."""
        try:
            await self._serve(self)
        except BaseException as exc:
            logger.error("Exception in ASGI application\n", exc_info=exc)
            if self._head is not None:  # a head not sent yet can still become a 500
                self.response_started, self._head = False, None
            if not self.response_started:
                await self._send_500()
            else:
                self.transport.close()
        else:
            if not self.response_started and not self.disconnected:
                logger.error("ASGI callable returned without starting response.")
                await self._send_500()
            elif not self.response_complete and not self.disconnected:
                logger.error("ASGI callable returned without completing response.")
                self.transport.close()
        finally:
            self.on_response = _nothing

    async def _send_500(self) -> None:
        self.keep_alive = False
        await self.whole(500, "text/plain; charset=utf-8", [], _INTERNAL_ERROR)

    # The request's body

    async def read_body(self, limit: int) -> bytes:
        """The whole body, refused (413) as soon as it passes `limit` bytes: by its
        Content-Length before a byte is read, else by what came. A client that leaves
        before its last byte is an InvalidRequest."""
        if self.more_body:  # (all in, as usual: its length is checked below, no header scan)
            refuse_declared_too_large(self.headers, limit)
        if self.waiting_for_100_continue and not self.transport.is_closing():
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        self.waiting_for_100_continue = False
        flow = self.flow
        while self.more_body and not self.disconnected:
            if len(self.body) > limit:
                raise body_too_large(len(self.body), limit)
            if flow.read_paused:  # the reader pauses reading over its high water
                flow.resume_reading()
            await self.message_event.wait()
        # Reading goes on after the body too (paused, a client's leaving would go unseen).
        if flow.read_paused:
            flow.resume_reading()
        if self.more_body:
            raise InvalidRequest("the client left before sending its whole body")
        body, self.body = self.body, bytearray()  # the cycle keeps no copy
        if len(body) > limit:
            raise body_too_large(len(body), limit)
        return bytes(body)

    # The answer: the `relay.ClientAnswer` the router's flows answer to

    async def whole(self, status: int, content_type: str, headers: Headers, body: bytes) -> None:
        """A whole answer: its head and body in one write."""
        if self.flow.write_paused:
            await self._catch_up()
        if not self._may_write():
            return
        if self.response_started:
            raise RuntimeError("the answer was started already")
        head = self._head_of(status, content_type, headers,
                             b"content-length: %d\r\n" % len(body))
        self.response_started = True
        self.transport.write(head + body)
        self._complete()

    async def start(self, status: int, content_type: str, headers: Headers) -> None:
        """A stream's head, held for its first bytes: the client gets it with the first
        event, in one segment."""
        if self.flow.write_paused:
            await self._catch_up()
        if not self._may_write():
            return
        if self.response_started:
            raise RuntimeError("the answer was started already")
        self._head = self._head_of(status, content_type, headers,
                                   b"transfer-encoding: chunked\r\n")
        self.response_started = True

    async def write(self, chunk: bytes) -> None:
        """More of the stream, as one chunk (nothing sent for b"", but a held head)."""
        if self.flow.write_paused:
            await self._catch_up()
        if not self._may_write():
            return
        out = b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunk else b""
        head, self._head = self._head, None
        if head is not None:
            out = head + out
        if out:
            self.transport.write(out)

    async def end(self, chunk: bytes) -> None:
        """The stream's last bytes and its end."""
        if self.flow.write_paused:
            await self._catch_up()
        if not self._may_write():
            return
        out = b"%x\r\n%b\r\n0\r\n\r\n" % (len(chunk), chunk) if chunk else _CHUNKED_END
        head, self._head = self._head, None
        self.transport.write(out if head is None else head + out)
        self._complete()

    async def _catch_up(self) -> None:
        """Wait while the client is behind (the listener's limits apply), unless it is gone."""
        if not self.disconnected:
            await self.flow.drain()

    def _may_write(self) -> bool:
        """False: the client is gone, and nothing is written. (Not a coroutine: the wait
        for a client behind is `_catch_up`'s, awaited only then; a coroutine per write
        is a generator object made, run and freed.)"""
        if self.response_complete:
            raise RuntimeError("the answer is complete already")
        return not self.disconnected

    def _complete(self) -> None:
        self.response_complete = True
        if not self.keep_alive:
            self.transport.close()
        self.on_response()

    def _head_of(self, status: int, content_type: str, headers: Headers, framing: bytes) -> bytes:
        """An answer's head: the status line, the server's own headers (date, server),
        the content type, `framing`, the router's `headers`, and `connection: close`
        when the connection ends after it. A value that could split the answer (the
        content type may be an upstream's; a request id comes from a client, checked
        when read) is refused with a RuntimeError, before anything is sent."""
        head = [STATUS_LINE[status], _rendered(self.server_state.default_headers),
                _content_type_line(content_type), framing]
        for name, value in headers:
            if _LF in value or _CR in value:  # (no call: this runs for every header)
                raise RuntimeError(f"Invalid HTTP header value: {name!r}: {value!r}")
            head.append(b"%b: %b\r\n" % (name, value))
        if not self.keep_alive:
            head.append(b"connection: close\r\n")
        head.append(b"\r\n")
        self.waiting_for_100_continue = False
        return b"".join(head)


# The bytes that could split an answer, as ints: `10 in value` looks for one byte, where
# `b"\n" in value` first tries the bytes as an index and makes and drops a TypeError
# (about 2,200 instructions per test, counted with callgrind: docs/benchmarks.md).
_LF: Final = ord("\n")
_CR: Final = ord("\r")

_content_type_lines: dict[str, bytes] = {}


def _content_type_line(content_type: str) -> bytes:
    """The content type's header line, checked and rendered once per value (a few: the
    router's own and its upstreams'); at most 64 kept. (Checked by a regular expression
    on every answer, it was 1.5% of the router's CPU per request, `perf` on the
    overhead scenario.)"""
    line = _content_type_lines.get(content_type)
    if line is None:
        kind = content_type.encode("latin-1")
        if HEADER_VALUE_RE.search(kind):
            raise RuntimeError(f"Invalid HTTP header value: {kind!r}")
        line = b"content-type: %b\r\n" % kind
        if len(_content_type_lines) >= 64:
            _content_type_lines.clear()
        _content_type_lines[content_type] = line
    return line


_last_rendered: tuple[list[tuple[bytes, bytes]], bytes] = ([], b"")


def _rendered(defaults: list[tuple[bytes, bytes]]) -> bytes:
    """The server's own header lines (date, server): rendered once per list, which uvicorn
    replaces each second with a new date in it."""
    global _last_rendered
    if _last_rendered[0] is not defaults:
        _last_rendered = (defaults, b"".join([b"%b: %b\r\n" % pair for pair in defaults]))
    return _last_rendered[1]


def _nothing() -> None:
    pass
