"""Prefix-cache-aware routing, measured: P's and D's cache hits against an oracle, TTFT
and throughput, per balancing policy and workload, in one run.

    .venv/bin/python -m scripts.bench_cache                   # about 4 minutes
    .venv/bin/python -m scripts.bench_cache --quick           # about 1 minute
    .venv/bin/python -m scripts.bench kv-routing --quick      # the same, from the suite

EMULATED: 2 P and 2 D are fake vLLM servers (`testbed.fake_vllm`) with a prefix cache
each (`testbed.fake_kv_cache`: `--p-blocks` / `--d-blocks` blocks of `--block-size`
tokens, least recently used evicted) that publishes vLLM's KV events over ZMQ, a
`/tokenize` and a `/kv_event_sources`, and a prefill that costs `--token-ms` per prompt
token actually computed (cache hits cost nothing), one prompt at a time per P. What the
emulation leaves out: the model's real compute and batching (prefills here run one after
another at a fixed token rate), decode time (D answers at once), and the KV transfer.

Workloads, each run against fresh caches for every router:
  tenants   tenants whose prompts share a short header and then each carry their own
            document, asked questions in random order by --concurrency clients; the
            documents fit in the two P's caches together but not in one (pressure).
  chat      multi-turn conversations, each turn sent with the whole history (the answers
            fed back), conversations in parallel; their final histories fit in the two
            P's caches together but not in one.
  noreuse   prompts that share nothing.

Routers: ours with each policy on P (round_robin, least_outstanding, prefix_affinity,
kv_aware; D balanced by least_outstanding, and by kv_aware in the kv_aware run), and
vllm-router with cache_aware when its command is installed (`pip install vllm-router`).

Reported per router and workload: P's hit rate (cached prompt tokens over prompt tokens)
and its share of the oracle's (an infinite cache that has seen every earlier request:
the most any routing could hit), the same for D (blocks D did not need sent), TTFT
p50/p90 (streamed, the first byte) and requests/s; the ratios the targets name; plots.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from scripts.benchkit import REPO, process, pyplot, save_figure, write_json
from testbed.fake_kv_cache import FakePrefixCache, fake_chat_tokens, fake_tokenize
from testbed.fake_vllm import Fabric, FakeVLLM, start
from testbed.ports import free_port

WORKLOADS = ("tenants", "chat", "noreuse")
OUR_POLICIES = ("round_robin", "least_outstanding", "prefix_affinity", "kv_aware")
PEER = "vllm-router:cache_aware"
MODEL = "fake-model"


def say(message: str) -> None:
    print(f"[bench_cache] {message}", file=sys.stderr, flush=True)


# --- the emulated servers, in a thread of their own -----------------------------------


class Backends:
    """2 P and 2 D fakes with prefix caches, served from a thread with its own event loop
    (so the routers' health checks are answered while this process waits on them)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fakes", daemon=True)
        self.fakes: list[FakeVLLM] = []
        self.urls: list[str] = []
        self._runners: list[Any] = []

    def __enter__(self) -> Backends:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _start(self) -> None:
        fabric = Fabric()
        a = self.args
        for i, role in enumerate(("prefill", "prefill", "decode", "decode")):
            blocks = a.p_blocks if role == "prefill" else a.d_blocks
            cache = FakePrefixCache(blocks, a.block_size)
            cache.start()
            fake = FakeVLLM(role, engine_id=f"engine-{i}", side_channel_port=free_port(),
                            fabric=fabric, kv_cache=cache)
            fake.behavior.prefill_token_s = a.token_ms / 1000
            fake.behavior.tokens = 2
            runner, url = await start(fake)
            self.fakes.append(fake)
            self._runners.append(runner)
            self.urls.append(url)

    async def _stop(self) -> None:
        for runner in self._runners:
            await runner.cleanup()
        for fake in self.fakes:
            assert fake.kv_cache is not None
            await fake.kv_cache.aclose()

    @property
    def prefill(self) -> list[FakeVLLM]:
        return self.fakes[:2]

    @property
    def decode(self) -> list[FakeVLLM]:
        return self.fakes[2:]


# --- routers ------------------------------------------------------------------------


def vllm_router() -> str | None:
    """vllm-router's command: on the PATH, or beside this Python (a venv's bin)."""
    beside = Path(sys.executable).parent / "vllm-router"
    return shutil.which("vllm-router") or (str(beside) if beside.exists() else None)


@contextlib.contextmanager
def router(name: str, backends: Backends, log_dir: Path) -> Iterator[str]:
    port = free_port()
    p_urls, d_urls = backends.urls[:2], backends.urls[2:]
    if name == PEER:
        command = [vllm_router() or "vllm-router", "--vllm-pd-disaggregation",
                   *[x for u in p_urls for x in ("--prefill", u)],
                   *[x for u in d_urls for x in ("--decode", u)],
                   "--prefill-policy", "cache_aware", "--decode-policy", "cache_aware",
                   "--port", str(port), "--log-level", "warning"]
    else:
        policy = name.split(":", 1)[1]
        config = {"prefill": p_urls, "decode": d_urls, "mode": "pull", "port": port,
                  "host": "127.0.0.1", "log_level": "info",
                  "balance": {"prefill": policy,
                              "decode": "kv_aware" if policy == "kv_aware" else "least_outstanding",
                              "kv_aware": {"discovery_interval": 0.5, **backends.args.kv}}}
        path = log_dir / f"{policy}.yaml"
        path.write_text(yaml.safe_dump(config))
        command = [sys.executable, "-m", "proxy", "serve", "--config", str(path)]
    with process(command, f"http://127.0.0.1:{port}", name,
                 log_path=log_dir / f"{name.replace(':', '-')}.log"):
        yield f"http://127.0.0.1:{port}"


# --- workloads ----------------------------------------------------------------------


def words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(1_000_000)}" for _ in range(n))


