"""Soak test: many requests through the router while its backends fail at random. Run it
before trusting a router build:

    python -m scripts.soak                              # 20,000 requests, 5% meet a fault
    python -m scripts.soak --requests 2000 --fault-rate 0.2 --seed 7
    python -m scripts.soak --fault-kinds cut_stream garbage --out bench-results/soak-cut.json
    python -m scripts.bench soak                        # the same, from the one command

Everything runs in this process: fake vLLM servers (`testbed.fake_vllm`, 2 P + 2 D by
default) that inject one random fault into a share of their requests (a 500, a dropped
connection, a body that is not JSON, a stream cut short, or a slow answer), and the
router under uvicorn, with timeouts of a few seconds and health checks every second.
`--concurrency` clients send `--requests` requests, a mix of completions and chat,
streamed or not, in pull, push or auto mode (`X-KV-Transfer-Mode`), and class each
answer:

  ok           200 and a whole answer: JSON with choices, or SSE ending in `data: [DONE]`
  clean_error  an OpenAI-shaped JSON error (4xx/5xx), or an SSE stream that ends with an
               error event (what the router sends when a stream breaks after its start)
  bad          anything else: a body that is not JSON, a stream cut without an error
               event, a connection reset by the router, a 200 without choices
  hang         no whole answer within `--deadline` seconds

Each request carries its own X-Request-Id, which the router forwards to both legs, so a
failed request is matched with the faults injected into it; one that failed with no
fault injected is `unexplained` (unless the machine did not run this process for a second
or more meanwhile, which can fire the router's timeouts: such requests are counted apart,
with a warning to run again). After the last answer and a short settle, leaks are read:
`pdproxy_endpoint_in_flight` (router /metrics) for every endpoint, the router's
asyncio tasks against those of the idle router before the load, its open downstream
connections and request tasks (uvicorn's state), requests still running on the fakes,
the upstream connections (every one the router's pools hold open is idle, holds the
only slots taken, and the fakes hold no other: a bound on how many, from what the load
could use at once, failed on a slow machine where four pools' keep-alive peaks summed
past it), and sockets left half-closed (CLOSE_WAIT, Linux).

It prints a progress line every few seconds, a summary at the end, and writes a JSON
report (`--out`). Exit status 0 only when there were no bad answers, no hangs, no
unexplained errors and no leaks.

What it leaves out: real vLLM (the fakes stand in), the router's own process as
`pd-proxy serve` runs it (it is served here, in this process), and speed: it checks
answers and leaks, not throughput or latency.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import json
import logging
import math
import random
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import uvicorn
from aiohttp import web

from proxy.api.app import create_app, serving
from proxy.config import build_config
from proxy.upstream.client import UpstreamClient
from proxy.upstream.http11 import ConnectionCounts
from testbed.fake_vllm import FAULT_KINDS, MODEL, Fabric, FakeVLLM, start

REPO = Path(__file__).resolve().parents[1]
OUTCOMES = ("ok", "clean_error", "bad", "hang")
ROUTES = ("/v1/completions", "/v1/chat/completions")
MODES = ("pull", "push", "auto")
EXAMPLES = 20  # bad, hung and unexplained requests kept in the report, each
# The fakes' per-connection handler task: one per upstream connection the router holds.
FAKE_CONNECTION_TASK = "RequestHandler.start"


@dataclasses.dataclass
class SoakOptions:
    requests: int = 20_000
    concurrency: int = 32
    fault_rate: float = 0.05  # share of client requests that meet a fault (about)
    fault_kinds: list[str] = dataclasses.field(default_factory=lambda: list(FAULT_KINDS))
    fault_slow_s: float = 0.5
    prefills: int = 2
    decodes: int = 2
    deadline: float = 30.0  # client side, per request: longer is a hang
    upstream_timeout: float = 5.0  # router: connect, prefill, first_token, stream_idle, probe
    settle: float = 5.0  # after the load, how long leaks may take to go away
    progress: float = 5.0  # seconds between progress lines (0: none)
    seed: int | None = None
    out: Path | None = REPO / "bench-results" / "soak.json"


@dataclasses.dataclass
class Outcome:
    """One client request and what the client saw."""

    request_id: str
    route: str
    stream: bool
    mode: str  # asked for in X-KV-Transfer-Mode
    kind: str = "hang"  # one of OUTCOMES
    status: int | None = None
    used_mode: str | None = None  # the router's X-KV-Transfer-Mode answer
    saw: str = ""  # what the client saw, when not ok
    seconds: float = 0.0
    sent_at: float = 0.0  # time.perf_counter()


# --- the backends --------------------------------------------------------------------


class Fleet:
    """The fake P and D servers, and the faults they injected, by request id."""

    def __init__(self) -> None:
        self.fakes: dict[str, FakeVLLM] = {}  # "prefill-0" -> fake
        self.urls: dict[str, str] = {}
        self.runners: list[web.AppRunner] = []
        self.faults: dict[str, list[str]] = collections.defaultdict(list)  # rid -> ["decode:garbage"]
        self.injected: collections.Counter[str] = collections.Counter()  # "decode:garbage" -> n

    def urls_of(self, role: str) -> list[str]:
        return [url for name, url in self.urls.items() if name.startswith(role)]

    def set_fault_rate(self, rate: float) -> None:
        for fake in self.fakes.values():
            fake.behavior.fault_rate = rate

    def harvest(self) -> None:
        """Take the finished requests' faults off the fakes' logs (which stay small)."""
        for fake in self.fakes.values():
            running = []
            for seen in fake.seen:
                if seen.finished is None:
                    running.append(seen)
                elif seen.fault is not None:
                    fault = f"{fake.role}:{seen.fault}"
                    self.faults[seen.headers.get("x-request-id", "none")].append(fault)
                    self.injected[fault] += 1
            fake.seen = running

    def running(self) -> int:
        return sum(fake.active for fake in self.fakes.values())

    def connections(self) -> int:
        """Connections the fakes hold open: the router's upstream connections."""
        return sum(len(r.server.connections) for r in self.runners if r.server is not None)

    def ports(self) -> set[int]:
        return {int(url.rsplit(":", 1)[1]) for url in self.urls.values()}


