"""Reading a server's load from vLLM's /metrics (summed over engines, the fullest KV cache;
not a vLLM or malformed text: no report), and the score that folds a report in (a missing
or stale report counts as nothing)."""

from __future__ import annotations

import pytest

from proxy.pool.load import LoadReport, LoadWeights, parse_vllm_metrics

# Trimmed from a real vLLM /metrics answer, with two engines (data parallel 2).
VLLM_METRICS = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 12345.0
python_gc_objects_collected_total{generation="1"} 678.0
# HELP process_resident_memory_bytes Resident memory size in bytes.
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 1.2345678e+09
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-0.6B"} 4.0
vllm:num_requests_running{engine="1",model_name="Qwen/Qwen3-0.6B"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-0.6B"} 3.0
vllm:num_requests_waiting{engine="1",model_name="Qwen/Qwen3-0.6B"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-0.6B"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen3-0.6B"} 0.5
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 7.0
vllm:num_preemptions_total{engine="1",model_name="Qwen/Qwen3-0.6B"} 0.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 98765.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="Qwen/Qwen3-0.6B"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="Qwen/Qwen3-0.6B"} 40.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="Qwen/Qwen3-0.6B"} 50.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="Qwen/Qwen3-0.6B"} 50.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="Qwen/Qwen3-0.6B"} 3.5
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="9001"} 1.0
"""


def test_a_vllm_answer_sums_engines_and_takes_the_fullest_kv_cache() -> None:
    report = parse_vllm_metrics(VLLM_METRICS, at=12.5)
    assert report == LoadReport(waiting=5.0, running=5.0, kv_cache_usage=0.5, at=12.5,
                                num_blocks=9001)  # from cache_config_info's label


def test_older_vllm_kv_cache_gauge_name_is_read() -> None:
    text = VLLM_METRICS.replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    report = parse_vllm_metrics(text, at=0.0)
    assert report is not None and report.kv_cache_usage == 0.5


def test_one_gauge_is_enough_and_the_others_default_to_zero() -> None:
    report = parse_vllm_metrics('vllm:num_requests_waiting{engine="0"} 9\n', at=1.0)
    assert report == LoadReport(waiting=9.0, running=0.0, kv_cache_usage=0.0, at=1.0)


def test_names_with_the_colon_replaced_are_read() -> None:
    text = "vllm_num_requests_running 2\nvllm_kv_cache_usage_perc 0.75\n"
    assert parse_vllm_metrics(text, at=0.0) == LoadReport(
        waiting=0.0, running=2.0, kv_cache_usage=0.75, at=0.0
    )


def test_values_out_of_range_are_bounded_and_nan_is_ignored() -> None:
    text = (
        "vllm:num_requests_waiting -3\nvllm:num_requests_running NaN\n"
        'vllm:kv_cache_usage_perc{engine="0"} 1.5\nvllm:kv_cache_usage_perc{engine="1"} NaN\n'
    )
    assert parse_vllm_metrics(text, at=0.0) == LoadReport(
        waiting=0.0, running=0.0, kv_cache_usage=1.0, at=0.0
    )


@pytest.mark.parametrize("text", [
    "",
    "# HELP nothing here\n",
    "process_resident_memory_bytes 1.0e+09\npython_info{version=\"3.12\"} 1.0\n",
    'vllm:kv_cache_usage_perc{engine="0"} 0.5\n',  # no request gauge: not enough to go by
    "num_requests_waiting 3\n",  # not vLLM's name
])
def test_text_without_vllm_request_gauges_gives_no_report(text: str) -> None:
    assert parse_vllm_metrics(text, at=0.0) is None


@pytest.mark.parametrize("bad", [
    'vllm:num_requests_running{engine="0" 3\n',  # unclosed labels
    "vllm:num_requests_running three\n",  # not a number
    "vllm:num_requests_running {{{ 1\n",
    '<html><body>{"not": "metrics"}</body></html>\n',
    "\x00\x01\x02 garbage \ufffd\n",
])
def test_malformed_text_gives_no_report_and_never_raises(bad: str) -> None:
    # Good gauges first: a partial parse must not pass for a report.
    assert parse_vllm_metrics(VLLM_METRICS + bad, at=0.0) is None
    assert parse_vllm_metrics(bad, at=0.0) is None


WEIGHTS = {"waiting_weight": 2.0, "kv_cache_weight": 10.0}


def load_score(in_flight: int, report: LoadReport | None, *, now: float, max_age: float,
               waiting_weight: float, kv_cache_weight: float) -> float:
    """A server's load score, as `LoadScore` adds it up."""
    return in_flight + LoadWeights(max_age, waiting_weight, kv_cache_weight).reported(report, now)


def test_score_of_a_fresh_report_adds_the_queue_and_the_kv_cache() -> None:
    report = LoadReport(waiting=3.0, running=8.0, kv_cache_usage=0.5, at=100.0)
    assert load_score(4, report, now=101.0, max_age=5.0, **WEIGHTS) == 4 + 2.0 * 3 + 10.0 * 0.5
    assert load_score(4, report, now=105.0, max_age=5.0, **WEIGHTS) == 15.0  # just at max_age


def test_score_of_a_stale_or_missing_report_is_in_flight_alone() -> None:
    report = LoadReport(waiting=3.0, running=8.0, kv_cache_usage=0.5, at=100.0)
    assert load_score(4, report, now=105.01, max_age=5.0, **WEIGHTS) == 4.0
    assert load_score(4, None, now=100.0, max_age=5.0, **WEIGHTS) == 4.0
    assert isinstance(load_score(0, None, now=0.0, max_age=5.0, **WEIGHTS), float)


def test_zero_weights_make_the_score_in_flight_alone() -> None:
    report = LoadReport(waiting=30.0, running=8.0, kv_cache_usage=0.9, at=100.0)
    assert load_score(2, report, now=100.0, max_age=5.0, waiting_weight=0, kv_cache_weight=0) == 2
