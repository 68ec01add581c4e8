"""Balancing: each policy's pick, prefix affinity's stickiness and bounded load, the
prompt prefix it hashes, and the settings."""

from __future__ import annotations

import random
import time
from collections import Counter

import msgspec
import pytest

from proxy.config import Balance, EndpointConfig, Policy, build_config
from proxy.pool.balance import Balancer, Lowest, Pipeline
from proxy.pool.endpoints import Cluster, ClusterName, Endpoint
from proxy.pool.load import LoadReport
from proxy.pool.pick import PickRequest
from proxy.protocol import Route, parse_request, prefix_key


def endpoints(n: int) -> list[Endpoint]:
    return [Endpoint(EndpointConfig(url=f"http://p{i}:8000"), ClusterName.PREFILL) for i in range(n)]


def test_round_robin_takes_each_in_turn_whatever_the_load() -> None:
    eps = endpoints(3)
    eps[0].in_flight = 50
    balancer = Balancer(Policy.ROUND_ROBIN)
    assert [balancer.pick(eps).url for _ in range(6)] == [e.url for e in eps] * 2


def test_least_outstanding_takes_the_least_busy_and_rotates_ties() -> None:
    eps = endpoints(3)
    eps[0].in_flight, eps[1].in_flight, eps[2].in_flight = 2, 0, 0
    balancer = Balancer(Policy.LEAST_OUTSTANDING)
    picked = Counter(balancer.pick(eps).url for _ in range(10))
    assert set(picked) == {eps[1].url, eps[2].url}
    assert abs(picked[eps[1].url] - picked[eps[2].url]) <= 1


def test_power_of_two_never_takes_the_busiest_and_spreads_over_the_rest() -> None:
    eps = endpoints(4)
    for e, load in zip(eps, (9, 1, 1, 1), strict=True):
        e.in_flight = load
    balancer = Balancer(Policy.POWER_OF_TWO, rng=random.Random(7))
    picked = Counter(balancer.pick(eps).url for _ in range(600))
    assert eps[0].url not in picked
    assert all(120 <= picked[e.url] <= 280 for e in eps[1:]), picked


def test_prefix_affinity_sends_one_prefix_to_one_endpoint() -> None:
    eps = endpoints(3)
    balancer = Balancer(Policy.PREFIX_AFFINITY)
    for key in ("You are a helpful assistant.", "System: translate", "x" * 300):
        assert len({balancer.pick(eps, key).url for _ in range(20)}) == 1


def test_prefix_affinity_spreads_many_prefixes_over_all_endpoints() -> None:
    eps = endpoints(3)
    balancer = Balancer(Policy.PREFIX_AFFINITY)
    picked = Counter(balancer.pick(eps, f"prompt number {i}").url for i in range(3000))
    assert all(700 <= picked[e.url] <= 1300 for e in eps), picked


