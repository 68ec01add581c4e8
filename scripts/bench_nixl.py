"""Raw NIXL WRITE baseline: the throughput that the connector's push path is compared with.

    python -m scripts.bench_nixl                                  # DRAM, 1024 x 64 KiB blocks
    python -m scripts.bench_nixl --noncontiguous --out bench-results/nixl-cpu.json
    python -m scripts.bench_nixl --device cuda --blocks 4096      # GPU memory to GPU memory
    python -m scripts.bench nixl                                  # the same, from the one command

Two processes, started with multiprocessing (spawn): the writer ("P") and the target ("D").
The target registers a buffer of blocks with NIXL (UCX backend, no UCX settings) and hands
its agent metadata and block descriptors to the writer over a multiprocessing Pipe. The
writer registers its own buffer, filled with a known pattern, and in every iteration WRITEs
all `--blocks` blocks to the target with a notification. An iteration is timed end to end:
from the moment the writer builds the transfer request to the moment the target sees that
exact notification (both read the same system-wide monotonic clock). Iterations do not
overlap: the writer starts the next one after the target has reported the last one.

With `--noncontiguous` both sides hold a pool of twice as many blocks, and the blocks moved
are a fixed pseudo-random selection of pool slots on each side, in random order (as KV cache
blocks are); otherwise block i goes to slot i, and NIXL may merge neighbouring descriptors.

By default every WRITE moves the same slots, so after the warm-up the copy runs from and
into the CPU's caches. With `--fresh-mib N` the pools repeat that layout until they hold at
least N MiB, and each WRITE takes the next copy in turn: like a KV transfer, which reads
blocks the forward pass wrote and writes blocks nobody touched lately, it meets memory that
is not in cache. Both pools are written once in full before the first WRITE, as vLLM's KV
cache is when it is allocated; numpy puts buffers this large on transparent huge pages, as
torch does vLLM's KV cache when the server runs with THP_MEM_ALLOC_ENABLE=1.

Reported: GB/s (10^9 bytes per second; median and best iteration), iteration latency p50/p99,
the writer's own post-to-DONE time, and the latency of a one-block WRITE with its
notification. At the end the target checks byte for byte that its blocks hold the writer's
pattern and that no other slot was touched; the run fails if not. Every wait is bounded by
`--timeout`; both processes are always joined (or terminated) and their agents released.

Progress: a NIXL agent must keep progressing or its peer's transfers stall. Here every wait
polls the agent (the writer checks its transfer, the target its notifications, both while
waiting on the pipe), yielding the CPU between polls, so the agents run without NIXL's busy
progress thread unless `--progress-thread` is given.

What it leaves out: vLLM, the connector and the router (two bare agents), and a network:
both processes run on this host.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import multiprocessing
import multiprocessing.connection
import os
import queue
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

SEED = 20240611
NOTIF_PREFIX = "bench-write-"


@dataclass(frozen=True)
class Params:
    device: str  # "cpu" (DRAM) or "cuda" (VRAM on GPU 0)
    block_bytes: int
    blocks: int
    iterations: int
    warmup: int
    noncontiguous: bool
    one_block_rounds: int
    progress_thread: bool
    timeout: float  # seconds for the whole run; also bounds every single wait
    fresh_mib: int = 0  # 0: every WRITE moves the same slots; else pools of >= this, in turn

    @property
    def window_blocks(self) -> int:
        """The slots one WRITE chooses from: room to scatter into when non-contiguous."""
        return 2 * self.blocks if self.noncontiguous else self.blocks

    @property
    def windows(self) -> int:
        """How many windows each pool holds; WRITE n uses window n modulo this."""
        window_bytes = self.window_blocks * self.block_bytes
        return max(1, -(-self.fresh_mib * 2**20 // window_bytes))

    @property
    def pool_blocks(self) -> int:
        """Blocks each side holds."""
        return self.window_blocks * self.windows

    @property
    def mem_type(self) -> str:
        return "VRAM" if self.device == "cuda" else "DRAM"

    @property
    def rounds(self) -> int:
        """Every WRITE of the run, in order: warm-up, measured, then one-block ones."""
        return self.warmup + self.iterations + self.one_block_rounds


class BenchError(RuntimeError):
    pass


# ---------------------------------------------------------------- what is written where


def block_indices(params: Params, round_no: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(writer slots, target slots) of WRITE `round_no`: block k goes from writer slot src[k]
    to target slot dst[k]. The same selection every time, in the round's window."""
    if params.noncontiguous:
        rng = np.random.default_rng(SEED)
        src = rng.choice(params.window_blocks, size=params.blocks, replace=False)
        dst = rng.choice(params.window_blocks, size=params.blocks, replace=False)
    else:
        src = dst = np.arange(params.blocks)
    offset = (round_no % params.windows) * params.window_blocks
    return (src + offset).astype(np.int32), (dst + offset).astype(np.int32)


