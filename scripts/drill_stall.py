"""Drill: clients that open streams and never read, or read a trickle, must not take the
router down.

    python -m scripts.drill_stall                       # 1,000 stalled clients, ~90 s
    python -m scripts.drill_stall --stalled 200 --duration 30 --stall-timeout 1
    python -m scripts.drill_stall --log-level warning   # the router logs each cut
    python -m scripts.drill_stall --read-every 10 --read-bytes 1   # 1,000 slow readers
    python -m scripts.bench drill stall                 # the same, from the one command

What it proves: with `limits.max_connections: 64` (the upstream connections the router
may open), `--stalled` clients open long streams over `--ramp` seconds and never read a
byte (receive buffers of 4 KiB, set before connecting), while ordinary clients send a
request every `--interval` seconds for the whole `--duration`. Each stalled stream holds
an upstream connection until the router cuts its client (`timeouts.client_stall`) or
refuses it; an ordinary request must get an answer meanwhile: a 200, or a clean
OpenAI-shaped error (such as 503 with Retry-After when no upstream connection is free
within `timeouts.pool`, or at once over `limits.max_in_flight`). Target: no silent
request (no answer within `--answer-bound` seconds), and nothing left in flight once the
stalled streams have been dealt with.

With `--read-every S`, the stalled clients are slow readers instead: each reads
`--read-bytes` bytes of its answer every S seconds, however little, so that the router
sees some progress (a byte a time may show none: the kernel opens a full receive window
again only once about half of it is free). The router cuts them by
`limits.client_min_read_rate` (`--min-read-rate`, bytes per second over each
`--stall-timeout` of waiting on them: `slow_read`), or as stalled when it saw nothing.

The router runs in a process of its own, served as `pd-proxy serve` serves it (uvloop,
`proxy.api.listener`); fake P and D servers (`testbed.fake_vllm`) and the clients run in this
one. The router's listening socket gets a send buffer of `--sndbuf` bytes (inherited by
every accepted connection): on loopback the kernel would otherwise queue megabytes per
connection before the router's own buffer fills and its stall clock starts, so the drill
would spend minutes generating tokens into kernel buffers (0 keeps the kernel's
autotuning).

It prints a progress line every 5 s, then: ordinary requests answered (200, clean
errors by status), malformed and silent ones; the cuts the router counted
(`pdproxy_client_cuts_total`); what the stalled clients saw (cut, refused, or still
streaming); and `pdproxy_endpoint_in_flight` at the end. Exit status 0 only with no
silent and no malformed answer and nothing in flight at the end.

What it leaves out: real vLLM servers (fake P and D answer), and speed: it checks that
every request is answered, not how fast.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import resource
import socket
import sys
import time
from typing import Any

import httpx
import uvicorn
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from proxy.api.app import create_app
from proxy.api.listener import server_config
from proxy.config import build_config
from testbed.fake_vllm import FakeVLLM

STALLED_RCVBUF = 4096
STALLED_TOKENS = 100_000  # a stalled stream lasts longer than the drill (the fake makes a list of them)


@dataclasses.dataclass
class Options:
    stalled: int
    ramp: float
    duration: float
    interval: float
    stall_timeout: float
    max_connections: int
    answer_bound: float
    token_delay: float
    sndbuf: int
    log_level: str
    read_every: float = 0.0  # the stalled clients read every this many seconds (0: never)
    read_bytes: int = 1  # this many bytes each time
    min_read_rate: int = 1024  # the router's limits.client_min_read_rate


@dataclasses.dataclass
class Tally:
    """What the ordinary clients got."""

    ok: int = 0
    errors: collections.Counter[int] = dataclasses.field(default_factory=collections.Counter)
    malformed: int = 0  # an answer that is neither a 200 nor an OpenAI-shaped error
    silent: int = 0  # no answer within the bound (or the connection failed without one)
    pending: int = 0

    def line(self) -> str:
        errors = ", ".join(f"{status}: {n}" for status, n in sorted(self.errors.items()))
        return (f"ordinary: {self.ok} ok, errors {{{errors}}}, {self.malformed} malformed, "
                f"{self.silent} silent, {self.pending} pending")


# The router, in its own process


def serve_router(values: dict[str, Any], sndbuf: int, log_level: str,
                 ports: multiprocessing.connection.Connection) -> None:
    """Run the router on 127.0.0.1 (a free port, sent back on `ports`) until SIGTERM."""
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = build_config(values, {})
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if sndbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    sock.bind(("127.0.0.1", 0))
    sock.listen(4096)
    ports.send(sock.getsockname()[1])
    ports.close()
    server = uvicorn.Server(server_config(create_app(config), config, log_level=log_level))
    server.run(sockets=[sock])


# The clients


def stream_request(tokens: int) -> bytes:
    body = b'{"model": "fake-model", "prompt": "hi", "stream": true, "max_tokens": %d}' % tokens
    return (b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json"
            b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))


async def open_stalled(port: int, count: int, ramp: float, out: list[socket.socket],
                       failures: list[str]) -> None:
    """Open `count` streams over `ramp` seconds; never read them."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    request = stream_request(STALLED_TOKENS)
    for i in range(count):
        delay = started + ramp * i / count - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, STALLED_RCVBUF)
        try:
            async with asyncio.timeout(10):
                await loop.sock_connect(sock, ("127.0.0.1", port))
                await loop.sock_sendall(sock, request)
        except (OSError, TimeoutError) as exc:
            failures.append(repr(exc))
            sock.close()
            continue
        out.append(sock)


