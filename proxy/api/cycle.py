"""An inference request's request-response cycle on the router's listener, without ASGI's
per-request machinery.

uvicorn runs every request through its `RequestResponseCycle`: a scope dict with a copy
of the app's state, an asyncio.Event for the body, ASGI message dicts both ways and every
header of the answer checked on the way out. For a POST to an inference route over
HTTP/1.1 the listener (`listener.GuardedHttpProtocol`) makes an `InferenceCycle` instead,
and `RouterApp.serve_inference` serves it:

- the body is read from the cycle (`read_body`), waiting only while it is still coming;
- the answer is sent through `send`, which takes the ASGI messages the flows send (so a
  flow runs the same under any ASGI server) but builds the head in one pass and sends
  it with the answer's first body bytes, in one write;
- the request carries a small scope of its own (type, method, path, headers and the
  listener's `ClientConnection`): what the router's responses read.

Everything else stays the listener's and uvicorn's: parsing, keep-alive, pipelining,
flow control, shutdown and the client limits. The cycle stands in for uvicorn's where
uvicorn's protocol touches one, by the same names: `body`, `more_body` and
`message_event.set()` (the body arriving), `disconnected` (the client gone),
`response_complete` and `keep_alive` (pipelining, shutdown) and `run_asgi` (the task).
Any other request, and every request while uvicorn's access log is on (it writes the
log lines), takes uvicorn's own cycle.

Measured with `python -m scripts.bench profile` on the 2-core machine of
docs/benchmarks.md: uvicorn's cycle (the scope, the body's Event, the task's wrapper and
the two `send` calls) was about a tenth of the router's CPU per request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.types import Message, Scope
from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE, STATUS_LINE

from proxy.errors import InvalidRequest
from proxy.protocol import ROUTE_PATH, Route, body_too_large, refuse_declared_too_large

logger = logging.getLogger("uvicorn.error")  # where uvicorn's own cycle logs an app's failure

# The paths served on this cycle, as the request line spells them (no query string).
INFERENCE_PATHS = {route.value.encode("ascii"): route for route in Route}

_CHUNKED_END = b"0\r\n\r\n"


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
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None


async def _nothing_received() -> Message:
    # The router's responses never call `receive` on this cycle: the body is read with
    # `read_body`, and the client leaving is told through the `ClientConnection`.
    raise RuntimeError("an inference cycle has no ASGI receive; read its body with read_body")


class InferenceCycle:
    """One inference request on the listener, from its head to its answer's last byte."""

    __slots__ = ("route", "headers", "transport", "flow", "server_state", "keep_alive",
                 "waiting_for_100_continue", "body", "more_body", "disconnected",
                 "response_started", "response_complete", "message_event", "scope",
                 "on_response", "_serve", "_length", "_head")

    receive = staticmethod(_nothing_received)

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
        request's ASGI extensions, and what to call when the answer is complete."""
        self.route = route
        self.headers = headers  # lowercase names, as uvicorn's protocol collects them
        self.transport = transport
        self.flow = flow
        self.server_state = server_state
        self.keep_alive = keep_alive
        self.waiting_for_100_continue = expect_100_continue
        # The request's body so far; `more_body` until its last byte (uvicorn's protocol
        # appends to it and clears the flag).
        self.body = bytearray()
        self.more_body = True
        self.disconnected = False
        self.response_started = False
        self.response_complete = False
        self.message_event = _Arrival()
        self.scope: Scope = {"type": "http", "method": "POST", "path": ROUTE_PATH[route],
                             "headers": headers, "extensions": extensions}
        self.on_response = on_response
        self._serve = serve
        self._length: int | None = None  # the answer's bytes still due; None: chunked
        self._head: bytes | None = None  # the answer's head, sent with its first body bytes

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
        await self.send({"type": "http.response.start", "status": 500,
                         "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                                     (b"content-length", b"21"), (b"connection", b"close")]})
        await self.send({"type": "http.response.body", "body": b"Internal Server Error"})

    # The request's body

    async def read_body(self, limit: int) -> bytes:
        """The whole body, refused (413) as soon as it passes `limit` bytes: by its
        Content-Length before a byte is read, else by what came. A client that leaves
        before its last byte is an InvalidRequest."""
        refuse_declared_too_large(self.headers, limit)
        if self.waiting_for_100_continue and not self.transport.is_closing():
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        self.waiting_for_100_continue = False
        flow = self.flow
        while self.more_body and not self.disconnected:
            if len(self.body) > limit:
                raise body_too_large(len(self.body), limit)
            flow.resume_reading()  # uvicorn's protocol pauses reading over its high water
            await self.message_event.wait()
        # Reading goes on after the body too (paused, a client's leaving would go unseen).
        flow.resume_reading()
        if self.more_body:
            raise InvalidRequest("the client left before sending its whole body")
        body, self.body = self.body, bytearray()  # the cycle keeps no copy
        if len(body) > limit:
            raise body_too_large(len(body), limit)
        return bytes(body)

    # The answer: ASGI's send, for the messages the router's responses send

    async def send(self, message: Message) -> None:
        flow = self.flow
        if flow.write_paused and not self.disconnected:
            await flow.drain()  # the client is behind: wait (the listener's limits apply)
        if self.disconnected:
            return
        if not self.response_started:
            if message["type"] != "http.response.start":
                raise RuntimeError(f"Expected ASGI message 'http.response.start', but got "
                                   f"'{message['type']}'.")
            self._start(message["status"], message.get("headers", ()))
            return
        if self.response_complete or message["type"] != "http.response.body":
            raise RuntimeError(f"Unexpected ASGI message '{message['type']}' sent.")
        body: bytes = message.get("body", b"")
        more_body: bool = message.get("more_body", False)
        if self._length is None:  # chunked
            out = b"%x\r\n%b\r\n" % (len(body), body) if body else b""
            if not more_body:
                out += _CHUNKED_END
        else:
            self._length -= len(body)
            if self._length < 0:
                raise RuntimeError("Response content longer than Content-Length")
            out = body
        head, self._head = self._head, None
        if head is not None:
            out = head + out
        transport = self.transport
        if out:
            transport.write(out)
        if not more_body:
            if self._length:
                raise RuntimeError("Response content shorter than Content-Length")
            self.response_complete = True
            if not self.keep_alive:
                transport.close()
            self.on_response()

    def _start(self, status: int, headers: Any) -> None:
        """The answer's head, held for the first body bytes: a client gets the head and
        a whole answer in one segment, and a stream's head with its first event."""
        self.response_started = True
        self.waiting_for_100_continue = False
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head.append(b"%b: %b\r\n" % (name, value))
        framed = close = False
        headers = list(headers)
        # uvicorn's checks of every name and value, two searches in all rather than two
        # per header (a forbidden byte shows as well in the joined names or values)
        if (HEADER_RE.search(b"".join([name for name, _ in headers]))
                or HEADER_VALUE_RE.search(b"".join([value for _, value in headers]))):
            bad = next(name for name, value in headers
                       if HEADER_RE.search(name) or HEADER_VALUE_RE.search(value))
            raise RuntimeError(f"Invalid HTTP header: {bad!r}")
        for name, value in headers:
            name = name.lower()
            if name == b"content-length" and not framed:
                self._length, framed = int(value), True
            elif name == b"transfer-encoding" and value.lower() == b"chunked":
                self._length, framed = None, True
            elif name == b"connection" and b"close" in [t.strip() for t in value.lower().split(b",")]:
                self.keep_alive, close = False, True
            head.append(b"%b: %b\r\n" % (name, value))
        if not self.keep_alive and not close:
            head.append(b"connection: close\r\n")
        if not framed:
            if status in (204, 304):
                self._length = 0
            else:
                self._length = None
                head.append(b"transfer-encoding: chunked\r\n")
        head.append(b"\r\n")
        self._head = b"".join(head)


def _nothing() -> None:
    pass
