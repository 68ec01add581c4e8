"""What is retried, and the retry budget (a share of recent traffic)."""

from __future__ import annotations

import pytest

from proxy.errors import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamStatusError,
    UpstreamTimeout,
)
from proxy.pool.retry import RetryBudget, retry_reason


def status(code: int) -> UpstreamStatusError:
    return UpstreamStatusError("x", status=code, content=b"")


@pytest.mark.parametrize(("exc", "reason"), [
    (UpstreamConnectError("x"), "connect"),
    (status(500), "status_5xx"),
    (status(502), "status_5xx"),
    (status(503), None),  # overload: retrying it elsewhere feeds a melt-down
    (status(429), None),
    (status(404), None),
    (UpstreamTimeout("x"), None),  # the work may still be running there
    (UpstreamProtocolError("x"), None),
])
def test_what_is_retried(exc: UpstreamError, reason: str | None) -> None:
    assert retry_reason(exc) == reason


def test_the_budget_is_a_floor_plus_a_share_of_recent_requests() -> None:
    budget = RetryBudget(ratio=0.5, min_per_window=2, window_s=10)
    assert [budget.try_spend(now=0.0) for _ in range(3)] == [True, True, False]
    for _ in range(4):
        budget.request(now=1.0)
    assert [budget.try_spend(now=1.0) for _ in range(3)] == [True, True, False]  # 2 + 0.5 * 4


def test_the_budget_forgets_what_is_older_than_its_window() -> None:
    budget = RetryBudget(ratio=0.0, min_per_window=1, window_s=10)
    assert budget.try_spend(now=0.0) and not budget.try_spend(now=9.9)
    assert budget.try_spend(now=10.0)


def test_the_budget_counts_by_tenths_of_its_window() -> None:
    """A retry leaves the window within its last tenth (slots of 1 s here), and a gap of
    more than a window forgets everything, in as many counts as ever."""
    budget = RetryBudget(ratio=0.0, min_per_window=1, window_s=10)
    assert budget.try_spend(now=0.5)
    assert not budget.try_spend(now=9.99)  # 9.49 s later: still in the window
    assert budget.try_spend(now=10.0)  # 9.5 s later: its slot left the window
    for _ in range(50):
        budget.request(now=10.0)
    assert budget.try_spend(now=1_000.0)  # 990 s on: nothing left of the 50 or the retry
    assert sum(budget._requests) == 0 and sum(budget._retries) == 1
    assert len(budget._requests) == len(budget._retries) == RetryBudget.SLOTS
