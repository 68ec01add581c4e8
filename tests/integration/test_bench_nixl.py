"""The raw NIXL WRITE baseline runs end to end on this machine (two processes, DRAM, UCX)
and its byte check really checks. Needs NIXL installed: without it these tests fail."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from scripts import bench_nixl


def run_bench(tmp_path: Path, *args: str) -> dict[str, Any]:
    """The benchmark's command line, run here; what it wrote to its JSON file."""
    out = tmp_path / "nixl.json"
    bench_nixl.main([*args, "--timeout", "60", "--out", str(out)])
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def test_small_scattered_write_between_two_processes(tmp_path: Path) -> None:
    result = run_bench(tmp_path, "--device", "cpu", "--blocks", "64", "--block-bytes", "4096",
                       "--iterations", "3", "--warmup", "1", "--one-block-rounds", "3",
                       "--noncontiguous")
    assert result["device"] == "cpu" and result["mem_type"] == "DRAM"
    assert result["blocks"] == 64 and result["block_bytes"] == 4096 and result["noncontiguous"]
    assert result["bytes_per_iteration"] == 64 * 4096
    assert result["verified"] is True
    assert result["verified_bytes"] == 64 * 4096
    assert result["gbps_median"] > 0 and result["gbps_best"] >= result["gbps_median"]
    assert 0 < result["latency_ms_p50"] <= result["latency_ms_p99"]
    assert len(result["iteration_latencies_ms"]) == 3
    assert result["one_block_latency_us_p50"] > 0


def test_fresh_slots_each_write_cover_the_pool_and_are_all_checked(tmp_path: Path) -> None:
    result = run_bench(tmp_path, "--blocks", "16", "--block-bytes", "4096", "--iterations", "10",
                       "--warmup", "1", "--one-block-rounds", "3", "--noncontiguous",
                       "--fresh-mib", "1")
    # 1 MiB holds 8 windows of 32 slots; 14 WRITEs went round them all, and the target
    # checked every slot written (16 per window), and that the rest stayed zero.
    assert result["fresh_mib"] == 1 and result["verified"] is True
    assert result["verified_bytes"] == 8 * 16 * 4096
    assert len(result["iteration_latencies_ms"]) == 10


def test_each_write_takes_the_next_window_and_wraps() -> None:
    params = bench_nixl.Params(
        device="cpu", block_bytes=4096, blocks=4, iterations=3, warmup=0, noncontiguous=True,
        one_block_rounds=0, progress_thread=False, timeout=10, fresh_mib=1,
    )
    assert params.windows == 2**20 // (8 * 4096) and params.pool_blocks == 8 * params.windows
    first, second = bench_nixl.block_indices(params, 0), bench_nixl.block_indices(params, 1)
    assert (second[1] == first[1] + 8).all() and (second[0] == first[0] + 8).all()
    wrapped = bench_nixl.block_indices(params, params.windows)
    assert (wrapped[1] == first[1]).all()


def _written_target(params: bench_nixl.Params) -> bench_nixl.Buffer:
    """A target buffer holding exactly what a correct run leaves there."""
    src, dst = bench_nixl.block_indices(params)
    data = np.zeros((params.pool_blocks, params.block_bytes), dtype=np.uint8)
    for s, d in zip(src, dst, strict=True):
        data[d] = bench_nixl.pattern_block(int(s), params.block_bytes)
    return bench_nixl.Buffer(data, int(data.ctypes.data), 0)


def test_byte_check_catches_wrong_and_stray_bytes() -> None:
    params = bench_nixl.Params(
        device="cpu", block_bytes=256, blocks=16, iterations=1, warmup=0, noncontiguous=True,
        one_block_rounds=0, progress_thread=False, timeout=10,
    )
    _, dst = bench_nixl.block_indices(params)
    assert bench_nixl.verify(_written_target(params), params)["verified"] is True

    wrong = _written_target(params)
    wrong.array[dst[5], 100] ^= 1
    with pytest.raises(bench_nixl.BenchError, match="differs first at byte 100"):
        bench_nixl.verify(wrong, params)

    stray = _written_target(params)
    untouched = sorted(set(range(params.pool_blocks)) - {int(d) for d in dst})[0]
    stray.array[untouched, 0] = 1
    with pytest.raises(bench_nixl.BenchError, match="nothing was written to"):
        bench_nixl.verify(stray, params)

    # Blocks are told apart even where the byte pattern would repeat (slot numbers 251 apart).
    assert not np.array_equal(bench_nixl.pattern_block(3, 64), bench_nixl.pattern_block(254, 64))