def round_indices(params: Params, round_no: int) -> tuple[np.ndarray, np.ndarray]:
    """What WRITE `round_no` moves: all its blocks, or only the first in a one-block round."""
    src, dst = block_indices(params, round_no)
    if round_no >= params.warmup + params.iterations:
        return src[:1], dst[:1]
    return src, dst


def pattern_block(slot: int, block_bytes: int) -> np.ndarray:
    """The bytes the writer keeps in its slot `slot`: distinct per slot (the slot number is
    written at the start) and varying within the block."""
    block = ((_pattern_base(block_bytes) + (slot * 131 + 1) % 251) % 251).astype(np.uint8)
    n = min(8, block_bytes)
    block[:n] = np.frombuffer(int(slot).to_bytes(8, "little"), dtype=np.uint8)[:n]
    return block


@functools.lru_cache(maxsize=4)
def _pattern_base(block_bytes: int) -> np.ndarray:
    return (np.arange(block_bytes, dtype=np.uint32) * 7 % 251).astype(np.uint16)


def notif_message(round_no: int) -> bytes:
    return f"{NOTIF_PREFIX}{round_no}".encode()


# ---------------------------------------------------------------- memory


@dataclass
class Buffer:
    """A (pool_blocks x block_bytes) uint8 buffer in DRAM or in GPU 0's memory."""

    array: Any  # numpy.ndarray (cpu) or torch.Tensor (cuda)
    address: int
    device_id: int

    def read_back(self) -> np.ndarray:
        host: np.ndarray = (
            self.array if isinstance(self.array, np.ndarray) else self.array.cpu().numpy()
        )
        return host

    def fill_from(self, host: np.ndarray) -> None:
        if isinstance(self.array, np.ndarray):
            self.array[...] = host
        else:
            import torch

            self.array.copy_(torch.from_numpy(host))
            torch.cuda.synchronize()


