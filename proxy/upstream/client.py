"""The client for vLLM servers, and the one place where transport errors become the
router's `UpstreamError`s.

Two calls: `post_json` waits for a whole JSON answer (P's leg, probes), and `stream`
opens a response whose body is read chunk by chunk as it arrives (D's leg), always
inside `async with` so that the connection goes back to its pool when the answer is
complete, or is closed when a leg is cancelled or fails: closing the connection is how
vLLM learns to abort the request. `get_json` and `get_text` are for the small GETs
(/health, /v1/models, /metrics). The transport is `http11` (keep-alive HTTP/1.1).

Two lanes, each its own `http11.Client` with its own cap: requests (P and D legs)
under `limits.max_connections`, and control traffic (health checks, model lists,
/metrics scrapes, probes: `post_json(control=True)`) under `limits.control_connections`,
so that a lane full of user traffic never delays a health check. No room in a lane
within `timeouts.pool` is the router's own overload: `Overloaded` (503, not retried,
not counted against the server), never an `UpstreamError`. Credentials for a server
(`set_api_key`) go with every request to it, in either lane.

What a server sends is bounded: a whole answer's body (P's answer, a non-streamed D's,
an error's, a probe's or a model list) over `limits.max_upstream_body_bytes` is a broken
answer, as is one SSE event of D's stream over `limits.max_upstream_event_bytes`
(`relay.EventFramer` finds it; `StreamedResponse.event_too_large` makes the error).

An error's message for the client names the server as `set_name` named it ("decode
server 2"), not by its URL, and leaves out the transport's detail (which may hold
addresses); its `str()`, for logs, has both. `show_upstream_urls` gives clients the
log's text.
"""

from __future__ import annotations

from typing import Any

import httptools
import msgspec
from msgspec.json import decode as decode_json
from msgspec.json import encode as encode_json

from proxy.config import Limits, Timeouts
from proxy.errors import (
    Overloaded,
    UpstreamAnswerTooLarge,
    UpstreamConnectError,
    UpstreamConnectionLost,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamStatusError,
    UpstreamTimeout,
)
from proxy.upstream.http11 import (
    AnswerTooLarge,
    Client,
    ConnectFailed,
    Connection,
    ConnectionCounts,
    ConnectionLost,
    Fetch,
    MalformedAnswer,
    Pool,
    PoolTimeout,
    Response,
)

# What the transport raises when a server fails us (TimeoutError: our own bounds).
TRANSPORT_ERRORS = (
    ConnectFailed, TimeoutError, ConnectionLost, MalformedAnswer, httptools.HttpParserError,
    msgspec.DecodeError, OSError,
)  # fmt: skip


def upstream_error(
    exc: BaseException, endpoint: str, cluster: str, what: str, *, name: str | None = None,
) -> UpstreamError:
    """The router's error for a transport failure, most specific first. Its log text
    names the server's URL and the transport's detail; its message for the client names
    the server `name` and leaves the detail out (`name` None: the log's text)."""

    def said(server: str) -> str:
        if isinstance(exc, ConnectFailed):
            return f"cannot connect to {server}"
        if isinstance(exc, TimeoutError):
            return f"{server} did not answer {what} in time"
        if isinstance(exc, AnswerTooLarge):
            return (f"{server} sent an answer larger than the router accepts "
                    "(limits.max_upstream_body_bytes)")
        return f"{server} broke off {what}: {type(exc).__name__}"

    detail = "" if isinstance(exc, TimeoutError) else f" ({exc})"
    log = said(f"{cluster} server {endpoint}") + detail
    message = log if name is None else said(name)
    if isinstance(exc, AnswerTooLarge):
        return UpstreamAnswerTooLarge(message, kind="body_too_large", endpoint=endpoint,
                                      cluster=cluster, log_message=log)
    kind: type[UpstreamError]
    if isinstance(exc, ConnectFailed):
        kind = UpstreamConnectError
    elif isinstance(exc, TimeoutError):
        kind = UpstreamTimeout
    elif isinstance(exc, (ConnectionLost, OSError)):
        kind = UpstreamConnectionLost
    else:
        kind = UpstreamProtocolError
    return kind(message, endpoint=endpoint, cluster=cluster, log_message=log)


