"""The push flow: P and D at the same time; P WRITEs the KV into D's blocks.

    client ──▶ router ─┬──▶ P (max_tokens=1, do_remote_decode, transfer_id)
                       └──▶ D (P's coordinates, transfer_id, remote_request_id)
                 D registers its blocks with P; P WRITEs the KV when the prompt is done;
                 D decodes and its answer is relayed to the client.

D's allocation and handshake overlap P's compute, and the router is off the critical
path. Both legs run in one task group: if P fails, D is cancelled at once (a stock D
would otherwise wait out a lease of minutes); if D fails, P is cancelled. Once D has sent
the client its first byte, P's own answer no longer matters (the KV reached D).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

from proxy.errors import RouterError, UpstreamError
from proxy.exchange import Exchange
from proxy.protocol import PrefillCoordinates, new_transfer_id, prefill_body, push_decode_body
from proxy.relay import Downstream

logger = logging.getLogger("pdproxy.push")


async def run_push(exchange: Exchange, down: Downstream, coordinates: PrefillCoordinates) -> None:
    transfer_id = new_transfer_id()
    p_body = prefill_body(exchange.request, transfer_id=transfer_id)
    d_body = push_decode_body(exchange.request, coordinates, transfer_id=transfer_id)
    try:
        async with asyncio.TaskGroup() as legs:
            legs.create_task(_prefill(exchange, p_body, down), name="push-prefill")
            legs.create_task(_decode(exchange, d_body, down), name="push-decode")
    except BaseExceptionGroup as group:
        raise _first_router_error(group) from None


async def _prefill(exchange: Exchange, body: dict[str, Any], down: Downstream) -> None:
    try:
        await exchange.prefill(body)
    except UpstreamError as exc:
        if down.started:
            # D already answers, so it has the KV: P's late failure changes nothing.
            logger.warning("request %s: P failed after D started: %s", exchange.request.request_id, exc)
            return
        exchange.router.metrics.cancelled_legs.labels("decode", "prefill_failed").inc()
        raise


async def _decode(exchange: Exchange, body: dict[str, Any], down: Downstream) -> None:
    try:
        await exchange.relay_decode(body, down)
    except RouterError:
        exchange.router.metrics.cancelled_legs.labels("prefill", "decode_failed").inc()
        raise


def _first_router_error(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The error to report from the legs' group: the first RouterError, else the first."""
    matched, _rest = group.split(RouterError)
    leaves = list(_leaves(matched)) if matched else list(_leaves(group))
    return leaves[0]


def _leaves(group: BaseExceptionGroup[BaseException]) -> Iterator[BaseException]:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc
