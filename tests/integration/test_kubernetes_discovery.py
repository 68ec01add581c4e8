"""Kubernetes discovery: the real client (kubernetes_asyncio) against an emulation of the
API server's pod list and watch (tests/k8s_apiserver.py), with the pods' vLLM stood in by
fake servers on distinct loopback addresses (127.0.0.2, .3, ... on one port).

Pods join when Running and Ready with an IP (IPv6 too), not before; a pod that stops
being Ready is drained (its running request finishes), after its readiness held for
drain_after, and taken back after undrain_after; a deleted pod leaves once idle, its
connection pools and metric series with it; lists come in pages; a watch that ends is
resumed from its last version or bookmark, without a list; a cut watch and a 410 Gone are
followed by a new list; an API server down at start is retried with backoff; the
namespace, selectors and token go out as the client sends them."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from proxy.config import ConfigSource, build_config, read_config_file
from proxy.flow.router import Router
from testbed.fake_vllm import Fabric, FakeVLLM, start
from tests.conftest import serve_router, until
from tests.k8s_apiserver import ApiServerEmulator

TOKEN = "emulated-service-account-token"
ADMIN = {"Authorization": "Bearer admin-token"}
PREFILL = {"app": "vllm", "pd-role": "prefill"}
DECODE = {"app": "vllm", "pd-role": "decode"}
BODY = {"model": "fake-model", "max_tokens": 2, "prompt": "hi"}


class Pods:
    """Fake vLLM servers at 127.0.0.2 (P), .3 and .4 (D), all on one port."""

    def __init__(self, port: int, prefill: FakeVLLM, decode: list[FakeVLLM]) -> None:
        self.port, self.prefill, self.decode = port, prefill, decode

    def url(self, ip: str) -> str:
        return f"http://{ip}:{self.port}"


@pytest.fixture
async def pods() -> AsyncIterator[Pods]:
    fabric = Fabric()
    prefill = FakeVLLM("prefill", engine_id="engine-p", fabric=fabric)
    decode = [FakeVLLM("decode", engine_id=f"engine-d{i}", fabric=fabric) for i in range(2)]
    async with AsyncExitStack() as stack:
        runner, url = await start(prefill, host="127.0.0.2")
        stack.push_async_callback(runner.cleanup)
        port = int(url.rsplit(":", 1)[1])
        for i, fake in enumerate(decode):
            runner, _ = await start(fake, port=port, host=f"127.0.0.{3 + i}")
            stack.push_async_callback(runner.cleanup)
        yield Pods(port, prefill, decode)


@pytest.fixture
async def apiserver() -> AsyncIterator[tuple[ApiServerEmulator, str]]:
    emulator = ApiServerEmulator(token=TOKEN)
    url = emulator.bind()
    try:
        yield emulator, url
    finally:
        await emulator.aclose()


def discovery_config(tmp_path: Path, emulator: ApiServerEmulator, url: str, port: int,
                     **settings: Any) -> dict[str, Any]:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(emulator.kubeconfig(url, "llm"))
    return {"discovery": {"kubernetes": {
        "namespace": "llm", "prefill_selector": "app=vllm,pd-role=prefill",
        "decode_selector": "app=vllm,pd-role=decode", "port": port,
        "kubeconfig": str(kubeconfig), "backoff_base": 0.05, "backoff_max": 0.4,
        "request_timeout": 5.0, "drain_after": 0, "undrain_after": 0, **settings}},
        "admin_token": "admin-token"}


def router_of(app: Any) -> Router:
    router: Router = app.state.router
    return router


def members(app: Any, cluster: str) -> dict[str, bool]:
    """URL -> draining, for the cluster's servers."""
    router = router_of(app)
    found = router.prefill if cluster == "prefill" else router.decode
    return {e.url: e.draining for e in found.endpoints}


def open_pools(router: Router) -> set[str]:
    """The servers the router's upstream client holds connection pools for."""
    return {f"{scheme}://{host}:{port}" for lane in (router.client._requests, router.client._control)
            for scheme, host, port in lane.http._pools}


async def events(client: httpx.AsyncClient, url: str, cluster: str, kind: str) -> float:
    text = (await client.get(f"{url}/metrics")).text
    found = re.search(rf'pdproxy_discovery_events_total{{cluster="{cluster}",kind="{kind}"}} (\S+)',
                      text)
    return float(found.group(1)) if found else 0.0


async def test_pods_join_when_running_and_ready_with_an_ip(
        tmp_path: Path, pods: Pods, apiserver: tuple[ApiServerEmulator, str]) -> None:
    emulator, api_url = apiserver
    await emulator.listen()
    emulator.put_pod("p-0", labels=PREFILL, ip="127.0.0.2", ready=True)
    emulator.put_pod("d-0", labels=DECODE, phase="Pending")  # no IP yet
    emulator.put_pod("other", labels={"app": "web"}, ip="127.0.0.9", ready=True)
    config = discovery_config(tmp_path, emulator, api_url, pods.port)
    async with serve_router(**config) as (url, app), httpx.AsyncClient(timeout=10) as client:
        await until(lambda: members(app, "prefill") == {pods.url("127.0.0.2"): False},
                    "the ready P pod joined")
        assert members(app, "decode") == {}
        r = await client.post(f"{url}/v1/completions", json=BODY)
        assert r.status_code == 503  # no D yet
        assert (await client.get(f"{url}/health")).status_code == 503

        # Running with an IP but not Ready: not yet. A ready pod after it on the same watch
        # shows the first was seen.
        emulator.put_pod("d-0", labels=DECODE, ip="127.0.0.3", ready=False)
        emulator.put_pod("d-1", labels=DECODE, ip="127.0.0.4", ready=True)
        await until(lambda: pods.url("127.0.0.4") in members(app, "decode"), "d-1 joined")
        assert members(app, "decode") == {pods.url("127.0.0.4"): False}

        emulator.put_pod("d-0", labels=DECODE, ip="127.0.0.3", ready=True)
        await until(lambda: len(members(app, "decode")) == 2, "d-0 joined once Ready")
        emulator.put_pod("d-1", labels=DECODE, ip="127.0.0.4", ready=False)
        await until(lambda: members(app, "decode")[pods.url("127.0.0.4")], "d-1 drained")
        r = await client.post(f"{url}/v1/completions", json=BODY)
        assert r.status_code == 200, r.text
        assert len(pods.prefill.seen) == 1 and len(pods.decode[0].seen) == 1
        assert pods.decode[1].seen == []

        admin = (await client.get(f"{url}/admin/endpoints", headers=ADMIN)).json()["endpoints"]
        assert {(e["cluster"], e["url"], e["draining"]) for e in admin} == {
            ("prefill", pods.url("127.0.0.2"), False), ("decode", pods.url("127.0.0.3"), False),
            ("decode", pods.url("127.0.0.4"), True)}
        assert await events(client, url, "decode", "joined") == 2

    # What went out, as the client sends it: the namespace in the path, each cluster's
    # selector, the kubeconfig's token, and a watch from the list's version.
    lists = emulator.lists()
    assert {r.path for r in emulator.requests} == {"/api/v1/namespaces/llm/pods"}
    assert {r.query["labelSelector"] for r in lists} == {
        "app=vllm,pd-role=prefill", "app=vllm,pd-role=decode"}
    assert {r.authorization for r in emulator.requests} == {f"Bearer {TOKEN}"}
    watches = emulator.watches()
    assert len(watches) == 2 and {w.query["labelSelector"] for w in watches} == {
        "app=vllm,pd-role=prefill", "app=vllm,pd-role=decode"}
    for watch in watches:
        # kubernetes_asyncio writes booleans as Python does; the API server takes either case
        assert watch.query["watch"].lower() == "true"
        assert watch.query["allowWatchBookmarks"].lower() == "true"
        assert watch.query["timeoutSeconds"] == "300"
        assert int(watch.query["resourceVersion"]) == 103  # the list's: 3 pods put before


