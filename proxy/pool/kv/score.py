"""kv_aware's scorer: the cost of sending a prompt to each candidate, in prompt tokens
of work (`proxy.pool.balance` picks the lowest):

    cost = token_weight x the prompt tokens the server does not hold
           + the work already queued on it

The queued work of a P is the prompt tokens its legs from this router are computing
(each leg's lease carries its predicted miss), plus `tokens_per_request` (calibrated:
the moving average of what routed requests compute on P) per unit of what only its
/metrics show (requests waiting there from other routers, a full KV
cache). A D's queued work is `tokens_per_request` per unit of load_aware's score
(requests in flight, waiting, KV cache usage): its work is decoding. `token_weight` is 1
for a P (each missing token is computed) and `decode_token_weight` for a D (a missing
token's KV is sent from P; a held one is neither sent nor computed).

A server whose events are not in sync (none heard yet, or a gap being replayed) is
unknown, not empty: it is scored as holding as much as the best known candidate, so the
choice among the unknown and the best falls to load. With nothing known at all, or a
prompt with no token ids, every candidate is scored by load alone, counted in
`pdproxy_kv_fallbacks_total`.

After the pick, the chosen server is credited with the prompt's blocks for `credit_s`
(`SourceIndex.credit`), so the next request of a burst with the same prefix sees them
there before the server's events say so.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from proxy.config import Balance, KvAware
from proxy.metrics import RouterMetrics
from proxy.pool.kv.blocks import PromptBlocks
from proxy.pool.kv.index import KvIndex
from proxy.pool.load import LoadWeights
from proxy.pool.pick import PickRequest

if TYPE_CHECKING:
    from proxy.pool.endpoints import Endpoint

logger = logging.getLogger("pdproxy.kv")


CALIBRATION_SMOOTHING = 0.05  # weight of one routed request in the moving average
_url = operator.attrgetter("url")


class Calibration:
    """What one request queued ahead costs, in prompt tokens: `tokens_per_request` at
    first, then (with `calibrate`) the moving average of the prompt tokens the requests
    routed to P compute, as predicted when they were routed. Shared by both clusters."""

    def __init__(self, settings: KvAware) -> None:
        self.tokens_per_request = settings.tokens_per_request
        self._enabled = settings.calibrate

    def observe(self, computed_tokens: int) -> None:
        if self._enabled:
            self.tokens_per_request += CALIBRATION_SMOOTHING * (
                computed_tokens - self.tokens_per_request)


@dataclass(frozen=True, slots=True)
class KvContext:
    """What one cluster's kv_aware scorer uses: the router's index and how this cluster
    weighs it (P: `token_weight` 1, its queue counted in prompt tokens; D:
    `decode_token_weight`, its queue in requests)."""

    index: KvIndex
    settings: KvAware
    cluster: str
    token_weight: float
    tracks_work: bool
    calibration: Calibration
    metrics: RouterMetrics | None = None


class KvCost:
    """The cost above for every candidate, in one pass; after the pick, the chosen server
    is credited with the prompt's blocks and the prediction is recorded. (The cache and
    the queue were two scorers the pipeline weighed and added: one pass is a scorer call,
    a list and the pipeline's sum less a pick, two picks a request; with the cuts of its
    round, kv_aware's extra went from 84 to 65 Python calls per request, see "kv_aware's
    CPU per request" in docs/benchmarks.md.)"""

    def __init__(self, kv: KvContext, balance: Balance) -> None:
        self.kv = kv
        weights = LoadWeights.of(balance)
        self._load_weights = (weights.max_age, weights.waiting_weight, weights.kv_cache_weight)
        self._tracks_work = kv.tracks_work
        self._block_size = kv.settings.block_size
        self._credit_s = kv.settings.credit_s
        self._fallback_logged: set[str] = set()
        self._predicted_hits = None if kv.metrics is None else kv.metrics.kv_predicted_hits
        self._cluster_label = (kv.cluster,)
        if self._predicted_hits is not None:
            self._predicted_hits.labels(kv.cluster)  # exposed from the start, at 0
        # The hits `scores` found for the request being picked, with its candidates, for
        # `picked` (a pick runs both at once, with no await between them: the index is
        # walked once).
        self._scored: tuple[PickRequest, Sequence[Endpoint], list[int | None]] | None = None

    def hit_tokens(self, url: str, prompt: PromptBlocks, now: float) -> int | None:
        """The prompt's tokens, from its start, that the server holds; None: unknown."""
        return self.kv.index.hit_tokens(url, prompt, now, fallback_block_size=self._block_size)

    def scores(self, candidates: Sequence[Endpoint], request: PickRequest,
               now: float) -> list[float]:
        kv = self.kv
        prompt = request.prompt
        if prompt is None:
            self._fell_back("no_tokens")
            length, held = 0, [0] * len(candidates)  # by load alone
        else:
            found = kv.index.hit_tokens_each(map(_url, candidates), prompt, now,
                                             fallback_block_size=self._block_size)
            self._scored = (request, candidates, found)
            length = prompt.length
            if None in found:
                held = self._unknown_as_best(found, length)
            else:  # every candidate in sync: the usual case
                held = found  # type: ignore[assignment]
        weight, per_request = kv.token_weight, kv.calibration.tokens_per_request
        # `LoadWeights.reported`, inlined: a call per candidate was 88 of kv_aware's 1,512
        # bytecodes per request (two picks between two servers, `scripts.bench_path
        # --target kv --bytecodes`)
        max_age, waiting_weight, cache_weight = self._load_weights
        costs: list[float] = []
        for e, h in zip(candidates, held, strict=True):
            load = e.load
            reported = (0.0 if load is None or now - load.at > max_age
                        else waiting_weight * load.waiting + cache_weight * load.kv_cache_usage)
            # (summed as the two scorers' costs were: the same ties)
            costs.append(weight * (length - h) + (e.pending_tokens + per_request * reported)
                         if self._tracks_work else
                         weight * (length - h) + per_request * (e.in_flight + reported))
        return costs

    def _unknown_as_best(self, found: list[int | None], length: int) -> list[int]:
        """Hits where some candidate is unknown (its events not in sync): it is scored as
        holding as much as the best known, not as empty; with none known, every
        candidate alike (the choice falls to load)."""
        known = [h for h in found if h is not None]
        if not known:
            self._fell_back("not_synced")
            return [length] * len(found)
        best = max(known)
        return [best if h is None else h for h in found]

    def picked(self, chosen: Endpoint, request: PickRequest, now: float) -> None:
        scored, self._scored = self._scored, None
        prompt = request.prompt
        if prompt is None:
            return
        kv = self.kv
        if scored is not None and scored[0] is request:
            hit = scored[2][scored[1].index(chosen)]
        else:  # a lone candidate is not scored
            hit = self.hit_tokens(chosen.url, prompt, now)
        prompt.predicted[kv.cluster] = hit
        length = prompt.length
        if self._tracks_work:  # P: the tokens it will compute calibrate a request's weight
            kv.calibration.observe(length - (hit or 0))
        if self._predicted_hits is not None and hit is not None and length:
            self._predicted_hits.observe(self._cluster_label, hit / length)
        if self._credit_s > 0:
            kv.index.credit(chosen.url, prompt, now + self._credit_s,
                            fallback_block_size=self._block_size)

    def _fell_back(self, reason: str) -> None:
        kv = self.kv
        if kv.metrics is not None:
            kv.metrics.child(kv.metrics.kv_fallbacks, kv.cluster, reason).inc()
        if reason not in self._fallback_logged:
            self._fallback_logged.add(reason)
            logger.warning("kv_aware (%s): no server's KV events known for a request (%s); "
                           "picking by load alone (logged once; counted in "
                           "pdproxy_kv_fallbacks_total)", kv.cluster, reason)