def per_server_rate(rate: float) -> float:
    """A request meets a P and a D: each fails at r, so that 1 - (1 - r)^2 = rate."""
    return 1.0 - math.sqrt(1.0 - rate)


async def start_fleet(options: SoakOptions, seed: int) -> Fleet:
    fleet, fabric = Fleet(), Fabric()
    for role, count in (("prefill", options.prefills), ("decode", options.decodes)):
        for i in range(count):
            fake = FakeVLLM(role, engine_id=f"engine-{role[0]}{i}", side_channel_port=5600 + i,
                            fabric=fabric, seed=seed * 100 + len(fleet.fakes))
            fake.behavior.tokens = 8
            fake.behavior.fault_kinds = list(options.fault_kinds)
            fake.behavior.fault_slow_s = options.fault_slow_s
            runner, url = await start(fake)
            fleet.fakes[f"{role}-{i}"] = fake
            fleet.urls[f"{role}-{i}"] = url
            fleet.runners.append(runner)
    return fleet


# --- the router ----------------------------------------------------------------------


def router_config(fleet: Fleet, options: SoakOptions) -> dict[str, Any]:
    """Short timeouts, so that no fault can hold a request for long; retries and
    ejection as they come."""
    limit = options.upstream_timeout
    return {
        "prefill": fleet.urls_of("prefill"),
        "decode": fleet.urls_of("decode"),
        "mode": "auto",  # P coordinates are probed at start (the header decides per request)
        "health": {"interval": 1.0},
        "timeouts": {"connect": limit, "prefill": limit, "first_token": limit,
                     "stream_idle": limit, "probe": limit, "health": 2.0},
    }  # fmt: skip


@contextlib.asynccontextmanager
async def serve_router(
        config: dict[str, Any]) -> AsyncIterator[tuple[str, uvicorn.Server, UpstreamClient]]:
    """The router under uvicorn on a free port, in this event loop; and its upstream
    client, whose connections the leak check counts."""
    app = create_app(build_config(config, {}))
    async with serving(app, name="soak-router") as (url, server):
        yield url, server, app.state.router.client


ROUTER_LOGGERS = ("pdproxy", "uvicorn.error", "asyncio")
FAKE_LOGGERS = ("aiohttp.server", "aiohttp.web")  # e.g. a write to a connection the router closed