async def read_slowly(socks: list[socket.socket], every: float, size: int,
                      heads: dict[int, bytes]) -> None:
    """Every `every` seconds, each open socket of `socks` (more join as they connect)
    reads `size` bytes if any are there; the first 64 bytes each got go to `heads`."""
    closed: set[int] = set()
    while True:
        await asyncio.sleep(every)
        for sock in list(socks):
            if sock.fileno() in closed:
                continue
            try:
                data = sock.recv(size)
            except BlockingIOError:
                continue
            except OSError:  # reset: cut by the router
                closed.add(sock.fileno())
                continue
            if not data:
                closed.add(sock.fileno())
                continue
            head = heads.get(sock.fileno(), b"")
            if len(head) < 64:
                heads[sock.fileno()] = head + data


def stalled_outcome(sock: socket.socket, heads: dict[int, bytes]) -> str:
    """The status line a stalled client got (read at the end, without waiting; a slow
    reader's from what it read). Whether it was cut the router's counters say: a cut
    client may still be receiving what the kernel had queued for it before the cut."""
    head = heads.get(sock.fileno(), b"")
    if len(head) < 64:
        try:
            head += sock.recv(64 - len(head), socket.MSG_PEEK)
        except BlockingIOError:
            pass
        except OSError as exc:
            if not head:
                return f"error {exc.errno}"
    if not head:
        return "no answer"
    line = head.split(b"\r\n", 1)[0].decode("latin-1", "replace")
    return line.removeprefix("HTTP/1.1 ") if line else "closed, no answer"


async def ordinary_request(client: httpx.AsyncClient, bound: float, tally: Tally) -> None:
    tally.pending += 1
    try:
        async with asyncio.timeout(bound):
            r = await client.post("/v1/completions",
                                  json={"model": "fake-model", "prompt": "hello", "max_tokens": 4})
    except (TimeoutError, httpx.HTTPError):
        tally.silent += 1
        return
    finally:
        tally.pending -= 1
    if r.status_code == 200 and "choices" in r.json():
        tally.ok += 1
        return
    try:
        message = r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = None
    if isinstance(message, str) and message:
        tally.errors[r.status_code] += 1
    else:
        tally.malformed += 1


