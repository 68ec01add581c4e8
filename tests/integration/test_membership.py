"""Live membership against emulated pools: the admin API (token, add, drain, remove, its
errors), changes under load losing no request, and the watched config file (a good
change applied, a bad file refused with the running config kept)."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.config import ConfigSource, build_config, read_config_file
from testbed.fake_vllm import Fabric, FakeVLLM, start
from testbed.ports import free_port
from tests.conftest import serve_router, until
from tests.integration.test_workers import REPO

TOKEN = "s3cret-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BODY = {"model": "fake-model", "max_tokens": 2, "prompt": "hi"}


class Fakes:
    def __init__(self, prefill: FakeVLLM, decode: list[FakeVLLM], p_url: str, d_urls: list[str]) -> None:
        self.prefill, self.decode, self.p_url, self.d_urls = prefill, decode, p_url, d_urls


@pytest.fixture
async def fakes() -> AsyncIterator[Fakes]:
    fabric = Fabric()
    prefill = FakeVLLM("prefill", fabric=fabric)
    decode = [FakeVLLM("decode", engine_id=f"engine-d{i}", fabric=fabric) for i in range(3)]
    async with AsyncExitStack() as stack:
        urls = []
        for fake in [prefill, *decode]:
            runner, url = await start(fake)
            stack.push_async_callback(runner.cleanup)
            urls.append(url)
        yield Fakes(prefill, decode, urls[0], urls[1:])


async def complete(client: httpx.AsyncClient, url: str, n: int) -> list[int]:
    return [(await client.post(f"{url}/v1/completions", json=BODY)).status_code for _ in range(n)]


async def test_the_admin_api_needs_its_token(fakes: Fakes) -> None:
    async with serve_router(prefill=[fakes.p_url], decode=fakes.d_urls[:1], admin_token=TOKEN) as (url, _), \
            httpx.AsyncClient(timeout=10) as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            r = await client.get(f"{url}/admin/endpoints", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = await client.get(f"{url}/admin/endpoints", headers=AUTH)
        assert r.status_code == 200
        assert [(e["cluster"], e["url"]) for e in r.json()["endpoints"]] == [
            ("prefill", fakes.p_url), ("decode", fakes.d_urls[0])]
    async with serve_router(prefill=[fakes.p_url], decode=fakes.d_urls[:1]) as (url, _), \
            httpx.AsyncClient(timeout=10) as client:
        assert (await client.get(f"{url}/admin/endpoints", headers=AUTH)).status_code == 404


async def test_add_drain_and_remove_a_server(fakes: Fakes) -> None:
    d0, d1 = fakes.d_urls[:2]
    async with serve_router(prefill=[fakes.p_url], decode=[d0], admin_token=TOKEN) as (url, _), \
            httpx.AsyncClient(timeout=10) as client:
        r = await client.post(f"{url}/admin/endpoints", headers=AUTH, json={"cluster": "decode", "url": d1})
        assert r.status_code == 201, r.text
        assert await complete(client, url, 6) == [200] * 6
        assert len(fakes.decode[1].seen) == 3, "the new D took its share"

        r = await client.post(f"{url}/admin/endpoints/drain", headers=AUTH,
                              json={"cluster": "decode", "url": d0})
        assert r.json() == {"url": d0, "draining": True, "in_flight": 0}
        before = len(fakes.decode[0].seen)
        assert await complete(client, url, 4) == [200] * 4
        assert len(fakes.decode[0].seen) == before, "a draining D takes no new request"

        r = await client.delete(f"{url}/admin/endpoints", headers=AUTH, params={"cluster": "decode", "url": d0})
        assert r.status_code == 200
        listed = (await client.get(f"{url}/admin/endpoints", headers=AUTH)).json()["endpoints"]
        assert [e["url"] for e in listed if e["cluster"] == "decode"] == [d1]


@pytest.mark.parametrize(("method", "path", "kwargs", "status"), [
    ("POST", "/admin/endpoints", {"json": {"cluster": "decode", "url": "ftp://x"}}, 400),
    ("POST", "/admin/endpoints", {"json": {"cluster": "middle", "url": "http://x:1"}}, 400),
    ("POST", "/admin/endpoints", {"content": b"not json"}, 400),
    ("POST", "/admin/endpoints", {"json": {"cluster": "decode", "url": "DUP"}}, 409),
    ("DELETE", "/admin/endpoints", {"params": {"cluster": "decode", "url": "DUP"}}, 409),
    ("DELETE", "/admin/endpoints", {"params": {"cluster": "decode", "url": "http://nope:1"}}, 404),
    ("POST", "/admin/endpoints/drain", {"json": {"cluster": "decode", "url": "DUP", "draining": "yes"}}, 400),
])
async def test_admin_errors_are_openai_shaped(fakes: Fakes, method: str, path: str,
                                              kwargs: dict[str, Any], status: int) -> None:
    d0 = fakes.d_urls[0]
    for key in ("json", "params"):
        value = kwargs.get(key)
        if isinstance(value, dict):
            kwargs[key] = {k: (d0 if v == "DUP" else v) for k, v in value.items()}
    async with serve_router(prefill=[fakes.p_url], decode=[d0], admin_token=TOKEN) as (url, _), \
            httpx.AsyncClient(timeout=10) as client:
        r = await client.request(method, url + path, headers=AUTH, **kwargs)
        assert r.status_code == status, r.text
        assert isinstance(r.json()["error"]["message"], str)


async def test_an_admin_call_reads_only_the_variables_set_aside_for_it(
    fakes: Fakes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An api_key of "env:NAME" would send the router's variable NAME to any URL: only
    names under admin_secret_env_prefix are read, and a refused name, an unset one and
    an empty one get the same answer, so it tells nothing of the environment."""
    d0, d1 = fakes.d_urls[:2]
    monkeypatch.setenv("ROUTER_TEST_SECRET", "not-for-the-admin")
    monkeypatch.setenv("PDPROXY_ENDPOINT_KEY_EMPTY", " ")
    monkeypatch.delenv("PDPROXY_ENDPOINT_KEY_UNSET", raising=False)
    monkeypatch.setenv("PDPROXY_ENDPOINT_KEY_D1", "d1-key")
    fakes.decode[1].api_key = "d1-key"
    async with serve_router(prefill=[fakes.p_url], decode=[d0], admin_token=TOKEN) as (url, _), \
            httpx.AsyncClient(timeout=10) as client:
        refusals = []
        for name in ("ROUTER_TEST_SECRET", "ROUTER_TEST_UNSET_TOO", "PDPROXY_ENDPOINT_KEY_UNSET",
                     "PDPROXY_ENDPOINT_KEY_EMPTY"):
            r = await client.post(f"{url}/admin/endpoints", headers=AUTH,
                                  json={"cluster": "decode", "url": d1, "api_key": f"env:{name}"})
            assert r.status_code == 400, r.text
            refusals.append(r.json()["error"])
        assert all(refusal == refusals[0] for refusal in refusals), refusals
        assert refusals[0]["param"] == "api_key"
        assert "PDPROXY_ENDPOINT_KEY_" in refusals[0]["message"]

        r = await client.post(f"{url}/admin/endpoints", headers=AUTH,
                              json={"cluster": "decode", "url": d1,
                                    "api_key": "env:PDPROXY_ENDPOINT_KEY_D1"})
        assert r.status_code == 201, r.text
        await client.post(f"{url}/admin/endpoints/drain", headers=AUTH,
                          json={"cluster": "decode", "url": d0})
        assert await complete(client, url, 1) == [200]
    assert fakes.decode[1].seen[0].headers["authorization"] == "Bearer d1-key"


