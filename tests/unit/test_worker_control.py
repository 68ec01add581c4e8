"""The workers' control channel (proxy.api.control): one /metrics exposition from every
worker's, admin calls applied on every worker in one order, and the workers' state file
that a (re)started worker takes. The workers here are `WorkerGroup`s in one process, each
with a router of its own (not started: no checks, no upstream calls), talking over real
unix sockets."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.api.admin import AdminCall
from proxy.api.control import (
    CONTROL_VERSION,
    STATE_FILE,
    ControlEnvelope,
    ControlReply,
    Heartbeat,
    WorkerError,
    WorkerGroup,
    merge_expositions,
)
from proxy.config import ConfigSource, RouterConfig, build_config, read_config_file
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


CONFIG = {"prefill": [P], "decode": [D], "health": {"interval": 0}}


@contextlib.asynccontextmanager
async def workers(directory: Path, count: int, *, running: int | list[int],
                  source: ConfigSource | None = None
                  ) -> AsyncIterator[list[tuple[WorkerGroup, Router]]]:
    """`count` workers of which the first `running` (or those listed) listen; the rest
    never started. With `source`, each reads its config from that file (not watched:
    the tests call `watcher.check`)."""
    config = source.load() if source is not None else build_config(CONFIG, {})
    started = []
    try:
        for index in (range(running) if isinstance(running, int) else running):
            router = Router(config, source)
            group = WorkerGroup(index, count, directory, timeout=2.0)
            await group.start(router)
            started.append((group, router))
        yield started
    finally:
        for group, router in started:
            await group.aclose()
            await router.aclose()


def add_call(url: str, cluster: str = "decode") -> AdminCall:
    return AdminCall(method="POST", path="/admin/endpoints",
                     body=msgspec.json.encode({"cluster": cluster, "url": url}))


def servers(router: Router) -> dict[str, bool]:
    """URL -> draining, for every server of both clusters."""
    return {e.url: e.draining for e in router.prefill.endpoints + router.decode.endpoints}


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
        status, answer = await first.admin(add_call(D2))
        assert status == 201 and answer["workers"] == [0, 1]
        assert router0.decode.find(D2) is not None and router1.decode.find(D2) is not None
        await first.admin(drain_call(D2))
        assert router1.membership.endpoint(router1.decode.name, D2).draining
        listing = AdminCall(method="GET", path="/admin/endpoints")
        views = (await first.admin(listing))[1]["workers"]
        assert [v["worker"] for v in views] == [0, 1]
        for view in views:
            assert {e["url"]: e["draining"] for e in view["endpoints"]}[D2] is True


async def test_a_worker_that_fails_or_is_missing_is_named(directory: Path) -> None:
    async with workers(directory, 3, running=2) as group:
        (first, router0), (_, router1) = group
        router1.decode.add(build_config({"prefill": [P], "decode": [D2]}, {}).decode[0])
        with pytest.raises(WorkerError) as failed:  # worker 1 has D2 already: a conflict there
            await first.admin(add_call(D2))
        message = failed.value.message
        assert "applied on worker(s) 0" in message
        assert "worker 1: decode server http://127.0.0.1:8201 is already a member" in message
        assert "worker 2: unreachable" in message
        assert failed.value.status == 502
        merged = (await first.metrics(router0.metrics.render())).decode()
        assert samples(merged, "pdproxy_worker_up") == {"0": 1.0, "1": 1.0, "2": 0.0}
        # worker 1, out of step, took the workers' servers instead: the same as worker 0's
        assert servers(router1) == servers(router0)


async def test_admin_changes_outlive_every_worker(directory: Path) -> None:
    async with workers(directory, 2, running=2) as group:
        (first, _), (second, _) = group
        await first.admin(add_call(D2))
        await second.admin(drain_call(D))
        await first.admin(add_call("http://127.0.0.1:8101", "prefill"))
    assert (directory / STATE_FILE).stat().st_mode & 0o777 == 0o600
    # Every worker gone; a worker started now serves what the admin API made.
    async with workers(directory, 2, running=[1]) as group:
        (_, router), = group
        assert servers(router) == {P: False, "http://127.0.0.1:8101": False, D: True, D2: False}


async def test_concurrent_changes_apply_in_one_order_on_every_worker(directory: Path) -> None:
    async with workers(directory, 3, running=3) as group:
        calls = []
        for i in range(30):  # taken by one worker or another, all at once
            call = drain_call(D, draining=i % 3 != 0) if i % 2 else add_call(
                f"http://127.0.0.1:{9000 + i}")
            calls.append(group[i % 3][0].admin(call))
        answers = await asyncio.gather(*calls)
        assert all(answer["workers"] == [0, 1, 2] for _, answer in answers)
        views = [servers(router) for _, router in group]
        assert views[0] == views[1] == views[2]
        assert len(views[0]) == 2 + 15
        assert [g.seq for g, _ in group] == [30, 30, 30]


async def test_a_worker_that_missed_a_change_takes_it_at_its_next_heartbeat(
        directory: Path) -> None:
    async with workers(directory, 2, running=2) as group:
        (first, router0), (second, router1) = group
        # worker 1 does not hear of this change (its forward fails)...
        async def unheard(request: Any) -> dict[int, ControlReply | str]:
            return {1: "unreachable (emulated)"}

        first._ask_peers = unheard  # type: ignore[method-assign]
        with pytest.raises(WorkerError, match="worker 1: unreachable"):
            await first.admin(add_call(D2))
        assert router1.decode.find(D2) is None
        # ...until the supervisor's next heartbeat
        second._answer(ControlEnvelope(CONTROL_VERSION, Heartbeat()))
        assert servers(router1) == servers(router0) and router1.decode.find(D2) is not None


async def test_a_config_file_change_is_applied_once_for_every_worker(
        directory: Path, tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"

    def write(decode: list[str]) -> None:
        path.write_text(msgspec.json.encode({**CONFIG, "decode": decode}).decode())
        os.utime(path, ns=(0, os.stat(path).st_mtime_ns + 10**9))  # a new stamp, surely

    def load() -> RouterConfig:
        return build_config(read_config_file(path), {})

    write([D])
    async with workers(directory, 2, running=2, source=ConfigSource(path, load)) as group:
        (first, router0), (second, router1) = group
        assert router0.watcher is not None and router1.watcher is not None
        write([D, D2])
        assert await router0.watcher.check() == [f"decode +{D2}"]
        assert router1.decode.find(D2) is not None  # worker 0 applied it for both
        await second.admin(drain_call(D2))
        # worker 1's own watcher sees the change late: it was applied, and the admin
        # change made since stays
        assert await router1.watcher.check() is None
        assert servers(router0) == servers(router1) == {P: False, D: False, D2: True}
        # a forced reload (SIGHUP) applies the file again, for both
        assert await router1.watcher.check(force=True) == [f"decode undrain {D2}"]
        assert servers(router0) == servers(router1) == {P: False, D: False, D2: False}


def test_workers_must_be_at_least_one() -> None:
    base = {"prefill": [P], "decode": [D]}
    assert build_config(base, {}).workers == 1
    assert build_config(base, {"workers": 4}).workers == 4
    with pytest.raises(ValueError, match="workers must be >= 1, got 0"):
        build_config(base, {"workers": 0})
