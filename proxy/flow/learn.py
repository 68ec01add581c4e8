"""How `auto` mode learns which KV hand-over is faster: pull, push or local, per prompt length.

When a request asks for `auto` and more than one mode is possible for it (its P and D
can do both pull and push, or `auto.local` lets D compute the prompt itself), the router
asks a `ModeLearner` which one to use among those candidates, and afterwards tells it
the request's measured time to first token (TTFT). Which mode wins depends on the
prompt: push overlaps the transfer with P's compute (good for long prompts), pull has
less coordination (often good for short ones), local saves the hand-over altogether
(good for short prompts, which D computes in less time than a transfer takes). So
prompts are sorted into buckets by length in characters, and each bucket learns on its
own.

Per bucket and mode the learner keeps an exponential moving average of TTFT: the first
sample sets it, each later one moves it by `smoothing` x (sample - average), so it
follows a change in the backends within a few requests.

The rule, per bucket:

* Learning (`auto_learning`): while any candidate has fewer than `min_samples`
  measured TTFTs, the candidates take turns: the one chosen fewest times gets the
  request (ties in the order push, pull, local, so the very first request is push).
  Turns are counted when a mode is chosen, not when its TTFT arrives, so requests in
  flight at once are split evenly too. Hence with every request measured and two
  candidates, both have `min_samples` after at most 2 x `min_samples` requests, and
  during learning at most half the traffic goes to the slower mode (also when one
  mode's TTFTs never arrive, e.g. its requests fail); with three, a third.
* A request whose TTFT cannot be measured (not streamed: its first byte is the whole
  answer) takes no turn: it gets the first candidate, push when possible
  (`auto_not_learned_yet`), until the bucket has learned, then the fastest mode, and is
  never sent to explore.
* Then the fastest average wins (`auto_faster_push` / `_pull` / `_local`; ties in the
  order above), except that a share `explore` of the requests, drawn at random, goes to
  another candidate (`auto_explore`), so that its average stays current and a change
  that makes it the faster one is noticed. With `explore` = 0 a slower mode is never
  measured again; the fastest one's average still follows it, so the choice still
  flips when the fastest mode becomes slower than another's last known average.
* Whether a push is written layer by layer (progressive push) or whole is learned the
  same way where `auto.push_layers` is `learn` (`LayersLearner` below), for every push
  whose client did not say: two arms per bucket, whole first (it wins ties); a push not
  measured is left to P's connector until the bucket has learned. Push's own average
  (against pull's and local's) is then of pushes written both ways, mostly the faster
  once the bucket has learned. Layers pay where the transfer is
  long against the prompt's compute (long prompts, slow links) and cost where it is
  short (the parts' posting on P, for a transfer with little to hide): where that
  threshold lies depends on the model and the network, so it is measured, not set.
* Local has a second condition, D's inter-token latency budget (`LocalBudget` below):
  local prefill runs on D, between the decode steps of D's other streams, so it slows
  them. A D over its budget takes no local request: local is then left out of the
  candidates (no learning turn, no exploring), and where it is the fastest the next
  fastest is chosen with the reason `auto_itl_budget`.

Every call is O(1). Not thread-safe: it lives in the router's one event loop.
"""

from __future__ import annotations

import random
from bisect import bisect_right
from collections.abc import Sequence
from math import isfinite
from typing import TYPE_CHECKING

from proxy.config import AutoSettings, Mode

if TYPE_CHECKING:
    from proxy.pool.endpoints import DecodeStreams, Endpoint

LEARNED_MODES = (Mode.PUSH, Mode.PULL, Mode.LOCAL)  # in this order they win ties
PAIR_MODES = (Mode.PUSH, Mode.PULL)  # the candidates when local is not one


class _Average:
    """One mode's TTFT in one bucket. (A plain class, compiled: its fields are C field
    reads on each request learned from, where a msgspec struct's were generic lookups.)"""

    def __init__(self) -> None:
        self.value = 0.0  # moving average, seconds (meaningless while count is 0)
        self.count = 0  # TTFTs measured
        self.chosen = 0  # times this mode was chosen (sets the turns while learning)

    def add(self, sample: float, smoothing: float) -> None:
        if not (isfinite(sample) and sample >= 0):
            raise ValueError(f"a TTFT must be a finite number >= 0, got {sample!r}")
        self.value = sample if self.count == 0 else self.value + smoothing * (sample - self.value)
        self.count += 1


