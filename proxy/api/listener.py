"""The router's HTTP listener: uvicorn's httptools protocol, plus the limits that stop a
bad client from holding the router's resources.

A client that stops reading its answer makes uvicorn pause the flow that writes to it; the
flow then stops reading its upstream legs, which keep their upstream connections and
leases. Nothing in uvicorn ever ends that, so a few such clients could take every
upstream connection (`limits.max_connections`) for good, and so could clients that read a
byte now and then. Likewise a client that sends its request slowly (its head or its body)
holds a connection forever. This protocol cuts them:

- stall and slow_read: while the client is behind (the transport's write buffer is full,
  so uvicorn paused writing; or the connection is closing with bytes unsent), the time
  it waits on the client and the bytes the client accepts meanwhile are counted. Each
  time those waits add up to `timeouts.client_stall`, the client must have accepted at
  least `limits.client_min_read_rate` bytes per second of them, else the connection is
  aborted: `stall` when it accepted none, `slow_read` when it accepted too few. The
  counts run across pauses (a client that reads a burst now and then to resume writing
  is measured over all its waits, not from its last burst), and start again when it has
  caught up (nothing unsent) or passed a check. Abort, not close: close() would wait to
  flush bytes the client never reads. uvicorn then tells the app `http.disconnect`, and
  the flow is cancelled with both its legs (see `relay.FlowResponse`). The clock starts
  only once the kernel's send queue for the socket is full too: the kernel autotunes
  that queue, up to a few MB (measured on loopback: 2.9 MB queued before the pause), so a
  client that stops reading a short or slow stream may get it whole into kernel
  buffers, uncut.
- slow_request: from a request's first byte, its head and body must be in within
  `timeouts.client_request` (the deadline is kept by `reader.RequestReader`).
- a new connection that sends nothing is closed after uvicorn's keep-alive timeout, as
  an idle connection between two requests is. That timeout is a deadline on the
  connection with one timer, not a timer armed after each answer and cancelled by the
  next request as in uvicorn (see `RequestReader.idle`).

Each cut is logged with the client's address and counted in `pdproxy_client_cuts`.
Timers exist only while there is something to watch: one while the router waits on the
client, one while a request is coming in; none per byte.

Requests come in through a `reader.RequestReader` (compiled with the request path): a
POST to an inference route runs on the router's own request-response cycle
(`proxy.api.cycle`), any other on uvicorn's; every limit above applies to both.

`server_config()` builds the uvicorn config for the router from its `RouterConfig`, so
that the CLI and the tests serve through the same listener.
"""

from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import logging
import struct
import termios
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from proxy.api.cycle import InferenceCycle
from proxy.api.reader import RequestReader
from proxy.config import Limits, RouterConfig, Timeouts
from proxy.flow.relay import CLIENT_CONNECTION, ClientConnection

logger = logging.getLogger("pdproxy.listener")

# Called with the reason ("stall", "slow_read" or "slow_request") of each cut.
OnCut = Callable[[str], None]

# Linux: the bytes in a socket's send queue not yet acknowledged by the peer. With it a
# client's progress is seen byte by byte, not only when the kernel takes a new chunk.
_OUTQ: int | None = getattr(termios, "TIOCOUTQ", None)


