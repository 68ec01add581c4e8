"""`pd-proxy serve --workers 2`: the real command line, two worker processes on one port,
in front of fake P and D servers in this process.

- requests are served by both workers (each counts its own, under its `worker` label);
- /metrics is one valid exposition with both workers' samples;
- an admin add and drain, and a change of the watched config file, reach both workers;
- a killed worker is started again, and the router keeps serving;
- SIGTERM lets a running stream finish, and the router exits 0;
- a worker that cannot start makes the router exit with uvicorn's STARTUP_FAILURE (3).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from scripts.bench import ProcessGauge
from scripts.fake_vllm import FakeVLLM, start
from tests.conftest import until
from tests.integration.conftest import Pair

REPO = Path(__file__).resolve().parents[2]
TOKEN = "w0rkers"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BODY = {"model": "fake-model", "prompt": "hi", "max_tokens": 2}
STARTUP_FAILURE = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def per_worker(text: str, name: str, **labels: str) -> dict[str, float]:
    """{worker: value} of the samples `name` with `labels`, summed per worker."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                worker = sample.labels["worker"]
                found[worker] = found.get(worker, 0.0) + sample.value
    return found


def worker_pids(supervisor: int) -> set[int]:
    """The supervisor's worker processes (its other child is multiprocessing's tracker)."""
    children = Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text().split()
    pids = set()
    for pid in map(int, children):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if b"spawn_main" in command:
            pids.add(pid)
    return pids


class Router:
    def __init__(self, process: asyncio.subprocess.Process, port: int, admin_port: int,
                 config: Path) -> None:
        self.process = process
        self.port = port
        self.admin_port = admin_port
        self.url = f"http://127.0.0.1:{port}"
        self.admin_url = f"http://127.0.0.1:{admin_port}"  # admin_listen: every worker serves it
        self.config = config

    async def metrics(self, client: httpx.AsyncClient) -> str:
        r = await client.get(f"{self.url}/metrics")
        assert r.status_code == 200, r.text
        return r.text

    async def both_up(self, client: httpx.AsyncClient) -> bool:
        try:
            text = await self.metrics(client)
        except httpx.TransportError:
            return False
        return per_worker(text, "pdproxy_worker_up") == {"0": 1.0, "1": 1.0}


def config_text(pair: Pair, port: int, admin_port: int, prefill: list[str] | None = None) -> str:
    prefill = prefill or [pair.p_url]
    return (f"prefill: [{', '.join(prefill)}]\ndecode: [{pair.d_url}]\nport: {port}\n"
            f"workers: 2\nadmin_token: {TOKEN}\nadmin_listen: 127.0.0.1:{admin_port}\n"
            "config_watch_interval: 0.1\nhealth: {interval: 0}\nlog_level: warning\n")


@pytest.fixture
async def router(pair: Pair, tmp_path: Path) -> AsyncIterator[Router]:
    port, admin_port = free_port(), free_port()
    config = tmp_path / "router.yaml"
    config.write_text(config_text(pair, port, admin_port))
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "serve", "--config", str(config), cwd=REPO)
    running = Router(process, port, admin_port, config)
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            await until(lambda: running.both_up(client), "both workers serve", timeout=60)
        yield running
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def spread_requests(client: httpx.AsyncClient, url: str, count: int) -> None:
    """`count` requests at once, each on a new connection (so any worker may take it)."""
    answers = await asyncio.gather(*(
        client.post(f"{url}/v1/completions", json=BODY, headers={"Connection": "close"})
        for _ in range(count)))
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]


async def test_both_workers_serve_and_show_in_one_exposition(router: Router, pair: Pair) -> None:
    sent = 0
    async with httpx.AsyncClient(timeout=10) as client:

        async def both_served() -> bool:
            nonlocal sent
            await spread_requests(client, router.url, 16)
            sent += 16
            text = await router.metrics(client)
            return set(per_worker(text, "pdproxy_requests_total")) == {"0", "1"}

        await until(both_served, "requests served by both workers", timeout=30)
        text = await router.metrics(client)
    names = [family.name for family in text_string_to_metric_families(text)]
    assert len(names) == len(set(names)), "a metric family appears twice"
    served = per_worker(text, "pdproxy_requests_total", status="200")
    assert sum(served.values()) == sent and all(v > 0 for v in served.values())
    assert set(per_worker(text, "pdproxy_endpoint_healthy")) == {"0", "1"}
    assert per_worker(text, "pdproxy_worker_up") == {"0": 1.0, "1": 1.0}
    # the bench counts the CPU of the whole process tree, workers included
    supervisor = ProcessGauge(router.process.pid)
    own = Path(f"/proc/{supervisor.pid}/stat").read_text().rsplit(")", 1)[1].split()
    own_seconds = (int(own[11]) + int(own[12])) / os.sysconf("SC_CLK_TCK")
    assert supervisor.cpu_seconds() > own_seconds + 0.5  # each worker's start alone is more