class ModeLearner:
    def __init__(self, settings: AutoSettings, rng: random.Random | None = None) -> None:
        self.settings = settings
        self._edges = tuple(settings.bucket_edges)
        self._rng = rng if rng is not None else random.Random()
        self._stats: dict[tuple[int, Mode], _Average] = {
            (bucket, mode): _Average()
            for bucket in range(len(self._edges) + 1) for mode in LEARNED_MODES
        }
        # Only with auto.local: D's inter-token latency, which decides where local may go.
        self.local_budget = LocalBudget(settings) if settings.local else None
        # Only with auto.push_layers: learn: whether a push goes layer by layer.
        self.layers = (LayersLearner(settings, len(self._edges) + 1, self._rng)
                       if settings.push_layers == "learn" else None)

    def bucket(self, prompt_chars: int) -> int:
        """The bucket of a prompt of this many characters."""
        return bisect_right(self._edges, prompt_chars)

    def observe(self, mode: Mode | str, bucket: int, ttft_seconds: float) -> None:
        """Count one measured TTFT of a request sent in `mode` (pull, push or local)."""
        if not isinstance(mode, Mode):  # (the enum's call, interpreted, only for a str)
            mode = Mode(mode)
        if mode not in LEARNED_MODES:
            raise ValueError(f"only pull, push and local are learned, got {mode.value!r}")
        self._stats[bucket, mode].add(ttft_seconds, self.settings.smoothing)

    def choose(
        self, bucket: int, *, measured: bool = True, candidates: Sequence[Mode] = PAIR_MODES,
        local_within_budget: bool = True,
    ) -> tuple[Mode, str]:
        """The mode for the next `auto` request in this bucket, and why (a metric label).
        `measured`: whether this request's TTFT will be observed (a streamed one); one
        that will not takes no learning turn, and gets the first candidate until the
        bucket has learned. `candidates`: the modes possible for this request, in the
        order of LEARNED_MODES. `local_within_budget`: false when the chosen D is over
        its inter-token latency budget, which leaves local out (see the module's doc)."""
        stats = self._stats
        left_out = not local_within_budget and Mode.LOCAL in candidates
        eligible = [m for m in candidates if m is not Mode.LOCAL] if left_out else candidates
        if len(eligible) == 1:
            mode, reason = eligible[0], ("auto_itl_budget" if left_out else "auto_only_candidate")
        elif not self._learned(bucket, eligible):
            if not measured:
                return eligible[0], "auto_not_learned_yet"
            # min() keeps the first of equals: the order of LEARNED_MODES breaks ties
            mode, reason = min(eligible, key=lambda m: stats[bucket, m].chosen), "auto_learning"
        else:
            ranked = self._fastest(bucket, eligible)
            mode, reason = ranked[0], f"auto_faster_{ranked[0].value}"
            local = stats[bucket, Mode.LOCAL]
            if left_out and local.count >= self.settings.min_samples and (
                    local.value < stats[bucket, mode].value):
                reason = "auto_itl_budget"  # local is the fastest, but D has no room for it
            explore = self.settings.explore
            if measured and explore > 0 and self._rng.random() < explore:
                others = ranked[1:]
                mode = others[0] if len(others) == 1 else self._rng.choice(others)
                reason = "auto_explore"
        stats[bucket, mode].chosen += 1
        return mode, reason

    def _learned(self, bucket: int, modes: Sequence[Mode]) -> bool:
        need, stats = self.settings.min_samples, self._stats
        for mode in modes:  # a loop, not min() over a generator: on every auto request
            if stats[bucket, mode].count < need:
                return False
        return True

    def _fastest(self, bucket: int, modes: Sequence[Mode]) -> list[Mode]:
        """`modes` from the fastest average TTFT; sorted() is stable, so equals keep the
        order of LEARNED_MODES (push wins a tie)."""
        return sorted(modes, key=lambda m: self._stats[bucket, m].value)

    def snapshot(self) -> list[dict[str, object]]:
        """Per bucket and mode: its prompt lengths (min_chars <= chars < max_chars, None:
        no limit), average TTFT in ms (None before any sample) and samples measured, for
        logs and the admin API. Local's rows only when auto may choose it."""
        rows: list[dict[str, object]] = []
        for (bucket, mode), average in self._stats.items():
            if mode is Mode.LOCAL and not self.settings.local:
                continue
            rows.append({
                "bucket": bucket,
                "min_chars": self._edges[bucket - 1] if bucket > 0 else 0,
                "max_chars": self._edges[bucket] if bucket < len(self._edges) else None,
                "mode": mode.value,
                "avg_ms": round(average.value * 1000, 3) if average.count else None,
                "samples": average.count,
            })
        return rows