def allocate(params: Params) -> Buffer:
    shape = (params.pool_blocks, params.block_bytes)
    if params.device == "cpu":
        array = np.zeros(shape, dtype=np.uint8)
        array.fill(0)  # written once, so its pages are in memory (the kernel maps them lazily)
        return Buffer(array, int(array.ctypes.data), 0)
    import torch

    if not torch.cuda.is_available():
        raise BenchError("--device cuda: torch sees no CUDA device")
    tensor = torch.zeros(shape, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    return Buffer(tensor, int(tensor.data_ptr()), 0)


def block_descs(buffer: Buffer, params: Params) -> np.ndarray:
    """One (address, length, device id) row per slot of the pool."""
    slots = np.arange(params.pool_blocks, dtype=np.uint64)
    descs = np.empty((params.pool_blocks, 3), dtype=np.uint64)
    descs[:, 0] = buffer.address + slots * params.block_bytes
    descs[:, 1] = params.block_bytes
    descs[:, 2] = buffer.device_id
    return descs


# ---------------------------------------------------------------- NIXL helpers


def make_agent(name: str, params: Params) -> Any:
    if params.device == "cuda":
        import torch  # before nixl: the nixl package picks its CUDA build from torch

        torch.cuda.set_device(0)  # the buffers live on GPU 0, and so does this agent
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    import nixl  # noqa: F401  (fails loudly when NIXL is not installed)
    from nixl._api import nixl_agent, nixl_agent_config

    config = nixl_agent_config(enable_prog_thread=params.progress_thread, backends=["UCX"])
    agent = nixl_agent(name, config)
    if "UCX" not in agent.backends:
        raise BenchError("NIXL has no UCX backend here")
    return agent


def register(agent: Any, buffer: Buffer, params: Params) -> Any:
    """Register the whole buffer as one region; returns the registration list to release."""
    length = params.pool_blocks * params.block_bytes
    region = [(buffer.address, length, buffer.device_id, "")]
    return agent.register_memory(region, params.mem_type)


def quietly(what: str, step: Callable[[], object]) -> None:
    """Run a release step; a failure is reported, not raised, so that it cannot hide how the
    run itself went."""
    try:
        step()
    except Exception as exc:
        print(f"bench_nixl: {what} failed: {type(exc).__name__}: {exc}", file=sys.stderr)


def wait_until(
    what: str, done: Callable[[], bool], deadline: float, progress: Callable[[], object]
) -> None:
    """Poll `done` until it holds, keeping the agent progressing; fail at `deadline`."""
    while not done():
        if time.monotonic() > deadline:
            raise BenchError(f"timed out waiting for {what}")
        progress()
        os.sched_yield()  # lets the peer run at once when they share a core


def receive(conn: multiprocessing.connection.Connection, what: str, deadline: float,
            progress: Callable[[], object]) -> Any:
    """The next message from the peer process, polling the agent meanwhile."""
    wait_until(what, lambda: conn.poll(0), deadline, progress)
    try:
        message = conn.recv()
    except EOFError as exc:
        raise BenchError(f"peer process went away while waiting for {what}") from exc
    if isinstance(message, dict) and "error" in message:
        raise BenchError(f"peer process failed: {message['error']}")
    return message


# ---------------------------------------------------------------- the target ("D")


def run_target(params: Params, conn: multiprocessing.connection.Connection) -> dict[str, Any]:
    deadline = time.monotonic() + params.timeout
    buffer = allocate(params)
    agent = make_agent(f"bench-target-{os.getpid()}", params)
    registration = register(agent, buffer, params)
    try:
        conn.send({"metadata": agent.get_agent_metadata(), "descs": block_descs(buffer, params)})

        def progress() -> object:
            return agent.update_notifs()

        writer_name = receive(conn, "the writer's name", deadline, progress)["writer"]
        for round_no in range(params.rounds):
            expected = notif_message(round_no)

            def seen(expected: bytes = expected) -> bool:
                # Exact match: the lookup helper of the API matches prefixes, and
                # "bench-write-1" is a prefix of "bench-write-10".
                messages = agent.update_notifs().get(writer_name, [])
                if expected in messages:
                    messages.remove(expected)
                    return True
                return False

            wait_until(f"notification {expected!r}", seen, deadline, lambda: None)
            conn.send({"round": round_no, "seen_ns": time.monotonic_ns()})

        receive(conn, "the writer's end of run", deadline, progress)
        return verify(buffer, params)
    finally:
        quietly("deregistering memory", lambda: agent.deregister_memory(registration))


def verify(buffer: Buffer, params: Params) -> dict[str, Any]:
    """Byte-for-byte check: every written slot holds the block last written into it, every
    other slot is still zero."""
    source_of: dict[int, int] = {}  # target slot -> writer slot, replaying every WRITE
    for round_no in range(params.rounds):
        src, dst = round_indices(params, round_no)
        source_of.update(zip(dst.tolist(), src.tolist(), strict=True))
    data = buffer.read_back()
    for slot, source in source_of.items():
        expected = pattern_block(source, params.block_bytes)
        if not np.array_equal(data[slot], expected):
            bad = int(np.flatnonzero(data[slot] != expected)[0])
            raise BenchError(
                f"data check failed: target slot {slot} (from writer slot {source}) differs "
                f"first at byte {bad}: got {data[slot, bad]}, expected {expected[bad]}"
            )
    untouched = np.setdiff1d(np.arange(params.pool_blocks), list(source_of))
    if untouched.size and data[untouched].any():
        raise BenchError("data check failed: a slot that nothing was written to is not zero")
    return {"verified": True, "verified_bytes": len(source_of) * params.block_bytes}


# ---------------------------------------------------------------- the writer ("P")


def run_writer(params: Params, conn: multiprocessing.connection.Connection) -> dict[str, Any]:
    deadline = time.monotonic() + params.timeout
    buffer = allocate(params)
    host = np.stack([pattern_block(slot, params.block_bytes) for slot in range(params.pool_blocks)])
    buffer.fill_from(host)
    del host

    agent = make_agent(f"bench-writer-{os.getpid()}", params)
    registration = register(agent, buffer, params)
    handles: list[Any] = []
    target_name = None
    try:

        def progress() -> object:
            return agent.get_new_notifs()

        hello = receive(conn, "the target's metadata", deadline, progress)
        target_name = agent.add_remote_agent(hello["metadata"])
        conn.send({"writer": agent.name})
        local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", block_descs(buffer, params),
                                      params.mem_type)
        remote = agent.prep_xfer_dlist(target_name, hello["descs"], params.mem_type)
        handles += [local, remote]

        def write(round_no: int, src_idx: np.ndarray, dst_idx: np.ndarray) -> tuple[int, int, int]:
            """One WRITE with its notification. Returns nanoseconds from the start to: the
            request built, the writer seeing DONE, the target seeing the notification."""
            started = time.monotonic_ns()
            xfer = agent.make_prepped_xfer("WRITE", local, src_idx, remote, dst_idx,
                                           notif_message(round_no))
            prepared = time.monotonic_ns()
            try:
                state = agent.transfer(xfer)
                while state == "PROC":
                    if time.monotonic() > deadline:
                        raise BenchError(f"timed out waiting for WRITE {round_no} to complete")
                    os.sched_yield()
                    state = agent.check_xfer_state(xfer)
                if state != "DONE":
                    raise BenchError(f"WRITE {round_no} failed (state {state})")
                done = time.monotonic_ns()
            finally:
                quietly("releasing a transfer", xfer.release)
            report = receive(conn, f"the target to see WRITE {round_no}", deadline, progress)
            if report["round"] != round_no:
                raise BenchError(f"target saw round {report['round']}, expected {round_no}")
            return prepared - started, done - started, report["seen_ns"] - started

        measured: list[tuple[int, int, int]] = []
        one_block: list[int] = []
        for round_no in range(params.rounds):
            timing = write(round_no, *round_indices(params, round_no))
            if round_no >= params.warmup + params.iterations:
                one_block.append(timing[2])
            elif round_no >= params.warmup:
                measured.append(timing)
        conn.send({"end": True})
        return summarize(params, measured, one_block)
    finally:
        for handle in handles:
            quietly("releasing descriptors", handle.release)
        if target_name is not None:
            quietly("removing the target", lambda: agent.remove_remote_agent(target_name))
        quietly("deregistering memory", lambda: agent.deregister_memory(registration))


