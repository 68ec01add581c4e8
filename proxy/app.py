"""The HTTP surface: routes only. The work happens in `Router`.

    POST /v1/completions, /v1/chat/completions   inference, through P and D
    GET  /v1/models                              the models the upstreams serve
    GET  /health                                 200 while a P and a D are healthy
    GET  /metrics                                Prometheus text

Every error leaves as OpenAI-shaped JSON; the mapping from exceptions is here, once.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from proxy.config import RouterConfig
from proxy.errors import InvalidRequest, NotFound, RouterError, error_body
from proxy.protocol import Route, body_too_large, parse_request
from proxy.router import Router

logger = logging.getLogger("pdproxy.app")


def create_app(config: RouterConfig) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        router = Router(config)
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

    async def completions(request: Request) -> Response:
        return await _inference(request, Route.COMPLETIONS)

    async def chat_completions(request: Request) -> Response:
        return await _inference(request, Route.CHAT)

    async def _inference(request: Request, route: Route) -> Response:
        router: Router = request.app.state.router
        raw = await _read_body(request, config.limits.max_body_bytes)
        headers = {k: v for k, v in request.headers.items() if k.startswith("x-")}
        parsed = parse_request(route, raw, headers, max_body_bytes=config.limits.max_body_bytes)
        return await router.exchange(parsed)  # type: ignore[return-value]

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

    # Plain Starlette routes: no FastAPI dependency injection on the hot path.
    app.router.add_route(Route.COMPLETIONS.value, completions, methods=["POST"])
    app.router.add_route(Route.CHAT.value, chat_completions, methods=["POST"])
    app.router.add_route("/v1/models", models, methods=["GET"])
    app.router.add_route("/health", health, methods=["GET"])
    app.router.add_route("/metrics", metrics, methods=["GET"])
    _install_error_handlers(app)
    return app


async def _read_body(request: Request, limit: int) -> bytes:
    """Read the body, refusing it (413) as soon as it passes the limit."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise body_too_large(int(declared), limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise body_too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _install_error_handlers(app: FastAPI) -> None:
    def json_error(error: RouterError) -> Response:
        return Response(
            error.body(), status_code=error.status, media_type="application/json",
            headers=error.headers(),
        )

    async def on_router_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RouterError)
        return json_error(exc)

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 404:
            return json_error(NotFound(f"no route {request.method} {request.url.path}"))
        if exc.status_code == 405:
            error = InvalidRequest(f"method {request.method} not allowed on {request.url.path}")
            error.status = 405
            return json_error(error)
        body = error_body(str(exc.detail), "invalid_request_error", exc.status_code)
        return Response(body, status_code=exc.status_code, media_type="application/json")

    async def on_validation_error(request: Request, exc: Exception) -> Response:
        return json_error(InvalidRequest(str(exc)))

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("unexpected error on %s %s", request.method, request.url.path)
        return json_error(RouterError(f"internal router error ({type(exc).__name__}); see its log"))

    app.add_exception_handler(RouterError, on_router_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(Exception, on_unexpected)