async def test_a_pod_no_longer_ready_is_drained_and_its_request_finishes(
        tmp_path: Path, pods: Pods, apiserver: tuple[ApiServerEmulator, str]) -> None:
    emulator, api_url = apiserver
    await emulator.listen()
    emulator.put_pod("p-0", labels=PREFILL, ip="127.0.0.2", ready=True)
    emulator.put_pod("d-0", labels=DECODE, ip="127.0.0.3", ready=True)
    d0, d1 = pods.decode
    d0.behavior.tokens, d0.behavior.token_delay = 8, 0.25  # a stream of about 2 s
    config = discovery_config(tmp_path, emulator, api_url, pods.port)
    async with serve_router(**config) as (url, app), httpx.AsyncClient(timeout=10) as client:
        await until(lambda: len(members(app, "decode")) == 1, "d-0 joined")
        await until(lambda: len(members(app, "prefill")) == 1, "p-0 joined")

        async def stream() -> tuple[int, str]:
            body = {**BODY, "max_tokens": 8, "stream": True}
            async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                return r.status_code, (await r.aread()).decode()

        running = asyncio.create_task(stream())
        try:
            await d0.until(lambda seen: len(seen) == 1)
            emulator.put_pod("d-1", labels=DECODE, ip="127.0.0.4", ready=True)
            emulator.put_pod("d-0", labels=DECODE, ip="127.0.0.3", ready=False)
            await until(lambda: members(app, "decode") == {
                pods.url("127.0.0.3"): True, pods.url("127.0.0.4"): False}, "d-0 drained")
            assert d0.seen[0].outcome == "running"  # drained while its request ran
            r = await client.post(f"{url}/v1/completions", json=BODY)
            assert r.status_code == 200 and len(d1.seen) == 1 and len(d0.seen) == 1
            status, text = await asyncio.wait_for(running, 10)
        finally:
            running.cancel()
        assert status == 200 and text.rstrip().endswith("data: [DONE]")
        assert d0.seen[0].outcome == "ok"
        assert await events(client, url, "decode", "drained") == 1

        emulator.put_pod("d-0", labels=DECODE, ip="127.0.0.3", ready=True)
        await until(lambda: members(app, "decode")[pods.url("127.0.0.3")] is False,
                    "d-0 takes requests again once Ready")
        assert await events(client, url, "decode", "undrained") == 1

        # Removed by an admin call, a pod comes back at its next change.
        r = await client.delete(f"{url}/admin/endpoints", headers=ADMIN,
                                params={"cluster": "decode", "url": pods.url("127.0.0.4")})
        assert r.status_code == 200 and pods.url("127.0.0.4") not in members(app, "decode")
        emulator.put_pod("d-1", labels={**DECODE, "zone": "b"}, ip="127.0.0.4", ready=True)
        await until(lambda: members(app, "decode").get(pods.url("127.0.0.4")) is False,
                    "d-1 back after its next change")


async def test_a_deleted_pod_leaves_once_its_requests_finish(
        tmp_path: Path, pods: Pods, apiserver: tuple[ApiServerEmulator, str]) -> None:
    emulator, api_url = apiserver
    await emulator.listen()
    emulator.put_pod("p-0", labels=PREFILL, ip="127.0.0.2", ready=True)
    emulator.put_pod("d-0", labels=DECODE, ip="127.0.0.3", ready=True)
    d0 = pods.decode[0]
    d0.behavior.delay = 1.5  # D's answer takes that long
    config = discovery_config(tmp_path, emulator, api_url, pods.port)
    async with serve_router(**config) as (url, app), httpx.AsyncClient(timeout=10) as client:
        await until(lambda: len(members(app, "decode")) == 1 and len(members(app, "prefill")) == 1,
                    "the pods joined")
        running = asyncio.create_task(client.post(f"{url}/v1/completions", json=BODY))
        try:
            await d0.until(lambda seen: len(seen) == 1)
            assert pods.url("127.0.0.3") in open_pools(router_of(app))
            emulator.put_pod("d-1", labels=DECODE, ip="127.0.0.4", ready=True)
            emulator.delete_pod("d-0")
            await until(lambda: members(app, "decode").get(pods.url("127.0.0.3")) is True,
                        "d-0 drained at once")
            assert d0.seen[0].outcome == "running"
            r = await asyncio.wait_for(running, 10)
        finally:
            running.cancel()
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        await until(lambda: members(app, "decode") == {pods.url("127.0.0.4"): False},
                    "d-0 removed once its request finished")

        # What the router kept for d-0 went with it: its connection pool.
        await until(lambda: pods.url("127.0.0.3") not in open_pools(router_of(app)),
                    "d-0's pool dropped")
        assert pods.url("127.0.0.2") in open_pools(router_of(app))  # p-0 stays

        # The last P leaves too: the cluster is empty, and the router says so.
        emulator.delete_pod("p-0")
        await until(lambda: members(app, "prefill") == {}, "p-0 removed")
        assert (await client.post(f"{url}/v1/completions", json=BODY)).status_code == 503
        assert (await client.get(f"{url}/health")).status_code == 503
        assert await events(client, url, "decode", "left") == 1