class LayersLearner:
    """Whether a push is written layer by layer or whole, per bucket, learned from the
    TTFT of pushes (the module's rule, with two arms: whole, then layers)."""

    def __init__(self, settings: AutoSettings, buckets: int, rng: random.Random) -> None:
        self.settings = settings
        self._rng = rng
        self._stats: dict[tuple[int, bool], _Average] = {
            (bucket, layers): _Average() for bucket in range(buckets) for layers in (False, True)
        }

    def choose(self, bucket: int, *, measured: bool) -> tuple[bool | None, str]:
        """Whether the next push in this bucket goes layer by layer, and why (a metric
        label); None: as P's connector decides. `measured`: whether its TTFT will be
        observed (a streamed request): one that is not takes no turn, and is left to the
        connector until the bucket has learned."""
        whole, layered = self._stats[bucket, False], self._stats[bucket, True]
        need = self.settings.min_samples
        if whole.count < need or layered.count < need:
            if not measured:
                return None, "layers_not_learned_yet"
            layers, reason = layered.chosen < whole.chosen, "layers_learning"
        else:
            layers = layered.value < whole.value  # a tie: whole
            reason = "layers_faster_on" if layers else "layers_faster_off"
            explore = self.settings.explore
            if measured and explore > 0 and self._rng.random() < explore:
                layers, reason = not layers, "layers_explore"
        (layered if layers else whole).chosen += 1
        return layers, reason

    def observe(self, layers: bool, bucket: int, ttft_seconds: float) -> None:
        """Count one measured TTFT of a push written layer by layer (or whole)."""
        self._stats[bucket, layers].add(ttft_seconds, self.settings.smoothing)

    def snapshot(self) -> list[dict[str, object]]:
        """Per bucket and arm: average TTFT in ms (None before any sample) and samples."""
        return [{"bucket": bucket, "layers": layers,
                 "avg_ms": round(average.value * 1000, 3) if average.count else None,
                 "samples": average.count}
                for (bucket, layers), average in self._stats.items()]


class LocalBudget:
    """Where auto may send a request local: on a D whose streams are not slowed too much.

    A local request's prompt is computed by D between the decode steps of the streams D
    is answering, so each of them waits longer for its next token. The budget is a
    ratio, `auto.local_itl_budget`: local goes to a D only while its recent ITL (every
    stream) is at most budget x its ITL on clean streams (no local prompt computed
    during them). A ratio rather than a bound in milliseconds, because what it limits
    is the slowdown local causes, and that is the one thing a ratio over the same D's
    own clean streams isolates: a D's ITL also depends on the model, the hardware, its
    batch size and the contexts it decodes, which an absolute bound would have to be
    tuned for per deployment and which would shut local off whenever D is simply busy,
    whether or not local is to blame. The ratio also corrects itself: while a D is over
    budget it gets no local request, so its streams are clean, its recent ITL returns to
    the clean one and local resumes; it settles where local costs about the budget. A
    D with no clean stream measured yet takes no local request from auto (the first
    streams give it one). A request that asks for local itself (its client, or `mode:
    local`) is held to the same budget (`over`: a D measured over it runs the request as
    a pull), but a D not measured yet takes it. Each D's measurements are kept on its
    endpoint (`Endpoint.streams`), so they go with it."""

    def __init__(self, settings: AutoSettings) -> None:
        self.ratio = settings.local_itl_budget
        self.smoothing = settings.smoothing

    @staticmethod
    def of(decode: Endpoint) -> DecodeStreams:
        return decode.streams

    def allows(self, decode: Endpoint) -> bool:
        """True while this D's recent ITL is within the budget of its clean ITL."""
        streams = decode.streams
        if streams.clean_itl is None or streams.recent_itl is None:
            return False
        return streams.recent_itl <= self.ratio * streams.clean_itl

    def over(self, decode: Endpoint) -> bool:
        """True when this D's recent ITL is measured and over the budget (unknown: not)."""
        streams = decode.streams
        if streams.clean_itl is None or streams.recent_itl is None:
            return False
        return streams.recent_itl > self.ratio * streams.clean_itl

    def snapshot(self, decodes: Sequence[Endpoint]) -> list[dict[str, object]]:
        """Per D of `decodes` that has a measurement or took a local request: its ITLs in
        ms (None before a sample), its local prompts now, and whether auto may send it a
        local request now."""
        rows: list[dict[str, object]] = []
        for decode in decodes:
            streams = decode.streams
            clean, recent = streams.clean_itl, streams.recent_itl
            if recent is None and not streams.local_started:
                continue
            rows.append({
                "decode": decode.url,
                "clean_itl_ms": round(clean * 1000, 3) if clean is not None else None,
                "recent_itl_ms": round(recent * 1000, 3) if recent is not None else None,
                "local_prefills": streams.local_prefills,
                "within_budget": self.allows(decode),
            })
        return rows