def tenants_requests(args: argparse.Namespace, rng: random.Random) -> list[dict[str, Any]]:
    header = words(rng, args.header_tokens)
    documents = [words(rng, args.document_tokens) for _ in range(args.tenants)]
    order = [rng.randrange(args.tenants) for _ in range(args.requests)]
    return [{"prompt": f"{header} {documents[t]} question {words(rng, 12)}"} for t in order]


async def run_workload(workload: str, url: str, args: argparse.Namespace,
                       seed: int) -> tuple[list[float], list[list[int]], float]:
    """Send the workload through `url`; returns TTFTs, the prompts' token ids in the
    order sent, and the wall time."""
    rng = random.Random(seed)
    ttfts: list[float] = []
    prompts: list[list[int]] = []
    timeout = aiohttp.ClientTimeout(total=120)
    started = time.perf_counter()
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def send(path: str, body: dict[str, Any]) -> str:
            payload = {"model": MODEL, "max_tokens": 2, "stream": True, **body}
            tokens = (fake_chat_tokens(body["messages"]) if "messages" in body
                      else fake_tokenize(body["prompt"]))
            prompts.append(tokens)
            sent = time.perf_counter()
            text = []
            async with session.post(f"{url}{path}", json=payload) as r:
                if r.status != 200:
                    raise RuntimeError(f"{r.status}: {await r.text()}")
                first = True
                async for line in r.content:
                    if first:
                        ttfts.append(time.perf_counter() - sent)
                        first = False
                    if line.startswith(b"data: {"):
                        choice = json.loads(line[6:])["choices"][0]
                        text.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
            return "".join(text)

        if workload == "chat":
            async def conversation(c: int) -> None:
                local = random.Random(seed * 1000 + c)
                messages = [{"role": "system", "content": words(local, args.block_size * 2)}]
                for _ in range(args.turns):
                    # turns of different lengths, so conversations do not move in lockstep
                    length = local.randint(args.turn_tokens // 2, args.turn_tokens * 3 // 2)
                    messages.append({"role": "user", "content": words(local, length)})
                    answer = await send("/v1/chat/completions", {"messages": list(messages)})
                    messages.append({"role": "assistant", "content": answer or "ok"})
            await asyncio.gather(*(conversation(c) for c in range(args.conversations)))
        else:
            bodies = (tenants_requests(args, rng) if workload == "tenants"
                      else [{"prompt": words(rng, args.document_tokens)} for _ in range(args.requests)])
            queue = list(reversed(bodies))

            async def client() -> None:
                while queue:
                    await send("/v1/completions", queue.pop())
            await asyncio.gather(*(client() for _ in range(args.concurrency)))
    return ttfts, prompts, time.perf_counter() - started


def oracle_hits(prompts: list[list[int]], block_size: int) -> int:
    """The tokens an infinite cache that saw every earlier prompt would hit."""
    cache = FakePrefixCache.__new__(FakePrefixCache)  # only its hashing, no sockets
    cache.block_size = block_size
    seen: set[bytes] = set()
    total = 0
    for tokens in prompts:
        hashes = FakePrefixCache.hashes(cache, tokens)
        for h in hashes:
            if h not in seen:
                break
            total += block_size
        seen.update(hashes)
    return total


def hit_rate(fakes: list[FakeVLLM]) -> tuple[float, int, list[int]]:
    seen = [s for f in fakes for s in f.seen if s.prompt_tokens]
    prompt = sum(s.prompt_tokens or 0 for s in seen)
    cached = sum(s.cached_tokens or 0 for s in seen)
    return (cached / prompt if prompt else 0.0), cached, [len(f.seen) for f in fakes]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))] if ordered else 0.0


