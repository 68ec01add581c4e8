"""kv_aware's pipeline: the missing tokens against the queued work, unknown servers never
taken as empty, load alone without events, credits after a pick, and the prediction
recorded for the log."""

from __future__ import annotations

from proxy.config import Balance, EndpointConfig, KvAware, Policy
from proxy.metrics import RouterMetrics
from proxy.pool.balance import Balancer
from proxy.pool.endpoints import Cluster, ClusterName, Endpoint
from proxy.pool.kv.blocks import PromptBlocks
from proxy.pool.kv.events import BlockStored, EventBatch
from proxy.pool.kv.index import KvIndex
from proxy.pool.kv.score import Calibration, KvContext

BS = 16
TOKENS = list(range(1, 8 * BS + 1))  # 8 blocks


def endpoints(n: int) -> list[Endpoint]:
    return [Endpoint(EndpointConfig(url=f"http://p{i}:8000"), ClusterName.PREFILL)
            for i in range(n)]


def balancer(index: KvIndex, *, prefill: bool = True, **settings: float) -> Balancer:
    kv = KvAware(**settings)  # type: ignore[arg-type]
    context = KvContext(index, kv, "prefill" if prefill else "decode",
                        token_weight=1.0 if prefill else kv.decode_token_weight,
                        tracks_work=prefill, calibration=Calibration(kv),
                        metrics=RouterMetrics())
    return Balancer(Policy.KV_AWARE, Balance(kv_aware=kv), kv=context)


def holds(index: KvIndex, url: str, blocks: int, seq: int = 0) -> None:
    source = index.source(url, 0)
    source.start_empty()
    if blocks:
        source.accept(seq, EventBatch(1.0, (BlockStored(
            block_hashes=tuple(range(1, blocks + 1)), parent_block_hash=None,
            token_ids=TOKENS[:blocks * BS], block_size=BS),)))


def test_the_server_holding_the_prompt_wins_until_its_queue_costs_more() -> None:
    index = KvIndex()
    eps = endpoints(2)
    holds(index, eps[0].url, 6)  # 96 of the prompt's 128 tokens
    holds(index, eps[1].url, 0)
    b = balancer(index, credit_s=0)
    assert b.pick(eps, prompt=PromptBlocks(TOKENS)) is eps[0]
    eps[0].pending_tokens = 95  # 32 + 95 < 128 + 0: still there
    assert b.pick(eps, prompt=PromptBlocks(TOKENS)) is eps[0]
    eps[0].pending_tokens = 97  # 32 + 97 > 128: the idle one computes it all sooner
    assert b.pick(eps, prompt=PromptBlocks(TOKENS)) is eps[1]


def test_what_only_metrics_show_counts_tokens_per_request() -> None:
    index = KvIndex()
    eps = endpoints(2)
    holds(index, eps[0].url, 8)
    holds(index, eps[1].url, 0)
    b = balancer(index, credit_s=0, tokens_per_request=100, calibrate=False)
    eps[0].in_flight = 2  # counted by pending_tokens (0 here), not per request, for a P
    assert b.pick(eps, prompt=PromptBlocks(TOKENS)) is eps[0]


def test_decode_weighs_missing_tokens_less_and_counts_requests() -> None:
    index = KvIndex()
    eps = endpoints(2)
    holds(index, eps[0].url, 8)
    holds(index, eps[1].url, 0)
    b = balancer(index, prefill=False, credit_s=0, tokens_per_request=16,
                 decode_token_weight=0.25, calibrate=False)
    eps[0].in_flight = 1  # 16 > 0.25 x 128 = 32? no: 16 < 32, stays
    assert b.pick(eps, prompt=PromptBlocks(TOKENS)) is eps[0]
    eps[0].in_flight = 3  # 48 > 32: the other
    assert b.pick(eps, prompt=PromptBlocks(TOKENS)) is eps[1]


def test_an_unknown_server_is_scored_as_the_best_known_not_as_empty() -> None:
    index = KvIndex()
    eps = endpoints(2)
    holds(index, eps[0].url, 8)
    index.source(eps[1].url, 0)  # subscribed, not caught up: unknown
    b = balancer(index, credit_s=0)
    eps[0].pending_tokens = 1  # a tie on the cache, so the queue decides
    assert b.pick(eps, prompt=PromptBlocks(TOKENS)) is eps[1]


