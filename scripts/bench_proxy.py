"""Proxy overhead benchmark: the router in front of fast fake P/D servers, against
calling the fake D directly, in one run.

    python -m scripts.bench_proxy                      # defaults: 64 concurrent, 5000 requests
    python -m scripts.bench_proxy --concurrency 128 --requests 20000 --out bench-results/proxy.json

Each scenario sends `--requests` requests (max_tokens=1) with `--concurrency` in flight,
after a warm-up, and reports requests/s and latency percentiles. Scenarios:
  direct           client -> fake D (one hop: the floor)
  proxy-pull       client -> router -> fake P, then fake D (two upstream calls)
  proxy-push       client -> router -> fake P and fake D at once
and the same with streaming (`--no-stream` to skip). The fakes and the router run as
separate processes on this machine; everything talks over 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def process(args: list[str], ready_url: str, name: str) -> Iterator[subprocess.Popen[bytes]]:
    """Start a server process (own process group) and wait until `ready_url` answers."""
    proc = subprocess.Popen(args, cwd=REPO, process_group=0, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                err = proc.stderr.read().decode() if proc.stderr else ""
                raise RuntimeError(f"{name} exited with {proc.returncode}: {err[-2000:]}")
            try:
                with socket.create_connection(_host_port(ready_url), timeout=0.2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name} did not start within 30 s") from None
                time.sleep(0.1)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


async def load(url: str, *, requests: int, concurrency: int, stream: bool,
               headers: dict[str, str]) -> dict[str, Any]:
    body = {"model": "fake-model", "prompt": "Hello, benchmark!", "max_tokens": 1, "stream": stream}
    latencies: list[float] = []
    errors = 0
    remaining = requests
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            nonlocal remaining, errors
            while remaining > 0:
                remaining -= 1
                started = time.perf_counter()
                async with session.post(url, json=body, headers=headers) as r:
                    await r.read()
                    if r.status != 200:
                        errors += 1
                latencies.append(time.perf_counter() - started)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    latencies.sort()
    return {
        "requests": len(latencies),
        "errors": errors,
        "req_per_s": round(len(latencies) / wall, 1),
        "p50_ms": round(statistics.median(latencies) * 1000, 2),
        "p99_ms": round(latencies[int(len(latencies) * 0.99) - 1] * 1000, 2),
    }


async def scenario(name: str, url: str, args: argparse.Namespace, *, stream: bool,
                   headers: dict[str, str]) -> dict[str, Any]:
    await load(url, requests=min(1000, args.requests), concurrency=args.concurrency,
               stream=stream, headers=headers)  # warm-up: connections, caches
    result = await load(url, requests=args.requests, concurrency=args.concurrency,
                        stream=stream, headers=headers)
    result["scenario"] = name
    print(f"  {name:<24} {result['req_per_s']:>9.1f} req/s   p50 {result['p50_ms']:>7.2f} ms"
          f"   p99 {result['p99_ms']:>7.2f} ms   errors {result['errors']}", flush=True)
    return result


async def run(args: argparse.Namespace, p_url: str, d_url: str, proxy_url: str) -> list[dict[str, Any]]:
    results = []
    for stream in ([False, True] if args.stream else [False]):
        suffix = "-stream" if stream else ""
        print(f"{'streaming' if stream else 'non-streaming'}, {args.concurrency} concurrent, "
              f"{args.requests} requests:", flush=True)
        results.append(await scenario("direct" + suffix, f"{d_url}/v1/completions", args,
                                      stream=stream, headers={}))
        for mode in ("pull", "push"):
            results.append(await scenario(f"proxy-{mode}{suffix}", f"{proxy_url}/v1/completions",
                                          args, stream=stream, headers={"X-KV-Transfer-Mode": mode}))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=5000, help="requests per scenario")
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight")
    parser.add_argument("--no-stream", dest="stream", action="store_false", help="skip the streaming runs")
    parser.add_argument("--out", type=Path, default=REPO / "bench-results" / "proxy.json",
                        help="JSON result file")
    args = parser.parse_args()

    p_port, d_port, proxy_port = free_port(), free_port(), free_port()
    p_url, d_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
    proxy_url = f"http://127.0.0.1:{proxy_port}"
    py = sys.executable
    with (
        process([py, "-m", "scripts.fake_vllm", "--role", "prefill", "--port", str(p_port)], p_url, "fake P"),
        process([py, "-m", "scripts.fake_vllm", "--role", "decode", "--port", str(d_port), "--tokens", "1"],
                d_url, "fake D"),
        process([py, "-m", "proxy", "serve", "--prefill", p_url, "--decode", d_url, "--port", str(proxy_port),
                 "--log-level", "warning"], proxy_url, "router"),
    ):
        results = asyncio.run(run(args, p_url, d_url, proxy_url))

    by_name = {r["scenario"]: r for r in results}
    ratios = {
        f"{name}/direct{suffix}": round(by_name[name + suffix]["req_per_s"] / by_name["direct" + suffix]["req_per_s"], 3)
        for suffix in (["", "-stream"] if args.stream else [""])
        for name in ("proxy-pull", "proxy-push")
    }
    print("throughput ratios (same run):", ", ".join(f"{k} {v}" for k, v in ratios.items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"concurrency": args.concurrency, "cpus": os.cpu_count(),
                                    "results": results, "ratios": ratios}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
