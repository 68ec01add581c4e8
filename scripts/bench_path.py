"""The request path's CPU, measured in one process: steady enough to compare two
revisions of the path a few percent apart, which the overhead scenario's figures on a
shared 2-core machine are not (they move by up to 15% between rounds).

The emulated P and D (`benchkit`'s canned fakes), the router and a closed-loop client
(`--concurrency` connections, each sending its next request when an answer ends) all run
on one uvloop event loop in this process, over real loopback sockets; pull mode, one P
and one D. It prints the process's CPU time per request (router, fakes and client
together, so no other process's scheduling or wake-ups come into it) and, with
`--calls`, the Python function calls per request (the compiled modules of a build
with them, setup.py, make none: count a pure build, PDPROXY_COMPILE=0). `--target
floor` runs `scripts.floor_router`'s pull (callbacks, no features) on the same loop: the least a
Python router spends here; ours minus floor is the price of the router's features.
`--profile N` prints the N functions with the most own time (cProfile: its overhead
weighs small functions more). `--bytecodes N` counts the bytecodes Python executes per
request, in all and in the N functions and the N source files that execute the most (a
trace of every bytecode: slow, but the same count within a few every run, where the
time moves by a few percent between runs; no C code is in it, and a bytecode's cost
varies).

    python -m scripts.bench_path                      # ours and the floor, 20,000 requests
    python -m scripts.bench_path --target ours --stream --profile 30
    python -m scripts.bench_path --target ours -n 2000 --bytecodes 40
    python -m scripts.bench_path --target ours --checkout ../before   # another revision
    python -m scripts.bench_path --target ours,kv --servers 2 --prompt-tokens 1024 --rounds 3

`--target kv` runs our router with kv_aware on both clusters, against fakes with a
prefix cache that publishes KV events and answers /tokenize (`--servers` of each; a
policy scores only between candidates): `--target ours,kv --servers 2 --prompt-tokens
1024` prints kv_aware's CPU over the default policy's, measured on the same fakes.

Leaves out: the load generator's and the fakes' own processes (all share one), more than
one worker, and the kernel's cost of waking another process, which the overhead scenario
has.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import functools
import gc
import importlib
import json
import logging
import pstats
import sys
import sysconfig
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httptools
import uvloop

from scripts import floor_router
from scripts.benchkit import DEFAULT_PROMPT, _BenchKV, _FakeProtocol, request_body

TARGETS = ("ours", "kv", "floor", "direct")


class _Bytecodes:
    """Counts the bytecodes each Python function executes while enabled (`sys.settrace`
    with opcode events), and the frames entered. Enabled and disabled around the
    measured load as a profiler is."""

    def __init__(self) -> None:
        self.executed: dict[Any, int] = {}  # code object -> bytecodes executed
        self.entered: dict[Any, int] = {}  # code object -> frames entered (resumed too)

    def _trace(self, frame: Any, event: str, _: Any) -> Any:
        code = frame.f_code
        if event == "opcode":
            self.executed[code] = self.executed.get(code, 0) + 1
        elif event == "call":
            frame.f_trace_opcodes = True
            self.entered[code] = self.entered.get(code, 0) + 1
        return self._trace

    def enable(self) -> None:
        sys.settrace(self._trace)

    def disable(self) -> None:
        sys.settrace(None)

    def top(self, n: int, requests: int) -> list[str]:
        """The `n` functions that execute the most bytecodes, per request, then the `n`
        source files that do."""
        rows = sorted(self.executed.items(), key=lambda item: -item[1])[:n]
        files: dict[str, int] = {}
        for code, count in self.executed.items():
            where = _where(code.co_filename)
            files[where] = files.get(where, 0) + count
        return [f"{count / requests:8.1f} {self.entered.get(code, 0) / requests:5.1f}  "
                f"{_where(code.co_filename)}:{code.co_firstlineno} {code.co_name}"
                for code, count in rows] + [
            f"{count / requests:8.1f}        {where} (the file's functions)"
            for where, count in sorted(files.items(), key=lambda item: -item[1])[:n]]


# Where source files are named from: the installed packages, the standard library, this
# project (in that order: the first two may lie under the project's virtualenv).
_SOURCE_ROOTS = (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["stdlib"],
                 str(Path(__file__).resolve().parents[1]))


def _where(path: str) -> str:
    """A source file's path, from the package, the library or the project it is in."""
    for root in _SOURCE_ROOTS:
        if path.startswith(root + "/"):
            return path[len(root) + 1:]
    return path


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
                profile: cProfile.Profile | _Bytecodes | None,
                prompt: str = DEFAULT_PROMPT) -> tuple[int, float, float]:
    """`requests` answers over `concurrency` connections: (answers, CPU s, wall s)."""
    loop = asyncio.get_running_loop()
    body = json.dumps(request_body(stream, prompt)).encode()
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
    """One round of `target`, on fresh fakes: `args.servers` P and as many D (with a
    prefix cache each when kv_aware runs in this invocation, so that both policies
    meet the same fakes)."""
    loop = asyncio.get_running_loop()
    async with contextlib.AsyncExitStack() as fakes:
        urls: dict[str, list[str]] = {"prefill": [], "decode": []}
        for role in urls:
            for _ in range(args.servers):
                kv = None
                if args.kv_fakes:
                    kv = _BenchKV()
                    fakes.push_async_callback(kv.cache.aclose)
                fake = await loop.create_server(
                    functools.partial(_FakeProtocol, role, kv=kv), "127.0.0.1", 0)
                await fakes.enter_async_context(fake)
                urls[role].append(f"http://127.0.0.1:{fake.sockets[0].getsockname()[1]}")
        return await _measure_on(target, args, urls["prefill"], urls["decode"])


