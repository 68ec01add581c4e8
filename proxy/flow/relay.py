"""Sending the answer downstream, and watching the client while a flow runs.

An answer goes to a `ClientAnswer`: on the router's own listener the request's cycle
(`proxy.api.cycle.InferenceCycle`), which frames it and writes it to the client's socket
itself; under any other ASGI server `AsgiAnswer`, which sends it as ASGI messages.

`Downstream` is the flow's side of it: it sends the response head only with the first
body byte, so until then any failure can still become a proper HTTP error (and a retry
is still possible). Once started, a streamed answer that fails ends with an SSE error
event. `relay_events` passes D's streamed answer to it as whole SSE events.

`FlowResponse` is what a route returns: `answer` runs the flow while watching for the
client's disconnect; a client that leaves cancels the flow, and with it both legs, at
once. The router's listener tells it through the request's `ClientConnection` (no task
per request); under another ASGI server (the response called as an ASGI app) a watcher
task waits for the disconnect.
"""

from __future__ import annotations

import asyncio
import logging
from asyncio import create_task, current_task
from collections.abc import Awaitable, Callable
from time import perf_counter
from typing import Any, Protocol

from mypy_extensions import mypyc_attr
from starlette.types import Receive, Scope, Send

from proxy.errors import RouterError, internal_error, sse_error_event
from proxy.task_scope import own_exception_state
from proxy.upstream.client import StreamedResponse

logger = logging.getLogger("pdproxy.relay")


# The ASGI extension (in `scope["extensions"]`) under which the router's listener gives
# a request its `ClientConnection`.
CLIENT_CONNECTION = "pdproxy.client_connection"


