"""The HTTP surface: routes only. The work happens in `Router`.

    POST /v1/completions, /v1/chat/completions   inference, through P and D
    GET  /v1/models                              the models the upstreams serve
    GET  /health                                 200 while a P and a D are healthy
    GET  /metrics                                Prometheus text

The two inference routes are the hot path: `RouterApp` serves them without Starlette's
middleware stack (measured: a third of the router's CPU per request went there), and on
the router's own listener without uvicorn's ASGI cycle either (`serve_inference`, see
`proxy.api.cycle`). Everything else, the lifespan included, is an ordinary FastAPI app.
Every error leaves as OpenAI-shaped JSON; the mapping from exceptions is here, once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.api import admin
from proxy.api.openapi import openapi_document
from proxy.config import ConfigSource, RouterConfig, environment_client_keys, resolve_secret
from proxy.errors import (
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    Overloaded,
    RouterError,
    Unauthorized,
    error_body,
    internal_error,
)
from proxy.flow.relay import (
    CLIENT_CONNECTION,
    AsgiAnswer,
    ClientAnswer,
    ClientConnection,
    FlowResponse,
)
from proxy.flow.router import Router
from proxy.protocol import Route, body_too_large, parse_request, refuse_declared_too_large

if TYPE_CHECKING:
    from proxy.api.control import WorkerGroup
    from proxy.api.cycle import InferenceCycle

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
        given = next((value for name, value in headers if name == b"authorization"), b"")
        # Every key compared in constant time, whichever matches: no timing hint.
        if not any([hmac.compare_digest(given, expected) for expected in self._expected]):
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


class RouterApp:
    """The ASGI app that uvicorn serves: POSTs to the inference routes go straight to the
    router; everything else (lifespan, other routes, wrong methods) to `api`. The router's
    listener hands it inference requests on its own cycle (`serve_inference`), served
    the same way.

    It admits an inference request only with a client key (when keys are configured) and
    under `limits.max_in_flight`; the count covers the request from its first byte to its
    last, so slow bodies and long streams count too."""

    def __init__(self, api: FastAPI, config: RouterConfig, admin_api: FastAPI | None = None) -> None:
        self.api = api
        self.state = api.state  # the running Router is `state.router`
        # ... and this, set by the same lifespan: the inference routes read it per request
        # (Starlette's State.__getattr__ was 0.7% of the router's CPU per request).
        self.router: Router | None = None
        # The admin API when it listens on its own address (`admin_listen`), else None.
        self.admin_api = admin_api
        self._max_body = config.limits.max_body_bytes
        self._max_in_flight = config.limits.in_flight_cap
        self._client_keys = ClientKeys.of(config)
        self._client_keys.log()
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = INFERENCE_ROUTES.get(scope.get("path", "")) if scope["type"] == "http" else None
        if route is None:
            if self._client_keys and scope["type"] == "http" and scope["path"] == "/v1/models":
                try:
                    self._client_keys.check(scope["headers"])
                except RouterError as exc:
                    self._reject(exc)
                    await _json_error(exc)(scope, receive, send)
                    return
            await self.api(scope, receive, send)
            return
        max_body = self._max_body
        await self._serve(route, scope["method"], scope["headers"],
                          lambda: _read_body(scope, receive, max_body), AsgiAnswer(send),
                          scope.get("extensions", {}).get(CLIENT_CONNECTION), receive)

    def serve_inference(self, cycle: InferenceCycle) -> Awaitable[None]:
        """An inference request on the router's own listener (`listener`), which read
        its head: the same as through ASGI, its body read from the cycle and its answer
        written by it. (Not a coroutine of its own: `_serve`'s is awaited directly, one
        frame less to resume at each of the request's waits.)"""
        max_body = self._max_body
        return self._serve(cycle.route, "POST", cycle.headers, lambda: cycle.read_body(max_body),
                           cycle, cycle.connection, None)

    async def _serve(
        self, route: Route, method: str, headers: list[tuple[bytes, bytes]],
        read_body: Callable[[], Awaitable[bytes]], out: ClientAnswer,
        connection: ClientConnection | None, receive: Receive | None,
    ) -> None:
        """Admit the request and answer it to `out`: its flow's answer, or an error's.
        The flow is told of the client leaving by `connection` (None: by `receive`)."""
        try:
            self._admit(headers)
        except RouterError as exc:
            self._reject(exc)
            await _answer_error(out, exc)
            return
        self.in_flight += 1
        try:
            response = await self._respond(route, method, headers, read_body)
            if isinstance(response, RouterError):
                await _answer_error(out, response)
            else:  # the flow runs in this frame, not under another one
                await response.answer(out, connection, receive)
        finally:
            self.in_flight -= 1

    def _admit(self, headers: list[tuple[bytes, bytes]]) -> None:
        if self._client_keys:
            self._client_keys.check(headers)
        if self._max_in_flight and self.in_flight >= self._max_in_flight:
            raise Overloaded(f"the router is serving {self.in_flight} requests, its limit "
                             f"(limits.max_in_flight: {self._max_in_flight}); try again shortly",
                             reason="max_in_flight")

    def _reject(self, error: RouterError) -> None:
        metrics = self.state.router.metrics
        reason = error.reason if isinstance(error, Overloaded) else "unauthorized"
        metrics.child(metrics.rejected, reason).inc()

    async def _respond(
        self, route: Route, method: str, headers: list[tuple[bytes, bytes]],
        read_body: Callable[[], Awaitable[bytes]],
    ) -> FlowResponse | RouterError:
        """The request's flow, or the error to answer it with. Returned, not run: the
        flow runs in `_serve`'s frame, not under another one."""
        try:
            if method != "POST":
                raise MethodNotAllowed(f"method {method} not allowed on {route.value}")
            raw = await read_body()
            own: dict[str, str] = {}  # the x- headers (a loop: a comprehension is a call more)
            for name, value in headers:
                if name.startswith(b"x-"):
                    own[name.decode("latin-1")] = value.decode("latin-1")
            request = parse_request(route, raw, own, max_body_bytes=self._max_body)
            router = self.router
            assert router is not None  # uvicorn serves no request before the lifespan's start
            if router.tracing is None:
                return await router.handle(request)
            # the request's span: the exchange the router builds adopts it
            return await router.tracing.handled(route.value, headers,
                                                lambda: router.handle(request))
        except RouterError as exc:
            return exc
        except Exception as exc:
            logger.exception("unexpected error on POST %s", route.value)
            return internal_error(exc)


def create_app(
    config: RouterConfig, source: ConfigSource | None = None, *,
    workers: WorkerGroup | None = None,
) -> RouterApp:
    """The router's ASGI app; with `source`, the config file is watched (see membership).
    With `workers` (one worker of `--workers N`), /metrics and the admin API cover every
    worker (see proxy.api.control)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        router = Router(config, source)
        app.state.router = router_app.router = router
        if admin_api is not None:
            admin_api.state.router = router
        router.metrics.watch_in_flight(lambda: router_app.in_flight)
        await router.start()
        try:
            if workers is not None:
                await workers.start(router)
            try:
                yield
            finally:
                if workers is not None:
                    await workers.aclose()
        finally:
            await router.aclose()

    app = FastAPI(
        title="pd-proxy",
        summary="OpenAI-compatible router for vLLM prefill/decode disaggregation",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )

    async def models(request: Request) -> Response:
        router: Router = request.app.state.router
        return JSONResponse(await router.catalog.listing())

    async def health(request: Request) -> Response:
        router: Router = request.app.state.router
        healthy = {c.name.value: sum(e.healthy for e in c.endpoints) for c in (router.prefill, router.decode)}
        # Serving needs a healthy D, and a healthy P unless requests can do without one
        # (`mode: local`, or auto with `auto.local`: D computes the prompt).
        needed = ["decode"] if router.serves_without_prefill else ["prefill", "decode"]
        status = 200 if all(healthy[name] for name in needed) else 503
        return JSONResponse({"status": "ok" if status == 200 else "degraded", "healthy": healthy}, status)

    async def metrics(request: Request) -> Response:
        router: Router = request.app.state.router
        text = router.metrics.render()
        if workers is not None:  # every worker's, each sample labelled with its worker
            text = await workers.metrics(text)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    app.router.add_route("/v1/models", models, methods=["GET"])
    app.router.add_route("/health", health, methods=["GET"])
    app.router.add_route("/metrics", metrics, methods=["GET"])
    admin_token = resolve_secret(config.admin_token) or os.environ.get("PDPROXY_ADMIN_TOKEN")
    admin_api: FastAPI | None = None
    if admin_token and config.admin_listen:
        # The admin API on its own listener (cli.serve runs it): the public one has no
        # /admin routes at all.
        admin_api = FastAPI(title="pd-proxy admin", docs_url=None, redoc_url=None)
        admin_api.state.workers = workers
        admin.install(admin_api, admin_token)
        admin_document = openapi_document(admin=True)
        admin_api.openapi = lambda: admin_document  # type: ignore[method-assign]
        _install_error_handlers(admin_api)
    elif admin_token:
        admin.install(app, admin_token)
    document = openapi_document(admin=bool(admin_token) and admin_api is None)
    app.openapi = lambda: document  # type: ignore[method-assign]
    _install_error_handlers(app)
    app.state.workers = workers
    router_app = RouterApp(app, config, admin_api)
    return router_app


@contextlib.asynccontextmanager
async def serving(
    app: ASGIApp, *, name: str = "router", config: RouterConfig | None = None, **overrides: Any
) -> AsyncIterator[tuple[str, Any]]:
    """Serve `app` with uvicorn on 127.0.0.1 (a free port) inside the running event loop,
    for tests and tools that embed the router; yields (base URL, the uvicorn server).
    It listens as `pd-proxy serve` does (proxy.api.listener), with `config`'s client timeouts
    and shutdown grace (their defaults without one); `overrides` are uvicorn.Config's."""
    from proxy.api.listener import server_config

    settings: dict[str, Any] = {"host": "127.0.0.1", "port": 0, "log_level": "warning",
                                "lifespan": "on", **overrides}
    server = uvicorn.Server(server_config(app, config, **settings))
    task = asyncio.create_task(server.serve(), name=name)
    async with asyncio.timeout(10):
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        async with asyncio.timeout(10):
            await task


async def _read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """Read the request body, refusing it (413) as soon as it passes the limit."""
    refuse_declared_too_large(scope["headers"], limit)
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


async def _answer_error(out: ClientAnswer, error: RouterError) -> None:
    """An error's OpenAI-shaped JSON answer, with its headers (as `_json_error`'s)."""
    await out.whole(error.status, "application/json",
                    [(name.lower().encode("latin-1"), value.encode("latin-1"))
                     for name, value in error.headers().items()], error.body())


def _json_error(error: RouterError) -> Response:
    return Response(
        error.body(), status_code=error.status, media_type="application/json",
        headers=error.headers(),
    )


def _install_error_handlers(app: FastAPI) -> None:
    json_error = _json_error

    async def on_router_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RouterError)
        return json_error(exc)

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 404:
            return json_error(NotFound(f"no route {request.method} {request.url.path}"))
        if exc.status_code == 405:
            return json_error(
                MethodNotAllowed(f"method {request.method} not allowed on {request.url.path}")
            )
        body = error_body(str(exc.detail), "invalid_request_error", exc.status_code)
        return Response(body, status_code=exc.status_code, media_type="application/json")

    async def on_validation_error(request: Request, exc: Exception) -> Response:
        return json_error(InvalidRequest(str(exc)))

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("unexpected error on %s %s", request.method, request.url.path)
        return json_error(internal_error(exc))

    app.add_exception_handler(RouterError, on_router_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(Exception, on_unexpected)