@pytest.mark.parametrize("inherit", [False, True])
async def test_an_admin_added_server_gets_the_cluster_key_only_when_the_config_says(
    fakes: Fakes, inherit: bool
) -> None:
    d0, d1 = fakes.d_urls[:2]
    async with serve_router(prefill=[fakes.p_url], decode=[d0], admin_token=TOKEN,
                            auth={"decode_api_key": "cluster-d-key"},
                            admin_inherit_cluster_key=inherit) as (url, _), \
            httpx.AsyncClient(timeout=10) as client:
        r = await client.post(f"{url}/admin/endpoints", headers=AUTH,
                              json={"cluster": "decode", "url": d1})
        assert r.status_code == 201, r.text
        await client.post(f"{url}/admin/endpoints/drain", headers=AUTH,
                          json={"cluster": "decode", "url": d0})
        assert await complete(client, url, 1) == [200]
    sent = fakes.decode[1].seen[0].headers.get("authorization")
    assert sent == ("Bearer cluster-d-key" if inherit else None)


@pytest.mark.parametrize("host", ["169.254.169.254", "169.254.169.254.", "[fe80::1]",
                                  "[fe80::1%25eth0]", "[::ffff:169.254.169.254]", "2852039166",
                                  "0xa9.0xfe.0xa9.0xfe", "metadata.google.internal",
                                  "METADATA.google.internal."])
