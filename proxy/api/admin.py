"""The admin API: list, add, remove and drain servers while the router runs.

    GET    /admin/endpoints                          every server and its state
    POST   /admin/endpoints         {"cluster": "prefill", "url": "http://p3:8000", ...}
    DELETE /admin/endpoints?cluster=decode&url=http://d2:8000
    POST   /admin/endpoints/drain   {"cluster": "decode", "url": "...", "draining": true}
    GET    /admin/auto                               what auto mode has measured: average
                                                     TTFT per mode and prompt-length bucket
                                                     (and per push layering, where learned)
    GET    /admin/kv                                 kv_aware's index: each server's event
                                                     sources, their state and blocks

Every call needs `Authorization: Bearer <admin_token>`; without a configured token the
routes do not exist. A refused call is logged (method, path, client address) and counted
in `pdproxy_admin_auth_failures_total`. With `admin_listen`, these routes are served on
that address only, never on the public listener. Answers are JSON; errors are OpenAI-shaped like the rest.

A caller with the token still gets no more than the operator allows: an added server's
`api_key` reads only variables under `admin_secret_env_prefix`, it is sent its
cluster's key only with `admin_inherit_cluster_key`, and its URL may be a link-local or
metadata address only with `admin_allow_link_local`.

With `--workers N`, each call is applied by the worker that took it (`apply`) and then by
every other worker (`proxy.api.control`), one change at a time in one order everywhere,
and written to the workers' state file that a restarted worker takes: a change answers
once all have applied it, with "workers" listing them, or 502 naming those that failed;
a GET answers this worker's view plus every worker's under "workers".
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

import msgspec
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from proxy.config import EndpointConfig
from proxy.errors import InvalidRequest, NotFound, Unauthorized
from proxy.pool.endpoints import ClusterName

if TYPE_CHECKING:
    from proxy.flow.router import Router

logger = logging.getLogger("pdproxy.admin")


class AdminCall(msgspec.Struct, frozen=True, kw_only=True):
    """One admin API call, as it is applied (and forwarded to the other workers)."""

    method: str
    path: str
    query: dict[str, str] = {}
    body: bytes = b""


# What an operation answers: an HTTP status and a JSON object.
Answer = tuple[int, dict[str, Any]]


class OtherWorkers(Protocol):
    """The workers of `--workers N` (`proxy.api.control.WorkerGroup`): a call is applied
    here and on every other worker."""

    async def admin(self, call: AdminCall) -> Answer: ...


def apply(router: Router, call: AdminCall) -> Answer:
    """Apply `call` to this process's router (already authorized)."""
    operation = _OPERATIONS.get((call.method, call.path))
    if operation is None:
        raise NotFound(f"no route {call.method} {call.path}")
    return operation(router, call)


def _body_of(call: AdminCall) -> dict[str, Any]:
    try:
        body = msgspec.json.decode(call.body)
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("body must be a JSON object")
    return body


def _cluster_of(value: object) -> ClusterName:
    try:
        return ClusterName(value)
    except ValueError:
        raise InvalidRequest("cluster must be 'prefill' or 'decode'", param="cluster") from None


def _listing(router: Router, call: AdminCall) -> Answer:
    return 200, {"endpoints": router.membership.describe()}


def _add(router: Router, call: AdminCall) -> Answer:
    settings = router.config
    body = _body_of(call)
    cluster = _cluster_of(body.pop("cluster", None))
    _check_env_reference(body.get("api_key"), settings.admin_secret_env_prefix)
    try:
        config = msgspec.convert(body, EndpointConfig)
    except (msgspec.ValidationError, ValueError) as exc:
        raise InvalidRequest(f"bad endpoint: {exc}") from None
    if not settings.admin_allow_link_local and _is_link_local(config.url):
        raise InvalidRequest(f"{config.url} is a link-local or cloud metadata address; the "
                             "admin API adds none unless admin_allow_link_local is true",
                             param="url")
    if not settings.admin_inherit_cluster_key:  # its own api_key, or none at all
        config = msgspec.structs.replace(config, cluster_key=False)
    endpoint = router.membership.add(cluster, config)
    return 201, {"added": endpoint.url, "cluster": cluster.value}


