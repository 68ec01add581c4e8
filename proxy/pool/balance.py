"""Choosing one endpoint of a cluster for a request: filter, then score, then pick.

- **filter** (in `Cluster.pick`): healthy, not draining, serving the model, not ejected,
  able to do the mode, and not a retry's failed server.
- **score and pick**, by the cluster's policy:
  - `round_robin`: each in turn.
  - `least_outstanding`: fewest requests in flight; ties in turn (the default).
  - `power_of_two`: two distinct endpoints at random, the one with fewer in flight
    (close to least outstanding, without every router herding onto the same server).
  - `prefix_affinity`: requests whose prompts start alike go to the same endpoint, so its
    prefix cache hits: consistent hashing of the prompt's first `prefix_chars` characters
    onto a ring of virtual nodes, with bounded load (an endpoint already over
    `load_factor` times the mean in flight is skipped for the next one on the ring), so
    one hot prefix cannot swamp a server. Adding or removing a server moves only the
    prefixes that hashed to it.
  - `load_aware`: the lowest score from what each server's vLLM says of itself (its
    /metrics, scraped in the background by `proxy.pool.load`): requests in flight from
    this router + `waiting_weight` x its waiting queue + `kv_cache_weight` x its KV cache
    usage; a server whose last scrape failed, or is older than 3 scrape intervals (and
    2 s), is scored by in flight alone.
    Ties in turn.
  - `kv_aware`: the lowest cost in prompt tokens of work: the prompt's tokens the server's
    prefix cache lacks (by its vLLM KV events, `proxy.pool.kv`) plus load_aware's load
    in tokens (`proxy.pool.kv.score`). Ties in turn.

A `Balancer` holds one cluster's policy state (its turn counter, its ring); the endpoints
and their counts live on the `Endpoint` objects.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
import random
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from proxy.config import Balance, Policy
from proxy.pool.load import load_score

if TYPE_CHECKING:
    from proxy.pool.endpoints import Endpoint
    from proxy.pool.kv.blocks import PromptBlocks
    from proxy.pool.kv.score import KvScorer

VIRTUAL_NODES = 64  # ring points per endpoint: spreads prefixes evenly across servers
# A load report is ignored once older than this many scrape intervals, and at least
# STALE_AFTER_S (a busy router's scrapes may run late by a moment).
STALE_SCRAPES = 3
STALE_AFTER_S = 2.0


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class Balancer:
    def __init__(
        self,
        policy: Policy,
        settings: Balance | None = None,
        *,
        rng: random.Random | None = None,
        kv: KvScorer | None = None,
    ) -> None:
        self.policy = policy
        self.kv = kv  # kv_aware's scorer (with the router's KV index)
        self.settings = settings or Balance()
        self._turn = itertools.count()
        self._last_pick: dict[str, int] = {}  # url -> turn of its last least-outstanding pick
        self._rng = rng or random.Random()
        self._ring: list[tuple[int, str]] = []  # (point, endpoint url), sorted
        self._ring_urls: frozenset[str] = frozenset()

    def pick(self, candidates: Sequence[Endpoint], key: str | None = None,
             prompt: PromptBlocks | None = None) -> Endpoint:
        """One of `candidates` (already filtered, not empty). `key`: the prompt's prefix,
        for prefix affinity; without it, that policy acts as least outstanding. `prompt`:
        its token blocks, for kv_aware."""
        if self.policy is Policy.KV_AWARE and self.kv is not None:
            return self._by_cache(candidates, prompt)
        if len(candidates) == 1:
            return candidates[0]
        if self.policy is Policy.ROUND_ROBIN:
            return candidates[next(self._turn) % len(candidates)]
        if self.policy is Policy.POWER_OF_TWO:
            first, second = self._rng.sample(range(len(candidates)), 2)
            a, b = candidates[first], candidates[second]
            return b if b.in_flight < a.in_flight else a
        if self.policy is Policy.PREFIX_AFFINITY and key is not None:
            return self._by_prefix(candidates, key)
        if self.policy is Policy.LOAD_AWARE:
            return self._least_loaded(candidates)
        return self._least_outstanding(candidates)

    def _least(self, candidates: Sequence[Endpoint], score: Callable[[Endpoint], float]) -> Endpoint:
        """The lowest `score`; among equals, the one picked longest ago."""
        chosen = min(candidates, key=lambda e: (score(e), self._last_pick.get(e.url, -1)))
        self._last_pick[chosen.url] = next(self._turn)
        return chosen

    def _least_outstanding(self, candidates: Sequence[Endpoint]) -> Endpoint:
        return self._least(candidates, lambda e: e.in_flight)

    def _load(self, now: float) -> Callable[[Endpoint], float]:
        s = self.settings
        max_age = max(STALE_SCRAPES * s.scrape_interval, STALE_AFTER_S)
        return lambda e: load_score(
            e.in_flight, e.load, now=now, max_age=max_age, waiting_weight=s.waiting_weight,
            kv_cache_weight=s.kv_cache_weight)

    def _least_loaded(self, candidates: Sequence[Endpoint]) -> Endpoint:
        return self._least(candidates, self._load(time.monotonic()))

    def _by_cache(self, candidates: Sequence[Endpoint], prompt: PromptBlocks | None) -> Endpoint:
        assert self.kv is not None
        now = time.monotonic()
        costs, hits = self.kv.costs(candidates, prompt, self._load(now), now)
        position = {id(e): i for i, e in enumerate(candidates)}
        chosen = self._least(candidates, lambda e: costs[position[id(e)]])
        self.kv.picked(chosen, prompt, hits[position[id(chosen)]], now)
        return chosen

    def _by_prefix(self, candidates: Sequence[Endpoint], key: str) -> Endpoint:
        by_url = {e.url: e for e in candidates}
        self._build_ring(by_url)
        # Bounded load: at most ceil(load_factor * mean), counting this request.
        total = sum(e.in_flight for e in candidates) + 1
        bound = max(1, math.ceil(self.settings.load_factor * total / len(candidates)))
        start = bisect.bisect(self._ring, (_hash(key), ""))
        for offset in range(len(self._ring)):
            _, url = self._ring[(start + offset) % len(self._ring)]
            endpoint = by_url[url]
            if endpoint.in_flight < bound:
                return endpoint
        return self._least_outstanding(candidates)  # cannot happen: someone is under the mean

    def _build_ring(self, by_url: dict[str, Endpoint]) -> None:
        urls = frozenset(by_url)
        if urls == self._ring_urls:
            return
        self._ring = sorted((_hash(f"{url}#{i}"), url) for url in urls for i in range(VIRTUAL_NODES))
        self._ring_urls = urls
