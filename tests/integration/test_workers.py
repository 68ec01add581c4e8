"""`pd-proxy serve --workers 2`: the real command line, two worker processes on one port,
in front of fake P and D servers in this process.

- requests are served by both workers (each counts its own, under its `worker` label);
- /metrics is one valid exposition with both workers' samples;
- an admin add and drain, and a change of the watched config file, reach both workers;
  concurrent admin calls apply in one order; admin changes outlive every worker;
- a killed worker is started again after a backoff, and the router keeps serving; one
  that keeps dying makes the router exit 4; a stuck one is killed and started again;
- SIGHUP reads the config file again; SIGTERM lets a running stream finish, and the
  router exits 0, its socket folder gone;
- a worker that cannot start makes the router exit with uvicorn's STARTUP_FAILURE (3).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from scripts.benchkit import ProcessGauge
from testbed.fake_vllm import FakeVLLM, start
from testbed.ports import free_port
from tests.conftest import until
from tests.integration.conftest import Pair

REPO = Path(__file__).resolve().parents[2]
TOKEN = "w0rkers"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BODY = {"model": "fake-model", "prompt": "hi", "max_tokens": 2}
STARTUP_FAILURE = 3
CRASH_LOOP = 4


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


def worker_pids_alive(pids: set[int]) -> set[int]:
    """Those of `pids` still running (not gone, not a zombie)."""
    alive = set()
    for pid in pids:
        with contextlib.suppress(FileNotFoundError):
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                alive.add(pid)
    return alive


class Router:
    def __init__(self, process: asyncio.subprocess.Process, port: int, admin_port: int,
                 config: Path, runtime: Path) -> None:
        self.process = process
        self.port = port
        self.admin_port = admin_port
        self.url = f"http://127.0.0.1:{port}"
        self.admin_url = f"http://127.0.0.1:{admin_port}"  # admin_listen: every worker serves it
        self.config = config
        self.runtime = runtime  # where the supervisor makes its socket folder

    def folders(self) -> list[Path]:
        return list(self.runtime.glob("pd-proxy-*"))

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


def config_text(pair: Pair, port: int, admin_port: int, prefill: list[str] | None = None,
                extra: str = "") -> str:
    prefill = prefill or [pair.p_url]
    return (f"prefill: [{', '.join(prefill)}]\ndecode: [{pair.d_url}]\nport: {port}\n"
            f"workers: 2\nadmin_token: {TOKEN}\nadmin_listen: 127.0.0.1:{admin_port}\n"
            "config_watch_interval: 0.1\nhealth: {interval: 0}\nlog_level: warning\n" + extra)


@pytest.fixture
def runtime() -> Iterator[Path]:
    """A short folder for the supervisor's (unix socket paths are limited to ~100 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="pdw-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@contextlib.asynccontextmanager
async def started(pair: Pair, tmp_path: Path, runtime: Path, extra: str = ""
                  ) -> AsyncIterator[Router]:
    """`pd-proxy serve --config` with 2 workers, once both serve; killed at the end."""
    port, admin_port = free_port(), free_port()
    config = tmp_path / "router.yaml"
    config.write_text(config_text(pair, port, admin_port, extra=extra))
    environment = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "serve", "--config", str(config), cwd=REPO,
        env={**environment, "TMPDIR": str(runtime)})
    running = Router(process, port, admin_port, config, runtime)
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            await until(lambda: running.both_up(client), "both workers serve", timeout=60)
        yield running
    finally:
        if process.returncode is None:
            for pid in worker_pids(process.pid):  # a stopped one would outlive us
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            process.kill()
            await process.wait()


@pytest.fixture
async def router(pair: Pair, tmp_path: Path, runtime: Path) -> AsyncIterator[Router]:
    async with started(pair, tmp_path, runtime) as running:
        yield running


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


async def new_worker(router: Router, before: set[int]) -> tuple[int, float]:
    """Wait for a worker not in `before`; its pid and when it was seen."""
    await until(lambda: worker_pids(router.process.pid) - before, "a new worker", timeout=30)
    return (worker_pids(router.process.pid) - before).pop(), time.monotonic()


async def test_a_worker_that_keeps_dying_is_restarted_later_each_time_then_the_router_stops(
        pair: Pair, tmp_path: Path, runtime: Path) -> None:
    extra = "supervisor: {restart_backoff: 1.0, max_restarts: 2, restart_window: 120}\n"
    async with started(pair, tmp_path, runtime, extra) as router, \
            httpx.AsyncClient(timeout=10) as client:
        assert len(router.folders()) == 1
        pids = worker_pids(router.process.pid)
        victim = min(pids)
        for backoff in (1.0, 2.0):  # doubled at its second exit within the window
            os.kill(victim, signal.SIGKILL)
            killed_at = time.monotonic()
            victim, seen_at = await new_worker(router, pids)
            pids.add(victim)
            assert seen_at - killed_at >= backoff - 0.1, "started again without a backoff"
            await until(lambda: router.both_up(client), "both workers serve again", timeout=60)
        os.kill(victim, signal.SIGKILL)  # a third exit: more than max_restarts (2)
        async with asyncio.timeout(30):
            assert await router.process.wait() == CRASH_LOOP
        assert router.folders() == []
        assert not worker_pids_alive(pids)


