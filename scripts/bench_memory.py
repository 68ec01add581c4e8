"""Memory benchmark: does the router's memory stay flat under healthy traffic?

    .venv/bin/python -m scripts.bench_memory                       # 400,000 requests
    .venv/bin/python -m scripts.bench_memory --requests 20000 --warmup-seconds 12  # short
    .venv/bin/python -m scripts.bench_memory --out bench-results/memory.json
    .venv/bin/python -m scripts.bench memory                       # the same, from the one command

The router runs as production runs it: a subprocess `python -m proxy serve --config FILE`
(so with the CLI's `gc.freeze()` and collector thresholds), in front of one fake P and
one fake D (`testbed.fake_vllm`, each its own process, so their memory is not counted).
This process is the client: `--concurrency` workers send healthy requests, every one
answered 200, a mix of completions and chat, streamed and not, each with its own
X-Request-Id (or none, for the router to make one).

First a warm-up (`--warmup` requests and at least `--warmup-seconds`, both modes) fills
every cache, pool, lazy structure and sliding window the router has; then the measured run: `--requests` requests, half in pull mode
then half in push mode (`X-KV-Transfer-Mode`). The router's resident memory (VmRSS) is
sampled every `--sample-every` requests; a phase's growth is the least-squares slope of
those samples (steadier than the first and last sample alone), scaled to 100,000
requests. It prints progress lines while it runs, then

    rss growth: X MiB per 100,000 requests (pull X MiB, push X MiB)

and writes the samples and results as JSON (`--out`). Exit status 1 when a request
failed, or when the growth is over `--max-growth-mib` (1 MiB per 100,000 by default: one
small object kept per request is 3 to 5 MiB).

On 2 otherwise idle cores (client, router and fakes sharing them) the default run takes
about 3 to 4 minutes (2,000 to 2,500 requests/s), twice that when other work shares the
cores; the short run above about 25 s, enough to see a leak of one object per request
(about 4 MiB per 100,000) but with noise near 1 MiB. RSS also moves in steps when the
machine is busy (the allocator's high-water marks): compare runs on a quiet machine.

What it leaves out: failures and error answers (every request here is healthy;
`scripts.soak` covers those), real vLLM servers, and the memory of the fakes and of this
client.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from scripts.benchkit import process, write_json
from testbed.ports import free_port

MODEL = "fake-model"  # what testbed.fake_vllm serves
PER = 100_000  # growth is reported per this many requests
MIB = 1024 * 1024


def log(message: str) -> None:
    print(f"[bench_memory] {message}", flush=True)


def rss_bytes(pid: int) -> int:
    """The process's resident memory now (VmRSS, Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def request_shape(index: int) -> tuple[str, dict[str, Any], bool]:
    """Request `index`'s route, body and whether it carries its own X-Request-Id: every
    combination of route, streaming and id within 8 requests."""
    stream = bool(index & 1)
    if index & 2:
        route = "/v1/chat/completions"
        body: dict[str, Any] = {"messages": [{"role": "user", "content": f"hello {index}"}]}
    else:
        route = "/v1/completions"
        body = {"prompt": f"hello {index}"}
    body.update(model=MODEL, max_tokens=4, stream=stream)
    return route, body, not index & 4


class Load:
    """The client: sends requests in phases, counts failures, samples the router's RSS."""

    def __init__(self, url: str, router_pid: int, args: argparse.Namespace) -> None:
        self.url = url
        self.pid = router_pid
        self.args = args
        self.failures: dict[str, int] = {}
        self.sent = 0  # all requests, warm-up included

    async def phase(self, session: aiohttp.ClientSession, name: str, modes: tuple[str, ...],
                    count: int, min_seconds: float = 0.0) -> dict[str, Any]:
        """`count` requests (more if `min_seconds` have not passed yet), cycling through
        `modes`; RSS sampled every `sample_every`."""
        numbers = itertools.count()
        done = 0
        samples: list[tuple[int, int]] = [(0, rss_bytes(self.pid))]
        started = last_line = time.monotonic()

        def more(index: int) -> bool:
            return index < count or time.monotonic() - started < min_seconds

        async def worker() -> None:
            nonlocal done, last_line
            while more(index := next(numbers)):
                await self.one(session, self.sent + index, modes[index % len(modes)])
                done += 1
                if done % self.args.sample_every == 0:
                    samples.append((done, rss_bytes(self.pid)))
                now = time.monotonic()
                if now - last_line >= self.args.progress:
                    last_line = now
                    log(f"{name}: {done:,}/{count:,}+ requests, {done / (now - started):.0f} req/s, "
                        f"router RSS {samples[-1][1] / MIB:.1f} MiB")

        await asyncio.gather(*(worker() for _ in range(self.args.concurrency)))
        self.sent += done
        if samples[-1][0] != done:
            samples.append((done, rss_bytes(self.pid)))
        wall = time.monotonic() - started
        return {"requests": done, "seconds": round(wall, 1), "req_per_s": round(done / wall, 1),
                "rss_first_mib": round(samples[0][1] / MIB, 2),
                "rss_last_mib": round(samples[-1][1] / MIB, 2),
                "growth_mib_per_100k": growth_per_100k(samples),
                "samples": [[n, round(rss / MIB, 3)] for n, rss in samples]}

    async def one(self, session: aiohttp.ClientSession, index: int, mode: str) -> None:
        route, body, own_id = request_shape(index)
        headers = {"X-KV-Transfer-Mode": mode}
        if own_id:
            headers["X-Request-Id"] = f"bench-memory-{index}"
        try:
            async with asyncio.timeout(self.args.deadline):
                async with session.post(self.url + route, json=body, headers=headers) as answer:
                    content = await answer.read()
            ok = answer.status == 200 and (not body["stream"] or content.endswith(b"[DONE]\n\n"))
            kind = "ok" if ok else f"status_{answer.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            kind = type(exc).__name__
        if kind != "ok":
            self.failures[kind] = self.failures.get(kind, 0) + 1


