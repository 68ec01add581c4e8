"""Two routers in front of the same pools: both serve, one is killed (SIGKILL), and the
other keeps serving with no failed request that had not started.

The routers run as real `python -m proxy serve` processes reading one config file (each
its own `--port`), in front of the same fake P and D servers. The client stands in for a
load balancer: it spreads requests over both routers in turn, and a request whose
connection is refused (nothing was sent, so it had not started) goes to the other router,
as a load balancer with a health check or a connect retry does. Each request uses a new
connection, so "refused" is the only signal that a router is gone before a request
starts.

Streamed answers take a while (a per-token delay), so some are in flight on the router
when it is killed. Those, and only those, may fail; every other request must be answered
200 in full. At the end nothing is left in flight: not on the survivor (its /metrics)
nor on any fake server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import pytest

from testbed.fake_vllm import Fabric, FakeVLLM, start
from testbed.ports import free_port
from tests.conftest import until

REPO = Path(__file__).resolve().parents[2]
TOKENS = 8
TOKEN_DELAY = 0.04  # a stream lasts about TOKENS x TOKEN_DELAY: long enough to be cut
REQUEST_ID = "two-routers-"  # + the request's number: the fakes see which request it is
CLIENTS = 6  # requests in flight at once, spread over the routers


class Pools:
    """Two fake P and two fake D servers in this process (sharing a fabric, so a push
    really waits for P), served to both routers."""

    def __init__(self, servers: list[tuple[FakeVLLM, str]]) -> None:
        self.prefill = [(f, u) for f, u in servers if f.role == "prefill"]
        self.decode = [(f, u) for f, u in servers if f.role == "decode"]

    @property
    def fakes(self) -> list[FakeVLLM]:
        return [f for f, _ in self.prefill + self.decode]

    def config(self, extra: str = "") -> str:
        p = ", ".join(u for _, u in self.prefill)
        d = ", ".join(u for _, u in self.decode)
        return f"prefill: [{p}]\ndecode: [{d}]\nlog_level: warning\n{extra}"


@pytest.fixture
async def pools() -> AsyncIterator[Pools]:
    fabric = Fabric()
    fakes = [
        FakeVLLM("prefill", engine_id="engine-p0", side_channel_port=5601, fabric=fabric),
        FakeVLLM("prefill", engine_id="engine-p1", side_channel_port=5602, fabric=fabric),
        FakeVLLM("decode", engine_id="engine-d0", fabric=fabric),
        FakeVLLM("decode", engine_id="engine-d1", fabric=fabric),
    ]
    runners, servers = [], []
    for fake in fakes:
        fake.behavior.tokens = TOKENS
        fake.behavior.token_delay = TOKEN_DELAY
        runner, url = await start(fake)
        runners.append(runner)
        servers.append((fake, url))
    try:
        yield Pools(servers)
    finally:
        for runner in runners:
            await runner.cleanup()


class RouterProcess:
    """One `python -m proxy serve --config FILE --port N` subprocess."""

    def __init__(self, config: Path) -> None:
        self.config = config
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "proxy", "serve", "--config", str(self.config),
            "--port", str(self.port), cwd=REPO,
        )

    async def ready(self, client: httpx.AsyncClient) -> None:
        """Until its /health answers 200 (bounded by the caller)."""
        while True:
            try:
                if (await client.get(f"{self.url}/health")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)  # a polling interval, not a synchronisation

    async def stop(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.kill()
            await self.process.wait()


@dataclasses.dataclass
class Attempt:
    """One request as sent to one router."""

    request: int
    router: int
    events: int = 0  # SSE data events received
    status: int | None = None
    mode: str | None = None  # the router's X-KV-Transfer-Mode
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.events == TOKENS + 1


class Front:
    """The load balancer: routers in turn; a refused connection goes to the next one.

    `in_flight[r]` holds the attempts on router r that started (the connection was
    being opened or the request sent) and have not finished."""

    def __init__(self, routers: list[RouterProcess], client: httpx.AsyncClient) -> None:
        self.routers = routers
        self.client = client
        self.turn = itertools.count()
        self.ids = itertools.count()
        self.attempts: list[Attempt] = []
        self.in_flight: list[set[int]] = [set() for _ in routers]  # ids into `attempts`
        self.refused: list[int] = [0 for _ in routers]
        self.stop = asyncio.Event()

    def served(self, router: int) -> int:
        return sum(1 for a in self.attempts if a.router == router and a.ok)

    def mid_stream(self, router: int, decode: list[FakeVLLM]) -> set[int]:
        """Attempts in flight on `router` whose D leg is streaming and has at least two
        token delays still to sleep: the D fake has not written their whole answer
        yet, whatever the sockets hold, so a kill of the router now must cut them."""
        by_id = {f"{REQUEST_ID}{self.attempts[i].request}": i for i in self.in_flight[router]}
        now = time.perf_counter()
        return {by_id[s.headers["x-request-id"]] for fake in decode for s in fake.seen
                if s.outcome == "running" and s.headers.get("x-request-id") in by_id
                and now - s.arrived < (TOKENS - 3) * TOKEN_DELAY}

    async def request(self) -> None:
        """One request: the next router in turn; on a refused connection, the others."""
        request, first = next(self.ids), next(self.turn)
        for offset in range(len(self.routers)):
            r = (first + offset) % len(self.routers)
            attempt = Attempt(request, r)
            index = len(self.attempts)
            self.attempts.append(attempt)
            self.in_flight[r].add(index)
            try:
                await self._send(attempt)
                return
            except httpx.ConnectError:  # refused: nothing was sent; the next router
                attempt.error = "refused"
                self.refused[r] += 1
            except httpx.TransportError as exc:  # it had started: not sent again
                attempt.error = f"{type(exc).__name__}: {exc}"
                return
            finally:
                self.in_flight[r].discard(index)

    async def _send(self, attempt: Attempt) -> None:
        body = {"model": "fake-model", "prompt": f"hello {attempt.request}",
                "max_tokens": TOKENS, "stream": True}
        url = f"{self.routers[attempt.router].url}/v1/completions"
        headers = {"X-Request-Id": f"{REQUEST_ID}{attempt.request}"}  # both legs carry it
        async with self.client.stream("POST", url, json=body, headers=headers) as answer:
            attempt.status = answer.status_code
            attempt.mode = answer.headers.get("x-kv-transfer-mode")
            async for line in answer.aiter_lines():
                if line.startswith("data: "):
                    attempt.events += 1
                    if line == "data: [DONE]":
                        break

    async def keep_sending(self) -> None:
        while not self.stop.is_set():
            await self.request()


async def in_flight_metric(client: httpx.AsyncClient, router: RouterProcess) -> float:
    """The router's own count: pdproxy_requests_in_flight plus every endpoint's."""
    text = (await client.get(f"{router.url}/metrics")).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(("pdproxy_requests_in_flight ", "pdproxy_endpoint_in_flight{")):
            total += float(line.rsplit(" ", 1)[1])
    assert "pdproxy_requests_in_flight" in text
    return total


async def kill_one_of_two(pools: Pools, tmp_path: Path, extra_config: str = "") -> Front:
    """Start two routers on one config file, send through both, SIGKILL the first while
    it streams, keep sending, and check the rules of the module docstring."""
    config = tmp_path / "router.yaml"
    config.write_text(pools.config(extra_config))
    routers = [RouterProcess(config), RouterProcess(config)]
    decode = [fake for fake, _ in pools.decode]
    limits = httpx.Limits(max_keepalive_connections=0)  # a new connection per request
    try:
        async with httpx.AsyncClient(timeout=10, limits=limits) as client:
            for router in routers:
                await router.start()
            async with asyncio.timeout(60):  # generous: the machine may be busy
                await asyncio.gather(*(r.ready(client) for r in routers))
            front = Front(routers, client)
            senders = [asyncio.create_task(front.keep_sending()) for _ in range(CLIENTS)]
            try:
                # Both serve; then kill the first while some of its streams are half sent.
                await until(lambda: min(front.served(0), front.served(1)) >= 3
                            and bool(front.mid_stream(0, decode)),
                            "both routers served, and D streams answers through the first",
                            timeout=30)
                victim = routers[0].process
                assert victim is not None
                allowed = set(front.in_flight[0])  # in flight on it at the kill
                cut = front.mid_stream(0, decode)
                before = len(front.attempts)
                victim.send_signal(signal.SIGKILL)
                async with asyncio.timeout(5):
                    await victim.wait()
                # Until it was gone, a request could still reach it: in flight at the kill.
                gone = len(front.attempts)
                allowed |= {i for i in range(before, gone) if front.attempts[i].router == 0}
                assert victim.returncode == -signal.SIGKILL
                # The survivor keeps serving, taking the requests the dead router refuses.
                await until(lambda: front.refused[0] >= 3 and front.served(1) >= 20,
                            "requests refused by the killed router, served by the other",
                            timeout=30)
            finally:
                front.stop.set()
                try:
                    async with asyncio.timeout(20):  # each sender finishes its request
                        await asyncio.gather(*senders)
                finally:  # on a failure above, the senders still running are stopped
                    for task in senders:
                        task.cancel()
                    await asyncio.gather(*senders, return_exceptions=True)

            attempts = front.attempts
            failed = {i for i, a in enumerate(attempts) if not a.ok and a.error != "refused"}
            assert failed <= allowed, [attempts[i] for i in failed - allowed]
            assert all(attempts[i].router == 0 for i in failed)
            # Streams D was still writing through the killed router cannot complete.
            assert cut and cut <= failed, (cut, failed)
            assert all(a.error == "refused" for a in attempts[gone:] if a.router == 0)
            # Every request sent after the kill was answered in full (by the survivor).
            requests_after = {a.request for a in attempts[before:]} - {
                attempts[i].request for i in allowed}
            answered = {a.request for a in attempts if a.ok}
            assert requests_after and requests_after <= answered
            assert front.refused[1] == 0

            # Nothing left in flight: the survivor's own counts, and every fake server.
            await until_async(lambda: in_flight_metric(client, routers[1]), 5)
            for fake in pools.fakes:
                await fake.until(lambda seen: all(s.outcome != "running" for s in seen), 5)
            # The killed router's connections closed, so D saw its cut streams cancelled
            # (a real vLLM aborts them and frees their KV).
            cut_ids = {f"{REQUEST_ID}{attempts[i].request}" for i in cut}
            assert {s.outcome for fake in decode for s in fake.seen
                    if s.headers.get("x-request-id") in cut_ids} == {"cancelled"}
            return front
    finally:
        for router in routers:
            await router.stop()


async def until_async(value: Callable[[], Awaitable[float]], timeout: float) -> None:
    """Poll an async `value()` until it is 0, bounded."""
    last = None
    try:
        async with asyncio.timeout(timeout):
            while (last := await value()) != 0:
                await asyncio.sleep(0.05)  # a polling interval
    except TimeoutError:
        raise AssertionError(f"still in flight on the survivor: {last}") from None


async def test_the_other_router_serves_every_request_that_had_not_started(
    pools: Pools, tmp_path: Path,
) -> None:
    front = await kill_one_of_two(pools, tmp_path)
    assert {a.mode for a in front.attempts if a.ok} == {"pull"}
    # Both routers balanced over the same pools.
    for fake in pools.fakes:
        assert any(s.outcome == "ok" for s in fake.seen), fake.engine_id


async def test_push_both_routers_probe_the_same_prefills(pools: Pools, tmp_path: Path) -> None:
    """Push: each router learns P's coordinates on its own (one probe per router per P),
    both push, and the kill leaves no push hanging on the fakes."""
    front = await kill_one_of_two(pools, tmp_path, "mode: push\n")
    assert {a.mode for a in front.attempts if a.ok} == {"push"}
    for fake, url in pools.prefill:
        probes = [s for s in fake.seen if (s.body.get("kv_transfer_params") or {}).get("probe")]
        assert len(probes) == 2, (url, len(probes))
    assert all(s.body.get("kv_transfer_params", {}).get("transfer_id")
               for fake, _ in pools.decode for s in fake.seen)
