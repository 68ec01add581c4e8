"""The admin API: list, add, remove and drain servers while the router runs.

    GET    /admin/endpoints                          every server and its state
    POST   /admin/endpoints         {"cluster": "prefill", "url": "http://p3:8000", ...}
    DELETE /admin/endpoints?cluster=decode&url=http://d2:8000
    POST   /admin/endpoints/drain   {"cluster": "decode", "url": "...", "draining": true}
    GET    /admin/auto                               what auto mode has measured: average
                                                     TTFT per mode and prompt-length bucket

Every call needs `Authorization: Bearer <admin_token>`; without a configured token the
routes do not exist. A refused call is logged (method, path, client address) and counted
in `pdproxy_admin_auth_failures_total`. With `admin_listen`, these routes are served on
that address only, never on the public listener. Answers are JSON; errors are OpenAI-shaped like the rest.
"""

from __future__ import annotations

import hmac
import logging
from typing import TYPE_CHECKING, Any

import msgspec
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from proxy.config import EndpointConfig
from proxy.endpoints import ClusterName
from proxy.errors import InvalidRequest, Unauthorized

if TYPE_CHECKING:
    from proxy.router import Router

logger = logging.getLogger("pdproxy.admin")


def install(app: FastAPI, token: str) -> None:
    def authorized(request: Request) -> Router:
        router: Router = request.app.state.router
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            router.metrics.admin_auth_failures.inc()
            client = request.client.host if request.client else "?"
            logger.warning("admin API: refused %s %s from %s (%s token)", request.method,
                           request.url.path, client, "wrong" if given else "no")
            raise Unauthorized("the admin API needs Authorization: Bearer <admin_token>")
        return router

    async def body_of(request: Request) -> dict[str, Any]:
        try:
            body = msgspec.json.decode(await request.body())
        except msgspec.DecodeError as exc:
            raise InvalidRequest(f"body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise InvalidRequest("body must be a JSON object")
        return body

    def cluster_of(value: object) -> ClusterName:
        try:
            return ClusterName(value)
        except ValueError:
            raise InvalidRequest("cluster must be 'prefill' or 'decode'", param="cluster") from None

    async def listing(request: Request) -> Response:
        router = authorized(request)
        return JSONResponse({"endpoints": router.membership.describe()})

    async def add(request: Request) -> Response:
        router = authorized(request)
        body = await body_of(request)
        cluster = cluster_of(body.pop("cluster", None))
        try:
            config = msgspec.convert(body, EndpointConfig)
        except (msgspec.ValidationError, ValueError) as exc:
            raise InvalidRequest(f"bad endpoint: {exc}") from None
        endpoint = router.membership.add(cluster, config)
        return JSONResponse({"added": endpoint.url, "cluster": cluster.value}, 201)

    async def remove(request: Request) -> Response:
        router = authorized(request)
        cluster = cluster_of(request.query_params.get("cluster"))
        endpoint = router.membership.remove(cluster, request.query_params.get("url", ""))
        return JSONResponse({"removed": endpoint.url, "in_flight": endpoint.in_flight})

    async def drain(request: Request) -> Response:
        router = authorized(request)
        body = await body_of(request)
        draining = body.get("draining", True)
        if not isinstance(draining, bool):
            raise InvalidRequest("draining must be true or false", param="draining")
        endpoint = router.membership.drain(cluster_of(body.get("cluster")), str(body.get("url", "")),
                                           draining)
        return JSONResponse({"url": endpoint.url, "draining": endpoint.draining,
                             "in_flight": endpoint.in_flight})

    async def auto(request: Request) -> Response:
        router = authorized(request)
        learner = router.learner
        return JSONResponse({"learning": learner is not None,
                             "buckets": learner.snapshot() if learner else []})

    app.router.add_route("/admin/endpoints", listing, methods=["GET"])
    app.router.add_route("/admin/auto", auto, methods=["GET"])
    app.router.add_route("/admin/endpoints", add, methods=["POST"])
    app.router.add_route("/admin/endpoints", remove, methods=["DELETE"])
    app.router.add_route("/admin/endpoints/drain", drain, methods=["POST"])