@dataclasses.dataclass(frozen=True, slots=True)
class ClientLimits:
    client_stall: float  # seconds of waiting on a client between two checks of its reading
    client_request: float  # seconds from a request's first byte to its last
    on_cut: OnCut
    # bytes per second a client must accept while the router waits on it (0: any progress)
    client_min_read_rate: int = 0


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the client limits above; `server_config()`
    makes a subclass that sets `limits`. Its requests come in through a
    `reader.RequestReader` (compiled): the connection's bytes, the parser's callbacks,
    the request and keep-alive deadlines, and the cycle of each inference request. The
    protocol keeps the connection, uvicorn's cycle for any other request, and the
    limits on the answer going out."""

    limits: ClassVar[ClientLimits]

    def __init__(
        self,
        config: uvicorn.Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._stall_timer: asyncio.TimerHandle | None = None
        # The wait on the client now: since when (loop time; None: not waiting), and what
        # it had not taken then. Past waits since the last check: their seconds, and the
        # bytes the client took during them.
        self._behind_since: float | None = None
        self._unsent_at_arm = 0
        self._waited = 0.0
        self._taken = 0
        # Given to each request in its scope: tells the running flow of a lost connection.
        self._connection = ClientConnection(self.loop)
        self.extensions = {CLIENT_CONNECTION: self._connection}
        # The router's own path for inference requests (`cycle.InferenceCycle`), when the
        # app uvicorn serves is the router's itself. None while uvicorn's access log is on
        # (its cycle writes the lines; its X-Forwarded-For middleware then wraps the app),
        # or for another app: uvicorn's cycle serves every request then.
        serve: Callable[[InferenceCycle], Awaitable[None]] | None = (
            None if self.access_log else getattr(self.app, "serve_inference", None))
        self._reader = RequestReader(self, self.loop, serve=serve,
                                     client_request=self.limits.client_request,
                                     keep_alive=self.timeout_keep_alive)
        # The reader parses, and takes the connection's bytes itself (the event loop
        # looks `data_received` up once, when the connection is made).
        self.parser = self._reader.parser
        self.data_received = self._reader.data_received  # type: ignore[method-assign]

    # The connection

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        # The socket's own transport goes to the reader, for the inference cycle (which
        # sends a head with its body itself), and uvicorn's writes through the wrapper
        # that holds a head back.
        super().connection_made(_CoalescingTransport(transport, self.loop))  # type: ignore[arg-type]
        self._reader.attach(transport, self.flow)  # idle until its first byte

    def connection_lost(self, exc: Exception | None) -> None:
        self._behind_since = None
        self._stop_stall_timer()
        self._reader.detach()
        super().connection_lost(exc)
        self._connection.lost()

    # What the reader hands back to uvicorn's code and to the limits

    def on_headers_complete(self) -> None:
        """A request that is not the reader's own (see `RequestReader.on_headers_complete`):
        uvicorn's cycle, with its ASGI scope built here rather than at the request's
        first byte, as in uvicorn."""
        self.scope = {  # uvicorn's (0.54), with the listener's extensions
            "type": "http",
            "asgi": {"version": self.asgi_version, "spec_version": "2.3"},
            "http_version": "1.1",
            "server": self.server,
            "client": self.client,
            "scheme": self.scheme,  # type: ignore[typeddict-item]
            "root_path": self.root_path,
            "headers": self.headers,
            "state": self.app_state.copy(),
            "extensions": self.extensions,  # type: ignore[typeddict-item]
        }
        super().on_headers_complete()

    def invalid_request(self) -> None:
        """The parser refused the bytes (uvicorn's answer: 400 and close)."""
        msg = "Invalid HTTP request received."
        self.logger.warning(msg)
        self.send_400_response(msg)

    def upgrade_requested(self) -> None:
        """An Upgrade request (uvicorn's handling: WebSocket, else a warning)."""
        if self._should_upgrade():
            self.handle_websocket_upgrade()
        else:
            self._unsupported_upgrade_warning()

    def cut_slow_request(self) -> None:
        self._cut("slow_request", f"request not complete within {self.limits.client_request:g} s "
                                  "(timeouts.client_request)")

    # The answer going out

    def pause_writing(self) -> None:
        super().pause_writing()
        self.watch_unsent()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._end_wait()

    def on_response_complete(self) -> None:
        # uvicorn's cycle calls it; the reader's cycles call the reader directly.
        self._reader.response_complete()

    def timeout_keep_alive_handler(self) -> None:
        super().timeout_keep_alive_handler()
        self.watch_unsent()  # the last answer may still be unread

    def watch_unsent(self) -> None:
        """A wait on the client begins, unless one runs or the client has everything
        already: its timer fires when the waits since the last check reach client_stall."""
        if self._behind_since is not None:
            return
        unsent = self._unsent()
        if unsent:
            self._behind_since = self.loop.time()
            self._unsent_at_arm = unsent
            left = max(self.limits.client_stall - self._waited, 0.0)
            self._stall_timer = self.loop.call_later(left, self._stall_check)

    def _end_wait(self) -> None:
        """The client took enough for writes to resume: count this wait, stop its timer."""
        if self._behind_since is None:
            return
        self._waited += self.loop.time() - self._behind_since
        self._taken += max(self._unsent_at_arm - self._unsent(), 0)
        self._behind_since = None
        self._stop_stall_timer()

    def _stall_check(self) -> None:
        self._stall_timer = None
        began, self._behind_since = self._behind_since, None
        unsent = self._unsent()
        waited = self._waited + (self.loop.time() - began if began is not None else 0.0)
        taken = self._taken + max(self._unsent_at_arm - unsent, 0)
        self._waited, self._taken = 0.0, 0
        if unsent == 0:
            return  # it has caught up: nothing to wait on
        rate = self.limits.client_min_read_rate
        if taken == 0:
            self._cut("stall", f"accepted no bytes for {waited:.3g} s (timeouts.client_stall), "
                               f"{unsent} bytes unsent")
        elif taken < rate * waited:
            self._cut("slow_read", f"accepted {taken} bytes in {waited:.3g} s of waiting on it, "
                                   f"under {rate} bytes/s (limits.client_min_read_rate), "
                                   f"{unsent} bytes unsent")
        else:  # reads fast enough: the next check counts from now
            self.watch_unsent()

    def _unsent(self) -> int:
        """Bytes written to this client that it has not accepted yet: those still in the
        transport's buffer, plus (on Linux) those in the kernel's send queue. While writes
        are paused or the transport is closing nothing is added, so a smaller number
        means the client read."""
        unsent = self.transport.get_write_buffer_size()
        sock = self.transport.get_extra_info("socket")
        if _OUTQ is not None and sock is not None:
            try:
                queued = fcntl.ioctl(sock.fileno(), _OUTQ, b"\0\0\0\0")
                unsent += struct.unpack("i", queued)[0]
            except (OSError, ValueError):
                pass  # closed meanwhile, or not a TCP socket: the buffer alone says enough
        return unsent

    def _stop_stall_timer(self) -> None:
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _cut(self, reason: str, why: str) -> None:
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "unknown address"
        logger.warning("cut client %s: %s", client, why)
        self.limits.on_cut(reason)
        self.transport.abort()  # connection_lost follows: uvicorn tells the app, timers stop


class _CoalescingTransport:
    """The client's transport, sending an answer's head with its first body bytes: uvicorn
    writes the head apart, a system call (and a segment to the client) more per answer.
    The head is held until the next write, which comes at once for a whole answer and
    with the first event for a stream (`relay.Downstream` starts an answer only then);
    if none comes within this turn of the event loop, it goes alone. Holding never
    reorders bytes: whatever comes next is sent after it. Everything else is the
    transport's own."""

    __slots__ = ("_transport", "_loop", "_held")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None

    def write(self, data: bytes) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._transport.write(held + data)
        elif data.startswith(b"HTTP/1.") and data.endswith(b"\r\n\r\n"):  # a head
            self._held = data
            self._loop.call_soon(self._flush)
        else:
            self._transport.write(data)

    def _flush(self) -> None:
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)

    def get_write_buffer_size(self) -> int:
        held = self._held
        return self._transport.get_write_buffer_size() + (len(held) if held else 0)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    # What uvicorn and the listener call on every request, spelled out: reaching them
    # through __getattr__ was 1.5% of the router's CPU per request (the profile scenario).

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def abort(self) -> None:
        self._held = None
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def count_in_router_metrics(app: object) -> OnCut:
    """An `OnCut` that counts in the running router's `metrics.client_cuts` (the app's
    `state.router`, set by its lifespan; nothing is counted while there is none)."""

    def count(reason: str) -> None:
        router = getattr(getattr(app, "state", None), "router", None)
        if router is not None:
            router.metrics.client_cuts.labels(reason).inc()

    return count


