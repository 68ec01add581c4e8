"""Drill: a flood at P's push port must cost the flooder, not P's pushes.

    python -m scripts.drill_flood                    # 1 flooder, 10 pushes each phase, ~3 min
    python -m scripts.drill_flood --flooders 2 --requests 20
    python -m scripts.bench drill flood              # the same, from the one command

What it proves: a real CPU P/D pair with our `NixlDualConnector` (the default config: no
CURVE) and the router in push mode. First `--requests` streamed pushes one after another
with fresh prompts, quietly: their median time to first token. Then the same while
`--flooders` processes flood P's push port (the address P's push side channel listens
on, `push_port` in P's connector config) with what anyone who can reach it may send:
pings, degenerate registrations (a thousand empty KV-cache groups, one group of 50,000
blocks, block ids past P's cache, a wrong block size or TP size; each with a fresh
transfer id), aborts and abandons of random transfer ids, and raw garbage frames (bytes
that are not msgpack, and multi-frame messages); each flooder takes a new ZMQ identity
(a new peer to P) every `--reconnect-every` messages. P's resident memory (its whole
process group) is sampled during the flood.

It prints a progress line per phase, then: the quiet and flood medians and their ratio
(target: `--target-ratio`, 2x), the pushes that failed or fell back, the messages the
flooders sent, P's RSS before, at most during, and after the flood (target: growth under
`--rss-bound-mib`), the medians of a few pushes after the flood, and P's last
"push stats:" log line. Exit status 0 only if every PASS line passes.

On a 2-core machine the flooders, both servers, the router and this client share the
cores: a flood costs some CPU whatever P does with it; the point is that P's channel
thread keeps serving pushes and keeps no memory for what it refuses.

What it leaves out: CURVE (off in the default config the drill uses), floods of the
router's or D's ports, and GPUs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import statistics
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx
import zmq

from connector.protocol.side_channel import (
    MAX_KV_GROUPS,
    Abandon,
    Abort,
    EngineId,
    Message,
    Ping,
    RegisterBlocks,
    TransferId,
    encode,
)
from scripts.demo import router
from testbed import tiny_model
from testbed.vllm_cpu import DEFAULT_MODEL_DIR, DUAL_CONNECTOR, pair

MAX_TOKENS = 4
MIB = 1 << 20


def say(message: str) -> None:
    print(f"[drill_flood] {message}", flush=True)


# --- the flood ------------------------------------------------------------------------------


def _id(rng: random.Random) -> str:
    return f"{rng.getrandbits(128):032x}"


def _registration(rng: random.Random, block_ids: list[list[int]], *, block_size: int = 128,
                  tp_size: int = 1) -> RegisterBlocks:
    return RegisterBlocks(
        transfer_id=TransferId(_id(rng)), engine_id=EngineId(_id(rng)), request_id=_id(rng),
        tp_size=tp_size, tp_rank=tp_size - 1, block_ids=block_ids, block_size=block_size,
        host="127.0.0.1", port=1, ttl_s=120.0)


def flood_frames(rng: random.Random) -> list[bytes]:
    """One message of the flood: a ping, a degenerate registration, an abort or abandon of
    a random transfer, or garbage."""
    kind = rng.randrange(10)
    message: Message
    if kind <= 2:
        message = Ping()
    elif kind == 3:
        message = _registration(rng, [[] for _ in range(MAX_KV_GROUPS)])
    elif kind == 4:
        message = _registration(rng, [list(range(50_000))])
    elif kind == 5:
        message = _registration(rng, [[10**9 + i for i in range(64)]],
                                block_size=rng.choice((1, 16, 4096)),
                                tp_size=rng.choice((1, 64)))
    elif kind == 6:
        message = Abort(transfer_id=TransferId(_id(rng)))
    elif kind == 7:
        message = Abandon(transfer_id=TransferId(_id(rng)))
    elif kind == 8:
        return [os.urandom(rng.randrange(1, 256))]
    else:
        return [b"not", b"one", b"frame"]
    return [encode(message)]


def flood(address: str, seed: int, reconnect_every: int, stop: Any, sent: Any) -> None:
    """Send `flood_frames` to `address` as fast as ZMQ takes them until `stop` is set;
    a new DEALER (a new identity) every `reconnect_every` messages; replies are drained."""
    rng = random.Random(seed)
    # A pool of messages, so the flood is paced by the socket, not by msgpack.
    pool = [flood_frames(rng) for _ in range(2000)]
    context = zmq.Context()
    sock: zmq.Socket[Any] | None = None
    count = since_new = 0
    try:
        while not stop.is_set():
            if sock is None or since_new >= reconnect_every:
                if sock is not None:
                    sock.close(linger=0)
                sock = context.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(address)
                since_new = 0
            for _ in range(100):
                try:
                    sock.send_multipart(rng.choice(pool), zmq.NOBLOCK)
                    count += 1
                    since_new += 1
                except zmq.Again:
                    time.sleep(0.001)
                    break
            while True:  # the pongs and nacks
                try:
                    sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
            with sent.get_lock():
                sent.value = count
    finally:
        if sock is not None:
            sock.close(linger=0)
        context.term()


# --- the pushes -----------------------------------------------------------------------------


@dataclass
class Phase:
    name: str
    ttft_s: list[float] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)

    def median_ms(self) -> float:
        return statistics.median(self.ttft_s) * 1000 if self.ttft_s else float("nan")


async def one_push(client: httpx.AsyncClient, url: str, prompt: str, timeout_s: float) -> float:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True, "ignore_eos": True}
    started = time.perf_counter()
    async with asyncio.timeout(timeout_s), client.stream(
            "POST", f"{url}/v1/completions", json=body,
            headers={"X-KV-Transfer-Mode": "push"}) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
        used = resp.headers.get("x-kv-transfer-mode")
        if used != "push":
            raise RuntimeError(f"the router used {used}, not push")
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - started
    raise RuntimeError("the stream had no token")


async def run_phase(client: httpx.AsyncClient, url: str, name: str, requests: int,
                    timeout_s: float) -> Phase:
    phase = Phase(name)
    for _ in range(requests):
        prompt = tiny_model.sample_text(uuid.uuid4().int % 2**32, lines=8)  # fresh: no hits
        try:
            phase.ttft_s.append(await one_push(client, url, prompt, timeout_s))
        except (TimeoutError, RuntimeError, httpx.HTTPError) as exc:
            phase.failed.append(repr(exc)[:200])
    say(f"  {name}: {len(phase.ttft_s)} pushes, median TTFT {phase.median_ms():.0f} ms, "
        f"{len(phase.failed)} failed")
    return phase


class RssSampler:
    """Samples a process group's RSS every `interval_s` on a thread."""

    def __init__(self, read: Any, interval_s: float = 0.25) -> None:
        self._read, self._interval = read, interval_s
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self._read())
            self._stop.wait(self._interval)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


# --- the drill ------------------------------------------------------------------------------


def push_port_of(kv_config: str | None) -> int:
    """The push port in a server's `--kv-transfer-config` JSON."""
    assert kv_config is not None, "P has no KV connector config"
    return int(json.loads(kv_config)["kv_connector_extra_config"]["push_port"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m scripts.drill_flood", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=10, help="pushes per phase")
    parser.add_argument("--flooders", type=int, default=1, help="flooding processes")
    parser.add_argument("--reconnect-every", type=int, default=1000,
                        help="messages per ZMQ identity of a flooder")
    parser.add_argument("--request-timeout", type=float, default=20.0,
                        help="seconds a push may take to its first token")
    parser.add_argument("--target-ratio", type=float, default=2.0,
                        help="flood/quiet median TTFT must be at most this")
    parser.add_argument("--rss-bound-mib", type=float, default=256.0,
                        help="P's RSS may grow at most this much during the flood")
    parser.add_argument("--start-timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    if args.requests < 1 or args.flooders < 1 or args.reconnect_every < 1:
        parser.error("--requests, --flooders and --reconnect-every must be at least 1")
    return args


async def drill(args: argparse.Namespace) -> int:
    tiny_model.build(DEFAULT_MODEL_DIR)
    say(f"starting a P/D pair with {DUAL_CONNECTOR} ... (20-90 s)")
    with pair(DUAL_CONNECTOR, start_timeout_s=args.start_timeout) as running, \
            router(running.prefill_url, running.decode_url, "push") as url:
        address = f"tcp://127.0.0.1:{push_port_of(running.prefill.spec.kv_config)}"
        say(f"P's push port: {address}")
        async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as client:
            await run_phase(client, url, "warm-up", 3, args.request_timeout)
            quiet = await run_phase(client, url, "quiet", args.requests, args.request_timeout)
            rss_before = running.prefill.rss_bytes()
            spawn = multiprocessing.get_context("spawn")
            stop = spawn.Event()
            counters = [spawn.Value("q", 0) for _ in range(args.flooders)]
            flooders = [spawn.Process(target=flood, daemon=True,
                                      args=(address, i, args.reconnect_every, stop, counters[i]))
                        for i in range(args.flooders)]
            for process in flooders:
                process.start()
            try:
                deadline = time.monotonic() + 30
                while sum(c.value for c in counters) < 10_000:  # the flood is on
                    if time.monotonic() > deadline or not all(p.is_alive() for p in flooders):
                        say("the flooders did not get going")
                        return 2
                    await asyncio.sleep(0.1)
                flood_started = time.monotonic()
                with RssSampler(running.prefill.rss_bytes) as rss:
                    flooded = await run_phase(client, url, "flood", args.requests,
                                              args.request_timeout)
                flood_s = time.monotonic() - flood_started
            finally:
                stop.set()
                for process in flooders:
                    process.join(10)
                    if process.is_alive():
                        process.kill()
            sent = sum(c.value for c in counters)
            after = await run_phase(client, url, "after", max(3, args.requests // 2),
                                    args.request_timeout)
            rss_after = running.prefill.rss_bytes()
            healthy = (await client.get(f"{running.prefill_url}/health")).status_code == 200
        stats = [line for line in running.prefill.spec.log_path.read_text(
            errors="replace").splitlines() if "push stats:" in line]

    ratio = flooded.median_ms() / quiet.median_ms()
    rss_max = max(rss.samples, default=rss_before)
    growth_mib = (rss_max - rss_before) / MIB
    checks = [
        (f"flood/quiet median TTFT {ratio:.2f}x (target <= {args.target_ratio:g}x)",
         ratio <= args.target_ratio),
        (f"pushes failed during the flood: {len(flooded.failed)} of {args.requests}",
         not flooded.failed and not quiet.failed),
        (f"P's RSS grew {growth_mib:.1f} MiB during the flood (bound {args.rss_bound_mib:g})",
         growth_mib <= args.rss_bound_mib),
        (f"P healthy after the flood, pushes served after it: {len(after.ttft_s)}",
         healthy and not after.failed),
    ]
    print()
    say("summary")
    say(f"  quiet: median TTFT {quiet.median_ms():.0f} ms over {len(quiet.ttft_s)} pushes")
    say(f"  flood: median TTFT {flooded.median_ms():.0f} ms over {len(flooded.ttft_s)} pushes, "
        f"max {max(flooded.ttft_s, default=float('nan')) * 1000:.0f} ms; "
        f"{args.flooders} flooder(s) sent {sent:,} messages ({sent / max(flood_s, 1e-9):,.0f}/s "
        "while the pushes ran)")
    say(f"  after: median TTFT {after.median_ms():.0f} ms")
    say(f"  P's RSS: {rss_before / MIB:.0f} MiB before, {rss_max / MIB:.0f} MiB at most during "
        f"({len(rss.samples)} samples), {rss_after / MIB:.0f} MiB after")
    for failure in (quiet.failed + flooded.failed + after.failed)[:5]:
        say(f"  failed: {failure}")
    if stats:
        say(f"  P's last {stats[-1][stats[-1].index('push stats:'):]}")
    for line, ok in checks:
        say(f"{'PASS' if ok else 'FAIL'}: {line}")
    return 0 if all(ok for _, ok in checks) else 1


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(drill(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
