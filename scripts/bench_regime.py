"""Pull, push, progressive push and local in the emulated GPU regime, over an emulated
link: TTFT through the router, per mode, profile, link and prompt length.

    .venv/bin/python -m scripts.bench_regime --quick   # a few minutes: eth25, 1k and 8k
    .venv/bin/python -m scripts.bench_regime           # the full grid (hours)
    .venv/bin/python -m scripts.bench_regime --help
    .venv/bin/python -m scripts.bench regime --quick   # the --quick run, from the one command
    .venv/bin/python -m scripts.bench regime --quick --modes pull,push,progressive,local

EMULATED: the servers are real vLLM on CPU serving the tiny test model as
`EmulatedLlamaForCausalLM` (package `testbed`) with `--layers` decoder layers (default:
the profile's own, 32 for Llama 3 8B and 80 for 70B), whose every forward pass lasts as long as a GPU profile says (llama8b-h100: Llama 3
8B on one H100; llama70b-h100x8: Llama 3 70B on eight), each layer ending at its share
of it, so that the connector's per-layer hooks fire when they would on the GPU. The KV
moves between P and D by NIXL over UCX's TCP transport on the loopback, shaped by `tc`
to an emulated link (`testbed.link`: rdma400, eth100, eth25, or none = unshaped) at the
link's rate x the emulated model's KV bytes per token / the profile's, so that a
transfer lasts what the profiled model's KV would on that link. Shaping needs root and
`tc`; it is removed when the run ends. No GPU and no network are involved.

What it runs (progress is printed as it goes): per profile, one P/D pair with our
`NixlDualConnector` and the router in front; per link (the shaping re-rated live on the
same pair, a check of its rate printed first), per load (D idle, then D busy), prompt
length and concurrency, rounds of streamed completions in each of `--modes`, chosen per
request by header: pull, push (whole push: `X-KV-Transfer-Mode: push`,
`X-KV-Push-Layers: off`), progressive (layer-by-layer push: `X-KV-Transfer-Mode: push`,
`X-KV-Push-Layers: on`), learned (`X-KV-Transfer-Mode: push` alone: the router learns
whether to write by layer, `auto.push_layers: learn`, from a learning phase of its own
before each case's rounds) and local; the modes interleaved round by round (their order
rotating) so that drift hits all alike, each request a fresh random prompt (no
prefix-cache hits). "D busy" keeps N streams decoding on D (sent straight to D, long
`max_tokens`, `ignore_eos`) for the whole case, so D steps at the profile's batch step
time and a new request waits for a step boundary. `--modes` picks some (a router or
connector that does not know `X-KV-Push-Layers` ignores it: progressive then runs as
whole push, and its hidden share is about 0).

Per case and mode it reports the median and p90 TTFT and two floors the emulated
physics allows (see `floor_s`): P's prefill of the prompt (with the case's concurrency,
in chunks of the servers' token budget) plus one D step at D's load, with the transfer
fully hidden (`floor`), and with the whole transfer over the link paid (`floor paid`);
each mode's overhead over the first; for progressive, the share of whole push's
transfer time it hides: (TTFT push - TTFT progressive) / transfer time, beside the most
it could hide on that link (the last layer's KV still crosses after the prefill, and a
link slower than the forward pass is itself the bound: `floor_s`). Local's
overhead over its own floor (D's prefill) is the host path every mode pays (client,
router, API server, scheduling, streaming back). Per case also the bytes the shaped
link carried against the KV of the case's transfers (proof that the KV took the link).
Busy cases report the inter-token latency of D's background streams per mode. Cases
whose emulated steps ran long (the tiny model's own compute past the profile's time:
long prompts with several layers on this CPU) are flagged from the servers' step logs.
`--slowdown` (default auto) runs the emulated GPU and the link K times slower where the
CPU's compute needs it: auto measures calibration rounds per load, length and
concurrency (its longest prefill step) and takes the least K (in steps of 0.5) that keeps the prefill's compute
within 80% of its time, set live on the servers (testbed.clock.TimeScale) and on the
link; every time and floor of the case is then K times longer, the host's own costs are
not (they weigh K times less than on the real pair); `--slowdown 1` keeps the profile's
own time and flags the steps that run long. vLLM's own
connectors (`NixlConnector` in pull, `NixlPushConnector` in push) run the same cases on
pairs of their own afterwards (`--no-stock` skips them; `--quick` too). Results go to
JSON and a PNG plot.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import random
import statistics
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import msgspec

from scripts.benchkit import batch, pyplot, save_figure, write_json
from scripts.demo import router
from testbed import link as links
from testbed import profiles, tiny_model
from testbed.clock import TIME_SCALE_FILE_ENV, StepRecord, read_step_log, write_time_scale
from testbed.profiles import Profile, StepShape, get_profile
from testbed.vllm_cpu import (
    DEFAULT_LOG_DIR,
    DUAL_CONNECTOR,
    GPU_MAX_BATCHED_TOKENS,
    GPU_MAX_MODEL_LEN,
    GPU_REGIME_ARGS,
    REPO_ROOT,
    Pair,
    gpu_model_dir,
    pair,
)

# Our connector's settings on the regime's pair. The write lease's timeouts are seconds
# of the host's clock, and every emulated transfer runs K times slower (`--slowdown`): a
# 16,384-token push over eth25 at K 20 takes 14 s, past the default write_timeout (10 s),
# and would be cancelled and read by D instead. Room for any K the bench picks.
REGIME_CONNECTOR_CONFIG: dict[str, object] = {"write_timeout": 600.0}

MODES = ("pull", "push", "progressive", "learned", "local")
# Each mode's request headers, and the mode the router's answer must name.
MODE_HEADERS: dict[str, dict[str, str]] = {
    "pull": {},
    "push": {"X-KV-Push-Layers": "off"},
    "progressive": {"X-KV-Push-Layers": "on"},
    "learned": {},  # the router decides: auto.push_layers: learn
    "local": {},
}
ROUTER_MODE = {"pull": "pull", "push": "push", "progressive": "push", "learned": "push",
               "local": "local"}
TRANSFER_MODES = ("pull", "push", "progressive", "learned")
DEFAULT_MODES = ("pull", "push", "progressive", "local")
# learned: the pushes each way (whole, by layer) the router measures in a bucket before
# it chooses; the learning phase sends twice as many before the case's rounds.
LEARN_SAMPLES = 3
WARM_PROMPT_TOKENS = 256  # each mode's warm-up requests on a new link
# vLLM's own connectors, measured in the same run for comparison, each in its one mode.
STOCK_MODES = {"NixlConnector": "pull", "NixlPushConnector": "push"}
LOADS = ("idle", "busy")
DEFAULT_PROFILES = ("llama8b-h100", "llama70b-h100x8")
DEFAULT_LINKS = ("rdma400", "eth100", "eth25")
DEFAULT_PROMPTS = (1024, 4096, 8192, 16384)
DEFAULT_CONCURRENCY = (1,)
QUICK_PROMPTS = (1024, 8192)
BUSY_PROMPT_TOKENS = 64
BUSY_MAX_TOKENS = 2048
SLOW_STEP = 1.10  # a step lasting more than this x its target ran long
# --slowdown auto: each case's factor keeps its prefill's compute within this share of
# its (slowed) time, measured on a calibration prompt, in steps of SLOWDOWN_STEP.
AUTO_COMPUTE_SHARE = 0.8
SLOWDOWN_STEP = 0.5
# What the emulation leaves out, besides the profile module's own list (docs/benchmarks.md,
# "The GPU regime, emulated").
LEFT_OUT = (
    "the host's own speed: vLLM's scheduler, the API servers, the router and this client "
    "run at this machine's CPU speed on 2 shared cores",
    "tensor-parallel communication (only lower efficiency factors in TP profiles)",
    "the model's own compute: the tiny model cut to one attention head of 32 per layer "
    "(testbed.model_dir); with 8 layers, prefills from about 4,096 tokens compute longer "
    "than the profile's time on one core (steps that run long are flagged per case; "
    "--slowdown stretches the emulated GPU and link alike to fit them)",
    "the network, EMULATED: KV moves by NIXL over UCX's TCP on the loopback, shaped by tc "
    "to the link's rate scaled by KV bytes per token; left out are RDMA's CPU offload "
    "(the host's TCP stack copies every byte here), congestion and other traffic, the "
    "NIC's and switch's latency, framing overheads, several NICs per node, and rates "
    "above what the loopback carries on this host (testbed.link)",
)


def say(message: str) -> None:
    print(f"[bench_regime] {message}", flush=True)


class Case(msgspec.Struct, frozen=True):
    load: str  # "idle" or "busy"
    prompt_tokens: int
    concurrency: int
    link: str = "none"

    @property
    def key(self) -> str:
        return f"{self.link}/{self.load}/{self.prompt_tokens}x{self.concurrency}"


class LinkRate(msgspec.Struct, frozen=True):
    """An emulated link as a profile's pair gets it: the rate `tc` shapes to (bit/s,
    None: unshaped) and the KV bytes per token it was scaled with."""

    name: str
    gbps: float | None
    rate_bps: float | None
    emulated_kv_bytes: int
    profile_kv_bytes: int

    def transfer_s(self, tokens: int) -> float:
        """The KV transfer's time on the emulated link (0 unshaped: the host's speed)."""
        if self.rate_bps is None:
            return 0.0
        return links.transfer_s(tokens, self.emulated_kv_bytes, self.rate_bps)

    def shaped_bps(self, slowdown: float) -> float | None:
        """The rate `tc` gets with the emulated GPU `slowdown` times slower."""
        return None if self.rate_bps is None else self.rate_bps / slowdown

    def describe(self) -> str:
        link = links.get_link(self.name)
        if self.rate_bps is None:
            return f"{self.name}: {link.description}"
        return (f"{self.name} ({link.description}): {self.gbps:g} Gb/s x "
                f"{self.emulated_kv_bytes} / {self.profile_kv_bytes} KV bytes per token"
                f" = {self.rate_bps / 1e6:.1f} Mb/s on lo (EMULATED; divided by a case's "
                "slowdown)")


def link_rate(name: str, profile: Profile, emulated_kv_bytes: int) -> LinkRate:
    """The rate `name` is shaped to for `profile`'s pair (testbed.link.scaled_rate_bps)."""
    link = links.get_link(name)
    rate = None if link.gbps is None else links.scaled_rate_bps(
        link.gbps, emulated_kv_bytes, profile.kv_bytes_per_token)
    return LinkRate(name=name, gbps=link.gbps, rate_bps=rate,
                    emulated_kv_bytes=emulated_kv_bytes,
                    profile_kv_bytes=profile.kv_bytes_per_token)