async def ordinary_clients(url: str, options: Options, tally: Tally) -> None:
    """A request every `interval` seconds for `duration` seconds; then their answers."""
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=20)
    async with httpx.AsyncClient(base_url=url, timeout=options.answer_bound,
                                 limits=limits) as client:
        tasks: list[asyncio.Task[None]] = []
        loop = asyncio.get_running_loop()
        started = loop.time()
        while loop.time() - started < options.duration:
            tasks.append(asyncio.create_task(ordinary_request(client, options.answer_bound, tally)))
            await asyncio.sleep(options.interval)
        await asyncio.gather(*tasks)


async def metric(client: httpx.AsyncClient, name: str, **labels: str) -> float:
    text = (await client.get("/metrics")).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


async def drill(options: Options) -> int:
    p = FakeVLLM("prefill", engine_id="engine-p0")
    d = FakeVLLM("decode", engine_id="engine-d0")
    d.behavior.tokens = STALLED_TOKENS  # ordinary requests ask for 4
    d.behavior.token_delay = options.token_delay
    runners: list[web.AppRunner] = []
    urls: list[str] = []
    for fake in (p, d):
        runner = web.AppRunner(fake.app, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=4096)
        await site.start()
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}")
    values = {
        "prefill": [urls[0]], "decode": [urls[1]],
        "limits": {"max_connections": options.max_connections,
                   "client_min_read_rate": options.min_read_rate},
        "timeouts": {"client_stall": options.stall_timeout},
    }
    spawn = multiprocessing.get_context("spawn")
    ports, child_end = spawn.Pipe(duplex=False)
    router = spawn.Process(target=serve_router, name="drill-router",
                           args=(values, options.sndbuf, options.log_level, child_end))
    router.start()
    child_end.close()
    stalled: list[socket.socket] = []
    loop = asyncio.get_running_loop()
    try:
        if not await loop.run_in_executor(None, ports.poll, 30):
            raise RuntimeError("the router process did not start")
        port = int(ports.recv())
        url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=url, timeout=30) as control:
            async with asyncio.timeout(30):
                while True:
                    with contextlib.suppress(httpx.TransportError):
                        if (await control.get("/health")).status_code == 200:
                            break
                    await asyncio.sleep(0.1)
            readers = (f"slow readers ({options.read_bytes} bytes every "
                       f"{options.read_every:g} s)" if options.read_every else "stalled clients")
            print(f"router on {url} (pid {router.pid}); max_connections "
                  f"{options.max_connections}, client_stall {options.stall_timeout:g} s, "
                  f"client_min_read_rate {options.min_read_rate} B/s; {options.stalled} "
                  f"{readers} over {options.ramp:g} s, an ordinary request every "
                  f"{options.interval:g} s for {options.duration:g} s", flush=True)
            return await run_load(options, port, control, d, stalled)
    finally:
        for sock in stalled:
            sock.close()
        router.terminate()
        await loop.run_in_executor(None, router.join, 40)
        if router.is_alive():
            router.kill()
        for runner in runners:
            await runner.cleanup()