async def test_a_stuck_worker_is_killed_and_started_again(
        pair: Pair, tmp_path: Path, runtime: Path) -> None:
    extra = "supervisor: {heartbeat_interval: 0.2, heartbeat_timeout: 1.5}\n"
    async with started(pair, tmp_path, runtime, extra) as router, \
            httpx.AsyncClient(timeout=10) as client:
        before = worker_pids(router.process.pid)
        victim = min(before)
        os.kill(victim, signal.SIGSTOP)  # alive, but answers nothing
        try:
            await new_worker(router, before)
            assert victim not in worker_pids(router.process.pid)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
        await until(lambda: router.both_up(client), "both workers serve again", timeout=60)
        answer = (await client.get(f"{router.admin_url}/admin/endpoints", headers=AUTH)).json()
        assert [view["worker"] for view in answer["workers"]] == [0, 1]
        assert all("error" not in view for view in answer["workers"]), answer
        assert router.process.returncode is None


async def test_admin_changes_outlive_every_worker(router: Router, pair: Pair) -> None:
    d2 = FakeVLLM("decode", engine_id="engine-d1")
    d2_runner, d2_url = await start(d2)
    try:
        async with httpx.AsyncClient(base_url=router.admin_url, headers=AUTH, timeout=10) as client:
            added = await client.post("/admin/endpoints", json={"cluster": "decode", "url": d2_url})
            assert added.status_code == 201, added.text
            drained = await client.post("/admin/endpoints/drain",
                                        json={"cluster": "decode", "url": pair.d_url})
            assert drained.status_code == 200, drained.text
            before = worker_pids(router.process.pid)
            for pid in before:  # every worker dies at once
                os.kill(pid, signal.SIGKILL)
            async with httpx.AsyncClient(timeout=10) as plain:
                await until(lambda: not worker_pids(router.process.pid) & before
                            and len(worker_pids(router.process.pid)) == 2, "two new workers",
                            timeout=30)
                await until(lambda: router.both_up(plain), "both workers serve again", timeout=60)
            answer = (await client.get("/admin/endpoints")).json()
            wanted = {pair.d_url: True, d2_url: False}
            for view in answer["workers"]:
                assert {e["url"]: e["draining"] for e in view["endpoints"]
                        if e["cluster"] == "decode"} == wanted, view
        async with httpx.AsyncClient(timeout=10) as plain:  # each worker routes to d2 only
            await spread_requests(plain, router.url, 6)
        assert len(d2.seen) == 6
    finally:
        await d2_runner.cleanup()


async def test_concurrent_admin_calls_apply_in_one_order_on_both_workers(router: Router) -> None:
    async with httpx.AsyncClient(base_url=router.admin_url, headers=AUTH, timeout=10) as client:
        for round in range(6):
            url = f"http://127.0.0.1:{9100 + round}"
            # Each on a new connection, so either worker may take it: one adds the server,
            # the others find it there (409), on whichever worker they reach.
            answers = await asyncio.gather(*(
                client.post("/admin/endpoints", json={"cluster": "decode", "url": url},
                            headers={"Connection": "close"}) for _ in range(8)))
            statuses = sorted(a.status_code for a in answers)
            assert statuses == [201] + [409] * 7, [a.text for a in answers]
        views = (await client.get("/admin/endpoints")).json()["workers"]
        urls = [{e["url"] for e in view["endpoints"]} for view in views]
        assert len(urls) == 2 and urls[0] == urls[1] and len(urls[0]) == 2 + 6


async def test_sighup_reads_the_config_file_again_and_sigterm_leaves_no_folder(
        pair: Pair, tmp_path: Path, runtime: Path) -> None:
    p2 = FakeVLLM("prefill", engine_id="engine-p1", side_channel_port=5602)
    p2_runner, p2_url = await start(p2)
    try:
        # Not watched: only SIGHUP reads it again.
        async with started(pair, tmp_path, runtime, "config_watch_interval: 0\n") as router, \
                httpx.AsyncClient(base_url=router.admin_url, headers=AUTH, timeout=10) as client:
            [folder] = router.folders()
            assert {p.name for p in folder.iterdir()} >= {"worker-0.sock", "worker-1.sock"}
            router.config.write_text(config_text(
                pair, router.port, router.admin_port, prefill=[pair.p_url, p2_url],
                extra="config_watch_interval: 0\n"))
            router.process.send_signal(signal.SIGHUP)

            async def both_have_p2() -> bool:
                views = (await client.get("/admin/endpoints")).json()["workers"]
                return len(views) == 2 and all(
                    p2_url in {e["url"] for e in view.get("endpoints", [])} for view in views)

            await until(both_have_p2, "the new P on both workers", timeout=15)
            assert router.process.returncode is None
            router.process.send_signal(signal.SIGTERM)
            async with asyncio.timeout(30):
                assert await router.process.wait() == 0
            assert router.folders() == []
    finally:
        await p2_runner.cleanup()


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
    assert router.folders() == []


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
