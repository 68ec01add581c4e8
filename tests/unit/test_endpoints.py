"""An endpoint's live state (health thresholds, models, capabilities, latency) and the
cluster filters built on it."""

from __future__ import annotations

import pytest

from proxy.config import EndpointConfig, Mode, Policy, build_config
from proxy.errors import NoHealthyEndpoint
from proxy.pool.balance import Balancer
from proxy.pool.endpoints import Cluster, ClusterName, Endpoint


def endpoint(**config: object) -> Endpoint:
    return Endpoint(EndpointConfig(url="http://s:1", **config), ClusterName.DECODE)  # type: ignore[arg-type]


def checks(e: Endpoint, results: str, *, up: int = 2, down: int = 3) -> list[bool]:
    """Feed checks ('+' passed, '-' failed); the `healthy` state after each."""
    states = []
    for r in results:
        e.record_check(r == "+", healthy_after=up, unhealthy_after=down)
        states.append(e.healthy)
    return states


def test_a_server_goes_down_only_after_failures_in_a_row() -> None:
    e = endpoint()
    assert checks(e, "--+--+---") == [True] * 8 + [False]


def test_a_server_comes_back_only_after_passes_in_a_row() -> None:
    e = endpoint()
    e.mark_down("connection refused")
    assert e.last_error == "connection refused"
    assert checks(e, "+-+-++") == [False] * 5 + [True]


def test_record_check_says_when_the_state_changed() -> None:
    e = endpoint()
    changes = [e.record_check(False, healthy_after=1, unhealthy_after=2) for _ in range(3)]
    assert changes == [False, True, False]
    assert e.record_check(True, healthy_after=1, unhealthy_after=2) is True


def test_configured_models_win_and_unknown_models_mean_maybe() -> None:
    learned = endpoint()
    assert learned.serves("anything")  # nothing known yet
    learned.learned_models = frozenset({"a"})
    assert learned.serves("a") and not learned.serves("b")
    configured = endpoint(models=["b"])
    configured.learned_models = frozenset({"a"})
    assert configured.serves("b") and not configured.serves("a")


def test_a_decode_server_can_be_configured_pull_only() -> None:
    assert endpoint().can(Mode.PUSH)
    pull_only = endpoint(transfer_modes=[Mode.PULL])
    assert pull_only.can(Mode.PULL) and not pull_only.can(Mode.PUSH)


def test_a_drained_server_in_the_config_starts_drained() -> None:
    assert endpoint(drain=True).draining and not endpoint().draining


def test_recent_latency_is_a_moving_average() -> None:
    e = endpoint()
    e.observe_latency(1.0)
    assert e.recent_latency == 1.0
    for _ in range(30):
        e.observe_latency(0.1)
    assert e.recent_latency == pytest.approx(0.1, abs=0.01)


def pool(*models: list[str] | None) -> Cluster:
    configs = [EndpointConfig(url=f"http://d{i}:1", models=m) for i, m in enumerate(models)]
    return Cluster(ClusterName.DECODE, configs, Balancer(Policy.ROUND_ROBIN))


def test_a_cluster_picks_only_servers_of_the_model() -> None:
    cluster = pool(["a"], ["b"], ["a", "b"], None)
    assert {cluster.pick(model="a").url for _ in range(9)} == {"http://d0:1", "http://d2:1", "http://d3:1"}
    assert {cluster.pick(model="b").url for _ in range(9)} == {"http://d1:1", "http://d2:1", "http://d3:1"}


def test_no_healthy_server_of_the_model_is_a_clear_error() -> None:
    cluster = pool(["a"], ["b"])
    cluster.endpoints[1].healthy = False
    with pytest.raises(NoHealthyEndpoint, match="serves the model `b`"):
        cluster.pick(model="b")


def test_the_model_filter_is_never_dropped_but_the_mode_filter_is() -> None:
    configs = [EndpointConfig(url="http://d0:1", models=["a"], transfer_modes=[Mode.PULL])]
    cluster = Cluster(ClusterName.DECODE, configs, Balancer(Policy.LEAST_OUTSTANDING))
    assert cluster.pick(model="a", mode=Mode.PUSH).url == "http://d0:1"  # falls back to pull
    with pytest.raises(NoHealthyEndpoint):
        cluster.pick(model="c")


@pytest.mark.parametrize(("health", "message"), [
    ({"interval": -1}, "health.interval"),
    ({"unhealthy_threshold": 0}, "threshold"),
    ({"healthy_threshold": 0}, "threshold"),
])
def test_bad_health_settings_are_refused(health: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_config({"prefill": ["http://p:1"], "decode": ["http://d:1"], "health": health}, {})
