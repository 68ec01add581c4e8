"""Choosing one endpoint of a cluster for a request: filter, then score, then pick.

- **filter** (`Cluster.pick` in `proxy.pool.endpoints`): healthy, not draining, serving
  the model, not ejected, able to do the mode, and not a retry's failed server.
- **score**: each of the policy's scorers gives every candidate a cost (lower is
  better); a candidate's total is the weighted sum.
- **pick**: the policy's chooser picks by the totals; hooks then hear of the choice.

A policy is one `Pipeline` of these (their protocols in `proxy.pool.pick`), built by its
entry in `POLICIES`:

| policy | scorers (weight) | chooser |
| --- | --- | --- |
| `round_robin` | none | `InTurn`: each in turn |
| `least_outstanding` (default) | `InFlight` | `Lowest`: ties to the one picked longest ago |
| `power_of_two` | `InFlight` | `LowerOfTwo`: two distinct at random, the lower (close to least outstanding, without every router herding onto the same server) |
| `prefix_affinity` | `PrefixRing` | `Lowest` |
| `load_aware` | `LoadScore` | `Lowest` |
| `kv_aware` | `KvCost`: the prompt tokens a server lacks (times 1 for P, `decode_token_weight` for D) plus the work queued on it | `Lowest`, then `KvCost` credits the chosen server |

- `PrefixRing`: requests whose prompts start alike go to the same endpoint, so its
  prefix cache hits: consistent hashing of the prompt's first `prefix_chars` characters
  onto a ring of virtual nodes, with bounded load (an endpoint already at `load_factor`
  times the mean in flight scores behind every one under it), so one hot prefix cannot
  swamp a server. Adding or removing a server moves only the prefixes that hashed to it.
  Without a prefix it scores by in flight.
- `LoadScore`: what each server's vLLM says of itself (its /metrics, scraped by
  `proxy.pool.scrape`), folded by `proxy.pool.load.LoadWeights`.
- `KvCost` is in `proxy.pool.kv.score`.

A `Balancer` holds one cluster's pipeline and its state (turns, ring); the endpoints and
their counts live on the `Endpoint` objects.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from bisect import bisect
from collections.abc import Callable, Sequence
from math import ceil
from time import monotonic
from typing import TYPE_CHECKING

from proxy.config import Balance, Policy
from proxy.pool.kv.score import KvContext, KvCost
from proxy.pool.load import LoadWeights
from proxy.pool.pick import AfterPick, Chooser, PickRequest, Scorer

if TYPE_CHECKING:
    from proxy.pool.endpoints import Endpoint
    from proxy.pool.kv.blocks import PromptBlocks

VIRTUAL_NODES = 64  # ring points per endpoint: spreads prefixes evenly across servers


# --- choosers -------------------------------------------------------------------------


class Lowest:
    """The lowest cost; among equals, the one picked longest ago."""

    def __init__(self) -> None:
        self._turn = itertools.count()
        self._last_pick: dict[str, int] = {}  # url -> turn of its last pick

    def choose(self, candidates: Sequence[Endpoint], costs: list[float]) -> Endpoint:
        # A plain loop, turns read only on a tie: min() with a key building a tuple per
        # candidate took three times as long for two (0.64 against 0.2 us, on every pick).
        last = self._last_pick
        best, low = 0, costs[0]
        for i in range(1, len(costs)):
            cost = costs[i]
            if cost < low or (cost == low and last.get(candidates[i].url, -1)
                              < last.get(candidates[best].url, -1)):
                best, low = i, cost
        chosen = candidates[best]
        last[chosen.url] = next(self._turn)
        return chosen


class InTurn:
    """Each in turn, whatever the costs."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, candidates: Sequence[Endpoint], costs: list[float]) -> Endpoint:
        return candidates[next(self._turn) % len(candidates)]


