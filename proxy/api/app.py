"""The HTTP surface: routes only. The work happens in `Router`.

    POST /v1/completions, /v1/chat/completions   inference, through P and D
    GET  /v1/models                              the models the upstreams serve
    GET  /health                                 200 while a P and a D are healthy
    GET  /metrics                                Prometheus text

The two inference routes are the hot path: `RouterApp` hands them to
`proxy.api.inference` without Starlette's middleware stack (measured: a third of the
router's CPU per request went there), and on the router's own listener without uvicorn's
ASGI cycle either (`serve_inference`, see `proxy.api.cycle`). Everything else, the
lifespan included, is an ordinary FastAPI app, whose handlers (here) answer every error
as OpenAI-shaped JSON, as the inference routes do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.api import admin
from proxy.api.inference import INFERENCE_ROUTES, InferenceRoutes
from proxy.api.openapi import openapi_document
from proxy.config import ConfigSource, RouterConfig, resolve_secret
from proxy.errors import (
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    RouterError,
    error_body,
    internal_error,
)
from proxy.flow.relay import CLIENT_CONNECTION, AsgiAnswer
from proxy.flow.router import Router

if TYPE_CHECKING:
    from proxy.api.control import WorkerGroup

logger = logging.getLogger("pdproxy.app")


class RouterApp:
    """The ASGI app that uvicorn serves: requests to the inference routes go straight to
    `InferenceRoutes` (`proxy.api.inference`: admission, the router, the answer);
    everything else (lifespan, other routes) to `api`. The router's listener hands it
    inference requests on its own cycle (`serve_inference`), served the same way."""

    def __init__(self, api: FastAPI, config: RouterConfig, admin_api: FastAPI | None = None) -> None:
        self.api = api
        self.state = api.state  # the running Router is `state.router`
        # The admin API when it listens on its own address (`admin_listen`), else None.
        self.admin_api = admin_api
        # The inference routes; their `router` is set by the same lifespan (they read it
        # per request: Starlette's State.__getattr__ was 0.7% of the router's CPU per
        # request).
        self.inference = InferenceRoutes(config)
        # What the router's listener calls with each inference request on its own cycle.
        self.serve_inference = self.inference.serve_inference

    @property
    def in_flight(self) -> int:
        """Inference requests admitted and not answered to their last byte."""
        return self.inference.in_flight

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = INFERENCE_ROUTES.get(scope.get("path", "")) if scope["type"] == "http" else None
        inference = self.inference
        if route is None:
            keys = inference.client_keys
            if keys and scope["type"] == "http" and scope["path"] == "/v1/models":
                try:
                    keys.check(scope["headers"])
                except RouterError as exc:
                    inference.reject(exc)
                    await _json_error(exc)(scope, receive, send)
                    return
            await self.api(scope, receive, send)
            return
        await inference.serve(route, scope["method"], scope["headers"], AsgiAnswer(send),
                              scope.get("extensions", {}).get(CLIENT_CONNECTION), None, receive)


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
        app.state.router = router_app.inference.router = router
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
