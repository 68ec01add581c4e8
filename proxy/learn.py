"""How `auto` mode learns which KV hand-over is faster: pull or push, per prompt length.

When a request asks for `auto` and its P and D can do both pull and push, the router
asks a `ModeLearner` which one to use, and afterwards tells it the request's measured
time to first token (TTFT). Which mode wins depends on the prompt: push overlaps the
transfer with P's compute (good for long prompts), pull has less coordination (often
good for short ones). So prompts are sorted into buckets by length in characters, and
each bucket learns on its own.

Per bucket and mode the learner keeps an exponential moving average of TTFT: the first
sample sets it, each later one moves it by `smoothing` x (sample - average), so it
follows a change in the backends within a few requests.

The rule, per bucket:

* Learning (`auto_learning`): while either mode has fewer than `min_samples` measured
  TTFTs, the two modes take turns: the one chosen fewer times gets the request (push on
  a tie, so the very first request is push). Turns are counted when a mode is chosen,
  not when its TTFT arrives, so requests in flight at once are split evenly too. Hence
  with every request measured, both modes have `min_samples` after at most
  2 x `min_samples` requests, and during learning at most half the traffic goes to the
  slower mode (also when one mode's TTFTs never arrive, e.g. its requests fail).
* A request whose TTFT cannot be measured (not streamed: its first byte is the whole
  answer) takes no turn: it gets push (`auto_not_learned_yet`) until the bucket has
  learned, then the faster mode, and is never sent to explore.
* Then the faster average wins (`auto_faster_push` / `auto_faster_pull`; push on a
  tie), except that a share `explore` of the requests, drawn at random, goes to the
  other mode (`auto_explore`), so that its average stays current and a change that
  makes it the faster one is noticed. With `explore` = 0 the slower mode is never
  measured again; the faster one's average still follows it, so the choice still flips
  when the faster mode becomes slower than the other's last known average.

Every call is O(1). Not thread-safe: it lives in the router's one event loop.
"""

from __future__ import annotations

import bisect
import math
import random

import msgspec

from proxy.config import AutoSettings, Mode

LEARNED_MODES = (Mode.PUSH, Mode.PULL)  # push first: it wins ties


class _Average(msgspec.Struct):
    """One mode's TTFT in one bucket."""

    value: float = 0.0  # moving average, seconds (meaningless while count is 0)
    count: int = 0  # TTFTs measured
    chosen: int = 0  # times this mode was chosen (sets the turns while learning)

    def add(self, sample: float, smoothing: float) -> None:
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

    def bucket(self, prompt_chars: int) -> int:
        """The bucket of a prompt of this many characters."""
        return bisect.bisect_right(self._edges, prompt_chars)

    def observe(self, mode: Mode | str, bucket: int, ttft_seconds: float) -> None:
        """Count one measured TTFT of a request sent in `mode` (pull or push)."""
        mode = Mode(mode)
        if mode not in LEARNED_MODES:
            raise ValueError(f"only pull and push are learned, got {mode.value!r}")
        if not (math.isfinite(ttft_seconds) and ttft_seconds >= 0):
            raise ValueError(f"a TTFT must be a finite number >= 0, got {ttft_seconds!r}")
        self._stats[bucket, mode].add(ttft_seconds, self.settings.smoothing)

    def choose(self, bucket: int, *, measured: bool = True) -> tuple[Mode, str]:
        """The mode for the next `auto` request in this bucket, and why (a metric label).
        `measured`: whether this request's TTFT will be observed (a streamed one); one
        that will not takes no learning turn, and gets push until the bucket has learned."""
        push, pull = self._stats[bucket, Mode.PUSH], self._stats[bucket, Mode.PULL]
        if min(push.count, pull.count) < self.settings.min_samples:
            if not measured:
                return Mode.PUSH, "auto_not_learned_yet"
            mode, reason = (Mode.PULL if pull.chosen < push.chosen else Mode.PUSH), "auto_learning"
        else:
            best, other = (Mode.PULL, Mode.PUSH) if pull.value < push.value else (Mode.PUSH, Mode.PULL)
            explore = self.settings.explore
            if measured and explore > 0 and self._rng.random() < explore:
                mode, reason = other, "auto_explore"
            else:
                mode, reason = best, f"auto_faster_{best.value}"
        self._stats[bucket, mode].chosen += 1
        return mode, reason

    def snapshot(self) -> list[dict[str, object]]:
        """Per bucket and mode: its prompt lengths (min_chars <= chars < max_chars, None:
        no limit), average TTFT in ms (None before any sample) and samples measured, for
        logs and the admin API."""
        rows: list[dict[str, object]] = []
        for (bucket, mode), average in self._stats.items():
            rows.append({
                "bucket": bucket,
                "min_chars": self._edges[bucket - 1] if bucket > 0 else 0,
                "max_chars": self._edges[bucket] if bucket < len(self._edges) else None,
                "mode": mode.value,
                "avg_ms": round(average.value * 1000, 3) if average.count else None,
                "samples": average.count,
            })
        return rows
