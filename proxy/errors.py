"""The router's exceptions, and their one mapping to OpenAI-shaped HTTP errors.

    RouterError                      anything the router reports to a client
    ├── InvalidRequest               400: the client's body or headers are wrong
    │   └── PayloadTooLarge          413: the body is over the configured limit
    │   └── MethodNotAllowed         405: a route asked with the wrong method
    ├── NotFound                     404: unknown route or model
    ├── Unauthorized                 401: a missing or wrong API key
    ├── NoHealthyEndpoint            503: no upstream can take the request now
    ├── Overloaded                   503: over a limit of the router's own (shed load)
    ├── KVTransferError              502: the KV hand-over between P and D failed
    └── UpstreamError                a vLLM server failed us
        ├── UpstreamConnectError     502: could not connect
        ├── UpstreamTimeout          504: a configured time limit ran out
        ├── UpstreamProtocolError    502: the answer was cut or malformed
        │   ├── UpstreamConnectionLost  502: the connection broke during the exchange
        │   └── UpstreamAnswerTooLarge  502: a body or an SSE event over its cap
        └── UpstreamStatusError      the upstream's own status and body

`upstream.py` is the only module that turns the HTTP client's (`proxy.upstream.http11`) or asyncio errors into these.

An `UpstreamError` has two texts: `message`, what the client is told, names the server
as the operator allows (by its name, such as "decode server 2", unless
`show_upstream_urls`), and `str()` of it, for logs, names its URL and the transport's
detail.
"""

from __future__ import annotations

from typing import Any

import msgspec


class RouterError(Exception):
    """Base class: every error that the router turns into an HTTP answer."""

    status: int = 500
    error_type: str = "internal_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> bytes:
        """The OpenAI-shaped JSON body for this error."""
        return error_body(self.message, self.error_type, self.status, param=self.param)

    def headers(self) -> dict[str, str]:
        return {}


class InvalidRequest(RouterError):
    status = 400
    error_type = "invalid_request_error"


class PayloadTooLarge(InvalidRequest):
    status = 413


class NotFound(RouterError):
    status = 404
    error_type = "not_found_error"


class MethodNotAllowed(InvalidRequest):
    status = 405


class Unauthorized(RouterError):
    status = 401
    error_type = "authentication_error"

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}


class Conflict(InvalidRequest):
    status = 409


class NoHealthyEndpoint(RouterError):
    status = 503
    error_type = "service_unavailable"
    retry_after_s = 1

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class Overloaded(RouterError):
    """The router refuses work over one of its own limits: no upstream connection free
    within `timeouts.pool`, or `limits.max_in_flight` reached. `reason` labels
    `pdproxy_rejected_total`. Never the upstream's fault: not retried, not counted
    against a server's health."""

    status = 503
    error_type = "service_unavailable"
    retry_after_s = 1

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class KVTransferError(RouterError):
    status = 502
    error_type = "kv_transfer_error"


class UpstreamError(RouterError):
    """A vLLM server failed. `endpoint` names it (its URL), `cluster` its role.
    `message` is the client's text; `log_message` (also `str()`) the log's, with the
    server's URL (the same text when not given)."""

    status = 502
    error_type = "upstream_error"
    kind = "error"  # short label for metrics

    def __init__(self, message: str, *, endpoint: str = "", cluster: str = "",
                 log_message: str | None = None) -> None:
        super().__init__(message)
        self.endpoint = endpoint
        self.cluster = cluster
        self.log_message = message if log_message is None else log_message

    def __str__(self) -> str:
        return self.log_message


class UpstreamConnectError(UpstreamError):
    kind = "connect"


class UpstreamTimeout(UpstreamError):
    status = 504
    error_type = "timeout"
    kind = "timeout"


class UpstreamProtocolError(UpstreamError):
    kind = "protocol"


class UpstreamConnectionLost(UpstreamProtocolError):
    """The server's connection closed or reset before its answer was complete (it
    crashed, or something between us cut the connection): counts against its health."""


class UpstreamAnswerTooLarge(UpstreamProtocolError):
    """A whole answer's body over `limits.max_upstream_body_bytes` (kind
    `body_too_large`), or one SSE event of a stream over `limits.max_upstream_event_bytes`
    (`event_too_large`): the router keeps no more of it, and closes its connection."""

    def __init__(self, message: str, *, kind: str, endpoint: str = "", cluster: str = "",
                 log_message: str | None = None) -> None:
        super().__init__(message, endpoint=endpoint, cluster=cluster, log_message=log_message)
        self.kind = kind


class UpstreamStatusError(UpstreamError):
    """The upstream answered with an error status: relay its status and body."""

    kind = "status"

    def __init__(
        self, message: str, *, status: int, content: bytes, endpoint: str = "", cluster: str = "",
        log_message: str | None = None,
    ) -> None:
        super().__init__(message, endpoint=endpoint, cluster=cluster, log_message=log_message)
        self.status = status
        self.content = content

    def body(self) -> bytes:
        # vLLM's error bodies are already OpenAI-shaped; keep them when they are JSON.
        try:
            decoded = msgspec.json.decode(self.content)
        except msgspec.DecodeError:
            decoded = None
        if isinstance(decoded, dict) and ("error" in decoded or "message" in decoded):
            return self.content
        return error_body(self.message, "upstream_error", self.status)


def internal_error(exc: BaseException) -> RouterError:
    """What a client is told of a bug: a 500 naming the exception type, no stack trace."""
    return RouterError(f"internal router error ({type(exc).__name__}); see its log")


def error_body(message: str, error_type: str, status: int, *, param: str | None = None) -> bytes:
    payload: dict[str, Any] = {
        "error": {"message": message, "type": error_type, "param": param, "code": status}
    }
    return msgspec.json.encode(payload)


def sse_error_event(error: RouterError) -> bytes:
    """How an error is told to a client once a stream has started: a last SSE event."""
    return b"data: " + error.body() + b"\n\ndata: [DONE]\n\n"
