"""A push whose prompt P computes in several chunks, on real vLLM CPU servers with our
`NixlDualConnector`: P's token budget (`--max-num-batched-tokens`) is 64 tokens and its
blocks 32, so a prompt of 130-260 tokens takes 3-5 steps. D registers before P starts;
with the push written by layer, each chunk's whole blocks are written while the next
chunk computes, and the last step's WRITE writes only the rest. The greedy tokens equal
one server's, D got the whole prompt by transfer, and neither server holds a block
afterwards. The test stops the session's shared pair first, since only one pair may run
at a time (see conftest)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from testbed.pd_protocol import prefill_leg
from testbed.vllm_cpu import Pair, server_spec
from tests.e2e.conftest import (
    DUAL,
    DUAL_EXTRA_CONFIG,
    LOG_DIR,
    PairManager,
)
from tests.e2e.test_dual_connector import (
    assert_nothing_held,
    coordinates,
    push_registered_first,
    push_stats,
    push_to_d,
)
from tests.e2e.test_push_tp_vllm import transferred
from tests.e2e.vllm_client import (
    COMPLETIONS,
    TIMEOUT,
    decode,
    external_kv_tokens,
    get_metrics,
    make_body,
    reference_tokens,
    wait_for_metric,
)

pytestmark = pytest.mark.e2e

CHUNKED = ("--max-num-batched-tokens", "64", "--max-num-seqs", "8", "--block-size", "32")


@pytest.fixture(scope="module")
def chunked_pair(pair_manager: PairManager, tiny_model: Path) -> Iterator[Pair]:
    """A P and a D with our connector whose steps compute at most 64 tokens."""
    specs = [server_spec(role, connector=DUAL, model_dir=tiny_model, log_dir=LOG_DIR,
                         name=f"{role}-chunked", kv_extra_config=DUAL_EXTRA_CONFIG,
                         extra_args=CHUNKED)
             for role in ("prefill", "decode")]
    with pair_manager.own_pair(specs, "chunked") as running:
        yield running


async def assert_pushed_whole(client: httpx.AsyncClient, running: Pair, body: dict[str, Any],
                              d_before: dict[Any, float],
                              answer: tuple[list[int], int]) -> None:
    """A prompt of more than two steps' tokens: D got all of it by transfer (it computed
    none), its tokens equal one server's, and neither server holds a block afterwards."""
    tokens, prompt_tokens = answer
    assert prompt_tokens > 64 * 2, "the prompt fits in two steps: one chunk at most"
    after = await wait_for_metric(client, running.decode_url,
                                  partial(transferred, d_before, prompt_tokens))
    assert external_kv_tokens(after) - external_kv_tokens(d_before) == prompt_tokens, (
        "D did not get the whole prompt's KV by transfer (it recomputed)")
    assert tokens == await reference_tokens(client, running.decode_url, COMPLETIONS, body)
    await assert_nothing_held(client, running)


async def test_a_prompt_in_chunks_is_written_chunk_by_chunk_and_gives_one_servers_tokens(
    chunked_pair: Pair,
) -> None:
    """The first push makes P's NIXL handshake with D (a push to a D P has no handshake
    with yet is written whole, its chunks too); the second goes by layer and by chunk."""
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        await push_registered_first(client, chunked_pair, push_layers=False)
        body, _, d_before, (tokens, prompt_tokens) = await push_registered_first(
            client, chunked_pair, push_layers=True)
        await assert_pushed_whole(client, chunked_pair, body, d_before,
                                  (tokens, prompt_tokens))
        await push_stats(client, chunked_pair.prefill,
                         r"writes done 2 failed 0 .*by layer 1, by chunk 1 of [1-9]")


async def test_a_prompt_in_chunks_pushed_with_both_legs_at_once_gives_one_servers_tokens(
    chunked_pair: Pair,
) -> None:
    """As the router sends them: P's and D's legs at once, so D's registration reaches P
    while it computes some chunk (which one varies: the chunks computed before it are
    asked for by D's grant, and written if their step is still running; the rest go with
    the final WRITE). Whichever it meets, D gets the whole prompt by transfer, its tokens
    equal one server's, and nothing is held after."""
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        await push_registered_first(client, chunked_pair, push_layers=True)  # handshake
        p_params = await coordinates(client, chunked_pair)
        body = make_body(COMPLETIONS)
        leg, request_id = push_to_d(body, p_params)
        d_before = await get_metrics(client, chunked_pair.decode_url)
        prefilled, (tokens, prompt_tokens) = await asyncio.wait_for(asyncio.gather(
            client.post(chunked_pair.prefill_url + COMPLETIONS, json=prefill_leg(
                body, transfer_id=request_id, transfer_mode="push", push_layers=True)),
            decode(client, chunked_pair.decode_url + COMPLETIONS, leg, stream=False,
                   headers={"X-Request-Id": request_id})), timeout=60)
        assert prefilled.status_code == 200, prefilled.text
        await assert_pushed_whole(client, chunked_pair, body, d_before,
                                  (tokens, prompt_tokens))
        # Received by push, not read instead: P logs a failed WRITE before it tells D,
        # so before D could read the prompt and answer.
        assert f"push {request_id}: WRITE failed" not in \
            chunked_pair.prefill.spec.log_path.read_text()
        await push_stats(client, chunked_pair.decode,
                         r"D registered (\d+) received \1 pulled instead 0 fell back 0 ")