async def test_a_watch_that_is_cut_is_followed_by_a_new_list(
        tmp_path: Path, pods: Pods, apiserver: tuple[ApiServerEmulator, str]) -> None:
    emulator, api_url = apiserver
    await emulator.listen()
    emulator.put_pod("p-0", labels=PREFILL, ip="127.0.0.2", ready=True)
    emulator.put_pod("d-0", labels=DECODE, ip="127.0.0.3", ready=True)
    config = discovery_config(tmp_path, emulator, api_url, pods.port)
    async with serve_router(**config) as (url, app), httpx.AsyncClient(timeout=10) as client:
        await until(lambda: emulator.open_watches == 2, "both clusters watch")
        # Changes no watch hears of: only a new list can show them.
        emulator.put_pod("d-1", labels=DECODE, ip="127.0.0.4", ready=True, notify=False)
        emulator.delete_pod("p-0", notify=False)
        lists = len(emulator.lists())
        emulator.drop_watches(clean=False)
        await until(lambda: members(app, "decode") == {
            pods.url("127.0.0.3"): False, pods.url("127.0.0.4"): False}, "d-1 found by a list")
        await until(lambda: members(app, "prefill") == {}, "p-0's absence found by a list")
        assert len(emulator.lists()) >= lists + 2
        assert await events(client, url, "decode", "watch_error") >= 1
        await until(lambda: emulator.open_watches == 2, "watching again")


async def test_a_watch_that_ends_is_resumed_from_its_last_version_or_bookmark(
        tmp_path: Path, pods: Pods, apiserver: tuple[ApiServerEmulator, str]) -> None:
    emulator, api_url = apiserver
    await emulator.listen()
    emulator.put_pod("p-0", labels=PREFILL, ip="127.0.0.2", ready=True)
    emulator.put_pod("d-0", labels=DECODE, ip="127.0.0.3", ready=True)
    config = discovery_config(tmp_path, emulator, api_url, pods.port)
    async with serve_router(**config) as (url, app), httpx.AsyncClient(timeout=10) as client:
        await until(lambda: emulator.open_watches == 2, "both clusters watch")
        lists, watches = len(emulator.lists()), len(emulator.watches())
        # An event on the decode watch, then pods neither selector matches: the versions
        # move on, and only a bookmark tells the watches.
        emulator.put_pod("d-1", labels=DECODE, ip="127.0.0.4", ready=True)
        await until(lambda: len(members(app, "decode")) == 2, "d-1 joined")
        d1_version = emulator.version
        for i in range(3):
            emulator.put_pod(f"web-{i}", labels={"app": "web"}, ip="127.0.0.9", ready=True)
        emulator.bookmark()
        bookmarked = emulator.version
        emulator.expire(notify=False)  # history compacted: older versions get 410
        emulator.drop_watches(clean=True)  # as the API server does after timeoutSeconds

        await until(lambda: len(emulator.watches()) == watches + 2, "watching again")
        await until(lambda: emulator.open_watches == 2, "both watches open")
        resumed = emulator.watches()[watches:]
        assert {int(w.query["resourceVersion"]) for w in resumed} == {bookmarked}
        assert bookmarked > d1_version
        assert len(emulator.lists()) == lists, "a watch that ended made a new list"
        for cluster in ("prefill", "decode"):
            assert await events(client, url, cluster, "gone") == 0
            assert await events(client, url, cluster, "watch_closed") == 1
        # and the resumed watches hear what comes next
        emulator.delete_pod("d-0")
        await until(lambda: members(app, "decode") == {pods.url("127.0.0.4"): False},
                    "d-0 left, heard on the resumed watch")
        assert len(emulator.lists()) == lists


