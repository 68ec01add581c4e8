"""The workers' control channel (proxy.api.control): one /metrics exposition from every
worker's, and admin calls applied on every worker. The workers here are `WorkerGroup`s in
one process, each with a router of its own (not started: no checks, no upstream calls),
talking over real unix sockets."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.api.admin import AdminCall, apply
from proxy.api.control import WorkerError, WorkerGroup, merge_expositions
from proxy.config import build_config
from proxy.flow.router import Router
from proxy.metrics import RouterMetrics

P, D, D2 = "http://127.0.0.1:8100", "http://127.0.0.1:8200", "http://127.0.0.1:8201"


def exposition(requests: int, ttfb: float | None = None) -> str:
    metrics = RouterMetrics()
    metrics.requests.labels("/v1/completions", "pull", "200").inc(requests)
    if ttfb is not None:
        metrics.time_to_first_byte.labels("pull").observe(ttfb)
    metrics.admin_auth_failures.inc()
    return metrics.render().decode()


def samples(text: str, name: str) -> dict[str, float]:
    """{worker label: value} of the samples called `name`."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                found[sample.labels.get("worker", "")] = sample.value
    return found


def test_merge_labels_every_sample_with_its_worker_and_keeps_one_family_each() -> None:
    merged = merge_expositions({0: exposition(3, 0.01), 1: exposition(5)}).decode()
    families = [f.name for f in text_string_to_metric_families(merged)]
    assert len(families) == len(set(families)), "a family appears twice"
    assert samples(merged, "pdproxy_requests_total") == {"0": 3.0, "1": 5.0}
    assert samples(merged, "pdproxy_admin_auth_failures_total") == {"0": 1.0, "1": 1.0}
    assert samples(merged, "pdproxy_time_to_first_byte_seconds_count") == {"0": 1.0}
    assert samples(merged, "pdproxy_worker_up") == {"0": 1.0, "1": 1.0}
    # each family's HELP and TYPE once, ahead of its samples
    assert merged.count("# TYPE pdproxy_requests_total counter") == 1


def test_a_worker_that_did_not_answer_is_left_out_and_marked_down() -> None:
    merged = merge_expositions({0: exposition(2), 1: None}).decode()
    assert samples(merged, "pdproxy_requests_total") == {"0": 2.0}
    assert samples(merged, "pdproxy_worker_up") == {"0": 1.0, "1": 0.0}


@pytest.fixture
def directory() -> Iterator[Path]:
    # A short path: unix socket paths are limited to about 100 bytes.
    path = Path(tempfile.mkdtemp(prefix="pdw-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@contextlib.asynccontextmanager
async def workers(directory: Path, count: int, *, running: int) -> AsyncIterator[list[tuple[WorkerGroup, Router]]]:
    """`count` workers of which the first `running` listen; the rest never started."""
    config = build_config({"prefill": [P], "decode": [D], "health": {"interval": 0}}, {})
    started = []
    try:
        for index in range(running):
            router = Router(config)
            group = WorkerGroup(index, count, directory, timeout=2.0)
            await group.start(router)
            started.append((group, router))
        yield started
    finally:
        for group, router in started:
            await group.aclose()
            await router.aclose()


def drain_call(url: str, draining: bool = True) -> AdminCall:
    body = msgspec.json.encode({"cluster": "decode", "url": url, "draining": draining})
    return AdminCall(method="POST", path="/admin/endpoints/drain", body=body)


async def test_metrics_gather_every_worker(directory: Path) -> None:
    async with workers(directory, 3, running=3) as group:
        for index, (_, router) in enumerate(group):
            router.metrics.requests.labels("/v1/completions", "pull", "200").inc(index + 1)
        first, router = group[0]
        merged = (await first.metrics(router.metrics.render())).decode()
    assert samples(merged, "pdproxy_requests_total") == {"0": 1.0, "1": 2.0, "2": 3.0}
    assert samples(merged, "pdproxy_worker_up") == {"0": 1.0, "1": 1.0, "2": 1.0}
    # per-endpoint gauges are read at scrape time in each worker, and kept apart
    assert set(samples(merged, "pdproxy_endpoint_in_flight")) == {"0", "1", "2"}


async def test_an_admin_change_reaches_every_worker(directory: Path) -> None:
    async with workers(directory, 2, running=2) as group:
        (first, router0), (_, router1) = group
        add = AdminCall(method="POST", path="/admin/endpoints",
                        body=msgspec.json.encode({"cluster": "decode", "url": D2}))
        status, answer = apply(router0, add)
        spread = await first.spread(add, answer)
        assert status == 201 and spread["workers"] == [0, 1]
        assert router1.decode.find(D2) is not None
        call = drain_call(D2)
        _, answer = apply(router0, call)
        await first.spread(call, answer)
        assert router1.membership.endpoint(router1.decode.name, D2).draining
        listing = AdminCall(method="GET", path="/admin/endpoints")
        _, answer = apply(router0, listing)
        views = (await first.spread(listing, answer))["workers"]
        assert [v["worker"] for v in views] == [0, 1]
        for view in views:
            assert {e["url"]: e["draining"] for e in view["endpoints"]}[D2] is True


async def test_a_worker_that_fails_or_is_missing_is_named(directory: Path) -> None:
    async with workers(directory, 3, running=2) as group:
        (first, router0), (_, router1) = group
        router1.decode.add(build_config({"prefill": [P], "decode": [D2]}, {}).decode[0])
        add = AdminCall(method="POST", path="/admin/endpoints",
                        body=msgspec.json.encode({"cluster": "decode", "url": D2}))
        _, answer = apply(router0, add)  # worker 1 has D2 already: a conflict there
        with pytest.raises(WorkerError) as failed:
            await first.spread(add, answer)
        message = failed.value.message
        assert "applied on worker(s) 0" in message
        assert "worker 1: decode server http://127.0.0.1:8201 is already a member" in message
        assert "worker 2: unreachable" in message
        assert failed.value.status == 502
        merged = (await first.metrics(router0.metrics.render())).decode()
        assert samples(merged, "pdproxy_worker_up") == {"0": 1.0, "1": 1.0, "2": 0.0}


def test_workers_must_be_at_least_one() -> None:
    base = {"prefill": [P], "decode": [D]}
    assert build_config(base, {}).workers == 1
    assert build_config(base, {"workers": 4}).workers == 4
    with pytest.raises(ValueError, match="workers must be >= 1, got 0"):
        build_config(base, {"workers": 0})
