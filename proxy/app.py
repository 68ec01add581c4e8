"""The HTTP surface: routes only. The work happens in `Router`.

    POST /v1/completions, /v1/chat/completions   inference, through P and D
    GET  /v1/models                              the models the upstreams serve
    GET  /health                                 200 while a P and a D are healthy
    GET  /metrics                                Prometheus text

The two inference routes are the hot path: `RouterApp` serves them straight from ASGI,
without Starlette's middleware stack (measured: a third of the router's CPU per request
went there). Everything else, the lifespan included, is an ordinary FastAPI app. Every
error leaves as OpenAI-shaped JSON; the mapping from exceptions is here, once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy import admin
from proxy.config import RouterConfig
from proxy.errors import (
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    RouterError,
    error_body,
    internal_error,
)
from proxy.openapi import openapi_document
from proxy.protocol import Route, body_too_large, parse_request
from proxy.router import ConfigSource, Router

logger = logging.getLogger("pdproxy.app")


INFERENCE_ROUTES = {route.value: route for route in Route}


class RouterApp:
    """The ASGI app that uvicorn serves: POSTs to the inference routes go straight to the
    router; everything else (lifespan, other routes, wrong methods) to `api`."""

    def __init__(self, api: FastAPI, config: RouterConfig) -> None:
        self.api = api
        self.state = api.state  # the running Router is `state.router`
        self._max_body = config.limits.max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = INFERENCE_ROUTES.get(scope.get("path", "")) if scope["type"] == "http" else None
        if route is None:
            await self.api(scope, receive, send)
            return
        try:
            if scope["method"] != "POST":
                raise MethodNotAllowed(f"method {scope['method']} not allowed on {route.value}")
            raw = await _read_body(scope, receive, self._max_body)
            headers = {
                name.decode("latin-1"): value.decode("latin-1")
                for name, value in scope["headers"]
                if name.startswith(b"x-")
            }
            request = parse_request(route, raw, headers, max_body_bytes=self._max_body)
            response: ASGIApp = await self.state.router.exchange(request)
        except RouterError as exc:
            response = _json_error(exc)
        except Exception as exc:
            logger.exception("unexpected error on POST %s", scope["path"])
            response = _json_error(internal_error(exc))
        await response(scope, receive, send)


def create_app(config: RouterConfig, source: ConfigSource | None = None) -> RouterApp:
    """The router's ASGI app; with `source`, the config file is watched (see membership)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        router = Router(config, source)
        app.state.router = router
        await router.start()
        try:
            yield
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
        status = 200 if all(healthy.values()) else 503
        return JSONResponse({"status": "ok" if status == 200 else "degraded", "healthy": healthy}, status)

    async def metrics(request: Request) -> Response:
        router: Router = request.app.state.router
        return Response(router.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.router.add_route("/v1/models", models, methods=["GET"])
    app.router.add_route("/health", health, methods=["GET"])
    app.router.add_route("/metrics", metrics, methods=["GET"])
    admin_token = config.admin_token or os.environ.get("PDPROXY_ADMIN_TOKEN")
    if admin_token:
        admin.install(app, admin_token)
    document = openapi_document(admin=bool(admin_token))
    app.openapi = lambda: document  # type: ignore[method-assign]
    _install_error_handlers(app)
    return RouterApp(app, config)


@contextlib.asynccontextmanager
async def serving(app: ASGIApp, *, name: str = "router") -> AsyncIterator[tuple[str, Any]]:
    """Serve `app` with uvicorn on 127.0.0.1 (a free port) inside the running event loop,
    for tests and tools that embed the router; yields (base URL, the uvicorn server)."""
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    )
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
    for name, value in scope["headers"]:
        if name == b"content-length" and value.isdigit() and int(value) > limit:
            raise body_too_large(int(value), limit)
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