async def test_lists_come_in_pages(
        tmp_path: Path, pods: Pods, apiserver: tuple[ApiServerEmulator, str]) -> None:
    emulator, api_url = apiserver
    await emulator.listen()
    emulator.put_pod("p-0", labels=PREFILL, ip="127.0.0.2", ready=True)
    ips = [f"127.0.0.{3 + i}" for i in range(5)]  # 5 D pods; the first two answer
    for i, ip in enumerate(ips):
        emulator.put_pod(f"d-{i}", labels=DECODE, ip=ip, ready=True)
    emulator.expire_pages = 1  # the first next-page token is too old: the list starts over
    config = discovery_config(tmp_path, emulator, api_url, pods.port, list_page_size=2)
    async with serve_router(**config) as (url, app), httpx.AsyncClient(timeout=10) as client:
        await until(lambda: set(members(app, "decode")) == {pods.url(ip) for ip in ips},
                    "all five D pods joined")
        assert await events(client, url, "decode", "list") == 1
        assert await events(client, url, "decode", "list_error") == 1
        await until(lambda: emulator.open_watches == 2, "both clusters watch")
    decode = [r for r in emulator.lists() if r.query["labelSelector"] == "app=vllm,pd-role=decode"]
    assert all(r.query["limit"] == "2" for r in decode)
    # first page, a 410 on the second; then the whole list again: 3 pages
    assert ["continue" in r.query for r in decode] == [False, True, False, True, True]
    watch = next(w for w in emulator.watches()
                 if w.query["labelSelector"] == "app=vllm,pd-role=decode")
    assert int(watch.query["resourceVersion"]) == 106  # the first page's version


async def test_readiness_has_hysteresis(
        tmp_path: Path, pods: Pods, apiserver: tuple[ApiServerEmulator, str]) -> None:
    emulator, api_url = apiserver
    await emulator.listen()
    emulator.put_pod("p-0", labels=PREFILL, ip="127.0.0.2", ready=True)
    emulator.put_pod("d-0", labels=DECODE, ip="127.0.0.3", ready=True)
    config = discovery_config(tmp_path, emulator, api_url, pods.port,
                              drain_after=1.0, undrain_after=1.5)
    d0 = pods.url("127.0.0.3")
    async with serve_router(**config) as (url, app), httpx.AsyncClient(timeout=10) as client:
        await until(lambda: members(app, "decode") == {d0: False}, "d-0 joined")
        # A flap shorter than drain_after drains nothing.
        emulator.put_pod("d-0", labels=DECODE, ip="127.0.0.3", ready=False)
        emulator.put_pod("d-0", labels=DECODE, ip="127.0.0.3", ready=True)
        emulator.put_pod("web", labels={"app": "web"})  # seen by no watch: a marker
        await until(lambda: emulator.open_watches == 2, "watching")
        await asyncio.sleep(1.5)  # longer than drain_after: time is what is tested here
        assert members(app, "decode") == {d0: False}
        assert await events(client, url, "decode", "drained") == 0
        # Not Ready for drain_after: drained, not before.
        emulator.put_pod("d-0", labels=DECODE, ip="127.0.0.3", ready=False)
        unready_at = time.monotonic()
        await until(lambda: members(app, "decode") == {d0: True}, "d-0 drained")
        assert time.monotonic() - unready_at >= 1.0
        # Ready for undrain_after: taken back, not before.
        emulator.put_pod("d-0", labels=DECODE, ip="127.0.0.3", ready=True)
        ready_at = time.monotonic()
        await until(lambda: members(app, "decode") == {d0: False}, "d-0 taken back")
        assert time.monotonic() - ready_at >= 1.5
        assert await events(client, url, "decode", "drained") == 1
        assert await events(client, url, "decode", "undrained") == 1
        # Deleted: at once, whatever the hysteresis.
        emulator.delete_pod("d-0")
        await until(lambda: members(app, "decode") == {}, "d-0 left", timeout=1.0)


