"""When a failed leg may be sent again to another server: the reason, and a budget.

A leg is retried (once, on another healthy server of its cluster, and only before any
byte reached the client) when its server refused the connection, or answered a 5xx
other than 503. Never for 503 or 429 (the backends are overloaded: more requests make it
worse), nor for timeouts (the work may still be running there).

The budget bounds retries to a share of recent traffic: within the last `window_s`
seconds, retries may be at most `ratio` of the requests, plus `min_per_window` so that a
quiet router can still retry. When a backend melts down, retries stop at the budget
instead of doubling the load.
"""

from __future__ import annotations

import collections
import time

from proxy.errors import UpstreamConnectError, UpstreamError, UpstreamStatusError

NOT_RETRIED_STATUSES = frozenset({429, 503})


def retry_reason(exc: UpstreamError) -> str | None:
    """Why this failure may be retried elsewhere (a metric label), or None."""
    if isinstance(exc, UpstreamConnectError):
        return "connect"
    if isinstance(exc, UpstreamStatusError) and exc.status >= 500 \
            and exc.status not in NOT_RETRIED_STATUSES:
        return "status_5xx"
    return None


class RetryBudget:
    def __init__(self, ratio: float = 0.2, min_per_window: int = 10, window_s: float = 10.0) -> None:
        self.ratio = ratio
        self.min_per_window = min_per_window
        self.window_s = window_s
        self._requests: collections.deque[float] = collections.deque()
        self._retries: collections.deque[float] = collections.deque()

    def request(self, now: float | None = None) -> None:
        """Count one client request (each request, retried or not). What left the window
        is dropped here too, not only when a retry asks: under healthy traffic none asks,
        and the record would keep one timestamp per request for ever."""
        now = time.monotonic() if now is None else now
        self._forget_before(now - self.window_s)
        self._requests.append(now)

    def try_spend(self, now: float | None = None) -> bool:
        """True (and counted) when one more retry fits the budget now."""
        now = time.monotonic() if now is None else now
        self._forget_before(now - self.window_s)
        if len(self._retries) >= self.min_per_window + self.ratio * len(self._requests):
            return False
        self._retries.append(now)
        return True

    def _forget_before(self, cutoff: float) -> None:
        """Drop the requests and retries at or before `cutoff` (both are in time order)."""
        for times in (self._requests, self._retries):
            while times and times[0] <= cutoff:
                times.popleft()
