r"""The benchmark command: the router's numbers and pictures, one scenario at a time or
several measured in one run.

    .venv/bin/python -m scripts.bench                  # overhead, streams, real: about 8 min
    .venv/bin/python -m scripts.bench --quick          # a short pass, about 2 min
    .venv/bin/python -m scripts.bench --scenarios overhead,streams
    .venv/bin/python -m scripts.bench overhead --concurrency 64   # = --scenarios overhead
    .venv/bin/python -m scripts.bench push --quick     # a scenario with its own script
    .venv/bin/python -m scripts.bench push --help      # ... and its own options
    .venv/bin/python -m scripts.bench --compare-cmd "my-router --prefill {prefill} --decode {decode} --port {port}"
    .venv/bin/python -m scripts.bench --compare http://127.0.0.1:9000   # see --backend-ports
    .venv/bin/python -m scripts.bench --scenarios overhead --kv-aware --prompt-tokens 1024 \
        --modes pull --concurrency 64 --rounds 3 [--token-ids]   # kv_aware's CPU cost
    .venv/bin/python -m scripts.bench overhead --loader python --rate 1500 \
        --concurrency 256 --compare-cmd "..."   # every router at one offered rate
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib
import json
import os
import random
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
from tqdm import tqdm

from scripts.benchkit import (
    DEFAULT_PROMPT,
    REPO,
    ProcessGauge,
    apply_load,
    percentiles_ms,
    process,
    serve_fake,
    write_json,
)
from testbed.fake_kv_cache import fake_tokenize
from testbed.ports import free_port

SCENARIOS = ("overhead", "streams", "real", "profile")
DEFAULT_SCENARIOS = ("overhead", "streams", "real")  # profile needs py-spy: asked by name
STREAM_STEPS = 10  # progress steps of the streams scenario

# What each scenario of this module measures, and what it leaves out: the --help texts.
SUITE_HELP = {
    "overhead": """\
fast emulated P and D (canned answers at once): requests/s and latency for
calling D directly (the floor), through our router in pull and in push mode,
and through another router (--compare / --compare-cmd), non-streamed and
streamed, at each concurrency of --concurrency. Also the router's CPU
seconds per 1,000 requests. --kv-aware adds our router with the kv_aware
policy on both clusters (targets ours-kv-<mode>) against emulated servers
whose prefix caches publish KV events and which serve /tokenize, and the
ratio of its CPU per request to the default policy's; --prompt-tokens N
sends a text prompt of N (fake-tokenizer) tokens, --token-ids as token ids.
Leaves out: a model's compute and the KV transfer (the emulated servers do
neither, so nearly all the CPU is the router's), and the load generator's
share of a machine whose cores it shares.""",
    "streams": """\
