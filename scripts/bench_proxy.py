"""Proxy overhead benchmark: the router in front of fast fake P/D servers, against
calling the fake D directly, in one run.

    python -m scripts.bench_proxy                    # defaults: 64 concurrent, 10 s each
    python -m scripts.bench_proxy --concurrency 128 --seconds 20 --out bench-results/proxy.json
    python -m scripts.bench_proxy --xpyd             # pools: 4 P + 4 D, one P slow
    python -m scripts.bench xpyd                     # the --xpyd run, from the one command

Each scenario keeps `--concurrency` requests (max_tokens=1) in flight for `--seconds`,
after a 1 s warm-up, and reports requests/s and latency percentiles. The load comes from
wrk when installed (apt-get install wrk), else from Python. Scenarios:
  direct           client -> fake D (one hop: the floor)
  proxy-pull       client -> router -> fake P, then fake D (two upstream calls)
  proxy-push       client -> router -> fake P and fake D at once
and the same with streaming (`--no-stream` to skip). The fakes and the router run as
separate processes on this machine (the fakes answer canned bytes at once, so nearly
all the CPU goes to the router); everything talks over 127.0.0.1.

`--xpyd` runs the pool case instead: 4 fake P and 4 fake D, one P answering
`--slow-ms` late, the router in pull mode with each balancing policy in turn (round
robin, least outstanding, power of two, on both clusters); it reports requests/s and
p99 for each, and each policy's ratio to round robin. Results: bench-results/xpyd.json.

What it leaves out: real servers and the KV transfer (the fakes answer canned bytes at
once). `python -m scripts.bench overhead` measures the 1P1D case at several concurrencies,
with the router's CPU; this run is kept for `--xpyd` (`python -m scripts.bench xpyd`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from scripts.benchkit import REPO, process, request_body, serve_fake
from testbed.ports import free_port


def wrk_load(url: str, *, seconds: float, concurrency: int, stream: bool,
             headers: dict[str, str]) -> dict[str, Any]:
    """Load with wrk (C, one thread): it costs far less CPU than the code under test."""
    lines = ['wrk.method = "POST"', f"wrk.body = {json.dumps(json.dumps(request_body(stream)))}",
             'wrk.headers["Content-Type"] = "application/json"']
    lines += [f"wrk.headers[{json.dumps(k)}] = {json.dumps(v)}" for k, v in headers.items()]
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write("\n".join(lines) + "\n")
    try:
        out = subprocess.run(
            ["wrk", "-t1", f"-c{concurrency}", f"-d{max(1, round(seconds))}s", "--latency",
             "-s", script.name, url],
            capture_output=True, text=True, check=True,
        ).stdout
    finally:
        os.unlink(script.name)
    rate = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    socket_errors = re.search(r"Socket errors: (.*)", out)
    return {
        "req_per_s": round(rate, 1),
        "requests": int(re.search(r"(\d+) requests in", out).group(1)),  # type: ignore[union-attr]
        "errors": int(errors.group(1)) if errors else 0,
        "socket_errors": socket_errors.group(1) if socket_errors else "",
        "p50_ms": _wrk_ms(out, "50%"),
        "p99_ms": _wrk_ms(out, "99%"),
    }


def _wrk_ms(out: str, percentile: str) -> float:
    value, unit = re.search(rf"^\s+{percentile}\s+([\d.]+)(us|ms|s)\s*$", out, re.M).groups()  # type: ignore[union-attr]
    return round(float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit], 2)


async def python_load(url: str, *, seconds: float, concurrency: int, stream: bool,
                      headers: dict[str, str]) -> dict[str, Any]:
    """Load from Python (aiohttp) when wrk is not installed; it needs far more CPU."""
    body = request_body(stream)
    latencies: list[float] = []
    errors = 0
    deadline = time.perf_counter() + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:

        async def worker() -> None:
            nonlocal errors
            while time.perf_counter() < deadline:
                started = time.perf_counter()
                async with session.post(url, json=body, headers=headers) as r:
                    await r.read()
                    errors += r.status != 200
                latencies.append(time.perf_counter() - started)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    latencies.sort()
    return {
        "req_per_s": round(len(latencies) / wall, 1),
        "requests": len(latencies),
        "errors": errors,
        "p50_ms": round(statistics.median(latencies) * 1000, 2),
        "p99_ms": round(latencies[int(len(latencies) * 0.99) - 1] * 1000, 2),
    }


def scenario(name: str, url: str, args: argparse.Namespace, *, stream: bool,
             headers: dict[str, str]) -> dict[str, Any]:
    def measure(seconds: float) -> dict[str, Any]:
        if args.loader == "wrk":
            return wrk_load(url, seconds=seconds, concurrency=args.concurrency, stream=stream, headers=headers)
        return asyncio.run(python_load(url, seconds=seconds, concurrency=args.concurrency,
                                       stream=stream, headers=headers))

    measure(1)  # warm-up: connections, caches
    result = {"scenario": name, **measure(args.seconds)}
    print(f"  {name:<22} {result['req_per_s']:>9.1f} req/s   p50 {result['p50_ms']:>7.2f} ms"
          f"   p99 {result['p99_ms']:>7.2f} ms   errors {result['errors']}", flush=True)
    return result


def run(args: argparse.Namespace, d_url: str, proxy_url: str) -> list[dict[str, Any]]:
    results = []
    for stream in ([False, True] if args.stream else [False]):
        suffix = "-stream" if stream else ""
        print(f"{'streaming' if stream else 'non-streaming'}, {args.concurrency} concurrent, "
              f"{args.seconds:.0f} s per scenario, load from {args.loader}:", flush=True)
        results.append(scenario("direct" + suffix, f"{d_url}/v1/completions", args,
                                stream=stream, headers={}))
        for mode in ("pull", "push"):
            results.append(scenario(f"proxy-{mode}{suffix}", f"{proxy_url}/v1/completions",
                                    args, stream=stream, headers={"X-KV-Transfer-Mode": mode}))
    return results


POLICIES = ("round_robin", "least_outstanding", "power_of_two")


def run_xpyd(args: argparse.Namespace, out: Path) -> None:
    """4 fake P (the first slow) and 4 fake D; the router with each policy in turn."""
    py = sys.executable
    ports = {role: [free_port() for _ in range(4)] for role in ("prefill", "decode")}
    urls = {role: [f"http://127.0.0.1:{p}" for p in ps] for role, ps in ports.items()}
    with contextlib.ExitStack() as stack:
        for role, role_ports in ports.items():
            for i, port in enumerate(role_ports):
                delay = args.slow_ms / 1000 if role == "prefill" and i == 0 else 0.0
                stack.enter_context(process(
                    [py, "-m", "scripts.bench_proxy", "--serve-fake", role, str(port), str(delay)],
                    f"http://127.0.0.1:{port}", f"fake {role} {i}"))
        print(f"pools: 4 P (P0 answers {args.slow_ms:.0f} ms late) + 4 D, {args.concurrency} "
              f"concurrent, {args.seconds:.0f} s per policy, pull mode, load from {args.loader}:",
              flush=True)
        results = []
        for policy in POLICIES:
            router_port = free_port()
            router_url = f"http://127.0.0.1:{router_port}"
            command = [py, "-m", "proxy", "serve", "--port", str(router_port), "--log-level",
                       "warning", "--prefill-policy", policy, "--decode-policy", policy]
            for role in ("prefill", "decode"):
                for url in urls[role]:
                    command += [f"--{role}", url]
            with process(command, router_url, f"router ({policy})"):
                results.append(scenario(f"xpyd-{policy}", f"{router_url}/v1/completions", args,
                                        stream=False, headers={}))
    base = results[0]["req_per_s"]
    ratios = {r["scenario"]: round(r["req_per_s"] / base, 3) for r in results}
    print("throughput vs round robin (same run):", ", ".join(f"{k} {v}" for k, v in ratios.items()))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"concurrency": args.concurrency, "slow_ms": args.slow_ms,
                               "cpus": os.cpu_count(), "results": results,
                               "ratios_vs_round_robin": ratios}, indent=2))
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench_proxy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10, help="measured seconds per scenario")
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight")
    parser.add_argument("--no-stream", dest="stream", action="store_false", help="skip the streaming runs")
    parser.add_argument("--loader", choices=["wrk", "python"],
                        default="wrk" if shutil.which("wrk") else "python",
                        help="load generator (default wrk when installed: apt-get install wrk)")
    parser.add_argument("--serve-fake", nargs="+", metavar="ROLE PORT [DELAY_S]", help=argparse.SUPPRESS)
    parser.add_argument("--xpyd", action="store_true",
                        help="the pool case: 4 P + 4 D, one P slow, each balancing policy")
    parser.add_argument("--slow-ms", type=float, default=200.0,
                        help="--xpyd: how late the slow P answers (ms)")
    parser.add_argument("--out", type=Path, help="JSON result file (default "
                        "bench-results/proxy.json, or xpyd.json with --xpyd)")
    args = parser.parse_args(argv)
    if args.serve_fake:
        role, port, *delay = args.serve_fake
        serve_fake(role, int(port), float(delay[0]) if delay else 0.0)
        return 0
    if args.xpyd:
        run_xpyd(args, args.out or REPO / "bench-results" / "xpyd.json")
        return 0
    args.out = args.out or REPO / "bench-results" / "proxy.json"

    p_port, d_port, proxy_port = free_port(), free_port(), free_port()
    p_url, d_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
    proxy_url = f"http://127.0.0.1:{proxy_port}"
    py = sys.executable
    with (
        process([py, "-m", "scripts.bench_proxy", "--serve-fake", "prefill", str(p_port)], p_url, "fake P"),
        process([py, "-m", "scripts.bench_proxy", "--serve-fake", "decode", str(d_port)], d_url, "fake D"),
        process([py, "-m", "proxy", "serve", "--prefill", p_url, "--decode", d_url, "--port", str(proxy_port),
                 "--log-level", "warning"], proxy_url, "router"),
    ):
        results = run(args, d_url, proxy_url)

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
    return 0


if __name__ == "__main__":
    sys.exit(main())