class LogCounter(logging.Handler):
    """Counts the warnings and errors logged by `names` (and their children)."""

    def __init__(self, names: tuple[str, ...]) -> None:
        super().__init__(logging.WARNING)
        self.names = names
        self.counts: collections.Counter[str] = collections.Counter()
        self.messages: list[str] = []  # the first few

    def emit(self, record: logging.LogRecord) -> None:
        self.counts[f"{record.name}:{record.levelname}"] += 1
        if len(self.messages) < EXAMPLES:
            self.messages.append(f"{record.levelname} {record.name}: {record.getMessage()[:300]}")

    @contextlib.contextmanager
    def installed(self) -> Any:
        """Catch those logs here instead of printing them (restored after)."""
        saved = []
        for name in self.names:
            logger = logging.getLogger(name)
            saved.append((logger, logger.propagate))
            logger.addHandler(self)
            logger.propagate = False
        try:
            yield self
        finally:
            for logger, propagate in saved:
                logger.removeHandler(self)
                logger.propagate = propagate


# --- the clients ---------------------------------------------------------------------


def request_shape(rng: random.Random, index: int) -> tuple[Outcome, dict[str, Any]]:
    """Request `index`: its route, streaming, mode and length drawn at random."""
    return new_request(f"soak-{index}", rng.choice(ROUTES), rng.random() < 0.5,
                       rng.choice(MODES), rng.randint(1, 8))


def new_request(request_id: str, route: str, stream: bool, mode: str,
                max_tokens: int) -> tuple[Outcome, dict[str, Any]]:
    """The outcome to fill in, and the body, of one request."""
    body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "stream": stream}
    if route == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": f"Hello from {request_id}"}]
    else:
        body["prompt"] = f"Hello from {request_id}"
    return Outcome(request_id, route, stream, mode), body


async def send(session: aiohttp.ClientSession, url: str, outcome: Outcome,
               body: dict[str, Any], deadline: float) -> Outcome:
    """Send one request and class what comes back (a hang when past `deadline`)."""
    headers = {"X-Request-Id": outcome.request_id, "X-KV-Transfer-Mode": outcome.mode}
    started = time.perf_counter()
    try:
        async with asyncio.timeout(deadline):
            async with session.post(url + outcome.route, json=body, headers=headers) as r:
                outcome.status = r.status
                outcome.used_mode = r.headers.get("x-kv-transfer-mode")
                content = await r.read()
                outcome.kind, outcome.saw = classify(
                    r.status, r.headers.get("content-type", ""), content, outcome.stream)
    except TimeoutError:
        outcome.kind, outcome.saw = "hang", f"no whole answer within {deadline:.0f} s"
    except (aiohttp.ClientError, OSError) as exc:
        outcome.kind, outcome.saw = "bad", f"{type(exc).__name__}: {exc}"[:300]
    outcome.sent_at, outcome.seconds = started, time.perf_counter() - started
    return outcome


def classify(status: int, content_type: str, content: bytes, stream: bool) -> tuple[str, str]:
    """(outcome, what the client saw when not ok) for one whole answer."""
    head = f"{status} {content_type or '(no content type)'}"
    if stream and status == 200:
        if not content_type.startswith("text/event-stream"):
            return "bad", f"{head}, a stream asked for: {content[:120]!r}"
        return classify_stream(content, head)
    try:
        decoded = json.loads(content)
    except ValueError:
        return "bad", f"{head}, body not JSON: {content[:120]!r}"
    if status == 200:
        if isinstance(decoded, dict) and decoded.get("choices"):
            return "ok", ""
        return "bad", f"{head}, JSON without choices: {content[:120]!r}"
    if 400 <= status < 600 and is_openai_error(decoded):
        return "clean_error", f"{head}: {decoded['error']['message'][:200]}"
    return "bad", f"{head}, not an OpenAI error: {content[:120]!r}"