def summarize(params: Params, measured: list[tuple[int, int, int]],
              one_block: list[int]) -> dict[str, Any]:
    total_bytes = params.blocks * params.block_bytes
    prepared, writer_done, latencies = (
        np.array(column, dtype=np.float64) / 1e9 for column in zip(*measured, strict=True)
    )  # seconds
    gbps = total_bytes / latencies / 1e9
    one = np.array(one_block, dtype=np.float64) / 1e3  # microseconds
    return {
        "bytes_per_iteration": total_bytes,
        "gbps_median": float(np.median(gbps)),
        "gbps_best": float(gbps.max()),
        "gbps_worst": float(gbps.min()),
        "latency_ms_p50": float(np.percentile(latencies, 50) * 1e3),
        "latency_ms_p99": float(np.percentile(latencies, 99) * 1e3),
        "latency_ms_min": float(latencies.min() * 1e3),
        "writer_done_ms_p50": float(np.percentile(writer_done, 50) * 1e3),
        "request_us_p50": float(np.percentile(prepared, 50) * 1e6),
        "one_block_latency_us_p50": float(np.percentile(one, 50)) if one.size else None,
        "one_block_latency_us_best": float(one.min()) if one.size else None,
        "iteration_latencies_ms": [round(x * 1e3, 4) for x in latencies.tolist()],
    }