async def test_the_admin_api_adds_no_link_local_server_unless_allowed(
    fakes: Fakes, host: str
) -> None:
    """Link-local addresses are where clouds serve instance metadata and credentials."""
    server = {"cluster": "decode", "url": f"http://{host}:80"}
    async with serve_router(prefill=[fakes.p_url], decode=fakes.d_urls[:1],
                            admin_token=TOKEN) as (url, _), \
            httpx.AsyncClient(timeout=10) as client:
        r = await client.post(f"{url}/admin/endpoints", headers=AUTH, json=server)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "url"
        assert "admin_allow_link_local" in r.json()["error"]["message"]
    async with serve_router(prefill=[fakes.p_url], decode=fakes.d_urls[:1], admin_token=TOKEN,
                            admin_allow_link_local=True) as (url, _), \
            httpx.AsyncClient(timeout=10) as client:
        r = await client.post(f"{url}/admin/endpoints", headers=AUTH, json=server)
        assert r.status_code == 201, r.text


async def test_membership_changes_under_load_lose_no_request(fakes: Fakes) -> None:
    for fake in fakes.decode:
        fake.behavior.delay = 0.02
    d0, d1, d2 = fakes.d_urls
    async with serve_router(prefill=[fakes.p_url], decode=[d0, d1], admin_token=TOKEN) as (url, _), \
            httpx.AsyncClient(timeout=10) as client:
        async def load() -> list[int]:
            return await complete(client, url, 25)

        running = [asyncio.create_task(load()) for _ in range(4)]
        await until(lambda: len(fakes.decode[0].seen) + len(fakes.decode[1].seen) >= 8,
                    "the load is running")
        await client.post(f"{url}/admin/endpoints", headers=AUTH, json={"cluster": "decode", "url": d2})
        await until(lambda: fakes.decode[2].seen, "the added D takes part of the load")
        await client.delete(f"{url}/admin/endpoints", headers=AUTH, params={"cluster": "decode", "url": d0})
        statuses = [s for task in running for s in await task]
    assert statuses == [200] * 100
    assert len(fakes.decode[2].seen) > 0


