"""The two inference routes (POST /v1/completions, /v1/chat/completions): admission and
answer, on the router's own listener (`serve_inference`) or through ASGI (`serve`).

A request is admitted only with a client key (when keys are configured) and under
`limits.max_in_flight`; the count covers it from its first byte to its last, so slow
bodies and long streams count too. Its body is read, parsed, and handed to the
`Router`, whose flow then answers it in this frame. Every error leaves as
OpenAI-shaped JSON.

This module is compiled with the request path (`pyproject.toml`); `proxy.api.app` (the
FastAPI app, its lifespan and its other routes, which mypyc does not compile) hands the
inference routes here.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from hmac import compare_digest
from typing import TYPE_CHECKING

from starlette.types import Receive

from proxy.config import RouterConfig, environment_client_keys, resolve_secret
from proxy.errors import (
    InvalidRequest,
    MethodNotAllowed,
    Overloaded,
    RouterError,
    Unauthorized,
    internal_error,
)
from proxy.flow.relay import ClientAnswer, ClientConnection, FlowResponse
from proxy.protocol import (
    ClientRequest,
    Route,
    body_too_large,
    parse_request,
    refuse_declared_too_large,
)

if TYPE_CHECKING:
    from proxy.api.cycle import InferenceCycle
    from proxy.flow.router import Router

logger = logging.getLogger("pdproxy.app")

INFERENCE_ROUTES = {route.value: route for route in Route}


class ClientKeys:
    """The API keys clients must show on the inference routes and /v1/models
    ("Authorization: Bearer <key>"); none configured: every client is let in, and the
    start says so (`log`)."""

    def __init__(self, keys: list[str]) -> None:
        self._expected = [f"Bearer {key}".encode("latin-1") for key in keys]

    def __bool__(self) -> bool:
        return bool(self._expected)

    def check(self, headers: list[tuple[bytes, bytes]]) -> None:
        given = b""
        for name, value in headers:
            if name == b"authorization":
                given = value
                break
        # Every key compared in constant time, whichever matches: no timing hint.
        if not any([compare_digest(given, expected) for expected in self._expected]):
            raise Unauthorized("a valid API key is needed: Authorization: Bearer <key>")

    @classmethod
    def of(cls, config: RouterConfig) -> ClientKeys:
        """The configured keys, else PDPROXY_CLIENT_API_KEYS's. A blank key is an error
        (refused already when the config was read): a key that vanished would open the
        routes to every client."""
        keys = [(resolve_secret(key) or "").strip() for key in config.auth.client_api_keys]
        if not all(keys):
            raise ValueError("auth.client_api_keys has an empty key: give the keys")
        return cls(keys or environment_client_keys())

    def log(self) -> None:
        if self:
            logger.info("client API keys: %d; %s and /v1/models need one", len(self._expected),
                        ", ".join(INFERENCE_ROUTES))
        else:
            logger.warning("no client API keys (auth.client_api_keys, PDPROXY_CLIENT_API_KEYS): "
                           "%s and /v1/models are open to every client",
                           ", ".join(INFERENCE_ROUTES))


class InferenceRoutes:
    """Serves the inference routes for the app (`proxy.api.app.RouterApp`), whose
    lifespan sets `router` before the first request."""

    def __init__(self, config: RouterConfig) -> None:
        self.router: Router | None = None
        self.in_flight = 0
        self._max_body = config.limits.max_body_bytes
        self._max_in_flight = config.limits.in_flight_cap
        self.client_keys = ClientKeys.of(config)
        self.client_keys.log()

    def serve_inference(self, cycle: InferenceCycle) -> Awaitable[None]:
        """An inference request on the router's own listener (`listener`), which read
        its head: its body read from the cycle and its answer written by it. (Not a
        coroutine of its own: `serve`'s is awaited directly, one frame less to resume at
        each of the request's waits.)"""
        return self.serve(cycle.route, "POST", cycle.headers, cycle, cycle.connection, cycle, None)

    async def serve(
        self, route: Route, method: str, headers: list[tuple[bytes, bytes]], out: ClientAnswer,
        connection: ClientConnection | None, cycle: InferenceCycle | None,
        receive: Receive | None,
    ) -> None:
        """Admit the request and answer it to `out`: its flow's answer, or an error's. Its
        body comes from `cycle` (the listener's), else from ASGI's `receive`; the flow is
        told of the client leaving by `connection` (None: by `receive`)."""
        try:
            self._admit(headers)
        except RouterError as refused:
            self.reject(refused)
            await answer_error(out, refused)
            return
        self.in_flight += 1
        try:
            response = await self._respond(route, method, headers, cycle, receive)
            if isinstance(response, RouterError):
                await answer_error(out, response)
            else:  # the flow runs in this frame, not under another one
                await response.answer(out, connection, receive)
        finally:
            self.in_flight -= 1

    def _admit(self, headers: list[tuple[bytes, bytes]]) -> None:
        if self.client_keys:
            self.client_keys.check(headers)
        if self._max_in_flight and self.in_flight >= self._max_in_flight:
            raise Overloaded(f"the router is serving {self.in_flight} requests, its limit "
                             f"(limits.max_in_flight: {self._max_in_flight}); try again shortly",
                             reason="max_in_flight")

    def reject(self, error: RouterError) -> None:
        """Count a request refused by a client key or a limit."""
        router = self.router
        assert router is not None  # uvicorn serves no request before the lifespan's start
        metrics = router.metrics
        reason = error.reason if isinstance(error, Overloaded) else "unauthorized"
        metrics.child(metrics.rejected, reason).inc()

    async def _respond(
        self, route: Route, method: str, headers: list[tuple[bytes, bytes]],
        cycle: InferenceCycle | None, receive: Receive | None,
    ) -> FlowResponse | RouterError:
        """The request's flow, or the error to answer it with. Returned, not run: the
        flow runs in `serve`'s frame, not under another one."""
        try:
            if method != "POST":
                raise MethodNotAllowed(f"method {method} not allowed on {route.value}")
            if cycle is not None:
                raw = await cycle.read_body(self._max_body)
            else:
                assert receive is not None
                raw = await read_asgi_body(headers, receive, self._max_body)
            own: dict[str, str] = {}  # the x- headers
            for name, value in headers:
                if name.startswith(b"x-"):
                    own[name.decode("latin-1")] = value.decode("latin-1")
            request = parse_request(route, raw, own, max_body_bytes=self._max_body)
            router = self.router
            assert router is not None  # uvicorn serves no request before the lifespan's start
            if router.tracing is None:
                return await router.handle(request)
            return await _traced(router, route, headers, request)
        except RouterError as failed:
            return failed
        except Exception as unexpected:
            logger.exception("unexpected error on POST %s", route.value)
            return internal_error(unexpected)


def _traced(router: Router, route: Route, headers: list[tuple[bytes, bytes]],
            request: ClientRequest) -> Awaitable[FlowResponse]:
    """`router.handle(request)` in the request's span, which the exchange the router
    builds adopts. (A function of its own: a closure inside a compiled coroutine would
    make a reference cycle per request.)"""
    assert router.tracing is not None
    return router.tracing.handled(route.value, headers, lambda: router.handle(request))


async def read_asgi_body(headers: list[tuple[bytes, bytes]], receive: Receive, limit: int) -> bytes:
    """An ASGI request's body, refused (413) as soon as it passes `limit` bytes."""
    refuse_declared_too_large(headers, limit)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise InvalidRequest("the client left before sending its whole body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise body_too_large(size, limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def answer_error(out: ClientAnswer, error: RouterError) -> None:
    """An error's OpenAI-shaped JSON answer, with its headers (as the app's handlers')."""
    await out.whole(error.status, "application/json",
                    [(name.lower().encode("latin-1"), value.encode("latin-1"))
                     for name, value in error.headers().items()], error.body())