def classify_stream(content: bytes, head: str) -> tuple[str, str]:
    """An SSE answer: ok when every event has choices and it ends with [DONE];
    clean_error when its last event before [DONE] is an error."""
    events = [e for e in content.split(b"\n\n") if e.strip()]
    if not content.endswith(b"\n\n") or not events or events[-1].strip() != b"data: [DONE]":
        return "bad", f"{head}, stream ends without data: [DONE]: ...{content[-160:]!r}"
    error = None
    for event in events[:-1]:
        if not event.startswith(b"data: "):
            return "bad", f"{head}, not an SSE data event: {event[:120]!r}"
        try:
            decoded = json.loads(event[6:])
        except ValueError:
            return "bad", f"{head}, event not JSON: {event[:120]!r}"
        if is_openai_error(decoded):
            error = decoded["error"]["message"]
        elif error is not None or not (isinstance(decoded, dict) and decoded.get("choices")):
            return "bad", f"{head}, unexpected event: {event[:120]!r}"
    if error is not None:
        return "clean_error", f"{head}, stream ended with an error event: {error[:200]}"
    return "ok", ""


def is_openai_error(decoded: Any) -> bool:
    error = decoded.get("error") if isinstance(decoded, dict) else None
    return isinstance(error, dict) and isinstance(error.get("message"), str)


class Tally:
    """The outcomes so far, for progress lines and the report."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.outcomes: list[Outcome] = []
        self.counts: collections.Counter[str] = collections.Counter()
        self.started = time.perf_counter()

    def add(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)
        self.counts[outcome.kind] += 1

    def line(self) -> str:
        elapsed = time.perf_counter() - self.started
        done = len(self.outcomes)
        classes = ", ".join(f"{k} {self.counts[k]}" for k in OUTCOMES)
        return (f"[{elapsed:6.1f} s] {done}/{self.total} done, {done / max(elapsed, 1e-9):.0f} "
                f"req/s, {classes}")


async def load(url: str, options: SoakOptions, rng: random.Random, tally: Tally) -> None:
    """`options.requests` requests from `options.concurrency` clients at once."""
    shapes = iter(request_shape(rng, i) for i in range(options.requests))
    connector = aiohttp.TCPConnector(limit=options.concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout()) as session:

        async def client() -> None:
            for outcome, body in shapes:
                tally.add(await send(session, url, outcome, body, options.deadline))

        await asyncio.gather(*(client() for _ in range(options.concurrency)))


class LoopLag:
    """How late this event loop wakes up from a short sleep. Everything (router, fakes,
    clients) shares it, so a stall of a second or more can fire the router's timeouts. A
    stall in which this process used little CPU is the machine's doing (the process was
    not scheduled): the requests in flight then are not held against the router. One in
    which it used the CPU is code blocking the loop, maybe the router's: not excused."""

    TICK_S = 0.05
    STALL_S = 1.0

    def __init__(self) -> None:
        self.max_s = 0.0
        # (from, to) in time.perf_counter(), and the CPU seconds this process used meanwhile
        self.stalls: list[tuple[float, float, float]] = []

    async def watch(self) -> None:
        while True:
            before, cpu = time.perf_counter(), time.process_time()
            await asyncio.sleep(self.TICK_S)
            after = time.perf_counter()
            lag = after - before - self.TICK_S
            self.max_s = max(self.max_s, lag)
            if lag >= self.STALL_S:
                self.stalls.append((before, after, time.process_time() - cpu))

    def descheduled(self, o: Outcome) -> bool:
        """Whether request `o` was in flight while the machine did not run this process."""
        return any(a < o.sent_at + o.seconds and b > o.sent_at and cpu < (b - a) / 2
                   for a, b, cpu in self.stalls)

    def report(self, started: float) -> dict[str, Any]:
        """The largest lag, and each stall: seconds into the load, length, CPU used."""
        return {"max_s": round(self.max_s, 3),
                "stalls": [{"at_s": round(a - started, 1), "seconds": round(b - a, 2),
                            "cpu_s": round(cpu, 2)} for a, b, cpu in self.stalls]}


async def report_progress(tally: Tally, fleet: Fleet, every: float) -> None:
    while True:
        await asyncio.sleep(every)
        fleet.harvest()
        print(tally.line(), flush=True)


# --- leaks ---------------------------------------------------------------------------