class StreamedResponse:
    """An open upstream response: status, content type, and its body as it arrives.
    `client` names the server in its errors (`UpstreamClient.shown`), only when one
    happens: the name is a string built per answer otherwise."""

    def __init__(self, response: Response, *, endpoint: str, cluster: str,
                 client: UpstreamClient, max_body_bytes: int, max_event_bytes: int) -> None:
        self.status = response.status
        self.content_type = response.header(b"content-type") or "application/json"
        self.max_event_bytes = max_event_bytes  # one SSE event's cap (relay.EventFramer)
        self._max_body = max_body_bytes
        self._response = response
        self._endpoint = endpoint
        self._cluster = cluster
        self._client = client

    async def read_chunk(self) -> bytes:
        """The next body chunk as it comes, b"" at the end; a silence longer than
        `stream_idle` is a timeout. (A coroutine, not an async generator: each of those
        is registered with the event loop and weakly referenced, three calls more a
        stream.)"""
        try:
            return await self._response.read_chunk()  # no wait when one is buffered
        except TRANSPORT_ERRORS as exc:
            raise self._error(exc, "the rest of its answer") from exc

    @property
    def at_end(self) -> bool:
        """The whole body has been received and handed out."""
        return self._response.at_end

    async def read(self) -> bytes:
        """The whole body, at most `limits.max_upstream_body_bytes`."""
        try:
            return await self._response.read(self._max_body)
        except TRANSPORT_ERRORS as exc:
            raise self._error(exc, "its answer") from exc

    def event_too_large(self) -> UpstreamAnswerTooLarge:
        """The error for an SSE event over `max_event_bytes` (the framer found it)."""
        def said(server: str) -> str:
            return (f"{server} sent a stream event larger than the router accepts "
                    "(limits.max_upstream_event_bytes)")

        log = f"{said(f'{self._cluster} server {self._endpoint}')} ({self.max_event_bytes} bytes)"
        name = self._client._name(self._endpoint, self._cluster)
        return UpstreamAnswerTooLarge(
            log if name is None else said(name), kind="event_too_large",
            endpoint=self._endpoint, cluster=self._cluster, log_message=log)

    def _error(self, exc: BaseException, what: str) -> UpstreamError:
        return upstream_error(exc, self._endpoint, self._cluster, what,
                              name=self._client._name(self._endpoint, self._cluster))


class _Lane:
    """One http11 client and the limit that caps it (named in its Overloaded errors)."""

    def __init__(self, timeouts: Timeouts, limits: Limits, limit_name: str) -> None:
        self.limit_name = limit_name
        self.cap: int = getattr(limits, limit_name)
        self.wait_s = timeouts.pool
        self.http = Client(
            max_connections=self.cap,
            pool_timeout=timeouts.pool,
            idle_reuse=timeouts.upstream_idle,
            max_header_bytes=limits.max_upstream_header_bytes,
        )

    def overloaded(self, server: str) -> Overloaded:
        return Overloaded(
            f"no upstream connection to {server} free within "
            f"{self.wait_s:g} s (limits.{self.limit_name}={self.cap})",
            reason="pool_timeout",
        )


