"""The overhead scenario's plots (scripts.bench.plot_all), from a result's rows alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from scripts.bench import plot_all


def _row(target: str, concurrency: int, stream: bool) -> dict[str, Any]:
    return {"target": target, "concurrency": concurrency, "stream": stream,
            "req_per_s": 1000.0 + concurrency, "latency_ms": {"p50": 1.0, "p99": 3.0}}


def test_a_run_only_over_64_concurrent_still_plots_its_latency(tmp_path: Path) -> None:
    # The latency CDF is drawn at the highest concurrency up to 64; a run at 256 alone
    # has none, and drew nothing (it raised) before the plots fell back to its lowest.
    rows = [_row(target, 256, stream) for target in ("ours", "peer") for stream in (False, True)]
    written = plot_all({"overhead": {"rows": rows}}, tmp_path)
    assert {path.name for path in written} >= {"throughput.png", "latency_cdf.png"}
    assert all(path.stat().st_size > 0 for path in written)