--streams concurrent open SSE streams through our router (slow emulated
tokens keep them all open at once) plus --slow-clients clients that read 1
byte a second: the router's peak memory, memory per stream, and whether the
fast streams still end on time. Leaves out: throughput and CPU (overhead's),
and real servers.""",
    "real": """\
a real CPU 1P1D of vLLM (tiny model, our connector on both): time to first
token for pull vs push by prompt length, and output tokens/s per mode.
Leaves out: GPUs and a network between P and D (one CPU host, the KV moved
in its memory), prefix-cache hits (every prompt is fresh) and long outputs;
`push` measures the same pair in more detail.""",
    "profile": """\
where our router's CPU per request goes, by stage: our router (1 worker,
pull, the first --concurrency, --profile-seconds of load from the first
--loader, not streamed unless --profile-stream) on the emulated servers of
`overhead`, under a CPU-time sampler (scripts/cpu_sampler.py: a sample per
millisecond of CPU the router spends, so waiting for a core on a shared
machine does not count); each stage's share of the samples times the CPU
per request measured over the same load. Time in C code goes to the Python
frame that called it (the socket writes: the kernel's loopback work), and
the event loop's own C code to the Python code it runs next, so the loop's
stage is a floor. Not in the default run; --kv-aware and --prompt-tokens
apply. Leaves out: push mode, more than one worker, and time the router
spends off a CPU (waiting). The sampler sees Python frames only: a compiled
request path (setup.py) shows as the interpreted code around it; build it pure
(PDPROXY_COMPILE=0) to see its stages.""",
}

SUITE_FOOTER = """\
Output: a progress bar while it runs, a summary with the ratios, a JSON file (--out)
and PNG plots (--plots: throughput against concurrency, latency CDFs, TTFT by mode and
prompt length; needs matplotlib: pip install -e .[bench]).

The load comes from wrk when installed (apt-get install wrk: it costs the machine far
less CPU than a Python client), else from Python. On a 2-core machine the client, the
router and the emulated servers share the cores: absolute numbers are this machine's,
the ratios are the point."""


@dataclasses.dataclass(frozen=True)
class Script:
    """A scenario with a script of its own: `module`'s `function(argv) -> int` runs it,
    `argv` before the options given; `python -m <module>` runs the same."""

    module: str
    summary: str  # what it measures, and what it leaves out
    function: str = "main"
    argv: tuple[str, ...] = ()


# Scenarios with a script of their own, in the order --help lists them; `drill` has two.
SCRIPTS: dict[str, Script | dict[str, Script]] = {
    "push": Script("scripts.bench_push", """\
time to first token through the router on a real CPU 1P1D pair: pull,
push and direct to P by prompt length and concurrency, our connector and
vLLM's NixlPushConnector, and our pushes' WRITE throughput against a raw
NIXL WRITE of the same shape. Leaves out: GPUs and a network (one CPU
host), prefix-cache hits, decode."""),
    "regime": Script("scripts.bench_regime", """\
pull, push, progressive push and local TTFT in the emulated GPU regime
(vLLM on CPU, each layer as long as a GPU profile says, the KV over an
emulated link: TCP on lo shaped by tc), D idle and busy, against the
floors the profile and link allow. Leaves out: a real GPU and network
(RDMA's offload, congestion) and the host's own speed; --help lists more."""),
    "idle": Script("scripts.bench_idle", """\
cores used with nothing to do: a NIXL agent per progress mode, each server
of an idle CPU pair, and D's engine while it only waits for a push. Leaves
out: the router, and any load."""),
    "memory": Script("scripts.bench_memory", """\
the router's RSS growth per 100,000 healthy requests (pull, then push)
against fake servers, after a warm-up. Leaves out: failures and error
paths (soak's), real servers, memory outside the router's process."""),
    "path": Script("scripts.bench_path", """\
the request path's CPU per request and Python calls per request, measured
in one process (the fakes, the router and a client on one event loop):
steady enough to compare revisions a few percent apart; our router against
the floor router (the least a Python router spends on a pull), or kv_aware
against the default policy on the same fakes. Leaves out: other processes'
scheduling and wake-ups, more than one worker."""),
    "nixl": Script("scripts.bench_nixl", """\
raw NIXL WRITE throughput and latency between two processes: the
baseline the push path is compared with. Leaves out: vLLM, the connector
and the router.""", function="cli"),
    "soak": Script("scripts.soak", """\
many requests through the router while fake backends fail at random:
every answer whole or a clean error, nothing hung or leaked (exit status 1
if not). Leaves out: real vLLM, and speed."""),
    "drill": {
        "flood": Script("scripts.drill_flood", """\
pushes' TTFT and P's memory on a real CPU pair while P's push port is
flooded with what anyone who reaches it may send (exit status 1 past the
targets). Leaves out: CURVE (off by default), floods of the router or D."""),
        "stall": Script("scripts.drill_stall", """\
the router under clients that open streams and never read (or read a
trickle): every ordinary request answered, nothing left in flight (exit
status 1 if not). Leaves out: real vLLM, and speed."""),
    },
    "kv-routing": Script("scripts.bench_cache", """\
prefix-cache-aware routing: P's and D's cache hits against an oracle,
TTFT and throughput per balancing policy and workload, on emulated
servers with prefix caches. Leaves out: a model's compute and batching,
decode time, the KV transfer."""),
    "tokenize": Script("scripts.bench_tokenize", """\
what tokenizing a prompt costs kv_aware: vLLM's POST /tokenize against a
tokenizer in the router's process, by prompt length, on a real vLLM CPU
server of the tiny model. Leaves out: the routing itself."""),
    "xpyd": Script("scripts.bench_proxy", """\
pools: 4 fake P and 4 fake D, one P slow, our router with each balancing
policy in turn: requests/s, p99, ratio to round robin (the older
`python -m scripts.bench_proxy` without --xpyd is its 1P1D overhead run).
Leaves out: real servers.""", argv=("--xpyd",)),
}


def log(message: str) -> None:
    tqdm.write(f"[bench] {message}")


# --- overhead ----------------------------------------------------------------------


class Targets:
    """Where the overhead load goes: name -> (URL, headers, process to account, or None)."""

    def __init__(self) -> None:
        self.items: dict[str, tuple[str, dict[str, str], ProcessGauge | None]] = {}

    def add(self, name: str, url: str, headers: dict[str, str] | None = None,
            gauge: ProcessGauge | None = None) -> None:
        self.items[name] = (url, headers or {}, gauge)


@contextlib.contextmanager
def emulated_backends(ports: tuple[int, int], kv_cache: bool = False,
                      servers: int = 1) -> Iterator[tuple[list[str], list[str]]]:
    """The emulated P and D URLs (the first ones at `ports`), `servers` of each;
    `kv_cache`: each with a prefix cache that publishes KV events, /tokenize and
    /kv_event_sources (for kv_aware)."""
    py = sys.executable
    kv = ["--fake-kv-cache"] if kv_cache else []
    urls: dict[str, list[str]] = {"prefill": [], "decode": []}
    with contextlib.ExitStack() as stack:
        for role, first in (("prefill", ports[0]), ("decode", ports[1])):
            for i in range(servers):
                port = first if i == 0 else free_port()
                url = f"http://127.0.0.1:{port}"
                stack.enter_context(process(
                    [py, "-m", "scripts.bench", "--serve-fake", role, str(port), *kv], url,
                    f"emulated {role[0].upper()}{i + 1 if servers > 1 else ''}"))
                urls[role].append(url)
        yield urls["prefill"], urls["decode"]


def router_command(p_url: str | list[str], d_url: str | list[str], port: int, *extra: str,
                   workers: int = 1) -> list[str]:
    """Our router's command line; a list of URLs gives a cluster of several servers."""
    urls = [arg for flag, given in (("--prefill", p_url), ("--decode", d_url))
            for url in ([given] if isinstance(given, str) else given) for arg in (flag, url)]
    return [sys.executable, "-m", "proxy", "serve", *urls,
            "--port", str(port), "--log-level", "warning", "--workers", str(workers), *extra]


KV_AWARE = ("--prefill-policy", "kv_aware", "--decode-policy", "kv_aware")


def ours_name(workers: int, kv_aware: bool = False) -> str:
    """Our router's target name: "ours" alone, "ours-w<N>" with --workers N > 1, and
    "-kv" after it with the kv_aware policy."""
    return ("ours" if workers == 1 else f"ours-w{workers}") + ("-kv" if kv_aware else "")


def run_overhead(args: argparse.Namespace, bar: tqdm) -> dict[str, Any]:
    with contextlib.ExitStack() as stack:
        p_urls, d_urls = stack.enter_context(
            emulated_backends(args.backend_ports, args.kv_aware, args.servers))
        p_url, d_url = p_urls[0], d_urls[0]
        targets = Targets()
        targets.add("direct", f"{d_url}/v1/completions")
        for workers in args.workers:
            # With --kv-aware, each default router is followed by a kv_aware one, so the
            # rounds interleave them.
            for kv_aware in (False, True) if args.kv_aware else (False,):
                port = free_port()
                ours = stack.enter_context(process(
                    router_command(p_urls, d_urls, port, *(KV_AWARE if kv_aware else ()),
                                   workers=workers),
                    f"http://127.0.0.1:{port}",
                    f"our router ({workers} workers{', kv_aware' if kv_aware else ''})"))
                gauge = ProcessGauge(ours.pid)
                for mode in args.modes:
                    targets.add(f"{ours_name(workers, kv_aware)}-{mode}",
                                f"http://127.0.0.1:{port}/v1/completions",
                                {"X-KV-Transfer-Mode": mode}, gauge)
        for peer_name, template in args.compare_cmd:
            peer_port = free_port()
            p_port, d_port = args.backend_ports
            command = shlex.split(template.format(
                prefill=p_url, decode=d_url, port=peer_port, prefill_host="127.0.0.1",
                prefill_port=p_port, decode_host="127.0.0.1", decode_port=d_port))
            peer = stack.enter_context(process(command, f"http://127.0.0.1:{peer_port}",
                                               peer_name))
            targets.add(peer_name, f"http://127.0.0.1:{peer_port}/v1/completions",
                        gauge=ProcessGauge(peer.pid))
        if args.compare:
            targets.add("peer", f"{args.compare.rstrip('/')}/v1/completions")
        rows = []
        for stream in args.stream_modes:
            for concurrency in args.concurrency:
                # Rounds interleave the targets (ours, peer, ours, peer...), so that drift in
                # a shared machine's load hits each alike; every round is reported.
                for round_ in range(args.rounds):
                    for loader in args.loader:
                        for name, (url, headers, gauge_of) in targets.items.items():
                            bar.set_description(
                                f"overhead {name} c={concurrency}{' stream' if stream else ''}"
                                f" {loader} round {round_ + 1}")
                            row = measure(args, name, url, headers, gauge_of, concurrency,
                                          stream, loader)
                            rows.append({**row, "round": round_ + 1})
                            bar.update()
    return {"backends": {"prefill": p_urls, "decode": d_urls} if args.servers > 1
            else {"prefill": p_url, "decode": d_url}, "rows": rows,
            "prompt_tokens": len(args.prompt) if isinstance(args.prompt, list)
            else len(args.prompt.split()),
            "token_ids": isinstance(args.prompt, list), "kv_cache": args.kv_aware,
            "offered_per_s": args.rate}


def measure(args: argparse.Namespace, name: str, url: str, headers: dict[str, str],
            gauge: ProcessGauge | None, concurrency: int, stream: bool,
            loader: str) -> dict[str, Any]:
    def load(seconds: float) -> dict[str, Any]:
        return apply_load(loader, url, seconds=seconds, concurrency=concurrency, stream=stream,
                          headers=headers, prompt=args.prompt, rate=args.rate)

    load(args.warmup)
    cpu_before = gauge.cpu_times() if gauge else None
    result = load(args.seconds)
    row = {"target": name, "concurrency": concurrency, "stream": stream, "loader": loader,
           **result}
    if gauge and cpu_before is not None and result["requests"]:
        user_after, system_after = gauge.cpu_times()
        user, system = user_after - cpu_before[0], system_after - cpu_before[1]
        cpu = user + system
        row["cpu_s_per_1000"] = round(cpu / result["requests"] * 1000, 3)
        # the same, split: the user-space part, and the kernel's (ProcessGauge.cpu_times)
        # (to 0.1 us per request: the floor's user time is about 8 us)
        row["cpu_user_s_per_1000"] = round(user / result["requests"] * 1000, 4)
        row["cpu_system_s_per_1000"] = round(system / result["requests"] * 1000, 4)
        # per core: requests per CPU-second of the router's process tree
        row["req_per_cpu_s"] = round(result["requests"] / cpu, 1) if cpu > 0 else None
    p = result["latency_ms"]
    log(f"{name:<13} c={concurrency:<4}{' stream' if stream else '       '} {loader:<6} "
        f"{result['req_per_s']:>9.1f} req/s  p50 {p.get('p50', 0):>7.2f} ms  "
        f"p99 {p.get('p99', 0):>7.2f} ms  errors {result['errors']}"
        + (f" {result['error_kinds']}" if result.get("error_kinds") else "")
        + (f" (open loop at {args.rate:g}/s; {result['waited']} waited for a slot)"
           if args.rate is not None else "")
        + (f"  cpu {row['cpu_s_per_1000']:.3f} s/1000 (user {row['cpu_user_s_per_1000']:.3f},"
           f" system {row['cpu_system_s_per_1000']:.3f})" if "cpu_s_per_1000" in row else "")
        + (f"  per core {row['req_per_cpu_s']:.0f} req/cpu-s" if row.get("req_per_cpu_s") else ""))
    return row


Point = tuple[str, int, bool, str]  # (target, concurrency, stream, loader)


def _medians(rows: list[dict[str, Any]], key: str) -> dict[Point, float]:
    """The median of `key` over the rounds, per (target, concurrency, stream, loader)."""
    values: dict[Point, list[float]] = {}
    for r in rows:
        if r.get(key) is not None:
            point = (r["target"], r["concurrency"], r["stream"], r.get("loader", "wrk"))
            values.setdefault(point, []).append(r[key])
    return {point: statistics.median(v) for point, v in values.items()}


def _point(concurrency: int, stream: bool, loader: str, loaders: set[str]) -> str:
    """A point's name in the summary: "c64", "c64-stream", with "-python" and the like
    when the run used more than one load generator."""
    return (f"c{concurrency}{'-stream' if stream else ''}"
            + (f"-{loader}" if len(loaders) > 1 else ""))


def _peers(by_key: dict[Point, float]) -> list[str]:
    """The other routers measured: every target that is neither ours nor direct."""
    return sorted({t for t, *_ in by_key if t != "direct" and not t.startswith("ours")})


def overhead_ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Throughput of each target over direct's, and our pulls over each peer's, per point
    (medians over the rounds)."""
    by_key = _medians(rows, "req_per_s")
    loaders = {loader for *_, loader in by_key}
    ratios = {}
    for (target, concurrency, stream, loader), req_per_s in by_key.items():
        direct = by_key.get(("direct", concurrency, stream, loader))
        point = _point(concurrency, stream, loader, loaders)
        if target != "direct" and direct:
            ratios[f"{target}/direct {point}"] = round(req_per_s / direct, 3)
        if target.startswith("ours") and target.endswith("-pull"):
            for peer in _peers(by_key):
                theirs = by_key.get((peer, concurrency, stream, loader))
                if theirs:
                    ratios[f"{target}/{peer} {point}"] = round(req_per_s / theirs, 3)
    return ratios


def _paired(rows: list[dict[str, Any]], key: str) -> dict[tuple[str, str, int, bool, str], float]:
    """`key` of one target over another's, per point: the median over the rounds of the
    ratio within each round, keyed (target, other, concurrency, stream, loader). The
    rounds interleave the targets, so the two values of a ratio were measured seconds
    apart: on this project's shared 2-core VM a target's CPU per request drifts by up to
    15% from round to round, which a ratio of medians takes in and a ratio within a
    round mostly cancels."""
    by_round: dict[tuple[int, bool, str, int], dict[str, float]] = {}
    for r in rows:
        if r.get(key) is not None:
            at = (r["concurrency"], r["stream"], r.get("loader", "wrk"), r.get("round", 1))
            by_round.setdefault(at, {})[r["target"]] = r[key]
    ratios: dict[tuple[str, str, int, bool, str], list[float]] = {}
    for (concurrency, stream, loader, _), values in by_round.items():
        for target, value in values.items():
            for other, theirs in values.items():
                if other != target and theirs:
                    ratios.setdefault((target, other, concurrency, stream, loader), []).append(
                        value / theirs)
    return {pair: statistics.median(v) for pair, v in ratios.items()}


def cpu_ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Our pulls' router CPU per request over each peer's (a peer that is another
    revision of this router gives before/after), per point (`_paired`: medians of the
    ratios within each round)."""
    paired = _paired(rows, "cpu_s_per_1000")
    loaders = {loader for *_, loader in paired}
    return {f"{target}/{other} {_point(c, s, lo, loaders)}": round(ratio, 3)
            for (target, other, c, s, lo), ratio in sorted(paired.items())
            if target.startswith("ours") and target.endswith("-pull")
            and other != "direct" and not other.startswith("ours")}  # a peer, as in `_peers`


def kv_cpu_ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The kv_aware router's CPU per request over the default policy's, per target and
    point (`_paired`: medians of the ratios within each round): "ours-kv-pull/ours-pull
    c64" -> 1.18."""
    paired = _paired(rows, "cpu_s_per_1000")
    loaders = {loader for *_, loader in paired}
    return {f"{target}/{other} {_point(c, s, lo, loaders)}": round(ratio, 3)
            for (target, other, c, s, lo), ratio in sorted(paired.items())
            if "-kv-" in target and other == target.replace("-kv-", "-")}


def cpu_split(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Each router's CPU per request in microseconds, [user, system], per point (medians):
    what its own code spends, and what the kernel spends for it (its socket calls)."""
    user, system = _medians(rows, "cpu_user_s_per_1000"), _medians(rows, "cpu_system_s_per_1000")
    loaders = {loader for *_, loader in user}
    split = {}
    for point, user_ms in user.items():
        system_ms = system.get(point)
        if system_ms is not None:
            target, concurrency, stream, loader = point
            name = f"{target} {_point(concurrency, stream, loader, loaders)}"
            split[name] = [round(user_ms * 1000, 1), round(system_ms * 1000, 1)]
    return split


def per_core(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Requests per CPU-second of each router's process tree, per point (medians)."""
    values = _medians(rows, "req_per_cpu_s")
    loaders = {loader for *_, loader in values}
    return {f"{target} {_point(concurrency, stream, loader, loaders)}": round(value, 1)
            for (target, concurrency, stream, loader), value in values.items()}


# --- profile -------------------------------------------------------------------------

# Stages of a request, by the innermost Python frame of each sample: (stage, files or
# "file:function" names it covers). The first that matches wins; the rest is "other".
STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("socket writes (system calls)", ("proxy/upstream/http11/connection.py:Connection.send",
                                      "proxy/api/listener.py:_CoalescingTransport._flush")),
    ("client HTTP: parsing, ASGI cycle, client limits", ("uvicorn/", "proxy/api/listener.py",
                                                         "proxy/api/cycle.py")),
    ("admission and validation (app, protocol)", ("proxy/api/", "proxy/protocol.py")),
    ("kv_aware: tokenizing, keys, index, scoring", ("proxy/pool/kv/",)),
    ("balancing and servers (pick, leases)", ("proxy/pool/",)),
    ("flow: modes, legs, relaying, access log", ("proxy/flow/",)),
    ("upstream HTTP client (pool, parsing, deadlines)", ("proxy/upstream/",)),
    ("metrics (prometheus_client)", ("prometheus_client/",)),
    ("logging", ("logging/",)),
    ("event loop, tasks, context managers", ("asyncio/", "contextlib", "<frozen", "uvloop",
                                             "enum.py", "_weakrefset")),
)


def stage_of(frame: str) -> str:
    """A py-spy frame, "function (path/file.py:line)", to its stage."""
    function, _, where = frame.rpartition(" (")
    path = where.rsplit(":", 1)[0]
    for stage, prefixes in STAGES:
        for prefix in prefixes:
            file, _, name = prefix.partition(":")
            if (path.endswith(file) or file in path) and (not name or function == name):
                return stage
    return "other"


def profile_stages(raw: str) -> dict[str, float]:
    """py-spy's raw output (one "frame;frame;... count" line per stack) to each stage's
    share of the samples, largest first."""
    counts: dict[str, int] = {}
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            stage = stage_of(stack.rsplit(";", 1)[-1])
            counts[stage] = counts.get(stage, 0) + int(count)
    total = sum(counts.values()) or 1
    return {stage: n / total for stage, n in sorted(counts.items(), key=lambda kv: -kv[1])}


def run_profile(args: argparse.Namespace, bar: tqdm) -> dict[str, Any]:
    concurrency = args.concurrency[0]
    stream = args.profile_stream
    with contextlib.ExitStack() as stack:
        p_urls, d_urls = stack.enter_context(
            emulated_backends(args.backend_ports, args.kv_aware, args.servers))
        port = free_port()
        out = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "stacks.txt"
        command = router_command(p_urls, d_urls, port, *(KV_AWARE if args.kv_aware else ()))
        # the router under the CPU-time sampler: `python -m scripts.cpu_sampler OUT -m proxy ...`
        command[1:1] = ["-m", "scripts.cpu_sampler", str(out)]
        router = stack.enter_context(process(command, f"http://127.0.0.1:{port}", "our router"))
        url = f"http://127.0.0.1:{port}/v1/completions"
        bar.set_description(f"profile c={concurrency}{' stream' if stream else ''}")
        load = {"concurrency": concurrency, "stream": stream,
                "headers": {"X-KV-Transfer-Mode": "pull"}, "prompt": args.prompt,
                "rate": args.rate}
        loader = args.loader[0]
        apply_load(loader, url, seconds=args.warmup, **load)
        gauge = ProcessGauge(router.pid)
        cpu_before = gauge.cpu_seconds()
        router.send_signal(signal.SIGUSR1)  # the sampler starts
        result = apply_load(loader, url, seconds=args.profile_seconds, **load)
        router.send_signal(signal.SIGUSR2)  # ... stops, and writes the stacks
        cpu = gauge.cpu_seconds() - cpu_before
        deadline = time.monotonic() + 10
        while not out.exists() and time.monotonic() < deadline:  # it appears whole
            time.sleep(0.05)
        raw = out.read_text()
        if args.profile_keep:
            args.profile_keep.write_text(raw)
        bar.update()
    cpu_us = cpu / max(1, result["requests"]) * 1e6
    shares = profile_stages(raw)
    log(f"profile: {result['req_per_s']:.0f} req/s, router CPU {cpu_us:.0f} us per request; "
        "by stage (share of the CPU-time samples x CPU per request):")
    for stage, share in shares.items():
        log(f"  {share * 100:5.1f}%  {share * cpu_us:6.1f} us  {stage}")
    return {"concurrency": concurrency, "stream": stream, "req_per_s": result["req_per_s"],
            "errors": result["errors"], "cpu_us_per_request": round(cpu_us, 1),
            "stages": {stage: round(share, 4) for stage, share in shares.items()},
            "samples": sum(int(line.rpartition(" ")[2]) for line in raw.splitlines()
                           if line.rpartition(" ")[2].isdigit())}


# --- streams -----------------------------------------------------------------------


async def slow_reader(url: str, body: bytes, seconds: float) -> int:
    """A client that reads its answer 1 byte a second for `seconds`, then leaves."""
    host, port = url.removeprefix("http://").split("/")[0].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json"
                 b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    await writer.drain()
    read = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and await reader.read(1):
        read += 1
        await asyncio.sleep(1.0)
    writer.close()
    return read


async def open_streams(url: str, args: argparse.Namespace, gauge: ProcessGauge,
                       bar: tqdm) -> dict[str, Any]:
    body = {"model": "fake-model", "prompt": "hello", "max_tokens": args.stream_tokens,
            "stream": True}
    durations: list[float] = []
    errors = 0
    peak_in_flight = 0
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one() -> None:
            nonlocal errors
            started = time.perf_counter()
            try:
                async with session.post(url + "/v1/completions", json=body) as r:
                    text = await r.text()
                    ok = r.status == 200 and text.rstrip().endswith("data: [DONE]")
            except aiohttp.ClientError:
                ok = False
            errors += not ok
            durations.append(time.perf_counter() - started)
            if len(durations) % max(1, args.streams // STREAM_STEPS) == 0:
                bar.update()

        async def watch() -> None:
            nonlocal peak_in_flight
            while True:
                async with session.get(url + "/metrics") as r:
                    text = await r.text()
                decode = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                             if line.startswith('pdproxy_endpoint_in_flight{cluster="decode"'))
                peak_in_flight = max(peak_in_flight, int(decode))
                await asyncio.sleep(0.25)

        slow_body = json.dumps({**body, "max_tokens": args.stream_tokens}).encode()
        slow = [asyncio.create_task(slow_reader(url, slow_body, args.slow_seconds))
                for _ in range(args.slow_clients)]
        watcher = asyncio.create_task(watch())
        before = gauge.memory_mib()
        started = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(args.streams)))
        wall = time.perf_counter() - started
        after = gauge.memory_mib()
        watcher.cancel()
        slow_bytes = await asyncio.gather(*slow)
        await asyncio.gather(watcher, return_exceptions=True)
    ideal = args.stream_tokens * args.token_delay
    p = percentiles_ms(durations)
    return {
        "streams": args.streams, "tokens_per_stream": args.stream_tokens,
        "token_delay_s": args.token_delay, "ideal_duration_ms": round(ideal * 1000, 1),
        "errors": errors, "wall_s": round(wall, 2), "peak_streams_open": peak_in_flight,
        "duration_ms": p, "p99_over_ideal": round(p["p99"] / (ideal * 1000), 3) if p else None,
        "slow_clients": args.slow_clients, "slow_client_bytes": slow_bytes,
        "router_rss_before_mib": before["rss_mib"], "router_peak_rss_mib": after["peak_rss_mib"],
        "kib_per_stream": round((after["peak_rss_mib"] - before["rss_mib"]) * 1024
                                / max(1, args.streams), 1),
    }


def run_streams(args: argparse.Namespace, bar: tqdm) -> dict[str, Any]:
    py = sys.executable
    p_port, d_port, port = free_port(), free_port(), free_port()
    p_url, d_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
    url = f"http://127.0.0.1:{port}"
    fake = [py, "-m", "scripts.bench", "--serve-slow-fake"]
    bar.set_description(f"streams: {args.streams} open at once")
    with process([*fake, "prefill", str(p_port), "1", "0"], p_url, "emulated P"), \
            process([*fake, "decode", str(d_port), str(args.stream_tokens), str(args.token_delay)],
                    d_url, "emulated D"), \
            process(router_command(p_url, d_url, port), url, "our router") as router:
        result = asyncio.run(open_streams(url, args, ProcessGauge(router.pid), bar))
    log(f"streams: {result['streams']} at once (peak open {result['peak_streams_open']}), "
        f"errors {result['errors']}, p99 {result['duration_ms'].get('p99', 0):.0f} ms for an ideal "
        f"{result['ideal_duration_ms']:.0f} ms; router peak RSS {result['router_peak_rss_mib']} MiB "
        f"(from {result['router_rss_before_mib']}), {result['kib_per_stream']} KiB per stream")
    return result


def serve_slow_fake(role: str, port: int, tokens: int, token_delay: float) -> None:
    """A testbed.fake_vllm server whose D streams `tokens` tokens `token_delay` apart."""
    from aiohttp import web

    from testbed.fake_vllm import FakeVLLM

    fake = FakeVLLM(role)
    fake.record = False
    fake.behavior.tokens = tokens
    fake.behavior.token_delay = token_delay
    web.run_app(fake.app, host="127.0.0.1", port=port, access_log=None, print=None,
                backlog=4096)


# --- real vLLM ----------------------------------------------------------------------


async def real_cases(url: str, args: argparse.Namespace, bar: tqdm) -> dict[str, Any]:
    import httpx

    from scripts.benchkit import batch

    rng = random.Random(args.seed)
    ttft: dict[str, dict[str, list[float]]] = {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as client:
        for mode in ("pull", "push"):  # warm both paths
            await batch(client, url, mode, 64, 2, rng)
        for prompt_len in args.prompts:
            for concurrency in args.real_concurrency:
                key = f"{prompt_len}x{concurrency}"
                ttft[key] = {"pull": [], "push": []}
                bar.set_description(f"real: TTFT {prompt_len} tokens x {concurrency}")
                for _ in range(max(1, args.real_requests // concurrency)):
                    for mode in ("pull", "push"):  # interleaved: drift hits both alike
                        ttft[key][mode] += await batch(client, url, mode, prompt_len,
                                                       concurrency, rng)
                bar.update()
                log(f"real {key}: median TTFT pull {statistics.median(ttft[key]['pull']) * 1000:.0f}"
                    f" ms, push {statistics.median(ttft[key]['push']) * 1000:.0f} ms")
        throughput = {}
        for mode in ("pull", "push"):
            bar.set_description(f"real: throughput {mode}")
            throughput[mode] = await output_rate(client, url, mode, args, rng)
            bar.update()
            log(f"real throughput {mode}: {throughput[mode]['output_tokens_per_s']:.1f} tokens/s")
    return {"ttft_s": ttft, "throughput": throughput}


async def output_rate(client: Any, url: str, mode: str, args: argparse.Namespace,
                      rng: random.Random) -> dict[str, Any]:
    """Output tokens per second for `real_requests` requests, 4 at a time."""
    from testbed.tiny_model import VOCAB_SIZE

    max_tokens = 32
    semaphore = asyncio.Semaphore(4)

    async def one() -> int:
        prompt = [rng.randrange(10, VOCAB_SIZE) for _ in range(256)]
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True}
        async with semaphore:
            r = await client.post(f"{url}/v1/completions", json=body,
                                  headers={"X-KV-Transfer-Mode": mode})
        if r.status_code != 200 or r.headers.get("x-kv-transfer-mode") != mode:
            raise RuntimeError(f"{mode}: HTTP {r.status_code} {r.text[:200]}")
        return int(r.json()["usage"]["completion_tokens"])

    started = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one() for _ in range(args.real_requests))))
    wall = time.perf_counter() - started
    return {"requests": args.real_requests, "output_tokens": tokens,
            "output_tokens_per_s": round(tokens / wall, 1)}