class UpstreamClient:
    """Keep-alive connections to every upstream, in two lanes (see the module's
    docstring); create in the app's lifespan."""

    def __init__(self, timeouts: Timeouts, limits: Limits, *, show_urls: bool = False) -> None:
        # The bounds every leg reads, as plain fields: a msgspec struct's field is a
        # generic attribute lookup from compiled code (docs/benchmarks.md)
        self._connect_s = timeouts.connect
        self._first_token_s = timeouts.first_token
        self._stream_idle_s = timeouts.stream_idle
        self._requests = _Lane(timeouts, limits, "max_connections")
        self._control = _Lane(timeouts, limits, "control_connections")
        self._max_body = limits.max_upstream_body_bytes
        self._max_event = limits.max_upstream_event_bytes
        self._show_urls = show_urls  # show_upstream_urls: clients see the log's text
        self._names: dict[str, str] = {}  # a server's base URL -> its name for clients

    async def aclose(self) -> None:
        self._requests.http.close()
        self._control.http.close()

    def connections(self) -> ConnectionCounts:
        """Upstream connections open and idle, and slots taken, in both lanes."""
        return self._requests.http.connections() + self._control.http.connections()

    def set_api_key(self, base_url: str, key: str | None) -> None:
        """Every request to the server of `base_url` (either lane, any path) carries
        `Authorization: Bearer <key>` from now on; None: no Authorization header."""
        for lane in (self._requests, self._control):
            lane.http.set_bearer_token(base_url, key)

    def forget(self, base_url: str) -> None:
        """The server of `base_url` left: drop its connection pools (either lane), its
        credentials and its name."""
        for lane in (self._requests, self._control):
            lane.http.forget(base_url)
        self._names.pop(base_url.rstrip("/"), None)

    def set_name(self, base_url: str, name: str) -> None:
        """Errors name the server of `base_url` to clients as "<cluster> server <name>"."""
        self._names[base_url.rstrip("/")] = name

    def shown(self, endpoint: str, cluster: str) -> str:
        """How a client is told of the server `endpoint` (a base URL): by its name, or by
        its URL with `show_upstream_urls`."""
        if self._show_urls:
            return f"{cluster} server {endpoint}"
        name = self._names.get(endpoint)
        return f"{cluster} server {name}" if name else f"a {cluster} server"

    def _name(self, endpoint: str, cluster: str) -> str | None:
        """An error's name for the server; None: its URL, as in the log."""
        return None if self._show_urls else self.shown(endpoint, cluster)

    def protocol_error(self, endpoint: str, cluster: str, problem: str,
                       detail: str = "") -> UpstreamProtocolError:
        """An answer a flow refuses as broken: the client is told which server (as
        `shown`) and `problem`; the log also the URL and `detail`."""
        log = f"{cluster} server {endpoint} {problem}" + (f": {detail}" if detail else "")
        name = self._name(endpoint, cluster)
        return UpstreamProtocolError(log if name is None else f"{name} {problem}",
                                     endpoint=endpoint, cluster=cluster, log_message=log)

    async def get_json(
        self, url: str, *, endpoint: str, cluster: str, timeout: float, expect_json: bool = True
    ) -> Any:
        """GET and decode the JSON answer (or only check the status: expect_json=False)."""
        answer = await self._whole(self._control, "GET", url, b"", {}, endpoint, cluster, timeout)
        return self._decode_json(answer.body, endpoint, cluster) if expect_json else None

    async def get_text(self, url: str, *, endpoint: str, cluster: str, timeout: float) -> str:
        """GET a text answer (a server's /metrics); bytes that are not UTF-8 are replaced."""
        answer = await self._whole(self._control, "GET", url, b"", {}, endpoint, cluster, timeout)
        return answer.body.decode("utf-8", errors="replace")

    async def post_json(
        self,
        url: str,
        body: dict[str, Any],
        *,
        headers: dict[str, str],
        endpoint: str,
        cluster: str,
        timeout: float,
        control: bool = False,
        type: Any = Any,
    ) -> Any:
        """POST and decode the whole JSON answer (as `type`, a msgspec type: an answer that
        is not one raises UpstreamError); error statuses raise UpstreamStatusError.
        `control`: on the control lane (probes), not behind user traffic."""
        lane = self._control if control else self._requests
        answer = await self._whole(
            lane, "POST", url, encode_json(body), headers, endpoint, cluster, timeout,
            json=True,
        )
        return self._decode_json(answer.body, endpoint, cluster, type)

    async def post_whole(
        self, url: str, body: dict[str, Any], *, headers: dict[str, str], endpoint: str,
        cluster: str,
    ) -> Fetch:
        """POST, and the whole answer (its `status`, `header()`s and `body`): bounded as
        `stream` bounds an answer, its head by `first_token` and each part of its body by
        `stream_idle`, and its size by `limits.max_upstream_body_bytes`. For an answer
        wanted whole (D's to a request not streamed): it wakes its caller once, at the
        answer's end. Error statuses raise UpstreamStatusError with the body."""
        return await self._whole(
            self._requests, "POST", url, encode_json(body), headers, endpoint, cluster,
            self._first_token_s, idle=self._stream_idle_s, json=True,
        )

    async def _whole(
        self, lane: _Lane, method: str, url: str, body: bytes, headers: dict[str, str],
        endpoint: str, cluster: str, timeout: float, idle: float | None = None,
        json: bool = False,
    ) -> Fetch:
        """The whole answer, its status checked (see `http11.Pool.fetch` for `idle` and
        `json`)."""
        pool, path = lane.http.pool(url)
        try:
            answer = await pool.fetch(
                method, path, body, headers, connect_timeout=self._connect_s,
                timeout=timeout, limit=self._max_body, idle=idle, json=json,
            )
        except PoolTimeout as full:  # (a name of its own: compiled, the first clause's
            # name keeps its type in the next one, setup.py)
            raise lane.overloaded(self.shown(endpoint, cluster)) from full
        except TRANSPORT_ERRORS as exc:
            raise upstream_error(exc, endpoint, cluster, "its answer",
                                 name=self._name(endpoint, cluster)) from exc
        _raise_for_status(answer.status, answer.body, endpoint, cluster, self)
        return answer

    def _decode_json(self, content: bytes, endpoint: str, cluster: str, type: Any = Any) -> Any:
        try:
            return decode_json(content, type=type)
        except msgspec.ValidationError as shape:  # JSON, not of `type`'s shape
            raise self.protocol_error(endpoint, cluster, "answered with JSON not of the shape "
                                      "the router reads", str(shape)) from shape
        except msgspec.DecodeError as exc:
            raise upstream_error(exc, endpoint, cluster, "its answer",
                                 name=self._name(endpoint, cluster)) from exc

    def stream(
        self,
        url: str,
        body: dict[str, Any],
        *,
        headers: dict[str, str],
        endpoint: str,
        cluster: str,
    ) -> OpenStream:
        """`async with client.stream(...) as answer:` POST, and the open response once its
        headers are in (bounded by `first_token`). Error statuses raise
        UpstreamStatusError with the body."""
        return OpenStream(self, url, body, headers, endpoint, cluster)


