"""The router keeps nothing per request: after a warm-up, more healthy requests (pull,
push and auto; streamed and not; completions and chat) leave no new memory allocated by
the router's own code.

Measured with tracemalloc, counting only allocations made by lines of `proxy/`, after a
full collection: no RSS, no timing. Before the fix, the retry budget kept the timestamp
of every request (a float and a deque slot, about 32 bytes) when no retry ever came to
drop the old ones: 1,200 requests left about 38 KB. The RSS side of the same question,
over hundreds of thousands of requests on the production process, is
`python -m scripts.bench_memory`.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

import proxy
from proxy.pool.retry import RetryBudget
from tests.conftest import serve_router
from tests.integration.conftest import Pair

PROXY_FILES = str(Path(proxy.__file__).parent / "*")
WARMUP = 300
MEASURED = 1200
CONCURRENCY = 8
# Retained by proxy/ code per measured request, at most (the leak was ~32 bytes each).
# Sliding windows (the retry budget's, shortened here) hold a handful of recent entries.
ALLOWED_BYTES = 4 * MEASURED


def shapes() -> Iterator[tuple[str, dict[str, Any], dict[str, str]]]:
    """Every mix of mode, route, streaming and client-given request id, in turn."""
    for n in itertools.count():
        mode = ("pull", "push", "auto")[n % 3]
        stream = bool(n // 3 % 2)
        chat = bool(n // 6 % 2)
        route = "/v1/chat/completions" if chat else "/v1/completions"
        prompt: dict[str, Any] = (
            {"messages": [{"role": "user", "content": f"hi {n}"}]} if chat else {"prompt": f"hi {n}"}
        )
        headers = {"X-KV-Transfer-Mode": mode}
        if n // 12 % 2:
            headers["X-Request-Id"] = f"memory-{n}"
        yield route, {"model": "fake-model", "max_tokens": 2, "stream": stream, **prompt}, headers


async def send(session: aiohttp.ClientSession, url: str,
               requests: Iterator[tuple[str, dict[str, Any], dict[str, str]]], count: int) -> None:
    """`count` requests from `requests`, CONCURRENCY at a time; each must succeed."""
    left = iter(range(count))

    async def worker() -> None:
        for _ in left:
            route, body, headers = next(requests)
            async with session.post(url + route, json=body, headers=headers) as answer:
                content = await answer.read()
            assert answer.status == 200, content[:300]
            assert not body["stream"] or content.endswith(b"data: [DONE]\n\n"), content[-300:]

    async with asyncio.timeout(60):
        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))


async def proxy_heap() -> tracemalloc.Snapshot:
    """What lines of proxy/ allocated and is still alive, once settled: garbage collected,
    and short-lived state let go (the upstream client's deadline sweep forgets an answer
    when it is released). Snapshots until two in a row, 0.1 s apart, hold the
    same bytes; at most 5 s."""
    previous = -1
    async with asyncio.timeout(5):
        while True:
            gc.collect()
            heap = tracemalloc.take_snapshot().filter_traces(
                [tracemalloc.Filter(True, PROXY_FILES)])
            size = sum(trace.size for trace in heap.traces)
            if size == previous:
                return heap
            previous = size
            await asyncio.sleep(0.1)


async def test_healthy_requests_leave_no_memory_behind(
    pair: Pair, caplog: pytest.LogCaptureFixture
) -> None:
    # The access log line per request would be kept by pytest's log capture, not us.
    caplog.set_level(logging.WARNING, logger="pdproxy")
    pair.prefill.record = pair.decode.record = False
    # A short retry-budget window, so that it holds a few requests, not all of them.
    async with serve_router(prefill=[pair.p_url], decode=[pair.d_url],
                            retry_budget={"window_s": 0.2}) as (url, _app):
        requests = shapes()
        connector = aiohttp.TCPConnector(limit=CONCURRENCY)
        async with aiohttp.ClientSession(connector=connector) as session:
            tracemalloc.start(1)
            try:
                await send(session, url, requests, WARMUP)
                before = await proxy_heap()
                await send(session, url, requests, MEASURED)
                after = await proxy_heap()
            finally:
                tracemalloc.stop()
    growth = after.compare_to(before, "lineno")
    retained = sum(stat.size_diff for stat in growth)
    top = "\n".join(str(stat) for stat in growth[:5])
    assert retained < ALLOWED_BYTES, (
        f"{MEASURED} requests left {retained} bytes allocated by proxy/ code; top lines:\n{top}")


def test_the_retry_budget_keeps_only_its_window_without_any_retry() -> None:
    """The leak itself, without a router: healthy traffic never asks for a retry, and
    the budget must still forget the requests that left its window."""
    budget = RetryBudget(window_s=1.0)
    for n in range(10_000):  # 10 s of requests, one per millisecond
        budget.request(now=n / 1000)
    # the last second's (to a slot of 0.1 s), not all 10,000, in as many counts as ever
    assert 900 <= sum(budget._requests) <= 1_000
    assert len(budget._requests) == RetryBudget.SLOTS
    assert budget.try_spend(now=10.0)
