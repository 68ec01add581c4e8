"""The push flow: P and D at the same time; P WRITEs the KV into D's blocks.

    client ──▶ router ─┬──▶ P (max_tokens=1, do_remote_decode, transfer_id)
                       └──▶ D (P's coordinates, transfer_id, remote_request_id)
                 D registers its blocks with P; P WRITEs the KV when the prompt is done;
                 D decodes and its answer is relayed to the client.

D's allocation and handshake overlap P's compute, and the router is off the critical
path. Both legs run in one task group: if P fails, D is cancelled at once (a stock D
would otherwise wait out a lease of minutes); if D fails, P is cancelled. Once D has sent
the client its first byte, P's own answer no longer matters (the KV reached D).

When P fails before D sent the client a byte, the client need not see it
(`push_recovery`): the request is redone as a pull on another P (`pull`, the default;
with no other P, D computes the prompt), or D gets the plain request and computes the
prompt itself (`recompute`), or P's error is the answer (`error`). A failure that is the
request's own (a 4xx from P) is always the answer. A recovery spends the retry budget,
so a pool whose P all fail does not double its load.

A data-parallel P (several engines behind one URL, see `proxy.pool.probe`) takes a push on the
rank the router pins with vLLM's `X-data-parallel-rank` header on P's leg, and D is given
that rank's coordinates. The rank is the known one with the fewest of this router's
pushes in flight, equals in turn (`DataParallelRanks.pick`). A P that refuses the rank
(fewer ranks since it restarted) has its ranks learned again, and the request is done as
a pull, unpinned.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

from connector.protocol import http_params as wire
from proxy.config import Mode, PushRecovery
from proxy.errors import NoHealthyEndpoint, RouterError, UpstreamError, UpstreamStatusError
from proxy.flow.exchange import Exchange
from proxy.flow.pull import run_pull
from proxy.flow.relay import Downstream
from proxy.pool.endpoints import ClusterName
from proxy.pool.probe import rank_out_of_range
from proxy.pool.retry import retry_reason
from proxy.protocol import PrefillCoordinates, new_transfer_id, prefill_body, push_decode_body

logger = logging.getLogger("pdproxy.push")

RECOVERY_HEADER = b"x-kv-transfer-recovery"  # how a push whose P failed was answered


class PrefillLegFailed(Exception):
    """P's leg of a push failed before D sent the client a byte (D's leg is cancelled)."""

    def __init__(self, error: UpstreamError) -> None:
        super().__init__(str(error))
        self.error = error


async def run_push(exchange: Exchange, down: Downstream, coordinates: PrefillCoordinates) -> None:
    p = exchange.prefill_server
    ranks = p.data_parallel_ranks
    if ranks is None:  # one engine behind P's URL
        await _push(exchange, down, coordinates, rank=None)
        return
    exchange.context.prober.complete_ranks(p, exchange.request.model)
    rank = ranks.pick()
    pinned = None if rank is None else p.rank_coordinates(rank)
    if rank is None or pinned is None:  # no rank known (a probe learns one first): pull
        exchange.ran_as(Mode.PULL, down, "push_unpinned:pull")
        await run_pull(exchange, down)
        return
    with ranks.lease(rank):
        await _push(exchange, down, pinned, rank=rank)


async def _push(exchange: Exchange, down: Downstream, coordinates: PrefillCoordinates, *,
                rank: int | None) -> None:
    """Both legs at once; P's pinned to data-parallel `rank` (None: not pinned)."""
    transfer_id = new_transfer_id()
    p_body = prefill_body(exchange.request, transfer_id=transfer_id,
                          push_layers=exchange.push_layers)
    d_body = push_decode_body(exchange.request, coordinates, transfer_id=transfer_id)
    pin = None if rank is None else {wire.DATA_PARALLEL_RANK_HEADER: str(rank)}
    try:
        async with asyncio.TaskGroup() as legs:
            legs.create_task(_prefill(exchange, p_body, down, pin), name="push-prefill")
            legs.create_task(_decode(exchange, d_body, down), name="push-decode")
    except BaseExceptionGroup as group:
        _abandon(exchange, coordinates, transfer_id)
        error = _first_error(group)
        if isinstance(error, PrefillLegFailed):
            failure = error.error
            if rank is not None and isinstance(failure, UpstreamStatusError) \
                    and rank_out_of_range(failure):
                # P has fewer ranks than it had: learn them again; pull needs no pin.
                p = exchange.prefill_server
                exchange.context.prober.forget(p)
                _recovering(exchange, down, "pull", f"{p.url} rank {rank}", failure)
                await run_pull(exchange, down)
                return
            await recover(exchange, down, failure)
            return
        raise error from None
    except asyncio.CancelledError:  # the client left, or the router shuts down
        _abandon(exchange, coordinates, transfer_id)
        raise