class ClientConnection:
    """A client's connection as the listener sees it: the request running on it may ask
    to be told when it is lost (one callback at a time; HTTP/1.1 runs one request at a
    time on a connection). A task per request waiting on ASGI's `receive` for the
    disconnect did the same for about a tenth of the router's CPU per request."""

    __slots__ = ("_on_lost", "_gone", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._on_lost: Callable[[], None] | None = None
        self._gone = False
        # The connection's event loop (None: not known), for the request's task to be
        # found without `get_running_loop`, a getpid system call in 3.11 (strace on the
        # router: 1.1 getpid calls per request before, 0.1 after).
        self.loop = loop

    def on_lost(self, callback: Callable[[], None] | None) -> None:
        """Call `callback` when the connection is lost (None: no longer); at once if it
        is lost already (the client left after its body, before the flow began)."""
        if self._gone and callback is not None:
            callback()
        else:
            self._on_lost = callback

    def lost(self) -> None:
        """The listener's part: the connection is gone."""
        self._gone = True
        callback, self._on_lost = self._on_lost, None
        if callback is not None:
            callback()


class EventTooLarge(Exception):
    """An SSE event grew past the framer's cap before it ended."""


class EventFramer:
    """Cuts a relayed SSE byte stream at event boundaries, so only whole events go out.

    An upstream's chunks need not end where its events do. Holding back a trailing
    partial event costs nothing in the usual case (vLLM writes whole events) and means a
    stream that breaks off mid-event still ends with an error event the client can read,
    never with half an event glued to it.

    Linear in the bytes fed: a partial event is kept as its chunks, each new chunk is
    searched alone (with the 3 bytes before it, where a boundary may begin), and the
    chunks are joined once, when the event ends. An event that grows past `limit` bytes
    before it ends raises EventTooLarge: the framer holds at most that much."""

    __slots__ = ("_held", "_held_bytes", "_limit", "_tail")

    def __init__(self, limit: int | None = None) -> None:
        self._held: list[bytes] = []  # the partial event's chunks
        self._held_bytes = 0
        self._tail = b""  # the last 3 bytes held: where a boundary may begin
        self._limit = limit

    def feed(self, chunk: bytes) -> bytes:
        """The whole events that `chunk` completes (b"" when none yet)."""
        if not self._held:
            if chunk.endswith((b"\n\n", b"\r\n\r\n")):  # the usual case: whole events
                return chunk
            cut = _after_last_boundary(chunk)
            if cut:
                self._hold(chunk[cut:])
                return chunk[:cut]
            self._hold(chunk)
            return b""
        tail = self._tail
        cut = _after_last_boundary(tail + chunk) - len(tail)
        if cut <= 0:
            self._hold(chunk)
            return b""
        events = b"".join([*self._held, chunk[:cut]])
        self._held, self._held_bytes, self._tail = [], 0, b""
        if cut < len(chunk):
            self._hold(chunk[cut:])
        return events

    def _hold(self, part: bytes) -> None:
        if not part:
            return
        self._held.append(part)
        self._held_bytes += len(part)
        self._tail = (self._tail + part[-3:])[-3:]
        if self._limit is not None and self._held_bytes > self._limit:
            raise EventTooLarge(f"an event over {self._limit} bytes")

    def rest(self) -> bytes:
        """What is held back (the stream's end: sent as it is)."""
        rest = b"".join(self._held)
        self._held, self._held_bytes, self._tail = [], 0, b""
        return rest


def _after_last_boundary(data: bytes) -> int:
    """Where the bytes after the last event boundary (a blank line) begin; 0: none."""
    lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


Headers = list[tuple[bytes, bytes]]  # an answer's, names lowercase


class ClientAnswer(Protocol):
    """Where a request's answer goes. A stream's head is sent with its first bytes, by
    `write` or `end`; `whole` sends a whole answer (its Content-Length added). The
    `content_type` may come from an upstream; `headers` are the router's own (lowercase
    names), with the content type and the framing added here."""

    async def whole(self, status: int, content_type: str, headers: Headers, body: bytes) -> None:
        """A whole answer."""

    async def start(self, status: int, content_type: str, headers: Headers) -> None:
        """A streamed answer's head (chunked)."""

    async def write(self, chunk: bytes) -> None:
        """More of the stream (b"": nothing yet)."""

    async def end(self, chunk: bytes) -> None:
        """The stream's last bytes, and its end."""


class AsgiAnswer:
    """A `ClientAnswer` as ASGI messages, for any ASGI server."""

    __slots__ = ("_send",)

    def __init__(self, send: Send) -> None:
        self._send = send

    async def whole(self, status: int, content_type: str, headers: Headers, body: bytes) -> None:
        await self.start(status, content_type,
                         [*headers, (b"content-length", b"%d" % len(body))])
        await self.end(body)

    async def start(self, status: int, content_type: str, headers: Headers) -> None:
        await self._send({"type": "http.response.start", "status": status,
                          "headers": [(b"content-type", content_type.encode("latin-1")),
                                      *headers]})

    async def write(self, chunk: bytes) -> None:
        await self._send({"type": "http.response.body", "body": chunk, "more_body": True})

    async def end(self, chunk: bytes) -> None:
        await self._send({"type": "http.response.body", "body": chunk, "more_body": False})


class Downstream:
    """The client's side of one exchange."""

    __slots__ = ("_out", "streaming", "headers", "started", "finished", "status",
                 "first_byte_at")

    def __init__(self, out: ClientAnswer, *, streaming: bool, headers: Headers):
        self._out = out
        self.streaming = streaming
        self.headers = headers  # sent with the head; the flow may add to them before
        self.started = False  # the head went out: the status can no longer change
        self.finished = False
        self.status = 0
        self.first_byte_at: float | None = None  # perf_counter()

    # Not coroutines of their own: each returns its answer's, one generator object less
    # per call (the flows await them on every request).

    def start(self, status: int, content_type: str) -> Awaitable[None]:
        self.status = status
        self.started = True
        self.first_byte_at = perf_counter()
        return self._out.start(status, content_type, self.headers)

    def write(self, chunk: bytes) -> Awaitable[None]:
        return self._out.write(chunk)

    def end(self, chunk: bytes = b"") -> Awaitable[None]:
        self.finished = True
        return self._out.end(chunk)

    def whole(self, status: int, content_type: str, body: bytes) -> Awaitable[None]:
        """A whole answer, with its Content-Length (not chunked: the server frames nothing,
        and the client knows the size from the head)."""
        self.status = status
        self.started = self.finished = True
        self.first_byte_at = perf_counter()
        return self._out.whole(status, content_type, self.headers, body)

    async def fail(self, error: RouterError) -> None:
        """Tell the client about an error, in the way still open to us."""
        if self.finished:
            return
        if not self.started:
            for name, value in error.headers().items():
                self.headers.append((name.lower().encode("latin-1"), value.encode("latin-1")))
            await self.whole(error.status, "application/json", error.body())
        elif self.streaming:
            await self.end(sse_error_event(error))
        else:
            await self.end()  # a cut JSON body: the client sees a broken answer, not a wrong one


async def relay_events(answer: StreamedResponse, down: Downstream, *,
                       first_byte: Callable[[], None]) -> None:
    """Pass a streamed answer to the client as it comes, in whole SSE events only: if D
    breaks off mid-event, the client's stream still ends with a readable error event.
    `first_byte` is called once, just before the head goes out. An event over
    `limits.max_upstream_event_bytes` ends it as D's broken answer."""
    framer = EventFramer(answer.max_event_bytes)
    while chunk := await answer.read_chunk():
        try:
            events = framer.feed(chunk)
        except EventTooLarge as exc:
            raise answer.event_too_large() from exc
        last = answer.at_end
        if last:
            events += framer.rest()  # D's last bytes go out as they are
        if events and not down.started:
            first_byte()
            await down.start(answer.status, answer.content_type)
        if last:  # the last chunk: send it with the end
            break
        if events:
            await down.write(events)
    else:
        events = framer.rest()
    if not down.started:
        await down.start(answer.status, answer.content_type)
    await down.end(events)


# Compiled (setup.py), a class is subclassed in Python only where it says so:
# `ItlWatchedResponse` (proxy/flow/local.py, not compiled) extends this one.
@mypyc_attr(allow_interpreted_subclasses=True)
class FlowResponse:
    """Runs `flow(downstream)` while watching for the client leaving (`answer`); an ASGI
    app as well, for any ASGI server.

    `done(downstream, error, client_left)` is called once at the end, whatever happened."""

    def __init__(
        self,
        flow: Callable[[Downstream], Awaitable[None]],
        *,
        streaming: bool,
        headers: Headers,
        done: Callable[[Downstream, RouterError | None, bool], None],
    ) -> None:
        self._flow = flow
        self._streaming = streaming
        self._headers = headers
        self._done = done

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """As an ASGI app (the router's listener gives the connection in the scope)."""
        await self.answer(AsgiAnswer(send), scope.get("extensions", {}).get(CLIENT_CONNECTION),
                          receive)

    async def answer(self, out: ClientAnswer, connection: ClientConnection | None,
                     receive: Receive | None = None) -> None:
        """Run the flow in this task, answering to `out`; it is cancelled if the client
        leaves, as `connection` tells (None: as ASGI's `receive` tells)."""
        down = Downstream(out, streaming=self._streaming, headers=self._headers)
        failure: RouterError | None = None
        this = current_task(None if connection is None else connection.loop)
        assert this is not None  # flows run inside tasks
        gone = _ClientGone(down, this)
        watcher: asyncio.Task[None] | None = None
        if connection is not None:
            connection.on_lost(gone)
        elif receive is not None:  # another ASGI server: wait for its disconnect message
            watcher = create_task(own_exception_state(_client_gone(receive)),
                                  name="disconnect-watcher")
            watcher.add_done_callback(lambda task: None if task.cancelled() else gone())
        # The flow runs in this frame, not in a helper coroutine: one frame less to
        # resume at each of the request's waits.
        try:
            try:
                await self._flow(down)
            except RouterError as exc:
                failure = exc
                await down.fail(exc)
            except Exception as unexpected:  # (a name of its own: compiled, `exc` above
                # would keep its type, RouterError, here)
                if down.started and isinstance(unexpected, (OSError, RuntimeError)):
                    # The client's connection broke while we wrote to it: nobody to tell.
                    failure = RouterError(f"client connection lost: {unexpected}")
                else:
                    logger.exception("internal error in a flow")
                    failure = internal_error(unexpected)
                    await down.fail(failure)
        except asyncio.CancelledError:
            if not gone.left:
                raise  # cancelled from outside (shutdown): not ours to swallow
        finally:
            if connection is not None:
                connection.on_lost(None)
            if watcher is not None:
                watcher.cancel()
            if gone.left and this.cancelling():
                this.uncancel()  # our own cancel: it must not leak into the server's code
            self._done(down, failure, gone.left)


class _ClientGone:
    """Called when the client leaves while its flow runs: the flow's task is cancelled,
    unless the answer's last byte is out (then a disconnect is not a client leaving).
    An object, not a closure over `FlowResponse.answer`'s variables: compiled with
    mypyc, such a closure and the coroutine's variables hold each other, a reference
    cycle per request left to the garbage collector."""

    __slots__ = ("_down", "_task", "left")

    def __init__(self, down: Downstream, task: asyncio.Task[Any]) -> None:
        self._down = down
        self._task = task
        self.left = False

    def __call__(self) -> None:
        if not self._down.finished:
            self.left = True
            self._task.cancel()


async def _client_gone(receive: Receive) -> None:
    """Return when the client disconnects (the request body was already read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