class LowerOfTwo:
    """Two distinct candidates at random, the lower cost (the first drawn on a tie)."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def choose(self, candidates: Sequence[Endpoint], costs: list[float]) -> Endpoint:
        first, second = self._rng.sample(range(len(candidates)), 2)
        return candidates[second] if costs[second] < costs[first] else candidates[first]


# --- scorers --------------------------------------------------------------------------


class InFlight:
    """Requests this router has in flight on each."""

    def scores(self, candidates: Sequence[Endpoint], request: PickRequest,
               now: float) -> list[float]:
        return [float(e.in_flight) for e in candidates]


class LoadScore:
    """load_aware's score: in flight plus what each server's /metrics report."""

    def __init__(self, settings: Balance) -> None:
        self._weights = LoadWeights.of(settings)

    def scores(self, candidates: Sequence[Endpoint], request: PickRequest,
               now: float) -> list[float]:
        reported = self._weights.reported
        return [e.in_flight + reported(e.load, now) for e in candidates]


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class PrefixRing:
    """Consistent hashing of the prompt's prefix, with bounded load (module docstring):
    the first candidate met on the ring from the prefix's point that is under the bound
    scores 0, the next 1, and so on; those at the bound score after all of them."""

    def __init__(self, settings: Balance) -> None:
        self._settings = settings
        self._ring: list[tuple[int, str]] = []  # (point, endpoint url), sorted
        self._ring_urls: frozenset[str] = frozenset()

    def scores(self, candidates: Sequence[Endpoint], request: PickRequest,
               now: float) -> list[float]:
        if request.key is None:
            return [float(e.in_flight) for e in candidates]
        position = {e.url: i for i, e in enumerate(candidates)}
        self._build_ring(frozenset(position))
        # Bounded load: at most ceil(load_factor * mean), counting this request.
        total = sum(e.in_flight for e in candidates) + 1
        bound = max(1, ceil(self._settings.load_factor * total / len(candidates)))
        costs = [float(len(candidates) + e.in_flight) for e in candidates]  # at the bound
        start = bisect(self._ring, (_hash(request.key), ""))
        order = 0
        for offset in range(len(self._ring)):
            _, url = self._ring[(start + offset) % len(self._ring)]
            i = position[url]
            if costs[i] >= len(candidates) and candidates[i].in_flight < bound:
                costs[i] = float(order)
                order += 1
        return costs

    def _build_ring(self, urls: frozenset[str]) -> None:
        if urls == self._ring_urls:
            return
        self._ring = sorted((_hash(f"{url}#{i}"), url) for url in urls for i in range(VIRTUAL_NODES))
        self._ring_urls = urls


# --- the pipeline ---------------------------------------------------------------------


class Pipeline:
    """Weighted scorers, a chooser, and the hooks told of each choice."""

    def __init__(self, scorers: list[tuple[Scorer, float]], chooser: Chooser,
                 after: Sequence[AfterPick] = ()) -> None:
        self.scorers = scorers
        self.chooser = chooser
        self.after = after
        # A lone scorer of weight 1 (every policy but round_robin) gives the costs as
        # they are: no sum to build, a loop and a list less on every pick (a
        # least_outstanding pick between two servers: 0.94 -> 0.68 us, this round's
        # micro-benchmark on a 2-core machine).
        self._alone = scorers[0][0] if len(scorers) == 1 and scorers[0][1] == 1.0 else None

    def pick(self, candidates: Sequence[Endpoint], request: PickRequest) -> Endpoint:
        now = monotonic()
        if len(candidates) == 1:
            chosen = candidates[0]
        elif self._alone is not None:
            chosen = self.chooser.choose(candidates, self._alone.scores(candidates, request, now))
        else:
            costs = [0.0] * len(candidates)
            for scorer, weight in self.scorers:
                for i, cost in enumerate(scorer.scores(candidates, request, now)):
                    costs[i] += weight * cost
            chosen = self.chooser.choose(candidates, costs)
        for hook in self.after:
            hook.picked(chosen, request, now)
        return chosen


def _kv_aware(settings: Balance, rng: random.Random, kv: KvContext | None) -> Pipeline:
    if kv is None:  # no KV index to score with: load alone
        return Pipeline([(LoadScore(settings), 1.0)], Lowest())
    cost = KvCost(kv, settings)
    return Pipeline([(cost, 1.0)], Lowest(), after=[cost])


POLICIES: dict[Policy, Callable[[Balance, random.Random, KvContext | None], Pipeline]] = {
    Policy.ROUND_ROBIN: lambda s, rng, kv: Pipeline([], InTurn()),
    Policy.LEAST_OUTSTANDING: lambda s, rng, kv: Pipeline([(InFlight(), 1.0)], Lowest()),
    Policy.POWER_OF_TWO: lambda s, rng, kv: Pipeline([(InFlight(), 1.0)], LowerOfTwo(rng)),
    Policy.PREFIX_AFFINITY: lambda s, rng, kv: Pipeline([(PrefixRing(s), 1.0)], Lowest()),
    Policy.LOAD_AWARE: lambda s, rng, kv: Pipeline([(LoadScore(s), 1.0)], Lowest()),
    Policy.KV_AWARE: _kv_aware,
}


class Balancer:
    """One cluster's policy: its pipeline, built once (`kv`: the KV index and how this
    cluster weighs it, for kv_aware)."""

    def __init__(
        self,
        policy: Policy,
        settings: Balance | None = None,
        *,
        rng: random.Random | None = None,
        kv: KvContext | None = None,
    ) -> None:
        self.policy = policy
        self.settings = settings or Balance()
        self.pipeline = POLICIES[policy](self.settings, rng or random.Random(), kv)
        self.told_of_every_pick = bool(self.pipeline.after)  # (`endpoints.Picker`)

    def pick(self, candidates: Sequence[Endpoint], key: str | None = None,
             prompt: PromptBlocks | None = None) -> Endpoint:
        """One of `candidates` (already filtered, not empty). `key`: the prompt's prefix,
        for prefix affinity; `prompt`: its token blocks, for kv_aware."""
        return self.pipeline.pick(candidates, PickRequest(key, prompt))
