"""The request path's own counters and histograms (`LoopCounter`, `LoopHistogram`) expose
exactly what prometheus_client's `Counter` and `Histogram` would, given the same updates."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from proxy.metrics import LoopCounter, LoopHistogram, RouterMetrics


def _without_times(text: str) -> str:
    """The exposition with each `_created` sample's value (a wall-clock time) masked."""
    return re.sub(r"^(\S+_created(?:\{[^}]*\})?) \S+$", r"\1 T", text, flags=re.M)


def test_loop_metrics_expose_what_prometheus_client_would() -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    buckets = (0.001, 0.01, 1.0, 5.0)
    their_hist = Histogram("x_seconds", "a histogram", ["mode"], buckets=buckets, registry=theirs)
    our_hist = LoopHistogram("x_seconds", "a histogram", ["mode"], buckets=buckets, registry=ours)
    their_count = Counter("y_total", "a counter", ["a", "b"], registry=theirs)
    our_count = LoopCounter("y_total", "a counter", ["a", "b"], registry=ours)
    their_plain = Counter("z", "no labels", registry=theirs)
    our_plain = LoopCounter("z", "no labels", registry=ours)
    # under the first bound, on each bound, just under and over one, past the last, and
    # a second label set
    for value in (-1.0, 0.0, 0.0005, 0.001, 0.0011, 0.01, 0.5, 1.0, 5.0, 7.0, 100.0):
        their_hist.labels("pull").observe(value)
        our_hist.observe(("pull",), value)
    their_hist.labels("push").observe(0.01)
    our_hist.labels("push").observe(0.01)
    their_count.labels("1", "2").inc()
    our_count.inc(("1", "2"))
    their_count.labels("1", "2").inc(2.5)
    our_count.labels("1", "2").inc(2.5)
    their_count.labels("3", "4").inc()
    our_count.inc(("3", "4"))
    their_plain.inc()
    our_plain.inc()
    # a series only bound is exposed at 0
    their_count.labels("5", "6")
    our_count.labels("5", "6")
    their_hist.labels("local")
    our_hist.labels("local")

    text = generate_latest(ours).decode()
    assert _without_times(text) == _without_times(generate_latest(theirs).decode())
    assert 'x_seconds_bucket{le="0.001",mode="pull"} 4.0' in text
    assert 'x_seconds_bucket{le="+Inf",mode="pull"} 11.0' in text
    # (the sum as its float is written: 112.5126 is not one)
    assert 'x_seconds_sum{mode="pull"} 112.51259999999999' in text
    assert 'y_total{a="1",b="2"} 3.5' in text
    assert 'y_total{a="5",b="6"} 0.0' in text and 'x_seconds_count{mode="local"} 0.0' in text


def test_created_series_follow_prometheus_clients_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    from prometheus_client import metrics as prometheus_metrics

    registry = CollectorRegistry()
    counter = LoopCounter("c_total", "a counter", ["a"], registry=registry)
    histogram = LoopHistogram("h_seconds", "a histogram", ["a"], buckets=(1.0,), registry=registry)
    plain = LoopCounter("p", "no labels", registry=registry)
    counter.inc(("x",))
    histogram.observe(("x",), 0.5)
    assert "c_created" in generate_latest(registry).decode()
    assert "p_total 0.0" in generate_latest(registry).decode()  # at 0 before any inc
    monkeypatch.setattr(prometheus_metrics, "_use_created", False)
    text = generate_latest(registry).decode()
    assert "_created" not in text and 'h_seconds_count{a="x"} 1.0' in text
    assert plain.values == {(): 0.0}


def test_a_series_bound_with_the_wrong_number_of_labels_is_refused() -> None:
    metrics = RouterMetrics()
    with pytest.raises(ValueError, match="3 label values expected, got 2"):
        metrics.requests.labels("/v1/completions", "pull")
    with pytest.raises(ValueError, match="1 label values expected, got 0"):
        metrics.time_to_first_byte.labels()


def test_the_routers_request_metrics_are_scraped_with_its_registry() -> None:
    metrics = RouterMetrics()
    metrics.requests.inc(("/v1/completions", "pull", "200"))
    metrics.time_to_first_byte.observe(("pull",), 0.02)
    text = metrics.render().decode()
    assert 'pdproxy_requests_total{mode="pull",route="/v1/completions",status="200"} 1.0' in text
    assert 'pdproxy_time_to_first_byte_seconds_bucket{le="0.025",mode="pull"} 1.0' in text
    assert 'pdproxy_time_to_first_byte_seconds_count{mode="pull"} 1.0' in text