def task_counts() -> collections.Counter[str]:
    """This loop's tasks by coroutine name, but for the caller's own task and the fakes'
    connection handlers (counted as upstream connections instead)."""
    me = asyncio.current_task()
    names = (getattr(t.get_coro(), "__qualname__", repr(t.get_coro()))
             for t in asyncio.all_tasks() if t is not me)
    return collections.Counter(n for n in names if n != FAKE_CONNECTION_TASK)


async def in_flight(url: str) -> dict[str, float]:
    """`pdproxy_endpoint_in_flight` per endpoint, from the router's /metrics."""
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as r:
        text = await r.text()
    values = {}
    for line in text.splitlines():
        if line.startswith("pdproxy_endpoint_in_flight{"):
            labels, value = line.rsplit(" ", 1)
            values[labels.removeprefix("pdproxy_endpoint_in_flight")] = float(value)
    return values


def half_closed_sockets(ports: set[int], local_port: int) -> int | None:
    """TCP sockets in CLOSE_WAIT (the peer closed, we never did) toward `ports`, or on
    `local_port`; None where /proc/net/tcp cannot be read (not Linux)."""
    count, read_any = 0, False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        read_any = True
        for line in lines:
            fields = line.split()
            local, remote, state = (int(fields[1].rsplit(":", 1)[1], 16),
                                    int(fields[2].rsplit(":", 1)[1], 16), fields[3])
            if state == "08" and (remote in ports or local == local_port):
                count += 1
    return count if read_any else None


def connection_leaks(router: ConnectionCounts, at_the_fakes: int) -> dict[str, int]:
    """What the router holds of upstream connections once nothing is in flight, that it
    should not: connections in use (lost by a request that ended), slots taken with no
    connection open, connections the fakes hold open that no pool knows."""
    return {"upstream_connections_in_use": router.open - router.idle,
            "upstream_slots_without_connection": max(0, router.slots - router.open),
            "upstream_connections_unknown_to_the_router": max(0, at_the_fakes - router.open)}


async def read_leaks(url: str, server: uvicorn.Server, upstream: UpstreamClient, fleet: Fleet,
                     baseline: collections.Counter[str], options: SoakOptions) -> dict[str, Any]:
    """Poll until nothing is left over, or `options.settle` seconds; then what is."""
    router_port = int(url.rsplit(":", 1)[1])
    deadline = time.monotonic() + options.settle
    while True:
        fleet.harvest()
        flights = await in_flight(url)
        tasks = task_counts()
        extra = {name: n - baseline[name] for name, n in tasks.items() if n > baseline[name]}
        found: dict[str, Any] = {
            "in_flight": {k: v for k, v in flights.items() if v != 0},
            "extra_tasks": extra,
            "downstream_connections": len(server.server_state.connections),
            "downstream_request_tasks": len(server.server_state.tasks),
            "fake_requests_running": fleet.running(),
            "half_closed_sockets": half_closed_sockets(fleet.ports(), router_port) or 0,
            **connection_leaks(upstream.connections(), fleet.connections()),
        }
        if not any(found.values()) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    return {
        "leaked": {k: v for k, v in found.items() if v},
        "tasks": {"baseline": sum(baseline.values()), "after": sum(tasks.values())},
        "upstream_connections": {"at_the_fakes": fleet.connections(),
                                 **dataclasses.asdict(upstream.connections())},
        "in_flight_endpoints": len(flights),
    }


# --- the run -------------------------------------------------------------------------