# ---------------------------------------------------------------- the two processes


def child_main(role: str, params: Params, conn: multiprocessing.connection.Connection,
               results: Any) -> None:
    """Entry point of each process: run the role and report the outcome to the parent."""
    try:
        body = run_writer if role == "writer" else run_target
        results.put((role, {"ok": True, **body(params, conn)}))
    except BaseException as exc:  # report everything, the parent decides
        detail = f"{type(exc).__name__}: {exc}"
        with contextlib.suppress(Exception):
            conn.send({"error": detail})  # unblock the peer at once
        results.put((role, {"ok": False, "error": detail, "traceback": traceback.format_exc()}))
    finally:
        conn.close()


@contextlib.contextmanager
def processes(params: Params) -> Iterator[tuple[list[Any], Any]]:
    """Start the writer and the target; always join them, terminating what is left."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    writer_end, target_end = ctx.Pipe()
    procs = [
        ctx.Process(target=child_main, args=("target", params, target_end, results),
                    name="bench-nixl-target", daemon=True),
        ctx.Process(target=child_main, args=("writer", params, writer_end, results),
                    name="bench-nixl-writer", daemon=True),
    ]
    try:
        for proc in procs:
            proc.start()
        # Only the children hold the pipe now: a dead peer then reads as end of file.
        writer_end.close()
        target_end.close()
        yield procs, results
    finally:
        for proc in procs:
            proc.join(timeout=5)
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        results.close()
        results.join_thread()


def run(params: Params) -> dict[str, Any]:
    """Run the benchmark; returns the parameters and every number, or raises BenchError."""
    if importlib.util.find_spec("nixl") is None:
        raise BenchError("NIXL is not installed (pip install nixl)")
    deadline = time.monotonic() + params.timeout + 30  # the children time out first
    outcome: dict[str, dict[str, Any]] = {}
    with processes(params) as (procs, results):
        while len(outcome) < 2:
            try:
                role, report = results.get(timeout=0.2)
            except queue.Empty:
                if time.monotonic() > deadline:
                    if any(not r["ok"] for r in outcome.values()):
                        break  # reported below
                    raise BenchError("benchmark timed out") from None
                dead = [p.name for p in procs if not p.is_alive() and p.exitcode not in (0, None)]
                if dead and results.empty():
                    raise BenchError(f"process died without reporting: {', '.join(dead)}") from None
                continue
            outcome[role] = report
            if not report["ok"]:
                # The peer fails next (it is told at once); give it a moment to say why.
                deadline = min(deadline, time.monotonic() + 3)
    failures = [(role, r) for role, r in outcome.items() if not r["ok"]]
    if failures:
        # Name the cause, not the peer that merely saw its partner fail.
        failures.sort(key=lambda item: "peer process" in item[1]["error"])
        role, report = failures[0]
        sys.stderr.write(report["traceback"])
        raise BenchError(f"{role} failed: {report['error']}")
    writer, target = outcome["writer"], outcome["target"]
    if not target.get("verified"):
        raise BenchError("the target did not verify the data")
    return {
        **asdict(params),
        "mem_type": params.mem_type,
        "backend": "UCX",
        "nixl_version": nixl_version(),
        **{k: v for k, v in writer.items() if k != "ok"},
        "verified": target["verified"],
        "verified_bytes": target["verified_bytes"],
    }


def nixl_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("nixl", "nixl-cu13", "nixl-cu12"):
        with contextlib.suppress(PackageNotFoundError):
            return version(dist)
    return None


# ---------------------------------------------------------------- command line


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.bench_nixl", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="memory to write between: cpu = DRAM, cuda = GPU 0 memory (VRAM)")
    parser.add_argument("--block-bytes", type=int, default=65536, help="bytes per block")
    parser.add_argument("--blocks", type=int, default=1024, help="blocks per WRITE")
    parser.add_argument("--iterations", type=int, default=20, help="measured WRITEs")
    parser.add_argument("--warmup", type=int, default=3, help="WRITEs before measuring")
    parser.add_argument("--noncontiguous", action="store_true",
                        help="write a scattered selection of block slots, as KV blocks are")
    parser.add_argument("--one-block-rounds", type=int, default=20,
                        help="one-block WRITEs timed for the latency figure (0 to skip)")
    parser.add_argument("--fresh-mib", type=int, default=0, metavar="N",
                        help="pools of at least N MiB, each WRITE into the next slots in "
                             "turn, so it meets memory that is not in cache, as a KV "
                             "transfer does (default 0: the same slots every time)")
    parser.add_argument("--progress-thread", action="store_true",
                        help="give each agent NIXL's own progress thread (NIXL's default; off "
                             "here because every wait polls the agent anyway, and the thread's "
                             "busy loop costs a core: about 3x slower on a 2-core machine)")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds the whole run may take; also bounds every wait")
    parser.add_argument("--out", type=Path, help="write the JSON result here")
    args = parser.parse_args(argv)
    if args.block_bytes < 1 or args.blocks < 1 or args.iterations < 1 or args.warmup < 0:
        parser.error("--block-bytes, --blocks and --iterations must be positive")
    if args.one_block_rounds < 0 or args.timeout <= 0 or args.fresh_mib < 0:
        parser.error("--one-block-rounds and --fresh-mib must not be negative, "
                     "--timeout must be positive")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    params = Params(
        device=args.device, block_bytes=args.block_bytes, blocks=args.blocks,
        iterations=args.iterations, warmup=args.warmup, noncontiguous=args.noncontiguous,
        one_block_rounds=args.one_block_rounds, progress_thread=args.progress_thread,
        timeout=args.timeout, fresh_mib=args.fresh_mib,
    )
    result = run(params)
    layout = "scattered" if params.noncontiguous else "contiguous"
    if params.fresh_mib:
        pool_mib = params.pool_blocks * params.block_bytes / 2**20
        layout += f", fresh slots each time from {pool_mib:.0f} MiB"
    one = result["one_block_latency_us_p50"]
    print(
        f"NIXL WRITE {params.mem_type}->{params.mem_type}, {params.blocks} x "
        f"{params.block_bytes} B {layout} ({result['bytes_per_iteration'] / 2**20:.1f} MiB): "
        f"{result['gbps_median']:.2f} GB/s median, {result['gbps_best']:.2f} best; "
        f"latency p50 {result['latency_ms_p50']:.2f} ms, p99 {result['latency_ms_p99']:.2f} ms; "
        f"one block {'-' if one is None else f'{one:.0f} us'}; data verified"
    )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    return result


def cli(argv: list[str] | None = None) -> int:
    """The command: `main`, with a failed run's reason as the exit message."""
    try:
        main(argv)
    except BenchError as exc:
        sys.exit(f"bench_nixl: {exc}")
    return 0


if __name__ == "__main__":
    sys.exit(cli())
