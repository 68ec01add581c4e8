"""kv_aware's cost of sending a prompt to each candidate, in prompt tokens of work.

    cost = token_weight x (prompt tokens the server does not hold) + queued work

The queued work of a P is the prompt tokens its legs from this router are computing
(each leg's lease carries its predicted miss), plus `tokens_per_request` per unit of
what only its /metrics show (requests waiting there from other routers, a full KV
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
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from proxy.config import KvAware
from proxy.metrics import RouterMetrics
from proxy.pool.kv.blocks import PromptBlocks
from proxy.pool.kv.index import KvIndex, SourceState

if TYPE_CHECKING:
    from proxy.pool.endpoints import Endpoint

logger = logging.getLogger("pdproxy.kv")


class KvScorer:
    def __init__(self, index: KvIndex, settings: KvAware, *, cluster: str, token_weight: float,
                 tracks_work: bool = False, metrics: RouterMetrics | None = None) -> None:
        self.index = index
        self.tracks_work = tracks_work  # P: its queue is counted in prompt tokens
        self.settings = settings
        self.cluster = cluster
        self.token_weight = token_weight
        self._metrics = metrics
        self._fallback_logged: set[str] = set()

    def hit_tokens(self, url: str, prompt: PromptBlocks, now: float) -> int | None:
        """The prompt's tokens, from its start, that the server holds; None: unknown."""
        sources = [s for s in self.index.sources(url) if s.state is SourceState.SYNCED]
        if not sources:
            return None
        best = 0
        for source in sources:
            size = source.block_size or self.default_block_size()
            best = max(best, source.hits(prompt.keys(size), now) * size)
        return min(best, len(prompt))

    def default_block_size(self) -> int:
        """The block size of a server whose events have stored nothing yet (so a burst's
        credit counts before its first events): another server's, else the config's."""
        return next((s.block_size for s in self.index.all_sources() if s.block_size),
                    self.settings.block_size)

    def costs(
        self, candidates: Sequence[Endpoint], prompt: PromptBlocks | None,
        load: Callable[[Endpoint], float], now: float,
    ) -> tuple[list[float], list[int | None]]:
        """Each candidate's cost, and the hit tokens it was scored with (None: unknown)."""
        hits: list[int | None] = (
            [self.hit_tokens(e.url, prompt, now) for e in candidates] if prompt is not None
            else [None] * len(candidates))
        known = [h for h in hits if h is not None]
        if not known:
            self._fell_back("no_tokens" if prompt is None else "not_synced")
            return [self.queued(e, load) for e in candidates], hits
        best = max(known)
        total = len(prompt) if prompt is not None else 0
        return [
            self.token_weight * (total - (best if h is None else h)) + self.queued(e, load)
            for e, h in zip(candidates, hits, strict=True)
        ], hits

    def queued(self, endpoint: Endpoint, load: Callable[[Endpoint], float]) -> float:
        """The work ahead of a request on `endpoint`, in prompt tokens. A P's own queue is
        known token by token: the prompt tokens its legs from this router compute
        (`pending_tokens`); what only its /metrics show (other routers' requests waiting,
        a full KV cache) counts `tokens_per_request` per unit of load_aware's score. D's
        work is decoding: every request in flight counts `tokens_per_request`."""
        per_request = self.settings.tokens_per_request
        if self.tracks_work:
            return endpoint.pending_tokens + per_request * (load(endpoint) - endpoint.in_flight)
        return per_request * load(endpoint)

    def picked(self, endpoint: Endpoint, prompt: PromptBlocks | None, hit: int | None,
               now: float) -> None:
        """The chosen server: credit it with the prompt's blocks, record the prediction."""
        if prompt is None:
            return
        prompt.predicted[self.cluster] = hit
        if self._metrics is not None and hit is not None and len(prompt):
            self._metrics.child(self._metrics.kv_predicted_hits, self.cluster).observe(
                hit / len(prompt))
        if self.settings.credit_s > 0:
            for source in self.index.sources(endpoint.url):
                size = source.block_size or self.default_block_size()
                source.credit(prompt.keys(size), now + self.settings.credit_s)

    def _fell_back(self, reason: str) -> None:
        if self._metrics is not None:
            self._metrics.child(self._metrics.kv_fallbacks, self.cluster, reason).inc()
        if reason not in self._fallback_logged:
            self._fallback_logged.add(reason)
            logger.warning("kv_aware (%s): no server's KV events known for a request (%s); "
                           "picking by load alone (logged once; counted in "
                           "pdproxy_kv_fallbacks_total)", self.cluster, reason)