def test_without_events_or_tokens_it_picks_by_load_and_counts_why() -> None:
    index = KvIndex()
    eps = endpoints(2)
    b = balancer(index, credit_s=0)
    eps[0].pending_tokens = 10
    assert b.pick(eps, prompt=PromptBlocks(TOKENS)) is eps[1]
    assert b.pick(eps, prompt=None) is eps[1]
    kv = b.pipeline.scorers[0][0]
    metrics = kv.kv.metrics  # type: ignore[attr-defined]
    text = metrics.render().decode()
    assert 'pdproxy_kv_fallbacks_total{cluster="prefill",reason="not_synced"} 1.0' in text
    assert 'pdproxy_kv_fallbacks_total{cluster="prefill",reason="no_tokens"} 1.0' in text


def test_a_pick_credits_the_chosen_server_and_records_the_prediction() -> None:
    index = KvIndex()
    eps = endpoints(2)
    holds(index, eps[0].url, 0)
    holds(index, eps[1].url, 0)
    b = balancer(index, credit_s=60)
    first = PromptBlocks(TOKENS)
    home = b.pick(eps, prompt=first)
    assert first.predicted == {"prefill": 0}
    second = PromptBlocks(TOKENS + [7, 7])
    home.pending_tokens = 100  # busy, but the credited prompt outweighs it
    assert b.pick(eps, prompt=second) is home
    assert second.predicted == {"prefill": 8 * BS}


def test_one_candidate_is_still_credited() -> None:
    index = KvIndex()
    (only,) = endpoints(1)
    holds(index, only.url, 0)
    b = balancer(index, credit_s=60)
    prompt = PromptBlocks(TOKENS)
    assert b.pick([only], prompt=prompt) is only
    assert index.sources(only.url)[0].hits(prompt.keys(BS), now=0) == 8


def test_a_lone_server_of_a_cluster_is_still_credited() -> None:
    # The cluster picks a lone candidate itself only for a policy that need not see it
    index = KvIndex()
    b = balancer(index, credit_s=60)
    assert b.told_of_every_pick
    cluster = Cluster(ClusterName.PREFILL, [EndpointConfig(url="http://p0:8000")], b)
    (only,) = cluster.endpoints
    holds(index, only.url, 0)
    prompt = PromptBlocks(TOKENS)
    assert cluster.pick(prompt=prompt) is only
    assert index.sources(only.url)[0].hits(prompt.keys(BS), now=0) == 8
    assert prompt.predicted == {"prefill": 0}


def test_a_requests_weight_follows_what_routed_requests_compute() -> None:
    index = KvIndex()
    eps = endpoints(2)
    holds(index, eps[0].url, 0)
    holds(index, eps[1].url, 0)
    b = balancer(index, credit_s=0, tokens_per_request=1024)
    calibration = b.pipeline.scorers[0][0].kv.calibration  # type: ignore[attr-defined]
    for _ in range(200):  # 128-token prompts nobody holds: 128 computed each
        b.pick(eps, prompt=PromptBlocks(TOKENS))
    assert abs(calibration.tokens_per_request - 128) < 1
    fixed = balancer(index, credit_s=0, tokens_per_request=1024, calibrate=False)
    fixed.pick(eps, prompt=PromptBlocks(TOKENS))
    assert fixed.pipeline.scorers[0][0].kv.calibration.tokens_per_request == 1024  # type: ignore[attr-defined]


def test_the_kv_series_are_exposed_at_zero_before_any_request() -> None:
    """A series that first appears at its first update loses that update to rate():
    the predicted hits per cluster and the tokenize cache's hit and miss start at 0."""
    from proxy.config import Limits, Timeouts
    from proxy.pool.kv.tokens import PromptTokenizer
    from proxy.upstream.client import UpstreamClient

    kv = balancer(KvIndex()).pipeline.after[0].kv  # type: ignore[attr-defined]
    assert kv.metrics is not None
    PromptTokenizer(UpstreamClient(Timeouts(), Limits()), list, timeout=1.0, metrics=kv.metrics)
    text = kv.metrics.render().decode()
    assert 'pdproxy_kv_predicted_hit_ratio_count{cluster="prefill"} 0.0' in text
    assert 'pdproxy_kv_tokenize_cache_total{result="hit"} 0.0' in text
    assert 'pdproxy_kv_tokenize_cache_total{result="miss"} 0.0' in text