def run_real(args: argparse.Namespace, bar: tqdm) -> dict[str, Any]:
    from scripts.demo import router
    from testbed import tiny_model
    from testbed.vllm_cpu import DEFAULT_MODEL_DIR, DUAL_CONNECTOR, pair

    bar.set_description("real: starting a vLLM pair (20-90 s)")
    tiny_model.build(DEFAULT_MODEL_DIR)
    with pair(DUAL_CONNECTOR, extra_args=["--max-model-len", "1024"],
              start_timeout_s=args.start_timeout) as p, \
            router(p.prefill_url, p.decode_url, "pull") as url:
        bar.update()
        return asyncio.run(real_cases(url, args, bar))


def real_ratios(real: dict[str, Any]) -> dict[str, float]:
    ratios = {f"push/pull TTFT {key}": round(statistics.median(v["push"]) / statistics.median(v["pull"]), 3)
              for key, v in real["ttft_s"].items()}
    t = real["throughput"]
    ratios["push/pull output tokens/s"] = round(
        t["push"]["output_tokens_per_s"] / t["pull"]["output_tokens_per_s"], 3)
    return ratios


# --- plots -------------------------------------------------------------------------


def plot_all(result: dict[str, Any], directory: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed (pip install -e .[bench]): no plots")
        return []
    directory.mkdir(parents=True, exist_ok=True)
    written = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(directory / name, dpi=100)
        plt.close(fig)
        written.append(directory / name)

    if "overhead" in result:
        rows = result["overhead"]["rows"]
        streams = sorted({r["stream"] for r in rows})
        fig, axes = plt.subplots(1, len(streams), figsize=(6 * len(streams), 4.5), squeeze=False)
        for ax, stream in zip(axes[0], streams, strict=True):
            for target in dict.fromkeys(r["target"] for r in rows):
                points = sorted((r["concurrency"], r["req_per_s"]) for r in rows
                                if r["target"] == target and r["stream"] == stream)
                ax.plot(*zip(*points, strict=True), "o-", label=target)
            ax.set(xscale="log", xlabel="concurrent requests", ylabel="requests/s",
                   title=f"throughput, {'streamed' if stream else 'not streamed'}")
            ax.grid(alpha=0.3)
            ax.legend()
        save(fig, "throughput.png")

        # the latency CDF at the highest concurrency up to 64 (the lowest, when all are over)
        levels = {r["concurrency"] for r in rows}
        at = max((c for c in levels if c <= 64), default=min(levels))
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in rows:
            if r["concurrency"] == at and r["latency_ms"]:
                points = sorted((float(k[1:]), v) for k, v in r["latency_ms"].items())
                ax.plot([v for _, v in points], [k / 100 for k, _ in points], "o-",
                        label=f"{r['target']}{' stream' if r['stream'] else ''}")
        ax.set(xscale="log", xlabel="latency (ms)", ylabel="share of requests",
               title=f"latency CDF at {at} concurrent")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        save(fig, "latency_cdf.png")

    if "real" in result:
        cases = result["real"]["ttft_s"]
        concurrencies = sorted({int(k.split("x")[1]) for k in cases})
        fig, axes = plt.subplots(1, len(concurrencies), figsize=(6 * len(concurrencies), 4.5),
                                 squeeze=False)
        for ax, c in zip(axes[0], concurrencies, strict=True):
            keys = sorted((k for k in cases if int(k.split("x")[1]) == c),
                          key=lambda k: int(k.split("x")[0]))
            x = [int(k.split("x")[0]) for k in keys]
            for mode, style in (("pull", "o-"), ("push", "s-")):
                ax.plot(x, [statistics.median(cases[k][mode]) * 1000 for k in keys], style,
                        label=mode)
            ax.set(xlabel="prompt tokens", ylabel="median TTFT (ms)",
                   title=f"real vLLM CPU 1P1D, {c} concurrent")
            ax.grid(alpha=0.3)
            ax.legend()
        save(fig, "ttft_by_mode.png")
    return written


# --- the command -------------------------------------------------------------------


def _listed(name: str, text: str, width: int = 12) -> str:
    """A scenario's entry in --help: its name, then its text indented past it."""
    lines = text.splitlines()
    return "\n".join([f"  {name:<{width - 2}}{lines[0]}"] + [" " * width + x for x in lines[1:]])


def description(scenario: str | None = None) -> str:
    """--help's text: every scenario, or one scenario of this module's."""
    if scenario is not None:
        return (f"The {scenario} scenario, of `python -m scripts.bench`:\n{SUITE_HELP[scenario]}\n\n"
                f"The same as --scenarios {scenario}; several scenarios in one run:\n"
                "python -m scripts.bench --scenarios a,b.\n\n" + SUITE_FOOTER)
    suite = "\n".join(_listed(name, text) for name, text in SUITE_HELP.items())
    scripts = []
    for name, script in SCRIPTS.items():
        for sub, one in (script.items() if isinstance(script, dict) else [("", script)]):
            full = f"{name} {sub}".strip()
            scripts.append(_listed(full, f"{one.summary}\n(python -m {one.module}"
                                   f"{' ' + ' '.join(one.argv) if one.argv else ''})", 14))
    return (f"{__doc__}\nScenarios of this module ({', '.join(DEFAULT_SCENARIOS)} by default; "
            "--scenarios a,b\nmeasures several in one run, so that their ratios compare like "
            "with like;\n`python -m scripts.bench NAME [options]` runs one, and its --help "
            "is its own):\n"
            f"{suite}\n\n"
            "Scenarios with a script of their own: `python -m scripts.bench NAME [options]` "
            "runs the\nscript with those options, and `NAME --help` gives its options, what "
            "it measures and\nwhat it leaves out:\n"
            + "\n".join(scripts) + "\n\n" + SUITE_FOOTER)


def parse_args(argv: list[str] | None, scenario: str | None = None) -> argparse.Namespace:
    """The options of this module's scenarios; `scenario`: as `python -m scripts.bench
    SCENARIO` gives them (that scenario alone, its own --help)."""
    prog = "python -m scripts.bench" + (f" {scenario}" if scenario else "")
    parser = argparse.ArgumentParser(prog=prog, description=description(scenario),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: tuple(int(x) for x in s.split(","))  # noqa: E731
    parser.add_argument("--scenarios", default=scenario or ",".join(DEFAULT_SCENARIOS),
                        help=argparse.SUPPRESS if scenario else
                        f"comma-separated, of {', '.join(SCENARIOS)} (default: "
                        f"{', '.join(DEFAULT_SCENARIOS)})")
    parser.add_argument("--profile-seconds", type=float, default=15.0,
                        help="profile: seconds of load sampled (default 15)")
    parser.add_argument("--profile-stream", action="store_true",
                        help="profile: streamed requests")
    parser.add_argument("--profile-keep", type=Path, metavar="FILE",
                        help="profile: keep the sampled stacks there (py-spy's raw format: "
                             "flamegraph.pl or speedscope read it)")
    parser.add_argument("--quick", action="store_true",
                        help="shorter runs and fewer points (a smoke pass)")
    parser.add_argument("--compare-cmd", metavar="[NAME=]TEMPLATE", action="append",
                        default=[],
                        help="start another router for the overhead scenario: a command with "
                             "{prefill}, {decode} (backend URLs; or {prefill_host}, "
                             "{prefill_port}, {decode_host}, {decode_port}) and {port} (where "
                             "it must listen). Repeatable; NAME= names its target (default "
                             "peer, then peer2...). Another checkout of this router, run "
                             "with `python -P` and PYTHONPATH=<checkout>, gives before/after "
                             "figures in the same run")
    parser.add_argument("--compare", metavar="URL",
                        help="another router, already running, in front of the backends at "
                             "--backend-ports (start it first, pointing at those ports)")
    parser.add_argument("--backend-ports", type=ints, metavar="P,D",
                        help="ports of the emulated P and D (default: free ones; 18100,18200 "
                             "with --compare)")
    parser.add_argument("--concurrency", type=ints, help="overhead: concurrent requests, "
                        "comma-separated (default 1,16,64,256,512; --quick 1,16,64)")
    parser.add_argument("--seconds", type=float, help="overhead: measured seconds per point "
                        "(default 3; --quick 1)")
    parser.add_argument("--no-stream", action="store_true", help="overhead: skip streamed runs")
    parser.add_argument("--workers", type=ints, default=(1,), metavar="N[,N...]",
                        help="overhead: run our router with --workers N (comma-separated: one "
                             "router per value, targets ours-w<N>-...; default 1)")
    parser.add_argument("--modes", default="pull,push",
                        help="overhead: our router's modes, comma-separated (default pull,push)")
    parser.add_argument("--kv-aware", action="store_true",
                        help="overhead: also our router with --prefill-policy kv_aware "
                             "--decode-policy kv_aware (targets ours-kv-<mode>), and emulated "
                             "servers with a prefix cache that publishes KV events and serve "
                             "/tokenize; the summary gives its CPU per request over the "
                             "default policy's")
    parser.add_argument("--servers", type=int, metavar="N",
                        help="overhead: emulated P and D servers, N of each, behind our "
                             "router (direct and --compare-cmd get the first; default 1, "
                             "with --kv-aware 2: a policy scores only between candidates)")
    parser.add_argument("--prompt-tokens", type=int, metavar="N",
                        help="overhead: a prompt of N words, N tokens of the emulated "
                             "servers' tokenizer (default: a 2-word prompt)")
    parser.add_argument("--token-ids", action="store_true",
                        help="overhead: send the prompt as token ids instead of text")
    parser.add_argument("--rounds", type=int, default=1,
                        help="overhead: measure every point this many times, the targets "
                             "interleaved (ours, peer, ours, peer...); ratios use the medians")
    parser.add_argument("--loader", default="wrk" if shutil.which("wrk") else "python",
                        help="load generator(s), comma-separated, of wrk and python (each "
                             "point is measured with each; default wrk when installed)")
    parser.add_argument("--rate", type=float, metavar="REQ_PER_S",
                        help="overhead, python loader: an open loop at this many requests/s "
                             "(at most --concurrency in flight) instead of a closed loop, so "
                             "that every target is measured at one offered rate: a faster "
                             "router is otherwise idle more, and an idle router pays a wake-up "
                             "for each event it would have found batched when busy")
    parser.add_argument("--streams", type=int, help="streams: how many open at once "
                        "(default 1000; --quick 200)")
    parser.add_argument("--stream-tokens", type=int, default=10, help="streams: tokens each")
    parser.add_argument("--token-delay", type=float, default=0.5,
                        help="streams: seconds between two tokens")
    parser.add_argument("--slow-clients", type=int, default=5,
                        help="streams: clients reading 1 byte a second meanwhile")
    parser.add_argument("--prompts", type=ints, default=(128, 512, 1000),
                        help="real: prompt lengths in tokens (at most 1020)")
    parser.add_argument("--real-concurrency", type=ints, default=(1, 4),
                        help="real: concurrent requests per TTFT round")
    parser.add_argument("--real-requests", type=int, help="real: requests per mode and case "
                        "(default 8; --quick 4)")
    parser.add_argument("--start-timeout", type=float, default=240.0,
                        help="real: seconds the vLLM pair may take to start")
    parser.add_argument("--seed", type=int, default=0, help="real: prompt generator seed")
    parser.add_argument("--out", type=Path, default=REPO / "bench-results" / "bench.json")
    parser.add_argument("--plots", type=Path, default=REPO / "bench-results",
                        help="directory for the PNG plots")
    parser.add_argument("--serve-fake", nargs=2, metavar=("ROLE", "PORT"), help=argparse.SUPPRESS)
    parser.add_argument("--fake-kv-cache", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--serve-slow-fake", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_fake or args.serve_slow_fake:
        return args
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = set(args.scenarios) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenario(s) {', '.join(sorted(unknown))}")
    if args.compare and args.compare_cmd:
        parser.error("give --compare or --compare-cmd, not both")
    args.compare_cmd = [_named_command(given, i) for i, given in enumerate(args.compare_cmd)]
    if len({name for name, _ in args.compare_cmd}) < len(args.compare_cmd):
        parser.error("--compare-cmd: two targets of the same name")
    if any(name == "direct" or name.startswith("ours") for name, _ in args.compare_cmd):
        parser.error("--compare-cmd: a NAME may not be direct or start with ours")
    args.loader = [x for x in args.loader.split(",") if x]
    if not args.loader or set(args.loader) - {"wrk", "python"}:
        parser.error("--loader takes wrk and/or python")
    if args.rate is not None and (args.rate <= 0 or args.loader != ["python"]):
        parser.error("--rate takes a positive requests/s and --loader python (wrk's loop "
                     "is closed)")
    if "wrk" in args.loader and not shutil.which("wrk"):
        parser.error("--loader wrk: wrk is not installed (apt-get install wrk)")
    args.modes = [m for m in args.modes.split(",") if m]
    if set(args.modes) - {"pull", "push"} or not args.modes:
        parser.error("--modes takes pull and/or push")
    if args.rounds < 1 or min(args.workers) < 1:
        parser.error("--rounds and --workers must be >= 1")
    args.servers = args.servers or (2 if args.kv_aware else 1)
    if args.servers < 1:
        parser.error("--servers must be >= 1")
    if args.prompt_tokens is not None and args.prompt_tokens < 1:
        parser.error("--prompt-tokens must be >= 1")
    args.prompt = (DEFAULT_PROMPT if args.prompt_tokens is None
                   else " ".join(f"word{i}" for i in range(args.prompt_tokens)))
    if args.token_ids:
        args.prompt = fake_tokenize(args.prompt)
    quick = args.quick
    args.concurrency = args.concurrency or ((1, 16, 64) if quick else (1, 16, 64, 256, 512))
    args.seconds = args.seconds or (1.0 if quick else 3.0)
    args.warmup = 0.5 if quick else 1.0
    args.streams = args.streams or (200 if quick else 1000)
    args.real_requests = args.real_requests or (4 if quick else 8)
    args.slow_seconds = args.stream_tokens * args.token_delay + 2
    args.stream_modes = [False] if args.no_stream else [False, True]
    if not args.backend_ports:
        args.backend_ports = (18100, 18200) if args.compare else (free_port(), free_port())
    return args


def _named_command(given: str, index: int) -> tuple[str, str]:
    """"NAME=TEMPLATE" -> (NAME, TEMPLATE); a template alone is named peer, peer2, ..."""
    name, sep, rest = given.partition("=")
    if sep and name and all(c.isalnum() or c in "-_" for c in name):
        return name, rest
    return ("peer" if index == 0 else f"peer{index + 1}"), given


def steps(args: argparse.Namespace) -> int:
    """How many progress steps the chosen scenarios take."""
    routers = len(args.workers) * (2 if args.kv_aware else 1)
    targets = 1 + routers * len(args.modes) + len(args.compare_cmd) + bool(args.compare)
    count = 0
    if "overhead" in args.scenarios:
        count += (len(args.stream_modes) * len(args.concurrency) * targets * args.rounds
                  * len(args.loader))
    if "streams" in args.scenarios:
        count += STREAM_STEPS
    if "real" in args.scenarios:
        count += 1 + len(args.prompts) * len(args.real_concurrency) + 2
    if "profile" in args.scenarios:
        count += 1
    return count


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    if "overhead" in result:
        rows = result["overhead"]["rows"]
        summary["ratios"] = overhead_ratios(rows)
        summary["req_per_cpu_s"] = per_core(rows)
        if any(not r["target"].startswith("ours") and r["target"] != "direct"
               and "cpu_s_per_1000" in r for r in rows):
            summary["cpu_per_request_ratios"] = cpu_ratios(rows)
        if any("-kv-" in r["target"] for r in rows):
            summary["kv_aware_cpu_ratios"] = kv_cpu_ratios(rows)
            cpu = _medians(rows, "cpu_s_per_1000")
            loaders = {loader for *_, loader in cpu}
            summary["router_cpu_ms_per_request"] = {
                f"{target} {_point(concurrency, stream, loader, loaders)}": round(value, 3)
                for (target, concurrency, stream, loader), value in cpu.items()}
        if any("cpu_user_s_per_1000" in r for r in rows):
            summary["router_cpu_us_per_request_user_system"] = cpu_split(rows)
        pull_cpu = [r["cpu_s_per_1000"] for r in rows
                    if r["target"] == "ours-pull" and not r["stream"] and "cpu_s_per_1000" in r]
        if pull_cpu:
            summary["router_cpu_s_per_1000_requests"] = round(statistics.median(pull_cpu), 3)
        summary["overhead_errors"] = sum(r["errors"] for r in rows
                                         if r["target"].startswith("ours"))
    if "streams" in result:
        s = result["streams"]
        summary["streams"] = {k: s[k] for k in ("streams", "peak_streams_open", "errors",
                                                "router_peak_rss_mib", "kib_per_stream",
                                                "p99_over_ideal")}
    if "real" in result:
        summary.setdefault("ratios", {}).update(real_ratios(result["real"]))
    if "profile" in result:
        summary["profile"] = {k: result["profile"][k] for k in ("cpu_us_per_request", "stages")}
    return summary


SCENARIO_RUNNERS: dict[str, Callable[[argparse.Namespace, tqdm], dict[str, Any]]] = {
    "overhead": run_overhead, "streams": run_streams, "real": run_real,
    "profile": run_profile,
}


def main(argv: list[str] | None = None) -> int:
    """`python -m scripts.bench [SCENARIO] [options]`: no SCENARIO, the scenarios of
    --scenarios (this module's); else that scenario, with its own options."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and not argv[0].startswith("-"):
        return run_scenario(argv[0], argv[1:])
    return run_suite(parse_args(argv))


def run_scenario(name: str, argv: list[str]) -> int:
    """One scenario by name: this module's, or a script's own `main(argv)`."""
    if name in SCENARIOS:
        return run_suite(parse_args(argv, scenario=name))
    script = SCRIPTS.get(name)
    if isinstance(script, dict):  # drill: which one
        kinds = ", ".join(script)
        if argv[:1] in (["-h"], ["--help"]):
            print(f"usage: python -m scripts.bench {name} {{{kinds.replace(', ', ',')}}} "
                  f"[options]\n\n" + "\n".join(
                      _listed(kind, f"{one.summary}\n(python -m {one.module})", 8)
                      for kind, one in script.items())
                  + f"\n\n`python -m scripts.bench {name} KIND --help` gives its options.")
            return 0
        if not argv or argv[0] not in script:
            print(f"python -m scripts.bench {name}: say which, of {kinds} (--help)",
                  file=sys.stderr)
            return 2
        script, argv = script[argv[0]], argv[1:]
    if script is None:
        known = [*SCENARIOS, *SCRIPTS]
        print(f"python -m scripts.bench: unknown scenario {name!r}, of {', '.join(known)} "
              "(--help)", file=sys.stderr)
        return 2
    run: Callable[[list[str]], int | None] = getattr(importlib.import_module(script.module),
                                                     script.function)
    return int(run([*script.argv, *argv]) or 0)


def run_suite(args: argparse.Namespace) -> int:
    """This module's scenarios, those of --scenarios, measured in one run."""
    if args.serve_fake:
        serve_fake(args.serve_fake[0], int(args.serve_fake[1]), kv_cache=args.fake_kv_cache)
        return 0
    if args.serve_slow_fake:
        role, port, tokens, delay = args.serve_slow_fake
        serve_slow_fake(role, int(port), int(tokens), float(delay))
        return 0
    started = time.monotonic()
    result: dict[str, Any] = {"cpus": os.cpu_count(), "loader": args.loader,
                              "scenarios": args.scenarios}
    with tqdm(total=steps(args), unit="step", dynamic_ncols=True) as bar:
        for name in args.scenarios:
            result[name] = SCENARIO_RUNNERS[name](args, bar)
    result["summary"] = summarize(result)
    result["wall_s"] = round(time.monotonic() - started, 1)
    write_json(args.out, result)
    print(json.dumps(result["summary"], indent=2))
    print(f"[bench] wrote {args.out}")
    for path in plot_all(result, args.plots):
        print(f"[bench] wrote {path}")
    print(f"[bench] done in {result['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