def run_one(name: str, workload: str, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    with Backends(args) as backends, router(name, backends, log_dir) as url:
        time.sleep(args.settle)  # the router finds the publishers and catches up
        ttfts, prompts, wall = asyncio.run(run_workload(workload, url, args, args.seed))
        p_rate, p_cached, p_spread = hit_rate(backends.prefill)
        d_rate, _, d_spread = hit_rate(backends.decode)
    oracle = oracle_hits(prompts, args.block_size)
    total = sum(len(p) for p in prompts)
    oracle_rate = oracle / total if total else 0.0
    return {
        "router": name, "workload": workload, "requests": len(prompts),
        "p_hit_rate": round(p_rate, 4), "d_hit_rate": round(d_rate, 4),
        "oracle_hit_rate": round(oracle_rate, 4),
        "p_share_of_oracle": round(p_rate / oracle_rate, 3) if oracle_rate else None,
        "d_share_of_oracle": round(d_rate / oracle_rate, 3) if oracle_rate else None,
        "p_spread": p_spread, "d_spread": d_spread,
        "ttft_p50_ms": round(percentile(ttfts, 50) * 1000, 1),
        "ttft_p90_ms": round(percentile(ttfts, 90) * 1000, 1),
        "req_per_s": round(len(prompts) / wall, 2),
    }


def targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets, as ratios measured in this run."""
    by = {(r["router"], r["workload"]): r for r in rows}
    out: dict[str, Any] = {}
    kv, pa, lo = "ours:kv_aware", "ours:prefix_affinity", "ours:least_outstanding"
    if (kv, "tenants") in by:
        out["tenants_kv_aware_p_share_of_oracle"] = by[kv, "tenants"]["p_share_of_oracle"]
        if (pa, "tenants") in by and by[pa, "tenants"]["ttft_p90_ms"]:
            out["tenants_p90_ttft_kv_aware_over_prefix_affinity"] = round(
                by[kv, "tenants"]["ttft_p90_ms"] / by[pa, "tenants"]["ttft_p90_ms"], 3)
        if (PEER, "tenants") in by and by[PEER, "tenants"]["ttft_p90_ms"]:
            out["tenants_p90_ttft_kv_aware_over_vllm_router"] = round(
                by[kv, "tenants"]["ttft_p90_ms"] / by[PEER, "tenants"]["ttft_p90_ms"], 3)
    if (kv, "noreuse") in by and (lo, "noreuse") in by and by[lo, "noreuse"]["ttft_p90_ms"]:
        out["noreuse_p90_ttft_kv_aware_over_least_outstanding"] = round(
            by[kv, "noreuse"]["ttft_p90_ms"] / by[lo, "noreuse"]["ttft_p90_ms"], 3)
    if (kv, "chat") in by:
        out["chat_kv_aware_p_share_of_oracle"] = by[kv, "chat"]["p_share_of_oracle"]
    return out


def plot(rows: list[dict[str, Any]], directory: Path) -> list[Path]:
    plt = pyplot(say)
    if plt is None:
        return []
    routers = list(dict.fromkeys(r["router"] for r in rows))
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    by = {(r["router"], r["workload"]): r for r in rows}
    paths = []
    for key, label, name in (("p_share_of_oracle", "P hit rate / oracle's", "cache_hits.png"),
                             ("ttft_p90_ms", "TTFT p90 (ms)", "cache_ttft_p90.png")):
        fig, ax = plt.subplots(figsize=(8, 4))
        width = 0.8 / len(routers)
        for i, name_ in enumerate(routers):
            values = [(by.get((name_, w)) or {}).get(key) or 0 for w in workloads]
            ax.bar([x + i * width for x in range(len(workloads))], values, width, label=name_)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(workloads))], workloads)
        ax.set_ylabel(label)
        ax.set_title(f"{label} by policy (EMULATED: fake servers, prefill charged per token)")
        ax.legend(fontsize=7)
        path = directory / name
        save_figure(plt, fig, path)
        paths.append(path)
    return paths


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench_cache", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--routers", default=None, help="comma-separated, of "
                        f"{', '.join('ours:' + p for p in OUR_POLICIES)}, {PEER} (default: all "
                        "ours, and the peer when vllm-router is installed)")
    parser.add_argument("--quick", action="store_true", help="fewer requests")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--p-blocks", type=int, default=96, help="each P's cache, in blocks")
    parser.add_argument("--d-blocks", type=int, default=96, help="each D's cache, in blocks")
    parser.add_argument("--tenants", type=int, default=6)
    parser.add_argument("--header-tokens", type=int, default=48,
                        help="tenants: the shared header (48 words: longer than "
                             "prefix_affinity's 256 characters, so the header decides its hash)")
    parser.add_argument("--document-tokens", type=int, default=320)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--turn-tokens", type=int, default=48,
                        help="chat: a user turn's mean length (half to 1.5 times this)")
    parser.add_argument("--token-ms", type=float, default=0.25,
                        help="emulated prefill time per computed prompt token (ms)")
    parser.add_argument("--settle", type=float, default=1.5,
                        help="seconds between a router's start and the first request")
    parser.add_argument("--kv", action="append", default=[], metavar="NAME=VALUE",
                        help="a balance.kv_aware setting for our kv_aware runs (repeatable), "
                             "e.g. --kv tokens_per_request=512")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=REPO / "bench-results" / "bench_cache.json")
    parser.add_argument("--plots", type=Path, default=REPO / "bench-results")
    parser.add_argument("--logs", type=Path, default=REPO / "bench-results" / "cache-logs",
                        help="the routers' configs and logs")
    args = parser.parse_args(argv)
    try:
        args.kv = {name: yaml.safe_load(value) for name, value in
                   (item.split("=", 1) for item in args.kv)}
    except ValueError:
        parser.error("--kv takes NAME=VALUE")
    args.workloads = [w for w in args.workloads.split(",") if w]
    if set(args.workloads) - set(WORKLOADS):
        parser.error(f"workloads are {', '.join(WORKLOADS)}")
    if args.routers is None:
        routers = [f"ours:{p}" for p in OUR_POLICIES]
        if vllm_router():
            routers.append(PEER)
        else:
            say("vllm-router is not installed (pip install vllm-router): no peer in this run")
        args.routers = routers
    else:
        args.routers = [r for r in args.routers.split(",") if r]
    if args.quick:
        args.requests, args.conversations, args.turns = 48, 4, 4
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    args.logs.mkdir(parents=True, exist_ok=True)
    for workload in args.workloads:
        for name in args.routers:
            say(f"{workload}: {name}")
            row = run_one(name, workload, args, args.logs)
            say(f"  P hits {row['p_hit_rate']:.2f} (oracle {row['oracle_hit_rate']:.2f}), "
                f"D hits {row['d_hit_rate']:.2f}, TTFT p50/p90 {row['ttft_p50_ms']}/"
                f"{row['ttft_p90_ms']} ms, {row['req_per_s']} req/s, P spread {row['p_spread']}")
            rows.append(row)
    return {"emulated": True, "settings": {k: v for k, v in vars(args).items()
                                           if isinstance(v, int | float | str | list)},
            "rows": rows, "targets": targets(rows)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    write_json(args.out, result, default=str)
    print(json.dumps({"targets": result["targets"]}, indent=2))
    header = f"{'router':28} {'workload':8} {'P hit/oracle':>12} {'D hit/oracle':>12} " \
             f"{'TTFT p50':>9} {'p90':>7} {'req/s':>6}"
    print(header)
    for r in result["rows"]:
        print(f"{r['router']:28} {r['workload']:8} {r['p_share_of_oracle']!s:>12} "
              f"{r['d_share_of_oracle']!s:>12} {r['ttft_p50_ms']:>9} {r['ttft_p90_ms']:>7} "
              f"{r['req_per_s']:>6}")
    for path in plot(result["rows"], args.plots):
        say(f"wrote {path}")
    say(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