async def test_an_ipv6_pod_is_reached_at_its_bracketed_address(
        tmp_path: Path, apiserver: tuple[ApiServerEmulator, str]) -> None:
    emulator, api_url = apiserver
    await emulator.listen()
    fabric = Fabric()
    prefill = FakeVLLM("prefill", engine_id="engine-p", fabric=fabric)
    decode = FakeVLLM("decode", engine_id="engine-d", fabric=fabric)
    async with AsyncExitStack() as stack:
        runner, p_url = await start(prefill, host="::1")
        stack.push_async_callback(runner.cleanup)
        port = int(p_url.rsplit(":", 1)[1])
        runner, _ = await start(decode, host="127.0.0.3", port=port)
        stack.push_async_callback(runner.cleanup)
        emulator.put_pod("p-0", labels=PREFILL, ip="::1", ready=True)
        emulator.put_pod("d-0", labels=DECODE, ip="127.0.0.3", ready=True)
        config = discovery_config(tmp_path, emulator, api_url, port)
        async with serve_router(**config) as (url, app), httpx.AsyncClient(timeout=10) as client:
            await until(lambda: members(app, "prefill") == {f"http://[::1]:{port}": False},
                        "the IPv6 P joined")
            r = await client.post(f"{url}/v1/completions", json=BODY)
            assert r.status_code == 200, r.text
        assert [seen.headers["host"] for seen in prefill.seen] == [f"[::1]:{port}"]


async def test_410_gone_is_followed_by_a_new_list(
        tmp_path: Path, pods: Pods, apiserver: tuple[ApiServerEmulator, str]) -> None:
    emulator, api_url = apiserver
    await emulator.listen()
    emulator.put_pod("p-0", labels=PREFILL, ip="127.0.0.2", ready=True)
    config = discovery_config(tmp_path, emulator, api_url, pods.port)
    async with serve_router(**config) as (url, app), httpx.AsyncClient(timeout=10) as client:
        await until(lambda: emulator.open_watches == 2, "both clusters watch")
        emulator.put_pod("d-0", labels=DECODE, ip="127.0.0.3", ready=True, notify=False)
        emulator.expire()
        await until(lambda: pods.url("127.0.0.3") in members(app, "decode"),
                    "d-0 found by the list after 410")
        assert await events(client, url, "decode", "gone") == 1
        assert await events(client, url, "prefill", "gone") == 1
        # The new watches start from the new list's version, which is not expired.
        await until(lambda: emulator.open_watches == 2, "watching again")
        for watch in emulator.watches()[2:]:
            assert int(watch.query["resourceVersion"]) >= emulator.expired_before


async def test_an_api_server_down_at_start_is_retried_with_backoff(
        tmp_path: Path, pods: Pods, apiserver: tuple[ApiServerEmulator, str]) -> None:
    emulator, api_url = apiserver  # bound, not listening: connections are refused
    emulator.put_pod("p-0", labels=PREFILL, ip="127.0.0.2", ready=True)
    emulator.put_pod("d-0", labels=DECODE, ip="127.0.0.3", ready=True)
    config = discovery_config(tmp_path, emulator, api_url, pods.port,
                              backoff_base=0.1, backoff_max=0.8)
    async with serve_router(**config) as (url, app), httpx.AsyncClient(timeout=10) as client:
        for cluster in ("prefill", "decode"):
            async def retried(c: str = cluster) -> bool:
                return await events(client, url, c, "list_error") > 1

            await until(retried, f"{cluster} lists refused and retried")
        assert members(app, "decode") == {}
        # Up, but answering 500 to three lists: the waits between them double.
        emulator.fail_lists = 3
        await emulator.listen()
        await until(lambda: members(app, "decode") == {pods.url("127.0.0.3"): False}
                    and len(members(app, "prefill")) == 1, "joined once the server answers",
                    timeout=10)
        assert (await client.post(f"{url}/v1/completions", json=BODY)).status_code == 200
    # The refused lists are unseen here; then three 500s among both clusters, then one good
    # list each. Waits of 0.1, 0.2, 0.4, 0.8, 0.8 s: after two refused lists, the gaps
    # between one cluster's seen lists are at least 0.4 s and do not shrink (sleeps never
    # end early; 50 ms of slack for the machine).
    all_gaps = []
    for selector in ("app=vllm,pd-role=prefill", "app=vllm,pd-role=decode"):
        times = [r.at for r in emulator.lists() if r.query["labelSelector"] == selector]
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        assert all(later >= earlier - 0.05 for earlier, later in zip(gaps, gaps[1:], strict=False)), gaps
        assert all(gap >= 0.4 for gap in gaps), gaps
        all_gaps += gaps
    assert len(all_gaps) >= 3 and max(all_gaps) >= 0.8, all_gaps  # it doubled


