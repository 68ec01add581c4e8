"""A P and a D of different KV block sizes (P 64, D 128; the tiny Llama, our connector on
both), started once for the module, with requests through the router.

Push is refused cleanly: P answers D's registration `NACK block_size_mismatch` before any
WRITE, D computes the prompt itself, and the answer is still right. The test holds the
whole chain: the router answered in push mode (it does not see the refusal), the tokens
equal one server's, D got nothing by transfer (`vllm:prompt_tokens_by_source` counts the
prompt as D's own compute), P logged the refusal with its reason, D logged that P refused
it, and both counted it in their `push stats:` lines (P's `refused`, D's `fell back`).

Pull between the two sizes is vLLM's own READ, which on CPU gives wrong tokens (vLLM
0.32, measured: docs/models.md): D's worker refuses the handshake with a P of another
block size, vLLM fails the requests that waited on it (`vllm:nixl_num_failed_transfers`)
and D computes them itself; the tokens equal one server's, D logged why.
docs/models.md has the table."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from testbed.pd_protocol import answer_token_ids, metric
from testbed.vllm_cpu import Pair, Role, ServerStartError, VllmServer, run_servers, server_spec
from tests.e2e.conftest import (
    DUAL,
    DUAL_EXTRA_CONFIG,
    LOG_DIR,
    PAIR_START_TIMEOUT_S,
    PairManager,
    ProxyFactory,
)
from tests.e2e.vllm_client import (
    COMPLETIONS,
    TIMEOUT,
    get_metrics,
    make_body,
    reference_tokens,
    served_by_mode,
)

pytestmark = pytest.mark.e2e

BLOCK_SIZES: dict[Role, int] = {"prefill": 64, "decode": 128}
FAILED_TRANSFERS = "vllm:nixl_num_failed_transfers_total"


@pytest.fixture(scope="module")
def block_size_pair(pair_manager: PairManager, tiny_model: Path) -> Iterator[Pair]:
    """The tiny Llama on a P and a D of the block sizes BLOCK_SIZES names."""
    pair_manager.close()  # one pair at a time: stop the session's own first
    specs = [server_spec(role, connector=DUAL, model_dir=tiny_model, log_dir=LOG_DIR,
                         name=f"{role}-block{size}", kv_extra_config=DUAL_EXTRA_CONFIG,
                         extra_args=("--block-size", str(size)))
             for role, size in BLOCK_SIZES.items()]
    try:
        with run_servers(specs, start_timeout_s=PAIR_START_TIMEOUT_S) as (prefill, decode):
            yield Pair(connector=DUAL, prefill=prefill, decode=decode)
    except ServerStartError as exc:
        pytest.fail(f"starting the pair of block sizes {BLOCK_SIZES} failed: {exc}",
                    pytrace=False)


async def through_router(client: httpx.AsyncClient, pair: Pair, router_url: str,
                         mode: str) -> tuple[dict[str, Any], dict[str, float]]:
    """A fresh greedy request by `mode`: the answer (its tokens checked against one
    server's) and D's prompt tokens by source for it."""
    body = make_body(COMPLETIONS)
    answer, delta = await served_by_mode(client, pair.decode_url, router_url, COMPLETIONS,
                                         body, mode)
    prompt_tokens = int(answer["usage"]["prompt_tokens"])
    assert sum(delta.values()) == prompt_tokens, f"{mode}: D counted {delta}"
    assert answer_token_ids(answer) == await reference_tokens(
        client, pair.decode_url, COMPLETIONS, body), f"{mode}: tokens differ from one server's"
    return answer, delta


async def logged(client: httpx.AsyncClient, server: VllmServer, pattern: str,
                 timeout_s: float = 15.0) -> re.Match[str]:
    """The first match of `pattern` in `server`'s log, waited for. The connector logs its
    `push stats:` at an engine step at least `stats_interval` after the last: a one-token
    request now and then makes the server step."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = re.search(pattern, server.spec.log_path.read_text(errors="replace"))
        if found is not None:
            return found
        assert time.monotonic() < deadline, (
            f"{server.spec.name} did not log {pattern!r}; last lines:\n{server.log_tail()}")
        resp = await client.post(server.url + COMPLETIONS, json={
            "model": "tiny", "prompt": "a", "max_tokens": 1, "temperature": 0})
        assert resp.status_code == 200, resp.text
        await asyncio.sleep(1.2)


async def test_a_push_between_block_sizes_is_refused_and_d_computes(
    block_size_pair: Pair, proxy_for: ProxyFactory
) -> None:
    router_url = proxy_for(block_size_pair, "pull")
    prefill, decode = block_size_pair.prefill, block_size_pair.decode
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        for _ in range(2):
            answer, delta = await through_router(client, block_size_pair, router_url, "push")
            assert delta["external_kv_transfer"] == 0, f"D got KV from P after all: {delta}"
            assert delta["local_compute"] > 0, delta
        sizes = f"decode {BLOCK_SIZES['decode']}, prefill {BLOCK_SIZES['prefill']}"
        await logged(client, prefill, rf"push \S+ refused: block size mismatch: {sizes}")
        await logged(client, decode, r"P refused the registration: block_size_mismatch: "
                                     rf"block size mismatch: {sizes}")
        # Both pushes counted: P refused them, D fell back to its own compute.
        await logged(client, prefill, r"push stats: .* refused ([2-9]|[1-9]\d+),")
        await logged(client, decode, r"push stats: .* fell back ([2-9]|[1-9]\d+) ")
        stats = re.findall(r"push stats: .*? writes done (\d+)",
                           prefill.spec.log_path.read_text(errors="replace"))
        assert stats and int(stats[-1]) == 0, f"P wrote into D: {stats}"


async def test_a_pull_between_block_sizes_is_refused_and_d_computes(
    block_size_pair: Pair, proxy_for: ProxyFactory
) -> None:
    router_url = proxy_for(block_size_pair, "pull")
    decode = block_size_pair.decode
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        failed_before = metric(await get_metrics(client, decode.url), FAILED_TRANSFERS)
        for _ in range(2):
            answer, delta = await through_router(client, block_size_pair, router_url, "pull")
            assert delta["external_kv_transfer"] == 0, f"D read KV from P after all: {delta}"
            assert delta["local_compute"] > 0, delta
        await logged(client, decode, r"refused the KV transfer handshake with \S+: KV block "
                                     r"size mismatch: local 128 \(kernel \d+\), peer 64")
        failed = metric(await get_metrics(client, decode.url), FAILED_TRANSFERS)
        assert failed - failed_before >= 2, f"D counted {failed - failed_before} failures"