def server_config(
    app: ASGIApp,
    config: RouterConfig | None = None,
    *,
    on_cut: OnCut | None = None,
    **overrides: Any,
) -> uvicorn.Config:
    """The uvicorn config that serves `app` for the router: address, loop, logs and
    shutdown grace from `config`, and the listener above with its timeouts (their
    defaults without a config). `overrides` are uvicorn.Config arguments that win (tests
    listen on a free port); cuts are counted in the app's router metrics unless `on_cut`."""
    timeouts = config.timeouts if config is not None else Timeouts()
    limits = ClientLimits(
        client_stall=timeouts.client_stall,
        client_request=timeouts.client_request,
        on_cut=on_cut or count_in_router_metrics(app),
        client_min_read_rate=(config.limits if config is not None else Limits()).client_min_read_rate,
    )
    protocol = type("RouterHttpProtocol", (GuardedHttpProtocol,), {"limits": limits})
    # uvicorn's access log as the router's config says (off by default, as there)
    settings: dict[str, Any] = {"access_log": False}
    if config is not None:
        settings = {
            "host": config.host,
            "port": config.port,
            "loop": "uvloop",
            "log_level": config.log_level,
            "access_log": config.access_log,
            "timeout_graceful_shutdown": config.shutdown_grace,
        }
    # X-Forwarded-For is read only for uvicorn's access log: the router itself never
    # reads the client's address from the request (a middleware call less per request).
    settings["proxy_headers"] = config is not None and config.access_log
    settings.update(overrides)
    return uvicorn.Config(app, http=protocol, **settings)
