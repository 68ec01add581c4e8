"""The pull flow: P first, then D, which READs P's blocks.

    client ──▶ router ──▶ P (max_tokens=1, do_remote_decode)
                 │   ◀── P's kv_transfer_params (engine, blocks, side channel)
                 └────▶ D (client's body + P's params) ──▶ answer relayed to the client

The router is on the critical path: D starts only when P has answered. A server that
refuses the connection is replaced by another of its cluster, once (nothing was sent).
"""

from __future__ import annotations

from typing import Any

from connector.protocol.http_params import PrefillAnswer
from proxy.config import MissingKVParams
from proxy.errors import KVTransferError, UpstreamError
from proxy.flow.exchange import Exchange
from proxy.flow.relay import Downstream
from proxy.pool.endpoints import ClusterName
from proxy.protocol import prefill_body, pull_decode_body


async def run_pull(exchange: Exchange, down: Downstream) -> None:
    p_body = prefill_body(exchange.request, transfer_id=None)
    try:
        answer = await exchange.prefill(p_body)
    except UpstreamError as exc:  # raised again, or once more on another P
        exchange.retry(ClusterName.PREFILL, exc)
        answer = await exchange.prefill(p_body)
    d_body = decode_body(exchange, answer)
    try:
        await exchange.relay_decode(d_body, down)
    except UpstreamError as exc:  # raised again, or once more on another D
        exchange.retry(ClusterName.DECODE, exc, down)
        await exchange.relay_decode(d_body, down)


def decode_body(exchange: Exchange, p_answer: PrefillAnswer) -> dict[str, Any]:
    """D's body from P's answer. P without usable kv_transfer_params means D would
    recompute the whole prompt: an error, or (when configured) a counted recompute."""
    try:
        return pull_decode_body(exchange.request, p_answer, exchange.prefill_params)
    except ValueError as exc:
        p = exchange.prefill_server
        why = (f"{exchange.context.client.shown(p.url, p.cluster.value)} gave no usable "
               f"kv_transfer_params ({exc})")
    metrics = exchange.context.metrics.missing_kv_params
    if exchange.context.config.missing_kv_params is MissingKVParams.RECOMPUTE:
        metrics.labels("recompute").inc()
        exchange.remark("recompute_on_decode")
        return dict(exchange.request.body)
    metrics.labels("error").inc()
    raise KVTransferError(
        f"{why}; is P started with a KV connector (--kv-transfer-config)? "
        "Set missing_kv_params: recompute to let D compute the prompt instead"
    )