async def _kv_synced(url: str, sources: int) -> None:
    """Wait (bounded) until the router's KV index is in sync with `sources` publishers,
    so that no measured pick falls back to load alone."""
    import httpx

    synced: list[str] = []
    try:
        async with httpx.AsyncClient() as client, asyncio.timeout(30):
            while len(synced) < sources:
                await asyncio.sleep(0.05)
                text = (await client.get(f"{url}/metrics")).text
                synced = [line for line in text.splitlines()
                          if line.startswith("pdproxy_kv_index_synced{") and line.endswith(" 1.0")]
    except TimeoutError:
        raise BenchFailed(f"followed the KV events of {len(synced)} of {sources} fake servers "
                          f"after 30 s") from None


async def _measure_on(target: str, args: argparse.Namespace, p_urls: list[str],
                      d_urls: list[str]) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    p_url, d_url = p_urls[0], d_urls[0]
    ports = [int(url.rsplit(":", 1)[1]) for url in (p_url, d_url)]
    # as `pd-proxy serve` runs: the start's objects frozen, collections rarer (proxy.serve)
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)
    profile: cProfile.Profile | _Bytecodes | None = (
        _Bytecodes() if args.bytecodes else cProfile.Profile() if args.calls or args.profile
        else None)

    async def warmed_up_load(port: int) -> tuple[int, float, float]:
        await _load(port, args.requests // 5, args.concurrency, args.stream, None, args.prompt)
        return await _load(port, args.requests, args.concurrency, args.stream, profile,
                           args.prompt)

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

        policy = "kv_aware" if target == "kv" else "least_outstanding"
        config = build_config({"prefill": [{"url": u} for u in p_urls],
                               "decode": [{"url": u} for u in d_urls],
                               "balance": {"prefill": policy, "decode": policy},
                               "mode": "pull", "log_level": "warning",
                               **({} if args.health_interval is None
                                  else {"health": {"interval": args.health_interval}})}, {})
        async with serving(create_app(config), config=config) as (url, _):
            if target == "kv":
                await _kv_synced(url, len(p_urls) + len(d_urls))
            answers, cpu, wall = await warmed_up_load(int(url.rsplit(":", 1)[1]))
    result: dict[str, Any] = {"target": target, "requests": answers,
                              "cpu_us_per_request": round(cpu / answers * 1e6, 1),
                              "req_per_s": round(answers / wall)}
    if isinstance(profile, _Bytecodes):
        result["bytecodes_per_request"] = round(sum(profile.executed.values()) / answers)
        result["frames_per_request"] = round(sum(profile.entered.values()) / answers, 1)
        result["top_bytecodes"] = profile.top(args.bytecodes, answers)
    elif profile is not None:
        stats = pstats.Stats(profile)
        result["calls_per_request"] = round(stats.total_calls / answers, 1)  # type: ignore[attr-defined]
        if args.profile:
            stats.sort_stats("tottime").print_stats(args.profile)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.bench_path", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=_targets, default="ours,floor",
                        help="comma-separated, measured in turn each round: ours (default "
                             "policy), kv (ours with kv_aware), floor (the floor router), "
                             "direct (the client straight to the fake D: what the harness "
                             "itself spends, about two thirds of its share under a router, "
                             "which adds the fake P's); both: ours,floor (default)")
    parser.add_argument("--requests", "-n", type=int, default=20_000,
                        help="requests measured, after a fifth as many to warm up")
    parser.add_argument("--concurrency", "-c", type=int, default=32)
    parser.add_argument("--stream", action="store_true", help="streamed requests")
    parser.add_argument("--servers", type=int, default=1,
                        help="fake P and D servers, each (ours and kv; a policy scores only "
                             "between candidates)")
    parser.add_argument("--prompt-tokens", type=int, metavar="N",
                        help="a prompt of N words (one token each to the fake tokenizer; "
                             "default: a 2-word prompt)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure each target this many times (fresh servers each)")
    parser.add_argument("--calls", action="store_true",
                        help="also count Python function calls per request (slower)")
    parser.add_argument("--profile", type=int, metavar="N", default=0,
                        help="print the N functions with the most own time")
    parser.add_argument("--bytecodes", type=int, metavar="N", default=0,
                        help="count the bytecodes executed per request, and print the N "
                             "functions that execute the most (bytecodes, frames entered "
                             "per request; very slow: use -n 2000)")
    parser.add_argument("--health-interval", type=float, metavar="S",
                        help="seconds between the router's health checks of the fakes "
                             "(default: the router's, 5; 0: none). Under valgrind a round "
                             "of checks waits behind the load past its time limit, the "
                             "fakes are taken out and the router answers 503: use 0 there")
    parser.add_argument("--checkout", metavar="DIR",
                        help="run our router from another checkout's proxy/ and connector/ "
                             "(the fakes and the client stay this one's)")
    args = parser.parse_args(argv)
    if args.servers < 1 or (args.prompt_tokens is not None and args.prompt_tokens < 1):
        parser.error("--servers and --prompt-tokens must be >= 1")
    if args.health_interval is not None and args.health_interval < 0:
        parser.error("--health-interval must be >= 0")
    args.prompt = (DEFAULT_PROMPT if args.prompt_tokens is None
                   else " ".join(f"word{i}" for i in range(args.prompt_tokens)))
    args.kv_fakes = "kv" in args.target
    logging.getLogger("pdproxy").setLevel(logging.ERROR)  # the start's notices (open routes)
    if args.checkout:
        if "proxy" in sys.modules:
            parser.error("--checkout: the router's code was imported already")
        # the fakes' prefix cache (imported when a fake starts) stays this checkout's
        importlib.import_module("testbed.fake_kv_cache")
        sys.path.insert(0, args.checkout)
    targets = args.target
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
            if "bytecodes_per_request" in result:
                calls = (f" traced, {result['bytecodes_per_request']} bytecodes and "
                         f"{result['frames_per_request']} frames entered")
            print(f"round {round_ + 1} {target}: {result['cpu_us_per_request']} us CPU per "
                  f"request{calls} ({result['req_per_s']} req/s, {result['requests']} requests)",
                  flush=True)
            if result.get("top_bytecodes"):
                print(" bytecodes frames  function (per request)")
                print("\n".join(result["top_bytecodes"]), flush=True)
    # traced, the bytecodes are the measure (the tracing's CPU is not)
    measure, what = (("bytecodes_per_request", "bytecodes") if args.bytecodes
                     else ("cpu_us_per_request", "CPU"))
    for first, second in (("ours", "floor"), ("kv", "ours")):
        if first in targets and second in targets:
            ratios = sorted(a[measure] / b[measure]
                            for a, b in zip(results[targets.index(first)::len(targets)],
                                            results[targets.index(second)::len(targets)],
                                            strict=True))
            print(f"{first} / {second}, {what} per request: {ratios[len(ratios) // 2]:.2f} "
                  f"(median of {len(ratios)} rounds)")
    return 0


def _targets(text: str) -> list[str]:
    names = ["ours", "floor"] if text == "both" else text.split(",")
    unknown = [n for n in names if n not in TARGETS]
    if unknown or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"targets are a comma-separated list of "
                                         f"{', '.join(TARGETS)} (or both), each once")
    return names


if __name__ == "__main__":
    sys.exit(main())