def growth_per_100k(samples: list[tuple[int, int]]) -> float:
    """MiB per 100,000 requests: the least-squares slope of RSS against requests sent."""
    if len(samples) < 2:
        return 0.0
    slope = statistics.linear_regression([n for n, _ in samples], [r for _, r in samples]).slope
    return round(slope * PER / MIB, 3)


def router_config(p_url: str, d_url: str, port: int, args: argparse.Namespace) -> dict[str, Any]:
    return {"prefill": [p_url], "decode": [d_url], "port": port, "mode": "pull",
            "log_level": args.log_level}


async def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    py = sys.executable
    p_port, d_port, r_port = free_port(), free_port(), free_port()
    config = workdir / "router.yaml"
    with contextlib.ExitStack() as stack:
        for role, port in (("prefill", p_port), ("decode", d_port)):
            stack.enter_context(process(
                [py, "-m", "testbed.fake_vllm", "--role", role, "--port", str(port)],
                f"http://127.0.0.1:{port}", f"fake {role}", workdir / f"fake-{role}.log"))
        p_url, d_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
        # JSON is YAML: the router reads it as its config file, as in production.
        config.write_text(json.dumps(router_config(p_url, d_url, r_port, args)))
        router = stack.enter_context(process(
            [py, "-m", "proxy", "serve", "--config", str(config)], f"http://127.0.0.1:{r_port}",
            "router",
            workdir / "router.log"))
        load = Load(f"http://127.0.0.1:{r_port}", router.pid, args)
        connector = aiohttp.TCPConnector(limit=args.concurrency)
        async with aiohttp.ClientSession(connector=connector) as session:
            log(f"router pid {router.pid}, RSS at start {rss_bytes(router.pid) / MIB:.1f} MiB; "
                f"warm-up: {args.warmup:,} requests and {args.warmup_seconds:g} s, pull and push")
            warmup = await load.phase(session, "warm-up", ("pull", "push"), args.warmup,
                                      args.warmup_seconds)
            half = args.requests // 2
            pull = await load.phase(session, "pull", ("pull",), half)
            push = await load.phase(session, "push", ("push",), args.requests - half)
        measured = pull["samples"] + [[n + half, rss] for n, rss in push["samples"]]
        total = growth_per_100k([(n, int(rss * MIB)) for n, rss in measured])
        if router.poll() is not None:
            raise RuntimeError(f"the router exited with {router.returncode} during the run")
    return {"requests": args.requests, "warmup": warmup["requests"],
            "concurrency": args.concurrency,
            "growth_mib_per_100k": total, "target_mib_per_100k": args.max_growth_mib,
            "failures": load.failures, "phases": {"warmup": warmup, "pull": pull, "push": push}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.bench_memory", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=400_000,
                        help="measured requests, half pull then half push (default 400000)")
    parser.add_argument("--warmup", type=int, default=20_000,
                        help="requests before measuring, both modes (default 20000)")
    parser.add_argument("--warmup-seconds", type=float, default=20.0, metavar="SECONDS",
                        help="warm up at least this long (20): longer than the router's "
                             "sliding windows (the retry budget's is 10 s), so they are full")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight (16)")
    parser.add_argument("--sample-every", type=int, default=2_000, metavar="N",
                        help="sample the router's RSS every N requests (2000)")
    parser.add_argument("--progress", type=float, default=10.0, metavar="SECONDS",
                        help="seconds between progress lines (10)")
    parser.add_argument("--deadline", type=float, default=30.0, metavar="SECONDS",
                        help="a request not answered in this time counts as failed (30)")
    parser.add_argument("--max-growth-mib", type=float, default=1.0, metavar="MIB",
                        help="exit 1 when growth per 100,000 requests is above this (1.0)")
    parser.add_argument("--log-level", default="warning",
                        choices=["debug", "info", "warning", "error"],
                        help="the router's log level (warning: no access line per request)")
    parser.add_argument("--out", type=Path, help="write the JSON report here")
    args = parser.parse_args(argv)
    if args.requests < 2 * args.sample_every or min(args.warmup, args.warmup_seconds) < 0 \
            or args.concurrency < 1:
        parser.error("--requests must be at least twice --sample-every; --warmup >= 0; "
                     "--warmup-seconds >= 0; --concurrency >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as workdir:
        result = asyncio.run(run(args, Path(workdir)))
    phases = result["phases"]
    log(f"rss growth: {result['growth_mib_per_100k']:.2f} MiB per 100,000 requests "
        f"(pull {phases['pull']['growth_mib_per_100k']:.2f} MiB, "
        f"push {phases['push']['growth_mib_per_100k']:.2f} MiB); router RSS "
        f"{phases['pull']['rss_first_mib']:.1f} -> {phases['push']['rss_last_mib']:.1f} MiB "
        f"over {result['requests']:,} requests after a {result['warmup']:,}-request warm-up")
    failed = sum(result["failures"].values())
    over = result["growth_mib_per_100k"] > args.max_growth_mib
    result["passed"] = not failed and not over
    if failed:
        log(f"failed requests: {result['failures']}")
    if over:
        log(f"over the target of {args.max_growth_mib} MiB per 100,000 requests")
    if args.out:
        write_json(args.out, result)
        log(f"wrote {args.out}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