def auto_slowdown(compute_over_target: float) -> float:
    """The factor that keeps a prefill whose compute took `compute_over_target` x the
    profile's time within AUTO_COMPUTE_SHARE of its slowed time: 1 when it fits, else
    rounded up to a step of SLOWDOWN_STEP."""
    needed = compute_over_target / AUTO_COMPUTE_SHARE
    if needed <= 1.0:
        return 1.0
    steps = -(-needed // SLOWDOWN_STEP)
    return float(steps * SLOWDOWN_STEP)


# The floor ----------------------------------------------------------------------------


def prefill_finish_s(profile: Profile, tokens: int, concurrency: int,
                     budget: int = GPU_MAX_BATCHED_TOKENS,
                     background: Sequence[StepShape] = ()) -> list[float]:
    """When each of `concurrency` prompts of `tokens`, arriving together, has been
    computed: first come first served, at most `budget` tokens a step (vLLM's chunked
    prefill) beside the `background` decodes, each step as long as the profile says."""
    done = [0] * concurrency
    finish: list[float] = []
    clock = 0.0
    while len(finish) < concurrency:
        room, shapes, ending = budget - len(background), list(background), 0
        for index in range(concurrency):
            left = tokens - done[index]
            if left <= 0 or room <= 0:
                continue
            take = min(left, room)
            shapes.append(StepShape(take, done[index]))
            done[index] += take
            room -= take
            ending += done[index] == tokens
        clock += profile.step_s(shapes)
        finish += [clock] * ending
    return finish


def busy_context(args: argparse.Namespace) -> int:
    """A background stream's context in the middle of its answer (the floor's estimate)."""
    return BUSY_PROMPT_TOKENS + int(args.busy_max_tokens) // 2


def floor_s(profile: Profile, case: Case, rate: LinkRate,
            args: argparse.Namespace, slowdown: float = 1.0) -> dict[str, float]:
    """The emulated physics' lower bounds on the case's median TTFT, and their parts:
    P's prefill (the median request's finish, see `prefill_finish_s`), one D step (the
    request's last token, which D computes, with the case's other new requests and,
    when D is busy, its background decodes), and the prompt's KV over the emulated
    link. `floor_s` is prefill + D step, the transfer fully hidden (what progressive
    push could reach); `floor_paid_s` adds the whole transfer (what whole push and pull
    pay at least); `floor_progressive_s` is what layer-by-layer push can reach on this
    link: the KV cannot all cross before the transfer's time has passed from the first
    layer's KV (about the step's start), nor the last layer's before it is computed
    (the step's (L-1)/L here, where the hook fires) plus its own share of the transfer:
    max(transfer, prefill x (L-1)/L + transfer / L) + D step, never below `floor_s`
    (`best_hidden_share`: the share of the transfer it can hide). Every time is `slowdown` times the profile's. With concurrency above
    1 it assumes the prompts reach P together; through the router they arrive a little
    apart, and the first can finish before the bound."""
    scale = slowdown
    prefill = statistics.median(prefill_finish_s(profile, case.prompt_tokens,
                                                 case.concurrency)) * scale
    transfer = rate.transfer_s(case.prompt_tokens) * scale
    shapes = [StepShape(1, case.prompt_tokens - 1)] * case.concurrency
    if case.load == "busy":
        shapes += [StepShape(1, busy_context(args) - 1)] * int(args.busy_streams)
    d_step = profile.step_s(shapes) * scale
    # local has its own, lower floor: D computes the prompts itself (no transfer), its
    # background decodes riding in the same steps.
    background = [StepShape(1, busy_context(args) - 1)] * (
        int(args.busy_streams) if case.load == "busy" else 0)
    local = statistics.median(prefill_finish_s(profile, case.prompt_tokens, case.concurrency,
                                               background=background)) * scale
    layers = int(args.layers or profile.model.num_layers)  # the profile's own by default
    progressive = max(prefill, transfer,
                      prefill * (layers - 1) / layers + transfer / layers) + d_step
    best_hidden = (prefill + transfer + d_step - progressive) / transfer if transfer else 0.0
    return {"prefill_s": prefill, "transfer_s": transfer, "d_step_s": d_step,
            "floor_s": prefill + d_step, "floor_paid_s": prefill + transfer + d_step,
            "floor_progressive_s": progressive, "best_hidden_share": best_hidden,
            "local_floor_s": local}


# D busy ------------------------------------------------------------------------------


class Ticks:
    """When each background stream's chunks arrived (one chunk per D step that gave it a
    token, as vLLM streams): the inter-token latency D's other streams see."""

    def __init__(self, streams: int) -> None:
        self.times: list[list[float]] = [[] for _ in range(streams)]

    def gaps(self, windows: Sequence[tuple[float, float]]) -> list[float]:
        """The gaps between two chunks of one stream whose later chunk came inside one
        of `windows` (wall-clock [start, end) pairs), in seconds."""
        gaps = []
        for times in self.times:
            for before, after in itertools.pairwise(times):
                if any(start <= after < end for start, end in windows):
                    gaps.append(after - before)
        return gaps


async def background_stream(client: httpx.AsyncClient, decode_url: str, rng: random.Random,
                            max_tokens: int, started: asyncio.Event,
                            stop: asyncio.Event, ticks: list[float]) -> int:
    """Keep one stream decoding on D until `stop`: a short prompt with a long answer,
    sent again when it ends; each chunk's arrival goes to `ticks`. Returns how many
    answers it finished."""
    finished = 0
    while not stop.is_set():
        body = {"model": "tiny", "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True, "prompt": [rng.randrange(10, tiny_model.VOCAB_SIZE)
                                               for _ in range(BUSY_PROMPT_TOKENS)]}
        async with client.stream("POST", f"{decode_url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"background stream: HTTP {resp.status_code}: "
                                   f"{(await resp.aread())[:300]!r}")
            async for _ in resp.aiter_raw():  # the bytes only: keep this client cheap
                ticks.append(time.time())
                started.set()
                if stop.is_set():
                    break
        finished += 1
    return finished