async def test_the_watched_config_file_is_applied_and_a_bad_one_refused(
    fakes: Fakes, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "router.yaml"
    d0, d1 = fakes.d_urls[:2]

    def write(decode: list[str], extra: str = "") -> None:
        path.write_text(f"prefill: [{fakes.p_url}]\ndecode: [{', '.join(decode)}]\n"
                        f"health: {{interval: 0}}\nconfig_watch_interval: 0.05\n{extra}")

    write([d0])
    source = ConfigSource(path, lambda: build_config(read_config_file(path), {}))
    async with serve_router(source) as (url, _), httpx.AsyncClient(timeout=10) as client:
        write([d0, d1])
        deadline = time.monotonic() + 5
        while not fakes.decode[1].seen and time.monotonic() < deadline:
            assert await complete(client, url, 1) == [200]
        assert fakes.decode[1].seen, "the D added to the file never got a request"

        path.write_text("decode: [not a url]\n")  # invalid: the running config stays
        await until(lambda: "refused, the running config stays" in caplog.text,
                    "the bad file refused")
        before = [len(f.seen) for f in fakes.decode[:2]]
        assert await complete(client, url, 4) == [200] * 4
        assert all(len(f.seen) > b for f, b in zip(fakes.decode[:2], before, strict=True))


async def test_drain_in_the_config_file_keeps_running_requests_and_takes_no_new_one(
    fakes: Fakes, tmp_path: Path
) -> None:
    path = tmp_path / "router.yaml"
    d0, d1 = fakes.d_urls[:2]

    def write(drain_d0: bool) -> None:
        path.write_text(f"prefill: [{fakes.p_url}]\n"
                        f"decode: [{{url: {d0}, drain: {str(drain_d0).lower()}}}, {d1}]\n"
                        "health: {interval: 0}\nconfig_watch_interval: 0.05\n"
                        "admin_token: " + TOKEN + "\n")

    write(False)
    source = ConfigSource(path, lambda: build_config(read_config_file(path), {}))
    fakes.decode[0].behavior.delay = 0.5  # a request that is running on d0 while it drains
    async with serve_router(source) as (url, _), httpx.AsyncClient(timeout=10) as client:
        assert await complete(client, url, 2) == [200, 200]  # one on each D, in turn
        running = asyncio.create_task(complete(client, url, 1))
        await fakes.decode[0].until(lambda seen: any(s.outcome == "running" for s in seen))
        write(True)

        async def drained() -> bool:
            listing = (await client.get(f"{url}/admin/endpoints", headers=AUTH)).json()
            return any(e["url"] == d0 and e["draining"] for e in listing["endpoints"])

        await until(drained, "drain: true in the file applied")
        on_d0 = len(fakes.decode[0].seen)
        assert await complete(client, url, 4) == [200] * 4
        assert len(fakes.decode[0].seen) == on_d0, "a draining D got a new request"
        assert await running == [200], "the request running on the drained D was lost"

        write(False)  # and back: d0 takes requests again, its state kept
        async def taking() -> bool:
            return not await drained()

        await until(taking, "drain: false in the file applied")
        await complete(client, url, 4)
        assert len(fakes.decode[0].seen) > on_d0


async def test_sighup_reads_the_config_file_again(fakes: Fakes, tmp_path: Path) -> None:
    """`pd-proxy serve` alone: SIGHUP applies the file's servers now (here it is not
    watched), and the router runs on."""
    port = free_port()
    path = tmp_path / "router.yaml"

    def write(decode: list[str]) -> None:
        path.write_text(f"prefill: [{fakes.p_url}]\ndecode: [{', '.join(decode)}]\nport: {port}\n"
                        f"admin_token: {TOKEN}\nconfig_watch_interval: 0\nhealth: {{interval: 0}}\n"
                        "log_level: warning\n")

    write(fakes.d_urls[:1])
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "serve", "--config", str(path), cwd=REPO)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers=AUTH,
                                     timeout=10) as client:
            async def decode() -> set[str]:
                try:
                    listing = (await client.get("/admin/endpoints")).json()["endpoints"]
                except httpx.TransportError:
                    return set()
                return {e["url"] for e in listing if e["cluster"] == "decode"}

            await until(decode, "the router serves", timeout=30)
            write(fakes.d_urls[:2])
            process.send_signal(signal.SIGHUP)

            async def applied() -> bool:
                return await decode() == set(fakes.d_urls[:2])

            await until(applied, "the second D added by SIGHUP")
            assert process.returncode is None
            process.send_signal(signal.SIGTERM)
            async with asyncio.timeout(30):  # uvicorn ends by raising SIGTERM again
                assert await process.wait() in (0, -signal.SIGTERM)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_a_removed_server_leaves_no_state_once_its_requests_finish(fakes: Fakes) -> None:
    """Its connection pools, credentials, name and metric series go, once idle."""
    d0, d1 = fakes.d_urls[:2]
    async with serve_router(prefill=[fakes.p_url], decode=[d0], admin_token=TOKEN) as (url, app), \
            httpx.AsyncClient(timeout=10) as client:
        router = app.state.router
        http = router.client._requests.http

        def state_of(server: str) -> list[str]:
            """Where the router still keeps something for `server`."""
            key = ("http", "127.0.0.1", int(server.rsplit(":", 1)[1]))
            return [where for where, kept in (
                ("pool", key in http._pools), ("credentials", key in http._extra_headers),
                ("name", server in router.client._names)) if kept]

        async def series_of(server: str) -> list[str]:
            text = (await client.get(f"{url}/metrics")).text
            return [line for line in text.splitlines() if f'endpoint="{server}"' in line]

        r = await client.post(f"{url}/admin/endpoints", headers=AUTH,
                              json={"cluster": "decode", "url": d1, "name": "d1"})
        assert r.status_code == 201, r.text
        await client.post(f"{url}/admin/endpoints/drain", headers=AUTH,
                          json={"cluster": "decode", "url": d0})
        fakes.decode[1].behavior.fail_status = 500
        await complete(client, url, 1)  # fails on d1: an error series for it
        fakes.decode[1].behavior.fail_status = None
        assert await series_of(d1) and state_of(d1) == ["pool", "credentials", "name"]

        fakes.decode[1].behavior.delay = 1.0
        running = asyncio.create_task(complete(client, url, 1))
        await fakes.decode[1].until(lambda seen: any(s.outcome == "running" for s in seen))
        await client.post(f"{url}/admin/endpoints/drain", headers=AUTH,
                          json={"cluster": "decode", "url": d0, "draining": False})
        r = await client.delete(f"{url}/admin/endpoints", headers=AUTH,
                                params={"cluster": "decode", "url": d1})
        assert r.status_code == 200 and r.json()["in_flight"] == 1
        assert state_of(d1) == ["pool", "credentials", "name"], "dropped under a request"
        assert await running == [200]

        async def gone() -> bool:
            return not state_of(d1) and not await series_of(d1)

        await until(gone, "d1's state dropped once its request finished")
        assert await complete(client, url, 2) == [200, 200]
        assert state_of(d0) == ["pool", "credentials", "name"]  # the one that stays