def _check_env_reference(api_key: object, prefix: str) -> None:
    """An admin call may name only the variables the operator set aside for it. One
    message for a name refused, unset or empty: the answer says nothing of what the
    router's environment holds."""
    if not (isinstance(api_key, str) and api_key.startswith("env:")):
        return
    name = api_key[4:]
    if not (name.startswith(prefix) and os.environ.get(name, "").strip()):
        raise InvalidRequest(f"api_key: the admin API reads only environment variables whose "
                             f"name starts with {prefix!r} (admin_secret_env_prefix), set "
                             "and not empty", param="api_key")


METADATA_HOSTS = {"metadata.google.internal"}


def _is_link_local(url: str) -> bool:
    """Whether the URL's host, as written, is a link-local address (169.254.0.0/16,
    fe80::/10, where clouds serve instance metadata and credentials) or a metadata name.
    IPv4 in any form the resolver takes ("2852039166", "0xa9.0xfe.0xa9.0xfe") counts."""
    host = (urlsplit(url).hostname or "").rstrip(".")
    if host in METADATA_HOSTS:
        return True
    try:
        address: ipaddress.IPv4Address | ipaddress.IPv6Address = ipaddress.ip_address(host)
    except ValueError:
        try:
            address = ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return False  # a name: not resolved here
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_link_local


def _remove(router: Router, call: AdminCall) -> Answer:
    cluster = _cluster_of(call.query.get("cluster"))
    endpoint = router.membership.remove(cluster, call.query.get("url", ""))
    return 200, {"removed": endpoint.url, "in_flight": endpoint.in_flight}


def _drain(router: Router, call: AdminCall) -> Answer:
    body = _body_of(call)
    draining = body.get("draining", True)
    if not isinstance(draining, bool):
        raise InvalidRequest("draining must be true or false", param="draining")
    endpoint = router.membership.drain(_cluster_of(body.get("cluster")), str(body.get("url", "")),
                                       draining)
    return 200, {"url": endpoint.url, "draining": endpoint.draining,
                 "in_flight": endpoint.in_flight}


def _auto(router: Router, call: AdminCall) -> Answer:
    learner, budget = router.learner, router.local_budget
    return 200, {"learning": learner is not None,
                 "buckets": learner.snapshot() if learner else [],
                 # with auto.push_layers: learn: pushes written by layer (or whole) per bucket
                 "push_layers": learner.layers.snapshot() if learner and learner.layers else [],
                 # wherever local may be used: each D's inter-token latency, which the
                 # budget of local requests weighs
                 "local_budget": None if budget is None else {
                     "ratio": budget.ratio, "decode": budget.snapshot(router.decode.endpoints)}}


def _kv(router: Router, call: AdminCall) -> Answer:
    index, calibration = router.kv_index, router.kv_calibration
    return 200, {"kv_aware": index is not None,
                 "tokens_per_request": calibration.tokens_per_request if calibration else None,
                 "sources": [s.snapshot() for s in index.all_sources()] if index else []}


_OPERATIONS: dict[tuple[str, str], Callable[[Router, AdminCall], Answer]] = {
    ("GET", "/admin/endpoints"): _listing,
    ("GET", "/admin/auto"): _auto,
    ("GET", "/admin/kv"): _kv,
    ("POST", "/admin/endpoints"): _add,
    ("DELETE", "/admin/endpoints"): _remove,
    ("POST", "/admin/endpoints/drain"): _drain,
}


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

    async def handle(request: Request) -> Response:
        router = authorized(request)
        call = AdminCall(method=request.method, path=request.url.path,
                         query=dict(request.query_params), body=await request.body())
        workers: OtherWorkers | None = getattr(request.app.state, "workers", None)
        status, answer = await workers.admin(call) if workers is not None else apply(router, call)
        return JSONResponse(answer, status)

    for method, path in _OPERATIONS:
        app.router.add_route(path, handle, methods=[method])