@contextlib.asynccontextmanager
async def busy_decode(decode_url: str, streams: int, max_tokens: int, rng: random.Random,
                      start_timeout_s: float = 60.0) -> AsyncIterator[Ticks]:
    """`streams` background streams on D for the body of the `async with`; all of them
    decoding before it runs, all of them cancelled and closed after it, on every path.
    Yields their chunks' arrival times."""
    stop = asyncio.Event()
    started = [asyncio.Event() for _ in range(streams)]
    ticks = Ticks(streams)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0),
                                 limits=httpx.Limits(max_connections=streams + 2)) as client:
        tasks = [asyncio.create_task(background_stream(client, decode_url, rng, max_tokens,
                                                       event, stop, times))
                 for event, times in zip(started, ticks.times, strict=True)]
        event_tasks = [asyncio.create_task(event.wait()) for event in started]
        waiting: asyncio.Task[Any] = asyncio.create_task(asyncio.wait(event_tasks))
        try:
            watched: set[asyncio.Task[Any]] = {waiting, *tasks}
            done, _ = await asyncio.wait(watched, timeout=start_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            for task in tasks:
                if task in done:
                    task.result()  # a stream that ended early raises its error here
            if not all(event.is_set() for event in started):
                raise RuntimeError(f"D's {streams} background streams did not all start "
                                   f"within {start_timeout_s:.0f} s")
            yield ticks
        finally:
            stop.set()
            helpers: list[asyncio.Task[Any]] = [*tasks, *event_tasks, waiting]
            for task in helpers:
                task.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)


# The router's waits on its upstreams, in the regime: a case slowed K times takes K times
# the profile's time, and the 70B's 16,384-token pull over eth25 (K about 40) waits
# minutes for D, past the defaults (timeouts.first_token 300 s, stream_idle 60 s).
REGIME_ROUTER_CONFIG = "timeouts:\n  prefill: 3600\n  first_token: 3600\n  stream_idle: 3600\n"


def router_config(args: argparse.Namespace) -> str:
    """`REGIME_ROUTER_CONFIG`, and for learned: the router learns layers or whole per
    prompt length, each of the run's lengths a bucket of its own (prompts of token ids
    count 4 characters a token; edges halfway between lengths), never exploring."""
    if "learned" not in args.modes:
        return REGIME_ROUTER_CONFIG
    lengths = sorted({WARM_PROMPT_TOKENS, *args.prompts})  # the warm-up's its own too
    edges = [2 * (a + b) for a, b in itertools.pairwise(lengths)]  # 4 x (a + b) / 2
    return (REGIME_ROUTER_CONFIG + "auto:\n  push_layers: learn\n"
            f"  min_samples: {LEARN_SAMPLES}\n  explore: 0\n  bucket_edges: {edges}\n")


@contextlib.contextmanager
def quiet_router(prefill_url: str, decode_url: str, log_path: Path,
                 config_text: str = REGIME_ROUTER_CONFIG) -> Iterator[str]:
    """`scripts.demo.router` with `REGIME_ROUTER_CONFIG`, its process's output (an access
    line per request) sent to `log_path` instead of this terminal: the router inherits
    our stdout and stderr as they are when it starts, so they point at the file for that
    moment only."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    config = log_path.with_suffix(".yaml")
    config.write_text(config_text)
    with contextlib.ExitStack() as stack:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = [os.dup(1), os.dup(2)]
        try:
            with open(log_path, "ab") as log:
                os.dup2(log.fileno(), 1)
                os.dup2(log.fileno(), 2)
                url = stack.enter_context(router(prefill_url, decode_url, "pull", config))
        finally:
            sys.stdout.flush()
            for fd, saved_fd in enumerate(saved, 1):
                os.dup2(saved_fd, fd)
                os.close(saved_fd)
        say(f"router on {url} (its output: {log_path})")
        yield url


# The runs ----------------------------------------------------------------------------


def step_summary(records: Sequence[StepRecord], since: float, until: float) -> dict[str, Any]:
    """A server's emulated steps in [since, until): how many ran long, and how close the
    tiny model's compute came to the profile's time in prefill steps."""
    steps = [r for r in records if since <= r.at < until]
    prefills = [r for r in steps if r.prefill_tokens > 0]
    decodes = [r for r in steps if r.prefill_tokens == 0 and r.decodes > 0]
    periods = [r.step_s + (r.gap_s or 0.0) for r in decodes if r.overlapped]
    return {
        "steps": len(steps),
        "long_steps": sum(r.step_s > SLOW_STEP * r.target_s for r in steps),
        "prefill_steps": len(prefills),
        "prefill_compute_over_target_max": max(
            (r.compute_s / r.target_s for r in prefills if r.target_s > 0), default=None),
        "prefill_compute_over_target_median": statistics.median(
            r.compute_s / r.target_s for r in prefills if r.target_s > 0) if prefills else None,
        "decode_step_ms_median": statistics.median(r.step_s for r in decodes) * 1e3
        if decodes else None,
        "decode_target_ms_median": statistics.median(r.target_s for r in decodes) * 1e3
        if decodes else None,
        "decode_period_ms_median": statistics.median(periods) * 1e3 if periods else None,
    }


async def run_case(client: httpx.AsyncClient, url: str, case: Case, modes: Sequence[str],
                   args: argparse.Namespace, rng: random.Random,
                   ) -> tuple[dict[str, list[float]], dict[str, list[tuple[float, float]]]]:
    """Rounds of `case.concurrency` requests per mode, the modes' order rotating. Returns
    the TTFTs per mode, and when each mode's rounds ran (wall clock)."""
    ttfts: dict[str, list[float]] = {mode: [] for mode in modes}
    windows: dict[str, list[tuple[float, float]]] = {mode: [] for mode in modes}
    rounds = max(1, -(-int(args.requests) // case.concurrency))
    for index in range(rounds):
        order = [*modes[index % len(modes):], *modes[:index % len(modes)]]
        for mode in order:
            start = time.time()
            got = await batch(client, url, ROUTER_MODE[mode], case.prompt_tokens,
                              case.concurrency, rng, MODE_HEADERS[mode])
            ttfts[mode] += got
            windows[mode].append((start, time.time()))
            # A long case (16k tokens slowed 80 times) runs for many minutes: say it lives.
            say(f"    {case.key} round {index + 1}/{rounds} {mode}: TTFT "
                f"{statistics.median(got) * 1e3:.1f} ms (slowed), {time.time() - start:.0f} s")
    return ttfts, windows


async def layer_choices(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """How many pushes the router has sent by layer ("on") and whole ("off") once it had
    learned (reasons layers_faster_*), from its /metrics."""
    counts = {"on": 0.0, "off": 0.0}
    for line in (await client.get(f"{url}/metrics")).text.splitlines():
        if line.startswith("pdproxy_push_layers_decisions_total{") \
                and 'reason="layers_faster_' in line:
            counts["on" if 'layers="on"' in line else "off"] += float(line.rsplit(" ", 1)[1])
    return counts


def itl_summary(ticks: Ticks | None, windows: dict[str, list[tuple[float, float]]],
                ) -> dict[str, dict[str, float | int]] | None:
    """Per mode, the inter-token latency of D's background streams while that mode's
    requests ran: median and p90 in ms, and how many gaps were seen."""
    if ticks is None:
        return None
    summary: dict[str, dict[str, float | int]] = {}
    for mode, spans in windows.items():
        gaps = ticks.gaps(spans)
        if gaps:
            summary[mode] = {"median_ms": statistics.median(gaps) * 1e3,
                             "p90_ms": p90(gaps) * 1e3, "n": len(gaps)}
    return summary


async def calibrate(client: httpx.AsyncClient, url: str, p: Pair, case: Case,
                    modes: Sequence[str], current: float, rng: random.Random) -> float:
    """How long the prefill of the case's prompts computes here against the profile's
    (unslowed) time: two rounds in the first transfer mode of `modes` (P computes) and
    one in local if `modes` has it (D does); the longest of their prefill steps (one
    round's step is noisy: whatever else the cores run counts in its compute)."""
    since = time.time()
    first = [m for m in modes if m in TRANSFER_MODES][:1]
    chosen = first * 2 + [m for m in modes if m == "local"]
    say(f"    {case.key}: calibrating the slowdown ({len(chosen)} rounds unslowed) ...")
    for mode in chosen:
        await batch(client, url, ROUTER_MODE[mode], case.prompt_tokens, case.concurrency,
                    rng, MODE_HEADERS[mode])
    ratios = [r.compute_s * current / r.target_s
              for server in (p.prefill, p.decode)
              for r in read_step_log(server.spec.step_log_path)
              if r.at >= since and r.prefill_tokens > 0 and r.target_s > 0]
    return max(ratios, default=0.0)


async def run_all(p: Pair, url: str, cases: Sequence[Case], modes: Sequence[str],
                  rates: dict[str, LinkRate], shaper: links.Shaper | None, scale_path: Path,
                  args: argparse.Namespace, rng: random.Random,
                  slowdowns: dict[str, float] | None = None,
                  ) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """Every case, link by link (the shaping re-rated live between links), each at its
    slowdown (`--slowdown`; auto: calibrated per load, length and concurrency, the
    servers' time scale and the link's rate set before the case; `slowdowns`, by case
    key, instead: vLLM's connectors run at our pair's factors). Returns the results
    and, per shaped link, the check of its rate."""
    results: list[dict[str, Any]] = []
    proofs: dict[str, dict[str, Any]] = {}
    compute_ratios: dict[tuple[str, int, int], float] = {}
    current = 1.0
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0),
                                 limits=httpx.Limits(max_connections=64)) as client:
        for link_name in dict.fromkeys(case.link for case in cases):
            rate = rates[link_name]
            if shaper is not None:
                shaper.set(rate.rate_bps)
            say(f"link {rate.describe()}")
            if shaper is not None and rate.rate_bps is not None:
                proof = links.prove(shaper, seconds=0.3)
                say(proof.line())
                proofs[link_name] = {"line": proof.line(), "ok": proof.ok(),
                                     "ratio": proof.ratio, "shaped_s": proof.shaped_s,
                                     "expected_s": proof.expected_s,
                                     "unshaped_s": proof.unshaped_s, "bytes": proof.nbytes}
            say("warming every mode (handshakes, first allocations) ...")
            for mode in modes:
                await batch(client, url, ROUTER_MODE[mode], WARM_PROMPT_TOKENS, 2, rng,
                            MODE_HEADERS[mode])
            for load in LOADS:
                load_cases = [c for c in cases if c.load == load and c.link == link_name]
                if not load_cases:
                    continue
                busy: contextlib.AbstractAsyncContextManager[Ticks | None] = (
                    busy_decode(p.decode_url, int(args.busy_streams),
                                int(args.busy_max_tokens), rng)
                    if load == "busy" else contextlib.nullcontext())
                if load == "busy":
                    say(f"D busy: starting {args.busy_streams} background streams on D ...")
                async with busy as ticks:
                    for case in load_cases:
                        ratio = None
                        if slowdowns is not None and case.key in slowdowns:
                            slowdown = slowdowns[case.key]
                        elif args.slowdown == "auto":
                            shape = (case.load, case.prompt_tokens, case.concurrency)
                            if shape not in compute_ratios:
                                compute_ratios[shape] = await calibrate(
                                    client, url, p, case, modes, current, rng)
                            ratio = compute_ratios[shape]
                            slowdown = auto_slowdown(ratio)
                        else:
                            slowdown = float(args.slowdown)
                        write_time_scale(scale_path, slowdown)
                        current = slowdown
                        if shaper is not None:
                            shaper.set(rate.shaped_bps(slowdown))
                        if "learned" in modes:  # the router's learning turns, not measured
                            for _ in range(2 * LEARN_SAMPLES):
                                await batch(client, url, "push", case.prompt_tokens, 1, rng,
                                            MODE_HEADERS["learned"])
                        since = time.time()
                        sent_before = links.shaped_bytes() if shaper is not None else None
                        chosen_before = (await layer_choices(client, url)
                                         if "learned" in modes else None)
                        ttfts, windows = await run_case(client, url, case, modes, args, rng)
                        learned_layers = None
                        if chosen_before is not None:
                            chosen = await layer_choices(client, url)
                            learned_layers = {k: int(chosen[k] - chosen_before[k])
                                              for k in chosen}
                        sent_after = links.shaped_bytes() if shaper is not None else None
                        until = time.time()
                        lost = shaper is not None and not shaper.intact()
                        if lost:
                            say(f"  WARNING: the shaping of lo was removed during {case.key} "
                                "(by another process?): its transfers were not shaped; "
                                "shaping again for the next case")
                        steps = {role: step_summary(read_step_log(server.spec.step_log_path),
                                                    since, until)
                                 for role, server in (("P", p.prefill), ("D", p.decode))}
                        transfers = sum(len(v) for m, v in ttfts.items()
                                        if m in TRANSFER_MODES)
                        link_bytes = (None if sent_before is None or sent_after is None
                                      else sent_after - sent_before)
                        results.append({
                            "case": msgspec.to_builtins(case), "key": case.key,
                            "ttft_s": ttfts, "steps": steps, "d_itl": itl_summary(ticks, windows),
                            "link_bytes": link_bytes, "learned_layers": learned_layers,
                            "kv_bytes_transferred": transfers * case.prompt_tokens
                            * rate.emulated_kv_bytes,
                            "slowdown": slowdown, "calibrated_compute_over_target": ratio,
                            "link_lost": lost})
                        medians = ", ".join(f"{m} {statistics.median(v) * 1e3:.1f} ms"
                                            for m, v in ttfts.items())
                        carried = ("" if link_bytes is None else
                                   f"; link carried {link_bytes / 1e6:.1f} MB for "
                                   f"{results[-1]['kv_bytes_transferred'] / 1e6:.1f} MB of KV")
                        slow = "" if slowdown == 1 else (
                            f" (slowdown {slowdown:g}"
                            + ("" if ratio is None else f": compute {ratio:.2f}x the profile")
                            + ")")
                        say(f"  [{len(results)}/{len(cases)}] {case.key}{slow}: median TTFT "
                            f"{medians}{carried}")
    return results, proofs


def p90(values: Sequence[float]) -> float:
    """The 90th percentile (inclusive method: defined from one value on)."""
    if len(values) < 2:
        return values[0]
    return statistics.quantiles(values, n=10, method="inclusive")[-1]


def long_steps_note(steps: dict[str, Any]) -> str | None:
    """Why a case's numbers are not the profile's alone, or None when its steps kept time."""
    notes = []
    for role, summary in steps.items():
        share = summary["prefill_compute_over_target_median"]
        if share is not None and share > 1.0:
            notes.append(f"{role} prefill compute {share:.2f}x its target (median)")
        if summary["long_steps"]:
            notes.append(f"{role} {summary['long_steps']}/{summary['steps']} steps ran long")
    return "; ".join(notes) or None


def mode_summary(values: Sequence[float], floor: float, floor_paid: float,
                 ) -> dict[str, float | int]:
    median = statistics.median(values)
    return {"median_ms": median * 1e3, "p90_ms": p90(values) * 1e3,
            "overhead_ms": (median - floor) * 1e3,
            "over_paid_floor_ms": (median - floor_paid) * 1e3, "n": len(values)}


def summarize(profile: Profile, results: Sequence[dict[str, Any]],
              stock: dict[str, list[dict[str, Any]]], rates: dict[str, LinkRate],
              args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per case. Each mode's overhead is its median TTFT over the floor with the
    transfer hidden (local's over its own: D's prefill, no transfer, no extra step), and
    also over the floor with the transfer paid. Local's overhead is the host path every
    mode pays (client, router, API server, tokenizing, scheduling, streaming back); what
    the transfer modes pay beyond it is their hand-off (`handoff_ms`). Progressive's
    `hidden_share`: the share of whole push's transfer time it hides."""
    rows = []
    stock_by_key = {f"{name} {STOCK_MODES[name]}": {r["key"]: r["ttft_s"][STOCK_MODES[name]]
                                                   for r in stock_results}
                    for name, stock_results in stock.items()}
    for result in results:
        case = msgspec.convert(result["case"], Case)
        slowdown = float(result.get("slowdown", 1.0))
        floor = floor_s(profile, case, rates[case.link], args, slowdown)
        modes = {mode: mode_summary(values,
                                    floor["local_floor_s" if mode == "local" else "floor_s"],
                                    floor["local_floor_s" if mode == "local"
                                          else "floor_paid_s"])
                 for mode, values in result["ttft_s"].items()}
        host = modes["local"]["overhead_ms"] if "local" in modes else None
        handoff = {mode: modes[mode]["overhead_ms"] - host for mode in TRANSFER_MODES
                   if mode in modes and host is not None}
        stock_modes = {label: mode_summary(by_key[result["key"]], floor["floor_s"],
                                           floor["floor_paid_s"])
                       for label, by_key in stock_by_key.items() if result["key"] in by_key}
        pull = modes["pull"]["median_ms"] if "pull" in modes else None
        ratios = {f"{mode}_over_pull": modes[mode]["median_ms"] / pull
                  for mode in ("push", "progressive", "learned", "local")
                  if mode in modes and pull}
        if "learned" in modes and "push" in modes and "progressive" in modes:
            better = min(modes["push"]["median_ms"], modes["progressive"]["median_ms"])
            ratios["learned_over_better"] = modes["learned"]["median_ms"] / better
        transfer_ms = floor["transfer_s"] * 1e3
        hidden = None
        if "push" in modes and "progressive" in modes and transfer_ms > 0:
            hidden = (modes["push"]["median_ms"] - modes["progressive"]["median_ms"]) \
                / transfer_ms
        rows.append({
            "link": case.link, "load": case.load, "prompt_tokens": case.prompt_tokens,
            "concurrency": case.concurrency, "slowdown": slowdown,
            "floor_ms": {name: value * 1e3 for name, value in floor.items()
                         if name.endswith("_s")},
            "progressive_best_hidden_share": floor["best_hidden_share"],
            "modes": modes, **ratios,
            "progressive_hidden_share": hidden,
            "host_path_ms": host,
            "handoff_ms": handoff,
            "link_bytes": result.get("link_bytes"),
            "learned_layers": result.get("learned_layers"),
            "kv_bytes_transferred": result.get("kv_bytes_transferred"),
            "stock": stock_modes,
            "d_itl": result.get("d_itl"),
            "steps": result["steps"],
            "flag": "; ".join(note for note in (
                "LINK LOST: the shaping was removed during the case, its transfers unshaped"
                if result.get("link_lost") else None,
                long_steps_note(result["steps"])) if note) or None,
        })
    return rows


def _modes_of(rows: Sequence[dict[str, Any]]) -> list[str]:
    return [mode for mode in MODES if any(mode in row["modes"] for row in rows)]


def print_table(rows: Sequence[dict[str, Any]], profile: Profile, layers: int) -> None:
    modes = _modes_of(rows)
    slowed = any(row["slowdown"] != 1 for row in rows)
    slow = ("; slow = the case's SLOWDOWN: its emulated GPU and link that many times "
            "slower, every time and floor with them (the host's own costs not)"
            if slowed else "")
    print(f"\nEMULATED GPU regime, profile {profile.name}, {layers} layers (no GPU: "
          "vLLM on CPU, each layer sleeping to its share of the profile's time; no network: "
          "KV over TCP on lo shaped to the link's scaled rate); floor = prefill + one D step "
          "(transfer hidden), paid = floor + the whole transfer; TTFT in ms, median (p90) "
          f"[median - floor; local's: over its own floor, D's prefill]; ! = steps ran long{slow}")
    print(f"{'link':>7} {'load':>4} {'prompt':>6} {'conc':>4} {'slow':>4} {'floor':>7} {'paid':>7} "
          + " ".join(f"{m + ' med (p90) [over]':>28}" for m in modes)
          + "".join(f" {m + '/pull':>9}" for m in ("push", "progressive", "learned", "local")
                    if m in modes and "pull" in modes)
          + (f" {'hidden (best)':>11}" if "progressive" in modes and "push" in modes else ""))
    for row in rows:
        cells = " ".join(
            f"{row['modes'][m]['median_ms']:>9.1f} ({row['modes'][m]['p90_ms']:>7.1f})"
            f" [{row['modes'][m]['overhead_ms']:>6.1f}]" if m in row["modes"] else f"{'-':>28}"
            for m in modes)
        ratios = "".join(f" {row[f'{m}_over_pull']:>9.2f}"
                         for m in ("push", "progressive", "learned", "local")
                         if m in modes and "pull" in modes and f"{m}_over_pull" in row)
        hidden = row["progressive_hidden_share"]
        best = row["progressive_best_hidden_share"]
        hidden_cell = "" if "progressive" not in modes or "push" not in modes else (
            f" {'-' if hidden is None else f'{hidden:.0%} ({best:.0%})':>11}")
        flag = f"  ! {row['flag']}" if row["flag"] else ""
        print(f"{row['link']:>7} {row['load']:>4} {row['prompt_tokens']:>6} "
              f"{row['concurrency']:>4} {row['slowdown']:>4g} {row['floor_ms']['floor_s']:>7.1f} "
              f"{row['floor_ms']['floor_paid_s']:>7.1f} {cells}{ratios}{hidden_cell}{flag}")
    if slowed:
        print("\nthe same in the profile's time (every number / the case's slowdown; the "
              "host's own costs, not slowed, shrink with it): median TTFT ms")
        print(f"{'link':>7} {'load':>4} {'prompt':>6} {'conc':>4} {'floor':>7} {'paid':>7} "
              + " ".join(f"{m:>11}" for m in modes))
        for row in rows:
            k = row["slowdown"]
            print(f"{row['link']:>7} {row['load']:>4} {row['prompt_tokens']:>6} "
                  f"{row['concurrency']:>4} {row['floor_ms']['floor_s'] / k:>7.1f} "
                  f"{row['floor_ms']['floor_paid_s'] / k:>7.1f} "
                  + " ".join(f"{row['modes'][m]['median_ms'] / k:>11.1f}" if m in row["modes"]
                             else f"{'-':>11}" for m in modes))
    if "learned" in modes:
        print("\nlearned: the router's choice once it had learned (after its learning turns), "
              "pushes by layer and whole, and its TTFT over the better of push and progressive")
        for row in rows:
            chosen = row.get("learned_layers") or {}
            better = row.get("learned_over_better")
            print(f"{row['link']:>7} {row['load']:>4} {row['prompt_tokens']:>6}: by layer "
                  f"{chosen.get('on', '-')}, whole {chosen.get('off', '-')}"
                  + (f"; learned/better {better:.2f}" if better is not None else ""))
    print("\nfloor parts (ms): prefill + D step, + transfer when paid; the shaped link's "
          "bytes against the KV of the case's transfers")
    for row in rows:
        f = row["floor_ms"]
        d = row["steps"]["D"]
        busy = ""
        if row["load"] == "busy" and d["decode_period_ms_median"] is not None:
            busy = (f"; D's decode steps: period {d['decode_period_ms_median']:.2f} ms, "
                    f"target {d['decode_target_ms_median']:.2f} ms")
        carried = ""
        if row.get("link_bytes") is not None:
            carried = (f"; link carried {row['link_bytes'] / 1e6:.1f} MB for "
                       f"{row['kv_bytes_transferred'] / 1e6:.1f} MB of KV")
        print(f"  {row['link']} {row['load']} {row['prompt_tokens']}x{row['concurrency']}: "
              f"{f['prefill_s']:.1f} + {f['d_step_s']:.2f} (+ {f['transfer_s']:.1f}); "
              f"progressive's own {f['floor_progressive_s']:.1f}; "
              f"local's own (D's prefill, no transfer) {f['local_floor_s']:.1f}"
              f"{carried}{busy}")


def print_breakdown(rows: Sequence[dict[str, Any]]) -> None:
    """The overheads split: the host path every mode pays (local's overhead over its own
    floor), and each transfer mode's hand-off beyond it; then vLLM's own connectors, and
    D's other streams' inter-token latency per mode."""
    modes = [m for m in _modes_of(rows) if m in TRANSFER_MODES]
    if all(row["host_path_ms"] is not None for row in rows):
        print("\noverhead over the floor (transfer hidden), split (ms): host path = local's "
              "overhead over its own floor (client, router, API server, scheduling, "
              "streaming back: every mode pays it); hand-off = a mode's overhead beyond it "
              "(the transfer it did not hide among it)")
        print(f"{'link':>7} {'load':>4} {'prompt':>6} {'conc':>4} {'host path':>9} "
              + " ".join(f"{m + ' hand-off':>20}" for m in modes))
        for row in rows:
            print(f"{row['link']:>7} {row['load']:>4} {row['prompt_tokens']:>6} "
                  f"{row['concurrency']:>4} {row['host_path_ms']:>9.1f} "
                  + " ".join(f"{row['handoff_ms'][m]:>20.1f}" if m in row["handoff_ms"]
                             else f"{'-':>20}" for m in modes))
    labels = sorted({label for row in rows for label in row["stock"]})
    if labels:
        print("\nvLLM's own connectors, same profile and cases, on their own pair (median TTFT "
              "ms [overhead]; ratio = ours in the same mode / theirs)")
        for row in rows:
            cells = []
            for label in labels:
                theirs = row["stock"].get(label)
                mode = label.rsplit(" ", 1)[1]
                if theirs is None or mode not in row["modes"]:
                    continue
                ours = row["modes"][mode]["median_ms"]
                cells.append(f"{label}: {theirs['median_ms']:.1f} [{theirs['overhead_ms']:.1f}]"
                             f", ours/theirs {ours / theirs['median_ms']:.2f}")
            print(f"  {row['link']} {row['load']} {row['prompt_tokens']}x{row['concurrency']}: "
                  + "; ".join(cells))
    busy = [row for row in rows if row.get("d_itl")]
    if busy:
        print("\nD's other streams while each mode's requests ran: inter-token latency, "
              "median (p90) ms")
        for row in busy:
            itl = row["d_itl"]
            line = ", ".join(f"{mode} {itl[mode]['median_ms']:.1f} ({itl[mode]['p90_ms']:.1f})"
                             for mode in MODES if mode in itl)
            print(f"  {row['link']} {row['load']} {row['prompt_tokens']}x"
                  f"{row['concurrency']}: {line}")


def target_check(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Progressive push's targets (issue: at 8,192 tokens on eth25 it hides at least 80%
    of the transfer time whole push pays, and its TTFT is at most 0.6x pull's; on every
    link and length it is never slower than whole push, within noise: 5% or 5 ms), and
    whole push against pull on every row; each with the value measured."""
    lines = []
    for row in rows:
        where = f"{row['link']} {row['load']} {row['prompt_tokens']}x{row['concurrency']}"
        modes = row["modes"]
        if "push" in modes and "pull" in modes:
            ratio = row["push_over_pull"]
            lines.append(f"push <= pull, {where}: {ratio:.2f}"
                         f" {'met' if ratio <= 1.0 else 'MISSED'}")
        if "progressive" not in modes:
            continue
        if row["link"] == "eth25" and row["prompt_tokens"] == 8192:
            hidden = row["progressive_hidden_share"]
            if hidden is not None:
                lines.append(f"progressive hides >= 80% of push's transfer, {where}: "
                             f"{hidden:.0%} {'met' if hidden >= 0.8 else 'MISSED'} (the "
                             f"link and {row['prompt_tokens']} tokens allow "
                             f"{row['progressive_best_hidden_share']:.0%})")
            if "pull" in modes:
                ratio = row["progressive_over_pull"]
                lines.append(f"progressive <= 0.6x pull, {where}: {ratio:.2f} "
                             f"{'met' if ratio <= 0.6 else 'MISSED'}")
        if "push" in modes:
            prog, push = modes["progressive"]["median_ms"], modes["push"]["median_ms"]
            slower = prog > max(push * 1.05, push + 5.0)
            lines.append(f"progressive never slower than push, {where}: {prog:.1f} against "
                         f"{push:.1f} ms {'MISSED' if slower else 'met'}")
    return lines


def left_out() -> list[str]:
    """What the emulation leaves out: the profiles module's own paragraph, and ours."""
    doc = profiles.__doc__ or ""
    paragraph = next((p for p in doc.split("\n\n") if p.startswith("What this leaves out")), "")
    return [" ".join(paragraph.split())] + list(LEFT_OUT) if paragraph else list(LEFT_OUT)


def plot(rows_by_profile: dict[str, list[dict[str, Any]]], path: Path) -> bool:
    """Per profile and link (rows) and load (columns): median TTFT by prompt length per
    mode, with both floors."""
    plt = pyplot(say)
    if plt is None:
        return False
    panels = [(name, link_name) for name, rows in rows_by_profile.items()
              for link_name in dict.fromkeys(r["link"] for r in rows)]
    loads = [load for load in LOADS
             if any(r["load"] == load for rows in rows_by_profile.values() for r in rows)]
    if not panels or not loads:
        return False
    fig, axes = plt.subplots(len(panels), len(loads), squeeze=False,
                             figsize=(6 * len(loads), 4.5 * len(panels)))
    for i, (name, link_name) in enumerate(panels):
        for j, load in enumerate(loads):
            ax = axes[i][j]
            chosen = sorted((r for r in rows_by_profile[name] if r["load"] == load
                             and r["link"] == link_name and r["concurrency"] == min(
                                 x["concurrency"] for x in rows_by_profile[name])),
                            key=lambda r: int(r["prompt_tokens"]))
            if not chosen:
                ax.set_visible(False)
                continue
            x = [r["prompt_tokens"] for r in chosen]
            k = [float(r["slowdown"]) for r in chosen]
            for mode, marker in zip(MODES, "os^*D", strict=True):
                if all(mode in r["modes"] for r in chosen):
                    ax.plot(x, [r["modes"][mode]["median_ms"] / s
                                for r, s in zip(chosen, k, strict=True)], f"{marker}-",
                            label=mode)
            for label, marker in zip(sorted({k for r in chosen for k in r["stock"]}), "vx",
                                     strict=False):
                if all(label in r["stock"] for r in chosen):
                    ax.plot(x, [r["stock"][label]["median_ms"] / s
                                for r, s in zip(chosen, k, strict=True)],
                            f"{marker}--", label=f"vLLM {label}")
            ax.plot(x, [r["floor_ms"]["floor_s"] / s for r, s in zip(chosen, k, strict=True)],
                    "k:", label="floor (transfer hidden)")
            ax.plot(x, [r["floor_ms"]["floor_paid_s"] / s
                        for r, s in zip(chosen, k, strict=True)], "k--", alpha=0.5,
                    label="floor (transfer paid)")
            ax.set_title(f"EMULATED {name}, link {link_name}: D {load}, concurrency "
                         f"{chosen[0]['concurrency']}")
            ax.set_xlabel("prompt tokens")
            ax.set_ylabel("median TTFT / slowdown (ms, the profile's time)"
                          if any(s != 1 for s in k) else "median TTFT (ms)")
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
            ax.legend()
    save_figure(plt, fig, path)
    return True


def _names(choices: Sequence[str], what: str) -> Any:
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
        unknown = [n for n in names if n not in choices]
        if not names or unknown:
            raise argparse.ArgumentTypeError(
                f"{what} must be some of {', '.join(choices)} (got {text!r})")
        return names
    return parse


def _slowdown(text: str) -> str | float:
    if text.strip() == "auto":
        return "auto"
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"--slowdown must be auto or a positive number, "
                                         f"got {text!r}")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.bench_regime", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="What the emulation leaves out:\n" + "\n".join(
            textwrap.fill(item, 88, initial_indent="- ", subsequent_indent="  ")
            for item in left_out()))
    ints = lambda s: tuple(int(x) for x in s.split(","))  # noqa: E731
    parser.add_argument("--profile", "--profiles", dest="profiles", default=None,
                        type=_names(sorted(profiles.PROFILES), "--profile"),
                        help="GPU profiles the servers emulate, comma-separated, a pair each "
                             f"(default: {','.join(DEFAULT_PROFILES)})")
    parser.add_argument("--links", default=None, type=_names(list(links.LINKS), "--links"),
                        help="emulated links, comma-separated, re-rated live on each pair: "
                             f"{', '.join(links.LINKS)} (default: {','.join(DEFAULT_LINKS)})")
    parser.add_argument("--modes", default=DEFAULT_MODES, type=_names(MODES, "--modes"),
                        help="modes, comma-separated: pull, push (whole), progressive "
                             "(layer by layer: X-KV-Push-Layers: on), learned (the router "
                             "learns which: auto.push_layers: learn; one link and one load "
                             "per run, as it learns per prompt length only), local "
                             "(default: pull,push,progressive,local)")
    parser.add_argument("--prompts", type=ints, default=None,
                        help="prompt lengths in tokens, comma-separated (default: "
                             f"{','.join(map(str, DEFAULT_PROMPTS))})")
    parser.add_argument("--concurrency", type=ints, default=None,
                        help="concurrent requests per round, comma-separated (default: 1)")
    parser.add_argument("--loads", type=_names(LOADS, "--loads"), default=None,
                        help="D's loads to measure: idle, busy or both (default: both)")
    parser.add_argument("--layers", type=int, default=None,
                        help="the emulated model's decoder layers (default: the profile's "
                             "own, 32 for Llama 3 8B and 80 for 70B: the share of the "
                             "transfer a layer-by-layer push can hide grows with them; "
                             "fewer run faster)")
    parser.add_argument("--slowdown", type=_slowdown, default="auto",
                        help="run the emulated GPU and link this many times slower, for "
                             "prompts whose real compute outlasts the profile's time; "
                             "every time and floor is then this many times longer, the "
                             "host's own costs are not. auto (default): per case, the "
                             "least (in steps of 0.5) that keeps the prefill's compute "
                             "within 80%% of its time, measured on calibration rounds (the longest step); 1: "
                             "the profile's own time, steps that run long flagged")
    parser.add_argument("--requests", type=int, default=None,
                        help="requests per mode and case, rounded up to whole rounds "
                             "(default: 8)")
    parser.add_argument("--busy-streams", type=int, default=8,
                        help="background streams decoding on D when it is busy")
    parser.add_argument("--busy-max-tokens", type=int, default=BUSY_MAX_TOKENS,
                        help="max_tokens of each background stream (sent again when done)")
    parser.add_argument("--quick", action="store_true",
                        help="profile llama8b-h100, link eth25, 1,024 and 8,192 tokens, D "
                             "idle, concurrency 1, 4 requests per mode, no stock connectors "
                             "(each given option still wins)")
    parser.add_argument("--start-timeout", type=float, default=240.0,
                        help="seconds the pair may take to start")
    parser.add_argument("--seed", type=int, default=0, help="prompt generator seed")
    parser.add_argument("--no-stock", action="store_true",
                        help="skip vLLM's own connectors (NixlConnector in pull, "
                             "NixlPushConnector in push, each on a pair of its own)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench-results" / "regime.json")
    parser.add_argument("--plot", type=Path, default=None,
                        help="PNG plot (default: --out with .png)")
    args = parser.parse_args(argv)
    quick = args.quick
    defaults = {
        "profiles": ("llama8b-h100",) if quick else DEFAULT_PROFILES,
        "links": ("eth25",) if quick else DEFAULT_LINKS,
        "prompts": QUICK_PROMPTS if quick else DEFAULT_PROMPTS,
        "concurrency": (1,) if quick else DEFAULT_CONCURRENCY,
        "loads": ("idle",) if quick else LOADS,
        "requests": 4 if quick else 8,
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if quick:
        args.no_stock = True
    longest = max(args.prompts)
    if min(args.prompts) < 2 or longest > GPU_MAX_MODEL_LEN - 16:
        parser.error(f"prompt lengths must be in 2..{GPU_MAX_MODEL_LEN - 16}")
    if any(c < 1 for c in args.concurrency) or args.requests < 1 or args.busy_streams < 1:
        parser.error("concurrencies, --requests and --busy-streams must be >= 1")
    if BUSY_PROMPT_TOKENS + args.busy_max_tokens > GPU_MAX_MODEL_LEN:
        parser.error(f"--busy-max-tokens must be at most {GPU_MAX_MODEL_LEN - BUSY_PROMPT_TOKENS}")
    if args.layers is not None and args.layers < 1:
        parser.error("--layers must be >= 1")
    if "learned" in args.modes and (len(args.links) > 1 or len(args.loads) > 1
                                    or len(args.concurrency) > 1
                                    or WARM_PROMPT_TOKENS in args.prompts):
        parser.error("learned needs one link, one load and one concurrency per run, and "
                     f"no {WARM_PROMPT_TOKENS}-token prompts (the warm-up's): the router "
                     "learns per prompt length only, and would carry what it learned across")
    if args.plot is None:
        args.plot = args.out.with_suffix(".png")
    return args


@contextlib.contextmanager
def emulated_link(args: argparse.Namespace) -> Iterator[links.Shaper | None]:
    """The shaping for the run (None when every link is `none`): removed at its end,
    on SIGTERM and at exit. Without root or tc it fails saying which is missing."""
    if all(links.get_link(name).gbps is None for name in args.links):
        yield None
        return
    try:
        links.require_tc()
    except links.LinkError as error:
        raise SystemExit(f"bench_regime: {error}") from None
    with links.shaped() as shaper:
        yield shaper


async def bench_profile(name: str, shaper: links.Shaper | None, args: argparse.Namespace,
                        ) -> dict[str, Any]:
    profile = get_profile(name)
    print(profile.describe(), flush=True)
    # The profile's own layer count unless told otherwise: each profile its own.
    args = argparse.Namespace(**{**vars(args),
                                 "layers": args.layers or profile.model.num_layers})
    model_dir = gpu_model_dir(profile.name, layers=args.layers)
    emulated_kv = links.model_kv_bytes_per_token(model_dir)
    rates = {link_name: link_rate(link_name, profile, emulated_kv)
             for link_name in args.links}
    for rate in rates.values():
        say(f"  {rate.describe()}")
    cases = [Case(load, n, c, link_name) for link_name in args.links
             for load in LOADS if load in args.loads
             for n in args.prompts for c in args.concurrency]
    rng = random.Random(args.seed)
    results, proofs = await run_pair(DUAL_CONNECTOR, args.modes, model_dir, cases, rates,
                                     shaper, args, rng)
    stock = {}
    ours = {result["key"]: float(result["slowdown"]) for result in results}
    for connector, mode in ({} if args.no_stock else STOCK_MODES).items():
        stock[connector], _ = await run_pair(connector, (mode,), model_dir, cases, rates,
                                             shaper, args, random.Random(args.seed), ours)
    rows = summarize(profile, results, stock, rates, args)
    return {"profile": profile.name, "profile_description": profile.describe(),
            "layers": args.layers, "emulated_kv_bytes_per_token": emulated_kv,
            "links": {n: msgspec.to_builtins(r) for n, r in rates.items()},
            "link_checks": proofs, "results": results, "stock_results": stock, "rows": rows}


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    layers = args.layers or "each profile's own number of"
    say(f"EMULATED GPU regime: vLLM on CPU with the tiny model in {layers} layers, each "
        "forward pass as long as the profile says, the KV over an emulated link (TCP on lo "
        "shaped by tc)")
    say("what the emulation leaves out:")
    for item in left_out():
        print(f"  - {item}", flush=True)
    with emulated_link(args) as shaper:
        by_profile = {name: await bench_profile(name, shaper, args) for name in args.profiles}
    return {"emulated": True, "left_out": left_out(),
            "floor": f"P's prefill (profile, chunks of {GPU_MAX_BATCHED_TOKENS} tokens) + one "
                     "D step at D's load (transfer hidden); floor_paid adds the KV over the "
                     "emulated link",
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "profiles": by_profile}


async def run_pair(connector: str, modes: Sequence[str], model_dir: Path,
                   cases: Sequence[Case], rates: dict[str, LinkRate],
                   shaper: links.Shaper | None, args: argparse.Namespace,
                   rng: random.Random, slowdowns: dict[str, float] | None = None,
                   ) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """Every case in `modes` on a fresh P/D pair with `connector` and the router in front,
    its NIXL data path on the emulated link's ports (`slowdowns`: see `run_all`)."""
    say(f"starting a P/D pair with {connector}, {model_dir.name} ... (30-90 s)")
    started = time.monotonic()
    scale_path = DEFAULT_LOG_DIR / f"time-scale-{os.getpid()}-{connector}.txt"
    write_time_scale(scale_path, 1.0 if args.slowdown == "auto" else float(args.slowdown))
    env = {**links.ucx_env(), TIME_SCALE_FILE_ENV: str(scale_path)}
    with pair(connector, model_dir=model_dir, extra_args=GPU_REGIME_ARGS,
              max_model_len=GPU_MAX_MODEL_LEN, start_timeout_s=args.start_timeout,
              extra_env=env,
              kv_extra_config=REGIME_CONNECTOR_CONFIG if connector == DUAL_CONNECTOR
              else None) as p, \
            quiet_router(p.prefill_url, p.decode_url,
                         DEFAULT_LOG_DIR / f"router-{p.decode.spec.port}.log",
                         router_config(args)) as url:
        say(f"pair healthy after {time.monotonic() - started:.0f} s; step logs "
            f"{p.prefill.spec.step_log_path}, {p.decode.spec.step_log_path}")
        return await run_all(p, url, cases, modes, rates, shaper, scale_path, args, rng,
                             slowdowns)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = asyncio.run(bench(args))
    for name, outcome in result["profiles"].items():
        profile = get_profile(name)
        for check in outcome["link_checks"].values():
            print(check["line"])
        print_table(outcome["rows"], profile, outcome["layers"])
        print_breakdown(outcome["rows"])
        lines = target_check(outcome["rows"])
        if lines:
            print(f"\ntargets ({name}):")
            for line in lines:
                print(f"  {line}")
    write_json(args.out, result)
    say(f"wrote {args.out}")
    if plot({name: o["rows"] for name, o in result["profiles"].items()}, args.plot):
        say(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
