"""The listener's requests as they come in: the parser's callbacks, the deadline on a
request's head and body, the keep-alive deadline between requests, and the task that
serves a connection's inference requests.

`listener.GuardedHttpProtocol` (uvicorn's httptools protocol, subclassed) gives its
connection's bytes and its parser's callbacks to a `RequestReader`, which is compiled with
the request path (`pyproject.toml`; a compiled class cannot subclass uvicorn's, so the
reader stands beside it). For a POST to an inference route over HTTP/1.1 the reader does
all of it: it collects the head, makes the `cycle.InferenceCycle`, feeds it the body and
hands it to the connection's task (one per connection, serving its requests in turn:
`_serve_in_turn`), and when the answer is complete starts a pipelined request or marks
the connection idle. Any other request it hands to uvicorn's code in the protocol at
the end of its head (`on_headers_complete`), with the head it collected, and passes its
body on: uvicorn's cycle serves it as before.

Measured (`scripts.bench_path --bytecodes` on a pure build): uvicorn's callbacks and the
listener's were about 360 of the 1,080 bytecodes a request still ran interpreted in a
compiled build.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
from collections.abc import Awaitable, Callable, Coroutine
from sys import exc_info
from typing import Any

import httptools
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT

from proxy.api.cycle import INFERENCE_PATHS, InferenceCycle
from proxy.task_scope import own_exception_state

_NONE = -1.0  # a loop time not set


def _http_11(parser: Any, keep_alive: bool, names_connection: bool) -> bool:
    """Whether the request is HTTP/1.1. llhttp keeps a request alive without a Connection
    header (or Proxy-Connection, which it reads as one) only when it is HTTP/1.1 (1.0
    needs `Connection: keep-alive`; it refuses versions but 0.9, 1.0, 1.1 and 2.0), so
    only a request that is not, or that names one, asks the parser, whose answer is
    formatted as a string per call (2,600 instructions a request, callgrind)."""
    if keep_alive and not names_connection:
        return True
    return bool(parser.get_http_version() == "1.1")


class RequestReader:
    """One client connection's requests, as the parser reads them (see the module's doc).
    `protocol` is the listener's protocol; what the reader needs of it is named below."""

    def __init__(
        self, protocol: Any, loop: asyncio.AbstractEventLoop, *,
        serve: Callable[[InferenceCycle], Awaitable[None]] | None,
        client_request: float, keep_alive: float,
    ) -> None:
        self.protocol = protocol
        self.loop = loop
        self.serve = serve  # None: every request goes to uvicorn's code
        self.client_request = client_request  # seconds from a request's first byte to its last
        self.keep_alive = keep_alive  # seconds an idle connection stays open
        self.limit_concurrency: int | None = protocol.limit_concurrency
        self.reset_contextvars = bool(getattr(protocol.config, "reset_contextvars", False))
        self.server_state: Any = protocol.server_state
        self.tasks: set[asyncio.Task[None]] = protocol.server_state.tasks
        self.pipeline: collections.deque[tuple[Any, Any]] = protocol.pipeline
        self.app: Any = protocol.app
        self.extensions: dict[str, Any] = protocol.extensions
        self.parser = httptools.HttpRequestParser(self)
        try:  # uvicorn's: answer the first of pipelined requests sent before a close
            self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        except AttributeError:  # httptools < 0.6.3
            pass
        # Set when the connection is made (`attach`): the socket's own transport and
        # uvicorn's FlowControl.
        self.socket: Any = None
        self.flow: Any = None
        # The request coming in: its URL and headers (lowercase names), its Expect, and
        # its cycle when it is an inference request (None: uvicorn's).
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.expect_100_continue = False
        self.names_connection = False  # a Connection (or Proxy-Connection) header came
        self.cycle: InferenceCycle | None = None
        # Deadlines: the loop time of a request's first byte (`_NONE` between requests)
        # and its timer, armed only when a read leaves the request incomplete; the loop
        # time the connection went idle (`_NONE` in use) and the keep-alive timer.
        self.request_began = _NONE
        self.request_timer: asyncio.TimerHandle | None = None
        self.idle_since = _NONE
        self.keep_alive_timer: asyncio.TimerHandle | None = None
        # The task that serves the connection's inference requests in turn (`_serve_in_turn`;
        # None until the first, and after it ends), the request it takes next, and the
        # future it waits on for one while the connection is idle.
        self.serving: asyncio.Task[None] | None = None
        self.next_cycle: InferenceCycle | None = None
        self.waiter: asyncio.Future[None] | None = None

    # The connection

    def attach(self, socket: Any, flow: Any) -> None:
        """The connection is made: a new connection is idle until its first byte."""
        self.socket = socket
        self.flow = flow
        self.idle()

    def detach(self) -> None:
        """The connection is lost: no timer outlives it."""
        self.request_began = self.idle_since = _NONE
        if self.request_timer is not None:
            self.request_timer.cancel()
            self.request_timer = None
        if self.keep_alive_timer is not None:
            self.keep_alive_timer.cancel()
            self.keep_alive_timer = None
        self._wake()  # the connection's task ends: no request comes any more

    def data_received(self, data: bytes) -> None:
        """The connection's bytes (the protocol's `data_received`)."""
        self.idle_since = _NONE  # in use
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.protocol.upgrade_requested()
            return
        except httptools.HttpParserError:
            self.protocol.invalid_request()
            return
        # A request that arrives whole in one read (nearly all) never arms a timer:
        # arming one per request was measured at a tenth of the router's CPU.
        if self.request_began != _NONE and self.request_timer is None:
            left = self.request_began + self.client_request - self.loop.time()
            self.request_timer = self.loop.call_later(max(left, 0.0), self._request_overdue)

    # The parser's callbacks

    def on_message_begin(self) -> None:
        self.url = b""
        self.headers = []
        self.expect_100_continue = False
        self.names_connection = False
        self.cycle = None
        if self.request_timer is not None:
            self.request_timer.cancel()
            self.request_timer = None
        self.request_began = self.loop.time()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        elif name == b"connection" or name == b"proxy-connection":  # llhttp reads both
            self.names_connection = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        """A POST to an inference route over HTTP/1.1 gets an `InferenceCycle`; any other
        request goes to uvicorn's code in the protocol, with its head."""
        route = INFERENCE_PATHS.get(self.url)
        serve = self.serve
        parser = self.parser
        keep_alive = parser.should_keep_alive()
        if (route is None or serve is None or self.limit_concurrency is not None
                or parser.get_method() != b"POST"
                or not _http_11(parser, keep_alive, self.names_connection)
                or parser.should_upgrade()):
            protocol = self.protocol
            protocol.url = self.url
            protocol.headers = self.headers
            protocol.expect_100_continue = self.expect_100_continue
            protocol.on_headers_complete()
            return
        cycle = self.cycle = InferenceCycle(
            route, self.headers, transport=self.socket, flow=self.flow,
            server_state=self.server_state, extensions=self.extensions,
            on_response=self.response_complete, keep_alive=keep_alive,
            expect_100_continue=self.expect_100_continue, serve=serve)
        protocol = self.protocol
        running = protocol.cycle
        protocol.cycle = cycle
        if running is None or running.response_complete:
            self._start(cycle, self.app)
        else:  # pipelined: waits for the answer before it, as in uvicorn
            self.flow.pause_reading()
            self.pipeline.appendleft((cycle, self.app))

    def on_body(self, body: bytes) -> None:
        cycle = self.cycle
        if cycle is None:
            self.protocol.on_body(body)  # uvicorn's
            return
        if cycle.response_complete:
            return
        cycle.body += body
        if len(cycle.body) > HIGH_WATER_LIMIT:  # uvicorn's: a body buffered past it pauses reading
            self.flow.pause_reading()
        cycle.message_event.set()

    def on_message_complete(self) -> None:
        self.request_began = _NONE
        if self.request_timer is not None:
            self.request_timer.cancel()
            self.request_timer = None
        cycle = self.cycle
        if cycle is None:
            self.protocol.on_message_complete()  # uvicorn's
            return
        self.cycle = None  # no more of its body: the protocol's `cycle` keeps it
        if cycle.response_complete:
            return
        cycle.more_body = False
        cycle.message_event.set()

    # The answer's end, and the connection between requests

    def response_complete(self) -> None:
        """A request's answer is complete (any cycle's, uvicorn's too: the protocol's
        `on_response_complete`): the next pipelined request starts, else the connection
        is idle. uvicorn's (0.54), with `idle` in place of a new keep-alive timer."""
        self.server_state.total_requests += 1
        if self.socket.is_closing():  # closed after the answer: close() flushes first
            self.protocol.watch_unsent()
            return
        flow = self.flow
        if flow.read_paused:
            flow.resume_reading()
        if self.pipeline:  # the next request, pipelined, waited for this answer
            cycle, app = self.pipeline.pop()
            self._start(cycle, app)
        else:
            self.idle()

    def idle(self) -> None:
        """The connection waits for its next request, closed after `keep_alive`.
        uvicorn armed a timer after every answer and cancelled it on the next request's
        bytes; here the connection keeps one timer, and its bytes only mark it in use
        (`data_received`). The timer, when it fires, closes a connection idle for the
        whole timeout, waits out the rest for one idle less long, and ends for one in
        use. (A timer per answer was 1-2% of the router's CPU per request.)"""
        self.idle_since = self.loop.time()
        if self.keep_alive_timer is None:
            self.keep_alive_timer = self.loop.call_later(self.keep_alive, self._keep_alive_check)

    def _keep_alive_check(self) -> None:
        self.keep_alive_timer = None
        if self.idle_since == _NONE:
            return  # in use: the end of its answer makes it idle again
        left = self.idle_since + self.keep_alive - self.loop.time()
        if left > 0:
            self.keep_alive_timer = self.loop.call_later(left, self._keep_alive_check)
        else:
            self.protocol.timeout_keep_alive_handler()

    def _request_overdue(self) -> None:
        self.request_timer = None
        if self.flow.read_paused:
            # We stopped reading (a pipelined request waits for the one before it): the
            # wait is ours, not the client's.
            self.request_timer = self.loop.call_later(self.client_request, self._request_overdue)
            return
        self.protocol.cut_slow_request()

    def _start(self, cycle: Any, app: Any) -> None:
        """Serve a request: an inference request by the connection's task, any other (and
        every request under uvicorn's `reset_contextvars`, a context each) in a task of
        its own, as uvicorn's `_start_asgi_task` does. A connection's requests share its
        task's context: a context variable a request sets, it resets (the router's own
        do: `tracing.Tracing.handled`)."""
        if self.reset_contextvars or not isinstance(cycle, InferenceCycle):
            self._start_task(cycle.run_asgi(app))
        elif self.serving is None:
            self.serving = self._start_task(self._serve_in_turn(cycle))
        else:  # it takes the request when the one it serves is done, or wakes for it
            self.next_cycle = cycle
            self._wake()

    def _start_task(self, run: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """A task for `run`, counted in uvicorn's tasks until it ends, with an exception
        state of its own (see `proxy.task_scope`: the cycles are compiled)."""
        scoped = own_exception_state(run)
        if self.reset_contextvars:  # uvicorn's opt-in: a fresh context per request
            task = self.loop.create_task(scoped, context=contextvars.Context())
        else:
            task = self.loop.create_task(scoped)
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)
        return task

    async def _serve_in_turn(self, first: InferenceCycle) -> None:
        """The connection's task: its inference requests one after another, from `first`,
        until the connection is lost. A task per request was measured at 2.3-2.6 us of
        CPU against 0.7 us for a wait on a future here (a loop of 200,000 under uvloop):
        about 3% of the router's CPU per request.

        The task ends early after a request that left an exception state behind (its
        compiled code can: see `proxy.task_scope`), which goes with the task's own, and
        the next request gets a new task: it must not start with another's exception.
        (Each request under an `own_exception_state` frame of its own instead was 11
        interpreted bytecodes and 3 frame entries more per request, `scripts.bench_path
        --bytecodes`, for what is rare.) The task also ends once it was cancelled (a
        cancel that a request let pass, as a forced shutdown's, must not reach the next
        request); the next then gets a new task."""
        this = self.serving  # this task: set before it first runs
        cycle: InferenceCycle | None = first
        try:
            while cycle is not None:
                await cycle.run_asgi(self.app)
                if exc_info()[1] is not None:
                    break  # an exception state left behind: this task ends with it
                if self.next_cycle is None and not self.socket.is_closing() \
                        and (this is None or not this.cancelling()):
                    waiter = self.waiter = self.loop.create_future()
                    await waiter
                cycle = self.next_cycle
                self.next_cycle = None
        finally:
            self.waiter = None
            self.serving = None
        # Ended early: a request already waiting gets a new task (one arriving later
        # finds none serving and starts one, `_start`).
        waiting, self.next_cycle = self.next_cycle, None
        if waiting is not None:
            self.serving = self._start_task(self._serve_in_turn(waiting))

    def _wake(self) -> None:
        """Wake the connection's task if it waits for a request (`next_cycle` set: to
        serve it; None: to end)."""
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
