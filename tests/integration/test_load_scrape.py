"""Scraping fake vLLM servers' /metrics: each endpoint gets its own server's report, a
server that stops answering (or is no vLLM) gets None with one warning, and the
scraper's task runs only between `start` and `aclose`."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from proxy.config import EndpointConfig, Limits, Timeouts
from proxy.pool.endpoints import ClusterName, Endpoint
from proxy.pool.load import LoadReport
from proxy.pool.scrape import LoadScraper
from proxy.upstream.client import UpstreamClient
from testbed.fake_vllm import FakeVLLM, start


class Servers:
    def __init__(self, fakes: list[FakeVLLM], runners: list[web.AppRunner], urls: list[str]) -> None:
        self.fakes, self.runners, self.urls = fakes, runners, urls
        self.endpoints = [Endpoint(EndpointConfig(url=u), ClusterName.PREFILL) for u in urls]


@pytest.fixture
async def servers() -> AsyncIterator[Servers]:
    fakes = [FakeVLLM("prefill", engine_id=f"engine-p{i}", side_channel_port=5600 + i) for i in range(2)]
    runners, urls = [], []
    try:
        for fake in fakes:
            runner, url = await start(fake)
            runners.append(runner)
            urls.append(url)
        yield Servers(fakes, runners, urls)
    finally:
        for runner in runners:
            await runner.cleanup()  # a second cleanup of a stopped one is harmless


@pytest.fixture
async def client() -> AsyncIterator[UpstreamClient]:
    upstream = UpstreamClient(Timeouts(connect=2.0), Limits())
    try:
        yield upstream
    finally:
        await upstream.aclose()


def scraper_for(endpoints: list[Endpoint], client: UpstreamClient, interval: float = 0) -> LoadScraper:
    return LoadScraper(lambda: endpoints, client, interval=interval, timeout=2.0)


async def test_each_endpoint_gets_its_own_servers_load(servers: Servers, client: UpstreamClient) -> None:
    servers.fakes[0].behavior.waiting = 3
    servers.fakes[0].behavior.kv_cache_usage = 0.75
    servers.fakes[1].behavior.waiting = 0
    before = time.monotonic()
    await scraper_for(servers.endpoints, client).scrape_all()
    first, second = (e.load for e in servers.endpoints)
    assert isinstance(first, LoadReport) and isinstance(second, LoadReport)
    assert (first.waiting, first.running, first.kv_cache_usage) == (3.0, 0.0, 0.75)
    assert (second.waiting, second.running, second.kv_cache_usage) == (0.0, 0.0, 0.0)
    assert before <= first.at <= time.monotonic()


async def test_running_counts_the_requests_the_server_is_answering(
    servers: Servers, client: UpstreamClient
) -> None:
    fake, endpoint = servers.fakes[1], servers.endpoints[1]
    fake.behavior.hang = True
    body = {"model": "fake-model", "prompt": "hi", "max_tokens": 1}
    hanging = asyncio.create_task(client.post_json(
        f"{endpoint.url}/v1/completions", body, headers={}, endpoint=endpoint.url,
        cluster="prefill", timeout=30.0,
    ))  # fmt: skip
    try:
        await fake.until(lambda seen: len(seen) == 1)
        await scraper_for(servers.endpoints, client).scrape_all()
        assert endpoint.load is not None and endpoint.load.running == 1.0
        assert servers.endpoints[0].load is not None and servers.endpoints[0].load.running == 0.0
    finally:
        hanging.cancel()
        await asyncio.gather(hanging, return_exceptions=True)


async def test_a_stopped_server_loses_its_report_with_one_warning(
    servers: Servers, client: UpstreamClient, caplog: pytest.LogCaptureFixture
) -> None:
    scraper = scraper_for(servers.endpoints, client)
    servers.fakes[0].behavior.waiting = 5
    await scraper.scrape_all()
    assert all(e.load is not None for e in servers.endpoints)

    await servers.runners[0].cleanup()
    with caplog.at_level(logging.DEBUG, logger="pdproxy.load"):
        for _ in range(3):
            await scraper.scrape_all()
    stopped, running = servers.endpoints
    assert stopped.load is None
    assert running.load is not None and running.load.waiting == 0.0
    about_stopped = [r for r in caplog.records if stopped.url in r.getMessage()]
    assert [r.levelno for r in about_stopped] == [logging.WARNING, logging.DEBUG, logging.DEBUG]
    assert not any(running.url in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(("status", "text"), [
    (404, "404: Not Found"),
    (200, "# TYPE process_open_fds gauge\nprocess_open_fds 12.0\n"),  # some other server
    (200, "vllm:num_requests_waiting{engine= oops\n"),  # malformed
])
async def test_a_server_without_vllm_metrics_gets_no_report(
    client: UpstreamClient, status: int, text: str
) -> None:
    async def metrics(request: web.Request) -> web.Response:
        return web.Response(status=status, text=text)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        endpoint = Endpoint(EndpointConfig(url=f"http://127.0.0.1:{port}"), ClusterName.DECODE)
        endpoint.load = LoadReport(waiting=1.0, running=1.0, kv_cache_usage=0.0, at=0.0)
        await scraper_for([endpoint], client).scrape_all()
        assert endpoint.load is None
    finally:
        await runner.cleanup()


def scraper_tasks() -> list[asyncio.Task[object]]:
    return [t for t in asyncio.all_tasks() if t.get_name() == "load-scraper" and not t.done()]


async def test_start_scrapes_in_the_background_and_aclose_stops_it(
    servers: Servers, client: UpstreamClient
) -> None:
    servers.fakes[0].behavior.waiting = 2
    scraper = scraper_for(servers.endpoints, client, interval=0.05)
    scraper.start()
    scraper.start()  # a second start adds no task
    try:
        assert len(scraper_tasks()) == 1
        async with asyncio.timeout(5):
            while servers.endpoints[0].load is None:
                await asyncio.sleep(0.01)
        first = servers.endpoints[0].load
        assert first is not None and first.waiting == 2.0
        servers.fakes[0].behavior.waiting = 7  # the next rounds see the change
        async with asyncio.timeout(5):
            while (load := servers.endpoints[0].load) is None or load.waiting != 7.0:
                await asyncio.sleep(0.01)
    finally:
        await scraper.aclose()
    assert scraper_tasks() == []
    await scraper.aclose()  # twice is harmless


async def test_interval_zero_starts_no_task(servers: Servers, client: UpstreamClient) -> None:
    scraper = scraper_for(servers.endpoints, client, interval=0)
    scraper.start()
    assert scraper_tasks() == []
    await scraper.aclose()