async def test_admin_changes_and_the_watched_file_reach_both_workers(
    router: Router, pair: Pair
) -> None:
    d2 = FakeVLLM("decode", engine_id="engine-d1")
    p2 = FakeVLLM("prefill", engine_id="engine-p1", side_channel_port=5602)
    (d2_runner, d2_url), (p2_runner, p2_url) = await start(d2), await start(p2)
    try:
        async with httpx.AsyncClient(base_url=router.admin_url, headers=AUTH, timeout=10) as client:
            added = await client.post("/admin/endpoints", json={"cluster": "decode", "url": d2_url})
            assert added.status_code == 201, added.text
            assert added.json()["workers"] == [0, 1]
            again = await client.post("/admin/endpoints", json={"cluster": "decode", "url": d2_url})
            assert again.status_code == 409  # refused where it was taken: nothing forwarded
            drained = await client.post("/admin/endpoints/drain",
                                        json={"cluster": "decode", "url": d2_url})
            assert drained.status_code == 200 and drained.json()["workers"] == [0, 1]
            views = (await client.get("/admin/endpoints")).json()["workers"]
            assert [view["worker"] for view in views] == [0, 1]
            for view in views:
                assert {e["url"]: e["draining"] for e in view["endpoints"]}[d2_url] is True

            router.config.write_text(config_text(pair, router.port, router.admin_port,
                                                 prefill=[pair.p_url, p2_url]))

            async def file_applied_by_both() -> bool:
                views = (await client.get("/admin/endpoints")).json()["workers"]
                return all(p2_url in {e["url"] for e in view["endpoints"]} for view in views)

            await until(file_applied_by_both, "the new P in both workers", timeout=15)
    finally:
        await d2_runner.cleanup()
        await p2_runner.cleanup()


async def test_a_killed_worker_is_started_again(router: Router) -> None:
    supervisor = router.process.pid
    before = worker_pids(supervisor)
    assert len(before) == 2
    victim = min(before)
    os.kill(victim, signal.SIGKILL)
    async with httpx.AsyncClient(timeout=10) as client:
        await until(lambda: len(worker_pids(supervisor) - before) == 1, "a new worker", timeout=30)
        await until(lambda: router.both_up(client), "both workers serve again", timeout=60)
        assert victim not in worker_pids(supervisor)
        await spread_requests(client, router.url, 8)
    assert router.process.returncode is None


async def test_a_restarted_worker_takes_the_admin_changes_made_before_it_started(
    router: Router, pair: Pair
) -> None:
    d2 = FakeVLLM("decode", engine_id="engine-d1")
    d2_runner, d2_url = await start(d2)
    supervisor = router.process.pid
    try:
        async with httpx.AsyncClient(base_url=router.admin_url, headers=AUTH, timeout=10) as client:
            added = await client.post("/admin/endpoints", json={"cluster": "decode", "url": d2_url})
            assert added.status_code == 201 and added.json()["workers"] == [0, 1], added.text
            drained = await client.post("/admin/endpoints/drain",
                                        json={"cluster": "decode", "url": d2_url})
            assert drained.status_code == 200, drained.text

            async def views() -> list[dict[str, bool]]:
                answer = (await client.get("/admin/endpoints")).json()
                return [{e["url"]: e["draining"] for e in view.get("endpoints", [])}
                        for view in answer["workers"]]

            wanted = {pair.d_url: False, d2_url: True}
            assert all({u: v[u] for u in wanted if u in v} == wanted for v in await views())
            before = worker_pids(supervisor)
            os.kill(min(before), signal.SIGKILL)
            async with httpx.AsyncClient(timeout=10) as plain:
                await until(lambda: len(worker_pids(supervisor) - before) == 1, "a new worker",
                            timeout=30)
                await until(lambda: router.both_up(plain), "both workers serve again", timeout=60)

            async def both_have_them() -> bool:
                seen = await views()
                return len(seen) == 2 and all(
                    {u: v.get(u) for u in wanted} == wanted for v in seen)

            await until(both_have_them, "the admin-added, drained D on both workers", timeout=15)
        # and every worker, the restarted one too, routes around the draining D
        async with httpx.AsyncClient(timeout=10) as plain:
            await spread_requests(plain, router.url, 8)
        assert d2.seen == []
    finally:
        await d2_runner.cleanup()


async def test_sigterm_lets_a_running_stream_finish_and_exits_0(router: Router, pair: Pair) -> None:
    pair.decode.behavior.tokens = 10
    pair.decode.behavior.token_delay = 0.15
    body = {**BODY, "max_tokens": 10, "stream": True}
    async with httpx.AsyncClient(base_url=router.url, timeout=10) as client:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            lines = r.aiter_lines()
            first = await anext(lines)
            router.process.send_signal(signal.SIGTERM)  # mid-stream
            rest = [line async for line in lines]
        events = [x for x in [first, *rest] if x.startswith("data: ")]
        assert len(events) == 11 and events[-1] == "data: [DONE]", events
        async with asyncio.timeout(30):
            assert await router.process.wait() == 0
        with pytest.raises(httpx.TransportError):
            await client.get("/health")


async def test_a_worker_that_cannot_start_fails_the_start(pair: Pair, tmp_path: Path) -> None:
    config = tmp_path / "router.yaml"
    # The config is valid, but the push channel's key files, read when a worker builds its
    # router, do not exist.
    config.write_text(config_text(pair, free_port(), free_port())
                      + f"push_channel: {{curve_secret_key_file: '{tmp_path / 'no.key_secret'}', "
                        f"curve_server_key_file: '{tmp_path / 'no.key'}'}}\n")
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "serve", "--config", str(config), cwd=REPO,
        stderr=asyncio.subprocess.PIPE)
    try:
        async with asyncio.timeout(60):
            _, err = await process.communicate()
        assert process.returncode == STARTUP_FAILURE
        assert b"failed to start" in err
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
