"""Passive outlier ejection: a server that fails requests in a row is taken out of its
cluster for a while, longer each time, without waiting for a health check to notice.

An endpoint is ejected after `consecutive_failures` failed legs in a row (connection
refused, timeout, a broken answer, or a 5xx other than 503, which is overload, not
failure). It is ejected for `base_seconds`, doubled at each further ejection up to
`max_seconds`; after that it takes requests again, and one success clears its record.
A cluster never ejects its last available servers: if all would be out, they stay in
(a router that refuses everything helps nobody).
"""

from __future__ import annotations

from proxy.config import Ejection
from proxy.errors import UpstreamError, UpstreamStatusError

OVERLOAD_STATUS = 503


def counts_as_failure(exc: UpstreamError) -> bool:
    if isinstance(exc, UpstreamStatusError):
        return exc.status >= 500 and exc.status != OVERLOAD_STATUS
    return True


class OutlierRecord:
    """One endpoint's recent failures and ejection state."""

    __slots__ = ("config", "consecutive_failures", "ejections", "ejected_until")

    def __init__(self, config: Ejection) -> None:
        self.config = config
        self.consecutive_failures = 0
        self.ejections = 0  # in a row, without a success in between: sets the backoff
        self.ejected_until = 0.0  # monotonic seconds

    def ejected(self, now: float) -> bool:
        return now < self.ejected_until

    def success(self) -> None:
        self.consecutive_failures = 0
        self.ejections = 0

    def failure(self, now: float) -> float | None:
        """Count a failed leg; return the ejection's length in seconds if it ejects now."""
        threshold = self.config.consecutive_failures
        if threshold == 0 or self.ejected(now):  # legs already running when it was ejected
            return None
        self.consecutive_failures += 1
        if self.consecutive_failures < threshold:
            return None
        self.consecutive_failures = 0
        seconds = float(min(self.config.max_seconds, self.config.base_seconds * 2**self.ejections))
        self.ejections += 1
        self.ejected_until = now + seconds
        return seconds