def test_prefix_affinity_bounds_the_load_one_hot_prefix_puts_on_a_server() -> None:
    eps = endpoints(3)
    balancer = Balancer(Policy.PREFIX_AFFINITY, Balance(load_factor=1.25))
    home = balancer.pick(eps, "hot prefix")
    # Requests stay in flight: the hot prefix's home fills up to its bound, then others
    # take the overflow; no server gets more than ceil(1.25 * mean) at any time.
    for n in range(1, 31):
        chosen = balancer.pick(eps, "hot prefix")
        chosen.in_flight += 1
        assert max(e.in_flight for e in eps) <= -(-125 * n // 300)  # ceil(1.25 * n / 3)
    assert home.in_flight == max(e.in_flight for e in eps)
    assert all(e.in_flight > 0 for e in eps)


def test_prefix_affinity_moves_only_the_prefixes_of_a_removed_endpoint() -> None:
    eps = endpoints(4)
    balancer = Balancer(Policy.PREFIX_AFFINITY)
    keys = [f"conversation {i}" for i in range(400)]
    before = {k: balancer.pick(eps, k).url for k in keys}
    gone = eps[2].url
    after = {k: balancer.pick([e for e in eps if e.url != gone], k).url for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == gone for k in moved)


def test_prefix_affinity_without_a_prompt_acts_as_least_outstanding() -> None:
    eps = endpoints(2)
    eps[0].in_flight = 3
    assert Balancer(Policy.PREFIX_AFFINITY).pick(eps, None) is eps[1]


def test_a_pipeline_of_several_scorers_picks_by_their_weighted_sum() -> None:
    class Given:
        def __init__(self, costs: list[float]) -> None:
            self.costs = costs

        def scores(self, candidates: object, request: object, now: float) -> list[float]:
            return self.costs

    eps = endpoints(2)
    pipeline = Pipeline([(Given([0.0, 2.0]), 1.0), (Given([3.0, 0.0]), 1.0)], Lowest())
    assert pipeline.pick(eps, PickRequest()) is eps[1]  # 3 + 0 > 0 + 2
    pipeline = Pipeline([(Given([0.0, 2.0]), 3.0), (Given([3.0, 0.0]), 1.0)], Lowest())
    assert pipeline.pick(eps, PickRequest()) is eps[0]  # 0 + 3 < 6 + 0
    pipeline = Pipeline([(Given([0.0, 2.0]), 1.0)], Lowest())  # one of weight 1: as given
    assert pipeline.pick(eps, PickRequest()) is eps[0]


def test_a_cluster_filters_before_its_policy_picks() -> None:
    cluster = Cluster(ClusterName.DECODE, [EndpointConfig(url=f"http://d{i}:1") for i in range(3)],
                      Balancer(Policy.ROUND_ROBIN))
    cluster.endpoints[1].healthy = False
    picked = {cluster.pick(exclude=cluster.endpoints[0]).url for _ in range(5)}
    assert picked == {cluster.endpoints[2].url}


def request(route: Route, body: dict[str, object]) -> object:
    return parse_request(route, msgspec.json.encode({"model": "m", **body}), {}, max_body_bytes=10**6)


@pytest.mark.parametrize(("route", "body", "expected"), [
    pytest.param(Route.COMPLETIONS, {"prompt": "abcdefgh"}, "abcde", id="text"),
    pytest.param(Route.COMPLETIONS, {"prompt": [11, 22, 33]}, "11 22", id="token-ids"),
    pytest.param(Route.CHAT, {"messages": [{"role": "system", "content": "ab"},
                                           {"role": "user", "content": "cdef"}]}, "ab\ncd",
                 id="chat"),
    pytest.param(Route.CHAT, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hello"}]}]}, "hello", id="chat-parts"),
    pytest.param(Route.CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]}, None, id="no-text"),
])
def test_the_prefix_hashed_is_the_prompts_start(route: Route, body: dict[str, object],
                                                expected: str | None) -> None:
    assert prefix_key(request(route, body), 5) == expected  # type: ignore[arg-type]


def test_policies_come_from_the_file_and_flags_win() -> None:
    config = build_config(
        {"prefill": ["http://p:1"], "decode": ["http://d:1"],
         "balance": {"prefill": "round_robin", "prefix_chars": 64}},
        {"balance.prefill": "prefix_affinity", "balance.decode": None})
    assert config.balance == Balance(prefill=Policy.PREFIX_AFFINITY, prefix_chars=64)


@pytest.mark.parametrize("balance", [
    {"prefill": "random"}, {"prefix_chars": 0}, {"load_factor": 0.9}, {"unknown": 1}])
def test_a_bad_balance_setting_is_refused(balance: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="balance|invalid configuration"):
        build_config({"prefill": ["http://p:1"], "decode": ["http://d:1"], "balance": balance}, {})


def test_load_aware_prefers_the_server_whose_vllm_reports_less_load() -> None:
    eps = endpoints(3)
    now = time.monotonic()
    eps[0].load = LoadReport(waiting=5, running=2, kv_cache_usage=0.1, at=now)
    eps[1].load = LoadReport(waiting=0, running=2, kv_cache_usage=0.9, at=now)  # 0 + 3.6
    eps[2].load = LoadReport(waiting=1, running=2, kv_cache_usage=0.2, at=now)  # 1 + 0.8
    balancer = Balancer(Policy.LOAD_AWARE, Balance(waiting_weight=1.0, kv_cache_weight=4.0))
    assert balancer.pick(eps) is eps[2]
    eps[2].in_flight = 3  # what this router sent counts too: 4.8 > 3.6
    assert balancer.pick(eps) is eps[1]


def test_load_aware_ignores_stale_reports_and_rotates_ties() -> None:
    eps = endpoints(2)
    eps[0].load = LoadReport(waiting=50, running=0, kv_cache_usage=0.0, at=time.monotonic() - 60)
    balancer = Balancer(Policy.LOAD_AWARE, Balance(scrape_interval=1.0))
    assert Counter(balancer.pick(eps).url for _ in range(4)) == {eps[0].url: 2, eps[1].url: 2}