def _abandon(exchange: Exchange, coordinates: PrefillCoordinates, transfer_id: str) -> None:
    """Tell P (our connector) that no D will claim this transfer unless one already
    did, so P frees the prompt's blocks now rather than at its `unclaimed_ttl`. P ignores
    it for a transfer a D has registered (that D aborts its own); never waits."""
    channel = exchange.context.push_channel
    if channel is None or coordinates.push_port is None:
        return
    sent = channel.abandon(coordinates.push_host or coordinates.host, coordinates.push_port,
                           transfer_id)
    metrics = exchange.context.metrics
    metrics.child(metrics.push_abandons, "sent" if sent else "dropped").inc()


async def recover(exchange: Exchange, down: Downstream, failure: UpstreamError) -> None:
    """Answer a push whose P failed before D's first byte, as `push_recovery` says."""
    context = exchange.context
    how = context.config.push_recovery
    if how is PushRecovery.ERROR or not recoverable(failure) or not context.retry_budget.try_spend():
        context.metrics.cancelled_legs.labels("decode", "prefill_failed").inc()
        raise failure
    failed = exchange.prefill_server
    if how is PushRecovery.PULL:
        try:
            other = exchange.pick_again(ClusterName.PREFILL, exclude=failed, mode=Mode.PULL)
        except NoHealthyEndpoint:
            other = None  # no other P of this model: D computes the prompt
        if other is not None:
            _recovering(exchange, down, "pull", f"{failed.url}->{other.url}", failure)
            exchange.prefill_endpoint = other
            await run_pull(exchange, down)
            return
    _recovering(exchange, down, "recompute", failed.url, failure)
    await exchange.relay_decode(dict(exchange.request.body), down)


def recoverable(failure: UpstreamError) -> bool:
    """P's failure is P's own and worth working around: not a 4xx (the request's fault,
    which D would find too), nor 429/503 (an overloaded pool, told to the client as it is,
    as for retries). An answer is judged by the retry rule; any other failure is P's."""
    return not isinstance(failure, UpstreamStatusError) or retry_reason(failure) is not None


def _recovering(exchange: Exchange, down: Downstream, how: str, where: str,
                failure: UpstreamError) -> None:
    exchange.context.metrics.child(exchange.context.metrics.push_recoveries, how).inc()
    exchange.ran_as(Mode.PULL if how == "pull" else Mode.LOCAL, down,
                    f"push_recovered:{how}:{failure.kind}:{where}")
    down.headers.append((RECOVERY_HEADER, how.encode()))
    logger.info("request %s: P failed before D's first byte (%s); answering by %s",
                exchange.request.request_id, failure, how)


async def _prefill(exchange: Exchange, body: dict[str, Any], down: Downstream,
                   headers: dict[str, str] | None) -> None:
    try:
        await exchange.prefill(body, headers=headers)
    except UpstreamError as exc:
        if down.started:
            # D already answers, so it has the KV: P's late failure changes nothing.
            logger.warning("request %s: P failed after D started: %s", exchange.request.request_id, exc)
            return
        raise PrefillLegFailed(exc) from exc


async def _decode(exchange: Exchange, body: dict[str, Any], down: Downstream) -> None:
    try:
        await exchange.relay_decode(body, down)
    except RouterError:
        exchange.context.metrics.cancelled_legs.labels("prefill", "decode_failed").inc()
        raise


def _first_error(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The error to act on from the legs' group: P's failure (it caused D's
    cancellation), else the first RouterError, else the first."""
    failed_p, _rest = group.split(PrefillLegFailed)
    if failed_p:
        return next(_leaves(failed_p))
    matched, _rest = group.split(RouterError)
    leaves = list(_leaves(matched)) if matched else list(_leaves(group))
    return leaves[0]


def _leaves(group: BaseExceptionGroup[BaseException]) -> Iterator[BaseException]:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc
