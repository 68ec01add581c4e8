"""CPU use while there is nothing to do: what an idle server, and a D that only waits for
a push, cost the machine.

    .venv/bin/python -m scripts.bench_idle                # ~4 min; needs no GPU
    .venv/bin/python -m scripts.bench_idle --no-pair      # the NIXL agents only (~1 min)
    .venv/bin/python -m scripts.bench_idle --modes --connector-config '{"push_wait_pause": 0.005}'
                                                          # the pair only, another pause
    .venv/bin/python -m scripts.bench idle                # the same, from the one command

What it measures, in one go:
1. a NIXL agent built the way vLLM's worker builds its own, inside the connector's
   `agent_progress(mode)`, for each progress mode (`nixl_progress_thread`): in a process
   of its own that does nothing else, the cores it uses over `--idle-seconds`. "spin"
   (NIXL's own thread) is the reference that "event" (the connector's default) replaces;
2. a real CPU 1P1D pair with our `NixlDualConnector`, after one request on each server,
   nothing held and a quiet spell: the cores each whole server (all its processes) uses
   over `--idle-seconds`;
3. on the same pair, D's engine core while D's only work is a push whose P leg never
   comes (registered with P, its blocks held): vLLM would step back to back; the
   connector pauses between idle steps (`push_wait_pause`).

Each figure is printed in cores (CPU seconds per second) with its ratio to the budget
the end-to-end tests once held it to (0.3 of a core idle, 0.25 for D's waiting engine).
These are measurements of a machine that others share, so they live here, not in the
tests: a busy neighbour moves them, and a bound on them fails for reasons of its own.

What it leaves out: the router, servers under load, and NIXL agents on GPU memory (the
agents here register host memory).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import multiprocessing.connection
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from scripts import bench_nixl
from scripts.benchkit import json_object, write_json
from testbed import tiny_model
from testbed.pd_protocol import KV_USAGE, metric, parse_metrics, probe_body, push_decode_leg
from testbed.vllm_cpu import DEFAULT_MODEL_DIR, DUAL_CONNECTOR, ENGINE_CORE, REPO_ROOT, pair

IDLE_BUDGET = 0.3  # cores: an idle server, or an idle NIXL agent
WAITING_BUDGET = 0.25  # cores: D's engine core while it only waits for a push
MODES = ("event", "off", "spin")
COMPLETIONS = "/v1/completions"
AGENT_PARAMS = bench_nixl.Params(device="cpu", block_bytes=4096, blocks=8, iterations=1,
                                 warmup=0, noncontiguous=False, one_block_rounds=0,
                                 progress_thread=False, timeout=30.0)


def say(message: str) -> None:
    print(f"[bench_idle] {message}", flush=True)


def row(what: str, cores: float, budget: float) -> dict[str, Any]:
    say(f"  {what}: {cores:.3f} cores ({cores / budget:.2f} of the {budget:g}-core budget)")
    return {"what": what, "cores": cores, "budget": budget, "ratio": cores / budget}


# --- 1. a NIXL agent alone ---------------------------------------------------------------


def idle_agent(mode: str, seconds: float, conn: multiprocessing.connection.Connection) -> None:
    """The child: build an agent as vLLM does, register a buffer, then do nothing for
    `seconds`; send the cores this process used meanwhile."""
    from connector.shared.progress import agent_progress
    from connector.vllm_compat import nixl_base_worker as base_worker

    with agent_progress(mode):  # type: ignore[arg-type]  # one of MODES
        agent = base_worker.NixlWrapper(  # type: ignore[attr-defined]  # vLLM's, untyped
            f"idle-{mode}", base_worker.nixl_agent_config(  # type: ignore[attr-defined]
                num_threads=4, capture_telemetry=True))
    buffer = bench_nixl.allocate(AGENT_PARAMS)
    registration = bench_nixl.register(agent, buffer, AGENT_PARAMS)
    started, cpu = time.monotonic(), time.process_time()
    time.sleep(seconds)  # the measurement: nothing happens in this process meanwhile
    conn.send((time.process_time() - cpu) / (time.monotonic() - started))
    agent.deregister_memory(registration)


def agent_cores(mode: str, seconds: float) -> float:
    context = multiprocessing.get_context("spawn")
    here, there = context.Pipe()
    child = context.Process(target=idle_agent, args=(mode, seconds, there), daemon=True)
    child.start()
    try:
        if not here.poll(120 + seconds):
            raise RuntimeError(f"the {mode} agent's process sent nothing")
        cores: float = here.recv()
        return cores
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
            child.join(5)


# --- 2. and 3. a real pair ---------------------------------------------------------------


async def until(condition: Callable[[], Any], what: str, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := await condition()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"not within {timeout:g} s: {what}")
        await asyncio.sleep(0.1)
    return value


async def kv_usage(client: httpx.AsyncClient, url: str) -> float:
    return metric(parse_metrics((await client.get(url + "/metrics")).text), KV_USAGE)


async def nothing_held(client: httpx.AsyncClient, urls: tuple[str, ...]) -> None:
    async def empty() -> bool:
        return all([await kv_usage(client, url) == 0.0 for url in urls])

    await until(empty, "no KV block held on P and D", 30)


def cores_over(seconds: float, *readers: Callable[[], float]) -> list[float]:
    before, started = [read() for read in readers], time.monotonic()
    time.sleep(seconds)  # the measurement: the servers run on their own meanwhile
    elapsed = time.monotonic() - started
    return [(read() - used) / elapsed for read, used in zip(readers, before, strict=True)]


async def waiting_d_leg(client: httpx.AsyncClient, p_url: str, d_url: str
                        ) -> asyncio.Task[httpx.Response]:
    """D's leg of a push whose P leg never comes, once D holds its blocks."""
    probe = await client.post(p_url + COMPLETIONS, json={
        **probe_body(), "kv_transfer_params": {**probe_body()["kv_transfer_params"],
                                               "probe": True}})
    probe.raise_for_status()
    p_params = probe.json()["kv_transfer_params"]
    request_id = f"bench-idle-{uuid.uuid4().hex[:12]}"
    leg = push_decode_leg({"model": "tiny", "prompt": "waits for a push", "max_tokens": 4},
                          p_params, request_id=request_id)
    leg["kv_transfer_params"].update(transfer_mode="push", push_host=p_params["push_host"],
                                     push_port=p_params["push_port"])
    waiting = asyncio.create_task(client.post(d_url + COMPLETIONS, json=leg,
                                              headers={"X-Request-Id": request_id}))

    async def held() -> bool:
        return await kv_usage(client, d_url) > 0.0

    await until(held, "D holds the push's blocks", 30)
    return waiting