async def run_load(options: Options, port: int, control: httpx.AsyncClient, d: FakeVLLM,
                   stalled: list[socket.socket]) -> int:
    tally = Tally()
    connect_failures: list[str] = []
    started = time.perf_counter()
    opener = asyncio.create_task(
        open_stalled(port, options.stalled, options.ramp, stalled, connect_failures))
    ordinary = asyncio.create_task(ordinary_clients(str(control.base_url), options, tally))
    heads: dict[int, bytes] = {}
    reader = asyncio.create_task(read_slowly(stalled, options.read_every, options.read_bytes,
                                             heads)) if options.read_every else None

    async def progress() -> None:
        while True:
            await asyncio.sleep(5)
            cuts = await metric(control, "pdproxy_client_cuts_total")
            in_flight = await metric(control, "pdproxy_endpoint_in_flight")
            print(f"{time.perf_counter() - started:6.1f}s  stalled open {len(stalled)}, "
                  f"cuts {cuts:.0f}, in flight {in_flight:.0f}, D streams running {d.active}; "
                  f"{tally.line()}", flush=True)

    reporter = asyncio.create_task(progress())
    try:
        await asyncio.gather(opener, ordinary)
        # The stalled streams still running get cut within client_stall (plus the time
        # their buffers take to fill); wait for that, at most two minutes.
        deadline = time.perf_counter() + min(options.stall_timeout + 30, 120)
        while (in_flight := await metric(control, "pdproxy_endpoint_in_flight")) and (
            time.perf_counter() < deadline
        ):
            await asyncio.sleep(0.5)
    finally:
        reporter.cancel()
        if reader is not None:
            reader.cancel()
    cuts = {reason: await metric(control, "pdproxy_client_cuts_total", reason=reason)
            for reason in ("stall", "slow_read", "slow_request")}
    refused = await metric(control, "pdproxy_rejected_total")
    seen = collections.Counter(stalled_outcome(sock, heads) for sock in stalled)
    print(f"\nafter {time.perf_counter() - started:.1f} s")
    print(tally.line())
    print(f"cuts counted: stall {cuts['stall']:.0f}, slow_read {cuts['slow_read']:.0f}, "
          f"slow_request {cuts['slow_request']:.0f}; refused (pdproxy_rejected_total) "
          f"{refused:.0f}")
    print("stalled clients' answers: " + ", ".join(f"{k}: {n}" for k, n in seen.most_common())
          + (f", could not connect: {len(connect_failures)}" if connect_failures else ""))
    print(f"pdproxy_endpoint_in_flight at the end: {in_flight:.0f}")
    failed = tally.silent or tally.malformed or in_flight
    print("FAIL" if failed else "OK: no silent request, nothing left in flight")
    return 1 if failed else 0


def raise_fd_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))  # the router inherits it


def parse_args(argv: list[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.drill_stall", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stalled", type=int, default=1000,
                        help="clients that open a stream and never read (default 1000)")
    parser.add_argument("--ramp", type=float, default=30.0,
                        help="seconds over which the stalled clients connect (default 30)")
    parser.add_argument("--duration", type=float, default=60.0,
                        help="seconds the ordinary clients send requests (default 60)")
    parser.add_argument("--interval", type=float, default=0.2,
                        help="seconds between two ordinary requests (default 0.2)")
    parser.add_argument("--stall-timeout", type=float, default=2.0,
                        help="the router's timeouts.client_stall in seconds (default 2)")
    parser.add_argument("--max-connections", type=int, default=64,
                        help="the router's limits.max_connections (default 64)")
    parser.add_argument("--answer-bound", type=float, default=30.0,
                        help="an ordinary request unanswered this long is silent (default 30)")
    parser.add_argument("--token-delay", type=float, default=0.001,
                        help="the fake D's pause between streamed tokens (default 0.001)")
    parser.add_argument("--sndbuf", type=int, default=65536,
                        help="send buffer of the router's client connections in bytes; "
                             "0: the kernel's autotuning (default 65536)")
    parser.add_argument("--read-every", type=float, default=0.0,
                        help="the stalled clients read every this many seconds instead of "
                             "never (default 0: never)")
    parser.add_argument("--read-bytes", type=int, default=1,
                        help="bytes each slow reader reads each time (default 1)")
    parser.add_argument("--min-read-rate", type=int, default=1024,
                        help="the router's limits.client_min_read_rate in bytes per second "
                             "(default 1024)")
    parser.add_argument("--log-level", default="error",
                        choices=["debug", "info", "warning", "error"],
                        help="the router's log level; warning shows each cut (default error)")
    a = parser.parse_args(argv)
    return Options(a.stalled, a.ramp, a.duration, a.interval, a.stall_timeout,
                   a.max_connections, a.answer_bound, a.token_delay, a.sndbuf, a.log_level,
                   a.read_every, a.read_bytes, a.min_read_rate)


def main(argv: list[str] | None = None) -> int:
    options = parse_args(argv)
    raise_fd_limit(2 * options.stalled + 1024)
    return asyncio.run(drill(options))


if __name__ == "__main__":
    sys.exit(main())
