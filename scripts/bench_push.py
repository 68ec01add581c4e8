"""Push vs pull: time to first token through the router on one real CPU 1P1D pair.

    .venv/bin/python -m scripts.bench_push            # ~5 min; needs no GPU
    .venv/bin/python -m scripts.bench_push --help
    .venv/bin/python -m scripts.bench push            # the same, from the one command

What it runs, in one go (progress is printed as it goes):
1. a P/D pair with our `NixlDualConnector` and the router in front: for each prompt
   length and concurrency, rounds of streamed completions alternating pull and push
   (chosen per request by header, on the same pair), each with a fresh random prompt
   (no prefix-cache hits); TTFT is measured at the client, to the first token; and,
   in the same rounds, the same requests sent whole to P alone ("direct": no router, no
   KV hand-over), the floor a hand-over adds to, so direct/pull is as low as push/pull
   could go;
2. the same with vLLM's `NixlPushConnector` (push only), for comparison;
3. a raw NIXL WRITE between two processes of the same bytes and descriptor count as
   one of our pushes (`scripts.bench_nixl`), after the servers are gone: once into fresh
   blocks each time from a 256 MiB pool, not in cache, as a KV transfer's are (the
   target's baseline), and once into the same cache-hot blocks every time.

It prints, per case, the median TTFT of each and the ratios direct/pull, push/pull
(target: 0.85 or less from 512 tokens on) and stock push/pull, and our pushes' WRITE
throughput in that case against a raw WRITE of that case's shape into fresh blocks;
then our push path's WRITE throughput over the whole run (from P's `vllm:nixl_*`
metrics: bytes over NIXL's own transfer time, and over the time inside NIXL's post
alone) against the raw WRITE's into fresh blocks (target: 0.7 or more) and into
cache-hot ones. Results go to a JSON file and, with matplotlib installed
(`pip install -e .[bench]`), a PNG plot.

On a 2-core machine both servers, the router and this client share the cores; the
absolute numbers are small-model CPU numbers, the ratios are the point.

What it leaves out: GPUs and a network between P and D (both servers on one CPU host,
NIXL moving the KV in its memory), prefix-cache hits (every prompt is fresh), decode
(2 tokens a request), and load past the concurrencies given.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from scripts import bench_nixl
from scripts.benchkit import DIRECT, batch, json_object, pyplot, save_figure, write_json
from scripts.demo import router
from testbed import tiny_model
from testbed.pd_protocol import metric, parse_metrics
from testbed.vllm_cpu import DEFAULT_MODEL_DIR, DUAL_CONNECTOR, REPO_ROOT, pair

STOCK_PUSH = "NixlPushConnector"
DEFAULT_PROMPTS = (128, 256, 512, 1000)  # the tiny model has 1,024 positions
DEFAULT_CONCURRENCY = (1, 4)
NIXL_BYTES = "vllm:nixl_bytes_transferred"
NIXL_TIME = "vllm:nixl_xfer_time_seconds"
NIXL_POST = "vllm:nixl_post_time_seconds"  # inside NIXL's post: on CPU, the copy itself
NIXL_DESCRIPTORS = "vllm:nixl_num_descriptors"


def say(message: str) -> None:
    print(f"[bench_push] {message}", flush=True)


async def p_nixl_counters(client: httpx.AsyncClient, prefill_url: str) -> dict[str, float]:
    """P's NIXL histograms' sums and counts (our pushes are WRITEs by P)."""
    samples = parse_metrics((await client.get(f"{prefill_url}/metrics")).text)
    return {f"{name}_{part}": metric(samples, f"{name}_{part}")
            for name in (NIXL_BYTES, NIXL_TIME, NIXL_POST, NIXL_DESCRIPTORS)
            for part in ("sum", "count")}


async def run_pair(connector: str, modes: Sequence[str], args: argparse.Namespace,
                   rng: random.Random) -> dict[str, Any]:
    """Every case on one pair; returns TTFTs by case and mode, and P's NIXL counters."""
    say(f"starting a P/D pair with {connector} ... (20-60 s)")
    ttfts: dict[str, dict[str, list[float]]] = {}
    nixl: dict[str, float] = {}
    nixl_by_case: dict[str, dict[str, float]] = {}
    extra = args.connector_config if connector == DUAL_CONNECTOR else None
    with pair(connector, extra_args=["--max-model-len", "1024"], kv_extra_config=extra,
              start_timeout_s=args.start_timeout) as p, \
            router(p.prefill_url, p.decode_url, "pull") as router_url:
        urls = {mode: p.prefill_url if mode == DIRECT else router_url for mode in modes}
        async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as client:
            for mode in modes:  # warm every path (handshakes, first allocations)
                await batch(client, urls[mode], mode, 128, 2, rng)
            before = case_before = await p_nixl_counters(client, p.prefill_url)
            cases = [(n, c) for n in args.prompts for c in args.concurrency]
            for index, (prompt_len, concurrency) in enumerate(cases, 1):
                key = f"{prompt_len}x{concurrency}"
                ttfts[key] = {mode: [] for mode in modes}
                rounds = max(1, args.requests // concurrency)
                for _ in range(rounds):  # modes interleaved, so drift hits both alike
                    for mode in modes:
                        ttfts[key][mode] += await batch(client, urls[mode], mode, prompt_len,
                                                        concurrency, rng)
                medians = ", ".join(f"{m} {statistics.median(v) * 1000:.0f} ms"
                                    for m, v in ttfts[key].items())
                say(f"  [{index}/{len(cases)}] {prompt_len} tokens x {concurrency} "
                    f"concurrent: median TTFT {medians}")
                case_after = await p_nixl_counters(client, p.prefill_url)
                nixl_by_case[key] = difference(case_after, case_before)
                case_before = case_after
            nixl = difference(case_before, before)
    return {"connector": connector, "ttft_s": ttfts, "prefill_nixl": nixl,
            "prefill_nixl_by_case": nixl_by_case}


def difference(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before[name] for name in after}


def write_gbps(nixl: dict[str, float], seconds: str = NIXL_TIME) -> float | None:
    """P's WRITEs' bytes over one of NIXL's time histograms (None without WRITEs)."""
    total = nixl.get(f"{seconds}_sum", 0.0)
    return nixl[f"{NIXL_BYTES}_sum"] / total / 1e9 if total > 0 else None


FRESH_MIB = 256  # the raw WRITE's pools for fresh blocks: well beyond any CPU cache


def write_shape(nixl: dict[str, float]) -> tuple[int, int] | None:
    """(descriptors, bytes per descriptor) of the average WRITE in `nixl`; None if none."""
    writes = nixl.get(f"{NIXL_BYTES}_count", 0.0)
    descriptors = nixl.get(f"{NIXL_DESCRIPTORS}_sum", 0.0)
    if writes <= 0 or descriptors <= 0:
        return None
    blocks = max(1, round(descriptors / writes))
    return blocks, max(1, round(nixl[f"{NIXL_BYTES}_sum"] / writes / blocks))


def raw_write_baseline(nixl: dict[str, float], args: argparse.Namespace,
                       fresh_mib: int) -> dict[str, Any] | None:
    """A raw NIXL DRAM WRITE shaped like our average push in `nixl`: same bytes, same
    descriptors; into fresh blocks each time (`fresh_mib` > 0) or the same ones."""
    shape = write_shape(nixl)
    if shape is None:
        return None
    blocks, block_bytes = shape
    where = f"fresh blocks from {fresh_mib} MiB" if fresh_mib else "the same blocks"
    say(f"raw NIXL WRITE of the same shape: {blocks} x {block_bytes} B, scattered, "
        f"into {where} ...")
    return bench_nixl.run(bench_nixl.Params(
        device="cpu", block_bytes=block_bytes, blocks=blocks, iterations=args.raw_iterations,
        warmup=3, noncontiguous=True, one_block_rounds=0, progress_thread=False,
        timeout=120.0, fresh_mib=fresh_mib))


def raw_by_case(dual: dict[str, Any], args: argparse.Namespace) -> dict[str, float]:
    """The raw WRITE's median GB/s into fresh blocks, shaped like each case's average push
    (one raw run per distinct shape: the cases of one prompt length share theirs)."""
    by_shape: dict[tuple[int, int], float | None] = {}
    gbps: dict[str, float] = {}
    for key, nixl in dual.get("prefill_nixl_by_case", {}).items():
        shape = write_shape(nixl)
        if shape is None:
            continue
        if shape not in by_shape:
            raw = raw_write_baseline(nixl, args, fresh_mib=FRESH_MIB)
            by_shape[shape] = raw["gbps_median"] if raw else None
        value = by_shape[shape]
        if value is not None:
            gbps[key] = value
    return gbps


def summarize(dual: dict[str, Any], stock: dict[str, Any] | None,
              raw: dict[str, Any] | None, raw_fresh: dict[str, Any] | None,
              raw_fresh_by_case: dict[str, float] | None = None) -> dict[str, Any]:
    rows = []
    for key, by_mode in dual["ttft_s"].items():
        pull, push = statistics.median(by_mode["pull"]), statistics.median(by_mode["push"])
        direct = statistics.median(by_mode[DIRECT]) if by_mode.get(DIRECT) else None
        stock_push = (statistics.median(stock["ttft_s"][key]["push"])
                      if stock and key in stock["ttft_s"] else None)
        prompt_len, concurrency = (int(x) for x in key.split("x"))
        case_gbps = write_gbps(dual.get("prefill_nixl_by_case", {}).get(key, {}))
        case_raw = (raw_fresh_by_case or {}).get(key)
        rows.append({
            "prompt_tokens": prompt_len, "concurrency": concurrency,
            "pull_ms": pull * 1000, "push_ms": push * 1000,
            "direct_ms": None if direct is None else direct * 1000,
            "direct_over_pull": None if direct is None else direct / pull,
            "stock_push_ms": None if stock_push is None else stock_push * 1000,
            "push_over_pull": push / pull,
            "stock_push_over_pull": None if stock_push is None else stock_push / pull,
            "write_gbps": case_gbps,
            "raw_fresh_gbps": case_raw,
            "write_over_raw_fresh": case_gbps / case_raw if case_gbps and case_raw else None,
        })
    nixl = dual["prefill_nixl"]
    ours_gbps, post_gbps = write_gbps(nixl), write_gbps(nixl, NIXL_POST)
    raw_gbps = raw["gbps_median"] if raw else None
    fresh_gbps = raw_fresh["gbps_median"] if raw_fresh else None
    return {
        "cases": rows,
        "write": {
            "ours_gbps": ours_gbps, "ours_post_gbps": post_gbps,
            "raw_fresh_gbps": fresh_gbps, "raw_gbps": raw_gbps,
            "ours_over_raw_fresh": ours_gbps / fresh_gbps if ours_gbps and fresh_gbps else None,
            "ours_over_raw": ours_gbps / raw_gbps if ours_gbps and raw_gbps else None,
            "pushes": nixl.get(f"{NIXL_BYTES}_count"),
            "bytes": nixl.get(f"{NIXL_BYTES}_sum"),
        },
    }


def print_summary(summary: dict[str, Any]) -> None:
    def cell(value: float | None, form: str) -> str:
        return "-" if value is None else format(value, form)

    print(f"\n{'prompt':>7} {'conc':>4} {'direct ms':>9} {'pull ms':>8} {'push ms':>8} "
          f"{'stock ms':>9} {'direct/pull':>11} {'push/pull':>9} {'stock/pull':>10} "
          f"{'WRITE GB/s':>10} {'raw GB/s':>8} {'WRITE/raw':>9}")
    for row in summary["cases"]:
        target = " (target <= 0.85)" if row["prompt_tokens"] >= 512 else ""
        print(f"{row['prompt_tokens']:>7} {row['concurrency']:>4} "
              f"{cell(row['direct_ms'], '.0f'):>9} {row['pull_ms']:>8.0f} "
              f"{row['push_ms']:>8.0f} {cell(row['stock_push_ms'], '.0f'):>9} "
              f"{cell(row['direct_over_pull'], '.2f'):>11} {row['push_over_pull']:>9.2f} "
              f"{cell(row['stock_push_over_pull'], '.2f'):>10} "
              f"{cell(row.get('write_gbps'), '.2f'):>10} "
              f"{cell(row.get('raw_fresh_gbps'), '.2f'):>8} "
              f"{cell(row.get('write_over_raw_fresh'), '.2f'):>9}{target}")
    w = summary["write"]
    if w["ours_gbps"] is not None:
        def raw(gbps: float | None, ratio: float | None) -> str:
            return "-" if gbps is None or ratio is None else f"{gbps:.2f} GB/s (ratio {ratio:.2f})"

        print(f"\nWRITE throughput: our push path {w['ours_gbps']:.2f} GB/s over "
              f"{w['pushes']:.0f} pushes. Raw NIXL DRAM WRITE of the same shape: into fresh "
              f"blocks, as KV blocks are, {raw(w['raw_fresh_gbps'], w['ours_over_raw_fresh'])}"
              f" (target >= 0.7); into the same cache-hot blocks every time "
              f"{raw(w['raw_gbps'], w['ours_over_raw'])}")
    if w.get("ours_post_gbps") is not None:
        print(f"  NIXL's post alone (on CPU, the copy itself): {w['ours_post_gbps']:.2f} "
              "GB/s; the rest of a WRITE's time is waiting for its completion, which needs "
              "both agents polled")


def plot(summary: dict[str, Any], path: Path) -> bool:
    plt = pyplot(say)
    if plt is None:
        return False
    concurrencies = sorted({row["concurrency"] for row in summary["cases"]})
    fig, axes = plt.subplots(1, len(concurrencies), figsize=(6 * len(concurrencies), 4.5),
                             squeeze=False)
    for ax, concurrency in zip(axes[0], concurrencies, strict=True):
        rows = [r for r in summary["cases"] if r["concurrency"] == concurrency]
        x = [r["prompt_tokens"] for r in rows]
        ax.plot(x, [r["pull_ms"] for r in rows], "o-", label="pull (ours)")
        ax.plot(x, [r["push_ms"] for r in rows], "s-", label="push (ours)")
        if all(r["direct_ms"] is not None for r in rows):
            ax.plot(x, [r["direct_ms"] for r in rows], "k:", label="direct to P (no hand-over)")
        if all(r["stock_push_ms"] is not None for r in rows):
            ax.plot(x, [r["stock_push_ms"] for r in rows], "^--", label="push (vLLM NixlPushConnector)")
        ax.set_title(f"TTFT through the router, concurrency {concurrency}")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("median TTFT (ms)")
        ax.grid(alpha=0.3)
        ax.legend()
    save_figure(plt, fig, path)
    return True


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench_push", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: tuple(int(x) for x in s.split(","))  # noqa: E731
    parser.add_argument("--prompts", type=ints, default=DEFAULT_PROMPTS,
                        help="prompt lengths in tokens, comma-separated (at most 1020)")
    parser.add_argument("--concurrency", type=ints, default=DEFAULT_CONCURRENCY,
                        help="concurrent requests per round, comma-separated")
    parser.add_argument("--requests", type=int, default=12,
                        help="requests per mode and case (rounded to whole rounds)")
    parser.add_argument("--no-stock", action="store_true",
                        help="skip the vLLM NixlPushConnector pair")
    parser.add_argument("--connector-config", type=json_object, default={}, metavar="JSON",
                        help="our connector's settings for the pair (kv_connector_extra_"
                             "config), e.g. '{\"push_wait_pause\": 0.005}'")
    parser.add_argument("--raw-iterations", type=int, default=20,
                        help="measured raw NIXL WRITEs")
    parser.add_argument("--start-timeout", type=float, default=240.0,
                        help="seconds a pair may take to start")
    parser.add_argument("--seed", type=int, default=0, help="prompt generator seed")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench-results" / "push.json")
    parser.add_argument("--plot", type=Path, default=REPO_ROOT / "bench-results" / "push_ttft.png")
    args = parser.parse_args(argv)
    if any(n < 1 or n > 1020 for n in args.prompts) or any(c < 1 for c in args.concurrency):
        parser.error("prompt lengths must be in 1..1020 and concurrencies >= 1")
    return args


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    tiny_model.build(DEFAULT_MODEL_DIR)
    dual = await run_pair(DUAL_CONNECTOR, (DIRECT, "pull", "push"), args, rng)
    stock = None if args.no_stock else await run_pair(STOCK_PUSH, ("push",), args, rng)
    raw_fresh = raw_write_baseline(dual["prefill_nixl"], args, fresh_mib=FRESH_MIB)
    raw = raw_write_baseline(dual["prefill_nixl"], args, fresh_mib=0)
    raw_fresh_by_case = raw_by_case(dual, args)
    summary = summarize(dual, stock, raw, raw_fresh, raw_fresh_by_case)
    return {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "dual": dual, "stock": stock, "raw_write_fresh": raw_fresh, "raw_write": raw,
            "raw_write_fresh_gbps_by_case": raw_fresh_by_case, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = asyncio.run(bench(args))
    print_summary(result["summary"])
    write_json(args.out, result)
    say(f"wrote {args.out}")
    if plot(result["summary"], args.plot):
        say(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