async def measure_pair(args: argparse.Namespace) -> list[dict[str, Any]]:
    say("starting a P/D pair with our connector ... (20-60 s)")
    rows = []
    tiny_model.build(DEFAULT_MODEL_DIR)
    with pair(DUAL_CONNECTOR, kv_extra_config=args.connector_config,
              start_timeout_s=args.start_timeout) as running:
        urls = (running.prefill_url, running.decode_url)
        async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as client:
            for url in urls:  # some work first: the first requests build what idle keeps
                answer = await client.post(url + COMPLETIONS, json={
                    "model": "tiny", "prompt": "warm up", "max_tokens": 4})
                answer.raise_for_status()
            await nothing_held(client, urls)
            # vLLM's processes poll each other for a second after any work: a quiet spell
            await asyncio.sleep(2)
            say(f"idle servers, over {args.idle_seconds:g} s:")
            idle = await asyncio.to_thread(cores_over, args.idle_seconds,
                                           running.prefill.cpu_seconds,
                                           running.decode.cpu_seconds)
            rows += [row(f"idle {name}", cores, IDLE_BUDGET)
                     for name, cores in zip(("P", "D"), idle, strict=True)]

            waiting = await waiting_d_leg(client, *urls)
            say(f"D waiting for a push, over {args.waiting_seconds:g} s:")
            try:
                (engine,) = await asyncio.to_thread(
                    cores_over, args.waiting_seconds,
                    lambda: running.decode.cpu_seconds(ENGINE_CORE))
            finally:
                waiting.cancel()
                await asyncio.gather(waiting, return_exceptions=True)
            rows.append(row("D's engine core, waiting for a push", engine, WAITING_BUDGET))
            await nothing_held(client, urls)
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench_idle", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--idle-seconds", type=float, default=3.0,
                        help="how long each idle measurement lasts (default 3)")
    parser.add_argument("--waiting-seconds", type=float, default=2.0,
                        help="how long D's waiting engine is measured (default 2)")
    parser.add_argument("--modes", nargs="*", choices=MODES, default=list(MODES),
                        help="the NIXL progress modes to measure (default: all)")
    parser.add_argument("--no-pair", action="store_true", help="skip the real pair (2., 3.)")
    parser.add_argument("--connector-config", type=json_object, default={}, metavar="JSON",
                        help="our connector's settings for the pair (kv_connector_extra_config)")
    parser.add_argument("--start-timeout", type=float, default=240.0,
                        help="seconds for the pair to start")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench-results" / "idle.json")
    args = parser.parse_args(argv)
    if args.idle_seconds <= 0 or args.waiting_seconds <= 0:
        parser.error("measurements must last more than 0 s")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = []
    if args.modes:
        say(f"a NIXL agent alone, over {args.idle_seconds:g} s:")
        rows += [row(f"idle NIXL agent, progress {mode}", agent_cores(mode, args.idle_seconds),
                     IDLE_BUDGET) for mode in args.modes]
    if not args.no_pair:
        rows += asyncio.run(measure_pair(args))
    write_json(args.out, {"args": {k: (str(v) if isinstance(v, Path) else v)
                                   for k, v in vars(args).items()}, "rows": rows})
    say(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