class OpenStream:
    """`UpstreamClient.stream`'s context (a class, not a generator: this is on every
    request's path). On any exit, cancellation included, a finished answer's connection
    is reused and an unfinished one is closed, so that the server aborts the request."""

    __slots__ = ("_client", "_url", "_body", "_headers", "_endpoint", "_cluster", "_held")

    def __init__(self, client: UpstreamClient, url: str, body: dict[str, Any],
                 headers: dict[str, str], endpoint: str, cluster: str) -> None:
        self._client = client
        self._url = url
        self._body = body
        self._headers = headers
        self._endpoint = endpoint
        self._cluster = cluster
        self._held: tuple[Pool, Connection, Response] | None = None

    async def __aenter__(self) -> StreamedResponse:
        client, endpoint, cluster = self._client, self._endpoint, self._cluster
        lane = client._requests
        pool, path = lane.http.pool(self._url)
        try:
            connection, response = await pool.request(
                "POST", path, encode_json(self._body), self._headers,
                connect_timeout=client._connect_s, timeout=client._first_token_s, json=True,
            )
        except PoolTimeout as full:  # (a name of its own, as in `_whole`)
            raise lane.overloaded(client.shown(endpoint, cluster)) from full
        except TRANSPORT_ERRORS as exc:
            raise upstream_error(exc, endpoint, cluster, "with its first byte",
                                 name=client._name(endpoint, cluster)) from exc
        self._held = (pool, connection, response)
        try:
            response.expect_within(client._stream_idle_s, per_chunk=True)
            streamed = StreamedResponse(response, endpoint=endpoint, cluster=cluster,
                                        client=client, max_body_bytes=client._max_body,
                                        max_event_bytes=client._max_event)
            if response.status >= 400:  # its body, for the error
                _raise_for_status(response.status, await streamed.read(), endpoint, cluster,
                                  client)
        except BaseException:
            self._release()
            raise
        return streamed

    async def __aexit__(self, *_: object) -> None:
        self._release()

    def _release(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            pool, connection, response = held
            pool.release(connection, response)


def _raise_for_status(status: int, content: bytes, endpoint: str, cluster: str,
                      client: UpstreamClient) -> None:
    """An error status raises, naming the server as `client` shows it (the name is built
    only then: on every answer's path it was a string per leg)."""
    if status >= 400:
        name = client._name(endpoint, cluster)
        log = f"{cluster} server {endpoint} answered {status}"
        raise UpstreamStatusError(
            log if name is None else f"{name} answered {status}",
            status=status,
            content=content,
            endpoint=endpoint,
            cluster=cluster,
            log_message=log,
        )
