"""Prefix hits on D through the router, on the `dual_pair` (our connector on both servers).

D (and P) already hold the start of the prompt: a prompt, then a longer one sharing its
first blocks; then a chat of three turns, each fed the answer before it. With pull, push,
and both alternating turn by turn: greedy tokens equal one server's, and D was sent only
the blocks it lacked: on D's `vllm:prompt_tokens_by_source`, the second request's
`local_cache_hit` covers at least the shared full blocks and its `external_kv_transfer`
at most the uncached tail (plus one block of rounding), and something did come over.

Correctness here rests on vLLM's push code writing P's matching tail into D's uncached
blocks (a front-trim would write P's first blocks there, and the tokens would differ).
vLLM CPU's default block size (128) and the pair's context (512) leave room for three
full blocks of prompt.
"""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest

from testbed.pd_protocol import answer_token_ids
from testbed.tiny_model import sample_text
from testbed.vllm_cpu import Pair
from tests.e2e.conftest import ProxyFactory
from tests.e2e.vllm_client import (
    CHAT,
    COMPLETIONS,
    MAX_TOKENS,
    TIMEOUT,
    common_prefix,
    reference_tokens,
    served_by_mode,
    tokenize,
)

pytestmark = pytest.mark.e2e

BLOCK_SIZE = 128  # vLLM CPU's default, which the pair keeps
async def text_of(client: httpx.AsyncClient, url: str, seed: int, lines: int,
                  min_tokens: int) -> str:
    """Pseudo-English of `lines` lines or more, at least `min_tokens` tokens."""
    for more in range(lines, lines + 40):
        text = sample_text(seed, lines=more)
        if len(await tokenize(client, url, text)) >= min_tokens:
            return text
    raise AssertionError(f"no text of {min_tokens} tokens from seed {seed}")


async def served(client: httpx.AsyncClient, pair: Pair, router_url: str, path: str,
                 body: dict[str, Any], mode: str) -> tuple[dict[str, Any], dict[str, float]]:
    """`body` through the router by `mode`: the answer, and D's prompt tokens by source
    for it, which add up to the prompt."""
    answer, delta = await served_by_mode(client, pair.decode_url, router_url, path, body, mode)
    prompt_tokens = int(answer["usage"]["prompt_tokens"])
    assert sum(delta.values()) == prompt_tokens, f"{mode}: D counted {delta} for {prompt_tokens}"
    return answer, delta


def check_prefix_hit(mode: str, delta: dict[str, float], prompt_tokens: int,
                     shared_tokens: int) -> None:
    """D had `shared_tokens` of the prompt: it used them and was sent no more than the rest."""
    shared = shared_tokens // BLOCK_SIZE * BLOCK_SIZE
    assert shared >= BLOCK_SIZE, f"the prompts share {shared_tokens} tokens, under one block"
    assert delta["local_cache_hit"] >= shared, (
        f"{mode}: D hit {delta['local_cache_hit']} cached tokens, expected >= {shared}: {delta}")
    tail = prompt_tokens - shared
    assert 0 < delta["external_kv_transfer"] <= tail + BLOCK_SIZE, (
        f"{mode}: D was sent {delta['external_kv_transfer']} tokens, its uncached tail is "
        f"{tail}: {delta}")


@pytest.mark.parametrize("modes", [("pull", "pull"), ("push", "push"), ("push", "pull", "push")],
                         ids=["pull", "push", "alternating"])
async def test_a_longer_prompt_sends_d_only_what_it_lacks(
    dual_pair: Pair, proxy_for: ProxyFactory, modes: tuple[str, ...]
) -> None:
    router_url = proxy_for(dual_pair, "pull")
    seed = uuid.uuid4().int % 2**32
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        previous: list[int] = []
        for turn, mode in enumerate(modes):
            # Each prompt the one before plus more: 1, 2, then 3 full blocks and a bit.
            prompt = await text_of(client, dual_pair.decode_url, seed, 6,
                                   (turn + 1) * BLOCK_SIZE + 20)
            ids = await tokenize(client, dual_pair.decode_url, prompt)
            assert len(ids) + MAX_TOKENS <= 512, len(ids)
            body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS,
                    "temperature": 0, "return_token_ids": True}
            answer, delta = await served(client, dual_pair, router_url, COMPLETIONS, body, mode)
            prompt_tokens = int(answer["usage"]["prompt_tokens"])
            assert prompt_tokens == len(ids)
            if turn == 0:
                assert delta["external_kv_transfer"] == prompt_tokens, (
                    f"{mode}: a fresh prompt did not all come by transfer: {delta}")
            else:
                check_prefix_hit(mode, delta, prompt_tokens, common_prefix(previous, ids))
            assert answer_token_ids(answer) == await reference_tokens(
                client, dual_pair.decode_url, COMPLETIONS, body), (
                f"turn {turn + 1} ({mode}): tokens differ from one server's")
            previous = ids


async def test_a_chat_of_three_turns_through_the_router(
    dual_pair: Pair, proxy_for: ProxyFactory
) -> None:
    router_url = proxy_for(dual_pair, "pull")
    seed = uuid.uuid4().int % 2**31
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        messages: list[dict[str, str]] = []
        previous: list[int] = []
        for turn, mode in enumerate(("push", "pull", "push")):
            # The first message fills a block; later ones are short, as in a chat.
            content = (await text_of(client, dual_pair.decode_url, seed, 6, BLOCK_SIZE + 20)
                       if turn == 0 else sample_text(seed + turn, lines=2))
            messages.append({"role": "user", "content": content})
            body = {"model": "tiny", "messages": list(messages), "max_tokens": MAX_TOKENS,
                    "temperature": 0, "return_token_ids": True}
            tokenized = await client.post(dual_pair.decode_url + "/tokenize",
                                          json={"model": "tiny", "messages": messages})
            assert tokenized.status_code == 200, tokenized.text
            ids = [int(t) for t in tokenized.json()["tokens"]]
            assert len(ids) + MAX_TOKENS <= 512, len(ids)
            answer, delta = await served(client, dual_pair, router_url, CHAT, body, mode)
            assert int(answer["usage"]["prompt_tokens"]) == len(ids)
            if turn > 0:
                check_prefix_hit(mode, delta, len(ids), common_prefix(previous, ids))
            tokens = answer_token_ids(answer)
            assert tokens == await reference_tokens(client, dual_pair.decode_url, CHAT, body), (
                f"turn {turn + 1} ({mode}): tokens differ from one server's")
            messages.append({"role": "assistant",
                             "content": answer["choices"][0]["message"]["content"]})
            previous = ids
