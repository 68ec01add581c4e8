"""Passive ejection: failures in a row eject a server, for longer each time; a success
clears the record; overload and client errors do not count; a cluster never ejects all."""

from __future__ import annotations

import pytest

from proxy.config import Ejection, EndpointConfig, Policy
from proxy.errors import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamStatusError,
    UpstreamTimeout,
)
from proxy.pool.balance import Balancer
from proxy.pool.endpoints import Cluster, ClusterName
from proxy.pool.outlier import OutlierRecord, counts_as_failure


def status(code: int) -> UpstreamStatusError:
    return UpstreamStatusError("x", status=code, content=b"")


@pytest.mark.parametrize(("exc", "counts"), [
    (UpstreamConnectError("x"), True),
    (UpstreamTimeout("x"), True),
    (UpstreamProtocolError("x"), True),
    (status(500), True),
    (status(502), True),
    (status(503), False),  # overload: shed load elsewhere, but not an outlier
    (status(429), False),
    (status(400), False),
])
def test_what_counts_as_a_failure(exc: UpstreamError, counts: bool) -> None:
    assert counts_as_failure(exc) is counts


def test_failures_in_a_row_eject_for_longer_each_time_up_to_the_cap() -> None:
    record = OutlierRecord(Ejection(consecutive_failures=3, base_seconds=5, max_seconds=12))
    assert [record.failure(0.0) for _ in range(3)] == [None, None, 5.0]
    assert record.ejected(4.9) and not record.ejected(5.0)
    assert record.failure(4.0) is None, "failures while ejected do not stack"
    assert [record.failure(6.0) for _ in range(3)] == [None, None, 10.0]
    assert [record.failure(20.0) for _ in range(3)] == [None, None, 12.0]


def test_a_success_clears_the_count_and_the_backoff() -> None:
    record = OutlierRecord(Ejection(consecutive_failures=2, base_seconds=5))
    record.failure(0.0)
    record.success()
    assert record.failure(0.0) is None, "the count restarted"
    assert record.failure(0.0) == 5.0
    record.success()
    assert [record.failure(10.0) for _ in range(2)] == [None, 5.0], "backoff restarted"


def test_zero_turns_ejection_off() -> None:
    record = OutlierRecord(Ejection(consecutive_failures=0))
    assert all(record.failure(0.0) is None for _ in range(100))


def test_a_cluster_skips_an_ejected_server_but_never_ejects_them_all() -> None:
    cluster = Cluster(ClusterName.DECODE, [EndpointConfig(url=f"http://d{i}:1") for i in range(2)],
                      Balancer(Policy.LEAST_OUTSTANDING), ejection=Ejection(consecutive_failures=1, base_seconds=60))
    first, second = cluster.endpoints
    assert first.outlier.failure(0.0) is not None  # ejected now (monotonic 0 + 60 s ahead)
    first.outlier.ejected_until = float("inf")
    assert {cluster.pick().url for _ in range(4)} == {second.url}
    second.outlier.ejected_until = float("inf")
    assert {cluster.pick().url for _ in range(4)} == {first.url, second.url}


@pytest.mark.parametrize("ejection", [
    {"consecutive_failures": -1}, {"base_seconds": 0}, {"base_seconds": 10, "max_seconds": 5}])
def test_bad_ejection_settings_are_refused(ejection: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Ejection(**ejection)  # type: ignore[arg-type]
