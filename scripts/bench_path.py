"""The request path's CPU, measured in one process: steady enough to compare two
revisions of the path a few percent apart, which the overhead scenario's figures on a
shared 2-core machine are not (they move by up to 15% between rounds).

The emulated P and D (`benchkit`'s canned fakes), the router and a closed-loop client
(`--concurrency` connections, each sending its next request when an answer ends) all run
on one uvloop event loop in this process, over real loopback sockets; pull mode, one P
and one D. It prints the process's CPU time per request (router, fakes and client
together, so no other process's scheduling or wake-ups come into it) and, with
`--calls`, the Python function calls per request. `--target floor` runs
`scripts.floor_router`'s pull (callbacks, no features) on the same loop: the least a
Python router spends here; ours minus floor is the price of the router's features.
`--profile N` prints the N functions with the most own time (cProfile: its overhead
weighs small functions more).

    python -m scripts.bench_path                      # ours and the floor, 20,000 requests
    python -m scripts.bench_path --target ours --stream --profile 30
    python -m scripts.bench_path --target ours --checkout ../before   # another revision

Leaves out: the load generator's and the fakes' own processes (all share one), more than
one worker, kv_aware's index (the default policy), and the kernel's cost of waking
another process, which the overhead scenario has.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import functools
import gc
import json
import logging
import pstats
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import httptools
import uvloop

from scripts import floor_router
from scripts.benchkit import _FakeProtocol, request_body


class BenchFailed(Exception):
    """The router answered something other than 200, or closed a connection."""


class _Client(asyncio.Protocol):
    """One client connection: sends `request` again as soon as each answer ends, until
    `more()` says stop. An answer other than 200, or the connection closing under it,
    fails the run (`fail`)."""

    def __init__(self, request: bytes, more: Callable[[], bool],
                 fail: Callable[[str], None]) -> None:
        self._request = request
        self._more = more
        self._fail = fail
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._closing = False
        self.answers = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._closing:
            self._fail(f"closed a connection ({exc or 'the router closed it'})")

    def data_received(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def on_message_complete(self) -> None:
        self.answers += 1
        status = self._parser.get_status_code()
        if status != 200:
            self._fail(f"answered {status}")
        elif self._more():
            self.send()

    def send(self) -> None:
        assert self._transport is not None
        self._transport.write(self._request)

    def close(self) -> None:
        self._closing = True
        if self._transport is not None:
            self._transport.close()


async def _load(port: int, requests: int, concurrency: int, stream: bool,
                profile: cProfile.Profile | None) -> tuple[int, float, float]:
    """`requests` answers over `concurrency` connections: (answers, CPU s, wall s)."""
    loop = asyncio.get_running_loop()
    body = json.dumps(request_body(stream)).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json"
               b"\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body))
    sent = concurrency
    outstanding = concurrency
    done = loop.create_future()

    def more() -> bool:
        nonlocal sent, outstanding
        outstanding -= 1
        if sent < requests:
            sent += 1
            outstanding += 1
            return True
        if outstanding == 0 and not done.done():
            done.set_result(None)
        return False

    def fail(why: str) -> None:
        if not done.done():
            done.set_exception(BenchFailed(f"the router {why}"))

    clients = []
    for _ in range(concurrency):
        _, client = await loop.create_connection(lambda: _Client(request, more, fail),
                                                 "127.0.0.1", port)
        clients.append(client)
    cpu, wall = time.process_time(), time.perf_counter()
    if profile is not None:
        profile.enable()
    for client in clients:
        client.send()
    try:
        async with asyncio.timeout(max(60.0, requests / 100)):
            await done
    finally:
        if profile is not None:
            profile.disable()
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        for client in clients:
            client.close()
    return sum(c.answers for c in clients), cpu, wall


async def _measure(target: str, args: argparse.Namespace) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    async with contextlib.AsyncExitStack() as fakes:
        ports = []
        for role in ("prefill", "decode"):
            fake = await loop.create_server(functools.partial(_FakeProtocol, role), "127.0.0.1", 0)
            await fakes.enter_async_context(fake)
            ports.append(fake.sockets[0].getsockname()[1])
        return await _measure_on(target, args, ports)


async def _measure_on(target: str, args: argparse.Namespace, ports: list[int]) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    p_url, d_url = (f"http://127.0.0.1:{port}" for port in ports)
    # as `pd-proxy serve` runs: the start's objects frozen, collections rarer (proxy.serve)
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)
    profile = cProfile.Profile() if args.calls or args.profile else None

    async def warmed_up_load(port: int) -> tuple[int, float, float]:
        await _load(port, args.requests // 5, args.concurrency, args.stream, None)
        return await _load(port, args.requests, args.concurrency, args.stream, profile)

    if target == "direct":  # the client straight to the fake D: the harness's own share
        answers, cpu, wall = await warmed_up_load(ports[1])
    elif target == "floor":
        p, d = floor_router.Pool(p_url), floor_router.Pool(d_url)
        server = await loop.create_server(lambda: floor_router.Client(p, d, False), "127.0.0.1", 0)
        async with server:
            answers, cpu, wall = await warmed_up_load(server.sockets[0].getsockname()[1])
    else:
        # here, not at the top: --checkout may put another revision's proxy/ first
        from proxy.api.app import create_app, serving
        from proxy.config import build_config

        config = build_config({"prefill": [{"url": p_url}], "decode": [{"url": d_url}],
                               "mode": "pull", "log_level": "warning"}, {})
        async with serving(create_app(config), config=config) as (url, _):
            answers, cpu, wall = await warmed_up_load(int(url.rsplit(":", 1)[1]))
    result: dict[str, Any] = {"target": target, "requests": answers,
                              "cpu_us_per_request": round(cpu / answers * 1e6, 1),
                              "req_per_s": round(answers / wall)}
    if profile is not None:
        stats = pstats.Stats(profile)
        result["calls_per_request"] = round(stats.total_calls / answers, 1)  # type: ignore[attr-defined]
        if args.profile:
            stats.sort_stats("tottime").print_stats(args.profile)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.bench_path", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", choices=["ours", "floor", "direct", "both"], default="both",
                        help="our router, the floor router, or both in turn (default); direct: "
                             "the client straight to the fake D (what the harness itself "
                             "spends: about two thirds of its share under a router, which "
                             "adds the fake P's)")
    parser.add_argument("--requests", "-n", type=int, default=20_000,
                        help="requests measured, after a fifth as many to warm up")
    parser.add_argument("--concurrency", "-c", type=int, default=32)
    parser.add_argument("--stream", action="store_true", help="streamed requests")
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure each target this many times (fresh servers each)")
    parser.add_argument("--calls", action="store_true",
                        help="also count Python function calls per request (slower)")
    parser.add_argument("--profile", type=int, metavar="N", default=0,
                        help="print the N functions with the most own time")
    parser.add_argument("--checkout", metavar="DIR",
                        help="run our router from another checkout's proxy/ and connector/ "
                             "(the fakes and the client stay this one's)")
    args = parser.parse_args(argv)
    logging.getLogger("pdproxy").setLevel(logging.ERROR)  # the start's notices (open routes)
    if args.checkout:
        if "proxy" in sys.modules:
            parser.error("--checkout: the router's code was imported already")
        sys.path.insert(0, args.checkout)
    targets = ["ours", "floor"] if args.target == "both" else [args.target]
    results = []
    for round_ in range(args.rounds):
        for target in targets:
            try:
                result = uvloop.run(_measure(target, args))
            except BenchFailed as exc:
                print(f"bench_path: {target}: {exc}", file=sys.stderr)
                return 1
            results.append(result)
            # cProfile's own overhead is in the CPU of a profiled round: not a measurement
            calls = (f" under cProfile, {result['calls_per_request']} Python calls"
                     if "calls_per_request" in result else "")
            print(f"round {round_ + 1} {target}: {result['cpu_us_per_request']} us CPU per "
                  f"request{calls} ({result['req_per_s']} req/s, {result['requests']} requests)",
                  flush=True)
    if len(targets) == 2:
        ratios = sorted(ours["cpu_us_per_request"] / floor["cpu_us_per_request"]
                        for ours, floor in zip(results[::2], results[1::2], strict=True))
        print(f"ours / floor, CPU per request: {ratios[len(ratios) // 2]:.2f} "
              f"(median of {len(ratios)} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