async def test_a_watched_config_file_leaves_discovered_servers_alone(
        tmp_path: Path, pods: Pods, apiserver: tuple[ApiServerEmulator, str]) -> None:
    emulator, api_url = apiserver
    await emulator.listen()
    emulator.put_pod("d-0", labels=DECODE, ip="127.0.0.3", ready=True)
    values = {**discovery_config(tmp_path, emulator, api_url, pods.port),
              "prefill": [pods.url("127.0.0.2")], "config_watch_interval": 0.05,
              "health": {"interval": 0}}
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(values))
    source = ConfigSource(path, lambda: build_config(read_config_file(path), {}))
    async with serve_router(source) as (_, app):
        await until(lambda: members(app, "decode") == {pods.url("127.0.0.3"): False}, "d-0 joined")
        path.write_text(yaml.safe_dump({**values, "decode": [pods.url("127.0.0.4")]}))
        await until(lambda: pods.url("127.0.0.4") in members(app, "decode"), "the file applied")
        assert pods.url("127.0.0.3") in members(app, "decode")  # still there
        assert members(app, "prefill") == {pods.url("127.0.0.2"): False}


# --- configuration ------------------------------------------------------------------

KUBERNETES = {"namespace": "llm", "prefill_selector": "app=vllm,pd-role=prefill",
              "decode_selector": "app=vllm,pd-role=decode"}


def test_with_discovery_the_static_lists_may_be_empty() -> None:
    config = build_config({"discovery": {"kubernetes": KUBERNETES}}, {})
    assert config.prefill == [] and config.decode == []
    assert config.discovery.kubernetes is not None and config.discovery.kubernetes.port == 8000
    with pytest.raises(ValueError, match="at least one prefill endpoint"):
        build_config({}, {})


@pytest.mark.parametrize(("change", "message"), [
    ({"prefill_selector": " "}, "prefill_selector must be a non-empty"),
    ({"decode_selector": ""}, "decode_selector must be a non-empty"),
    ({"decode_selector": "app=vllm,pd-role=prefill"}, "are the same"),
    ({"port": 0}, "port out of range"),
    ({"port": 65536}, "port out of range"),
    ({"namespace": "LLM_Pods"}, "not a namespace name"),
    ({"backoff_base": 5, "backoff_max": 1}, "backoff_base <= backoff_max"),
    ({"watch_timeout": 0}, "watch_timeout >= 1"),
    ({"list_page_size": -1}, "list_page_size must be >= 0"),
    ({"drain_after": -1}, "drain_after >= 0 and undrain_after >= 0"),
    ({"selector": "x"}, "unknown field"),
], ids=["prefill", "decode", "same", "port0", "port-high", "namespace", "backoff", "watch",
        "page", "hysteresis", "unknown"])
def test_discovery_settings_are_checked(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_config({"discovery": {"kubernetes": {**KUBERNETES, **change}}}, {})


def test_without_the_client_library_the_error_names_the_extra(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "kubernetes_asyncio" else real(name, *a))
    with pytest.raises(ValueError, match=re.escape("pip install 'pd-proxy[kubernetes]'")):
        build_config({"discovery": {"kubernetes": KUBERNETES}}, {})


async def test_a_missing_kubeconfig_fails_the_start(tmp_path: Path) -> None:
    config = build_config({"discovery": {"kubernetes": {
        **KUBERNETES, "kubeconfig": str(tmp_path / "absent")}}}, {})
    router = Router(config)
    try:
        with pytest.raises(ValueError, match="cannot reach Kubernetes with"):
            await router.start()
    finally:
        await router.aclose()