async def warm_up(url: str) -> None:
    """One fault-free request of each kind: probes done, pools opened."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout()) as session:
        kinds = [(route, stream, mode) for route in ROUTES for stream in (False, True) for mode in MODES]
        for i, (route, stream, mode) in enumerate(kinds):
            outcome, body = new_request(f"warm-up-{i}", route, stream, mode, 4)
            done = await send(session, url, outcome, body, 30.0)
            if done.kind != "ok":
                raise RuntimeError(f"a warm-up request failed, before any fault: {done}")


async def run_soak(options: SoakOptions) -> dict[str, Any]:
    """Run the soak; return the report (also written to `options.out` when set)."""
    seed = options.seed if options.seed is not None else random.randrange(1 << 31)
    fleet = await start_fleet(options, seed)
    rate = per_server_rate(options.fault_rate)
    logs, fake_logs = LogCounter(ROUTER_LOGGERS), LogCounter(FAKE_LOGGERS)
    try:
        with logs.installed(), fake_logs.installed():
            async with serve_router(router_config(fleet, options)) as (url, server, upstream):
                await warm_up(url)
                await asyncio.sleep(0.2)
                fleet.harvest()
                baseline = task_counts()
                print(f"soak: {options.requests} requests, {options.concurrency} at once, "
                      f"{options.fault_rate:.1%} meet a fault ({rate:.2%} per server), "
                      f"{options.prefills} P + {options.decodes} D, seed {seed}", flush=True)
                fleet.set_fault_rate(rate)
                tally, lag = Tally(options.requests), LoopLag()
                watchers = [asyncio.create_task(lag.watch())]
                if options.progress > 0:
                    watchers.append(asyncio.create_task(
                        report_progress(tally, fleet, options.progress)))
                try:
                    await load(url, options, random.Random(seed), tally)
                finally:
                    for watcher in watchers:
                        watcher.cancel()
                    await asyncio.gather(*watchers, return_exceptions=True)
                wall = time.perf_counter() - tally.started
                print(tally.line(), flush=True)
                fleet.set_fault_rate(0.0)
                leaks = await read_leaks(url, server, upstream, fleet, baseline, options)
    finally:
        for runner in fleet.runners:
            await runner.cleanup()
    report = build_report(options, seed, rate, wall, tally, fleet, leaks, lag, logs, fake_logs)
    print_summary(report)
    if options.out is not None:
        options.out.parent.mkdir(parents=True, exist_ok=True)
        options.out.write_text(json.dumps(report, indent=2))
        print(f"wrote {options.out}")
    return report


def build_report(options: SoakOptions, seed: int, rate: float, wall: float, tally: Tally,
                 fleet: Fleet, leaks: dict[str, Any], lag: LoopLag, logs: LogCounter,
                 fake_logs: LogCounter) -> dict[str, Any]:
    faulted = [o for o in tally.outcomes if fleet.faults.get(o.request_id)]
    failed = [o for o in tally.outcomes if o.kind != "ok" and not fleet.faults.get(o.request_id)]
    unexplained = [o for o in failed if not lag.descheduled(o)]
    by_fault: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for o in faulted:
        by_fault[" + ".join(sorted(fleet.faults[o.request_id]))][o.kind] += 1
    client_ids = {o.request_id for o in tally.outcomes}
    outside = sum(len(v) for k, v in fleet.faults.items() if k not in client_ids)
    options_out = {k: str(v) if isinstance(v, Path) else v
                   for k, v in dataclasses.asdict(options).items()}
    report = {
        "options": {**options_out, "seed": seed, "fault_rate_per_server": round(rate, 5)},
        "wall_s": round(wall, 1),
        "req_per_s": round(len(tally.outcomes) / wall, 1),
        "outcomes": {k: tally.counts[k] for k in OUTCOMES},
        "faults_injected": dict(sorted(fleet.injected.items())),
        "faulted_requests": len(faulted),
        "faulted_requests_ok": sum(o.kind == "ok" for o in faulted),
        "faults_outside_client_requests": outside,  # probes of P's coordinates
        "outcomes_by_fault": {k: dict(v) for k, v in sorted(by_fault.items())},
        "unexplained": len(unexplained),
        # failed with no fault injected, but while this process was not run (see LoopLag)
        "failed_while_descheduled": len(failed) - len(unexplained),
        "leaks": leaks["leaked"],
        "resources": {k: v for k, v in leaks.items() if k != "leaked"},
        "loop_lag": lag.report(tally.started),
        "router_log": {"counts": dict(logs.counts), "messages": logs.messages},
        "fake_log": {"counts": dict(fake_logs.counts), "messages": fake_logs.messages[:3]},
        "examples": {
            "bad": examples(tally, fleet, "bad"),
            "hang": examples(tally, fleet, "hang"),
            "unexplained": [describe(o, fleet, tally.started) for o in unexplained[:EXAMPLES]],
        },
    }
    report["passed"] = not (report["outcomes"]["bad"] or report["outcomes"]["hang"]
                            or report["unexplained"] or report["leaks"])
    return report


def examples(tally: Tally, fleet: Fleet, kind: str) -> list[dict[str, Any]]:
    return [describe(o, fleet, tally.started) for o in tally.outcomes if o.kind == kind][:EXAMPLES]


def describe(o: Outcome, fleet: Fleet, started: float) -> dict[str, Any]:
    """One request for the report; `sent_at` in seconds into the load."""
    return {**dataclasses.asdict(o), "seconds": round(o.seconds, 3),
            "sent_at": round(o.sent_at - started, 2), "faults": fleet.faults.get(o.request_id, [])}


def print_summary(report: dict[str, Any]) -> None:
    outcomes = ", ".join(f"{k} {v}" for k, v in report["outcomes"].items())
    print(f"outcomes: {outcomes} in {report['wall_s']} s ({report['req_per_s']} req/s)")
    injected = ", ".join(f"{k} {v}" for k, v in report["faults_injected"].items()) or "none"
    print(f"faults injected: {injected}; {report['faulted_requests']} requests met one "
          f"({report['faulted_requests_ok']} still ok)")
    for fault, counts in report["outcomes_by_fault"].items():
        print(f"  {fault:<40} " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    print(f"unexplained errors (no fault injected): {report['unexplained']}")
    print(f"leaks: {report['leaks'] or 'none'}  ({report['resources']})")
    lag = report["loop_lag"]
    if lag["stalls"]:
        print(f"WARNING: the event loop stood still {len(lag['stalls'])} times for 1 s or more "
              f"(max {lag['max_s']} s): {lag['stalls'][:5]}; "
              f"{report['failed_while_descheduled']} requests failed with no fault injected while "
              "the machine did not run this process (not counted as unexplained): run again on "
              "a quieter machine")
    counts = report["router_log"]["counts"]
    if counts:
        print(f"router log: {counts}; first: {report['router_log']['messages'][0]}")
    for kind in ("bad", "hang", "unexplained"):
        for example in report["examples"][kind][:3]:
            print(f"  {kind}: {example['route']} stream={example['stream']} mode={example['mode']}"
                  f" (used {example['used_mode']}) faults={example['faults']}: {example['saw']}")
    print("PASSED" if report["passed"] else "FAILED")


def parse_args(argv: list[str] | None = None) -> SoakOptions:
    d = SoakOptions()
    parser = argparse.ArgumentParser(prog="python -m scripts.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=d.requests, help="requests to send in all")
    parser.add_argument("--concurrency", type=int, default=d.concurrency, help="requests in flight")
    parser.add_argument("--fault-rate", type=float, default=d.fault_rate,
                        help="share of requests (0..1) that meet an injected fault, about")
    parser.add_argument("--fault-kinds", nargs="+", choices=FAULT_KINDS, default=d.fault_kinds,
                        help="the faults to inject (default: all)")
    parser.add_argument("--fault-slow", type=float, default=d.fault_slow_s, dest="fault_slow_s",
                        help="seconds a `slow` fault delays an answer")
    parser.add_argument("--prefills", type=int, default=d.prefills, help="fake P servers")
    parser.add_argument("--decodes", type=int, default=d.decodes, help="fake D servers")
    parser.add_argument("--deadline", type=float, default=d.deadline,
                        help="seconds a client waits for a whole answer; longer is a hang")
    parser.add_argument("--upstream-timeout", type=float, default=d.upstream_timeout,
                        help="the router's connect, prefill, first-token, stream-idle and probe timeouts")
    parser.add_argument("--settle", type=float, default=d.settle,
                        help="seconds after the load for counters to come back, before leaks are read")
    parser.add_argument("--progress", type=float, default=d.progress,
                        help="seconds between progress lines (0: none)")
    parser.add_argument("--seed", type=int, help="seed of the request mix and the faults (default: random, printed)")
    parser.add_argument("--out", type=Path, default=d.out, help="JSON report (default %(default)s)")
    args = parser.parse_args(argv)
    if not 0.0 <= args.fault_rate < 1.0:
        parser.error("--fault-rate must be within 0..1 (1 excluded)")
    return SoakOptions(**vars(args))


def main(argv: list[str] | None = None) -> int:
    options = parse_args(argv)
    try:
        import uvloop
    except ImportError:
        report = asyncio.run(run_soak(options))
    else:
        report = uvloop.run(run_soak(options))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
