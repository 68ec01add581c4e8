"""A 2P1D pool of real vLLM CPU servers with our connector, through the router: both P
serve (pull and push), and after one P is killed, later requests go to the other and
still return the tokens one server computes alone."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.conftest import Pool, RouterProcess
from tests.e2e.vllm_client import (
    COMPLETIONS,
    TIMEOUT,
    decode,
    get_metrics,
    make_body,
    reference_tokens,
)

pytestmark = pytest.mark.e2e

PROMPT_TOKENS = "vllm:prompt_tokens_total"


async def served_prompts(client: httpx.AsyncClient, url: str) -> float:
    samples = await get_metrics(client, url)
    return sum(v for k, v in samples.items() if k[0] == PROMPT_TOKENS)


async def ask(client: httpx.AsyncClient, router_url: str, d_url: str, mode: str) -> None:
    body = make_body(COMPLETIONS)
    tokens, _ = await decode(client, router_url + COMPLETIONS, body, stream=False,
                             headers={"X-KV-Transfer-Mode": mode})
    assert tokens == await reference_tokens(client, d_url, COMPLETIONS, body), mode


async def test_two_prefills_share_the_work_and_one_dying_is_routed_around(pool_2p1d: Pool) -> None:
    p0, p1 = pool_2p1d.prefills
    d_url = pool_2p1d.decode.url
    router = RouterProcess([p0.url, p1.url], d_url, "pull",
                           ("--prefill-policy", "round_robin", "--health-interval", "1"))
    try:
        router.wait_healthy()
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            before = [await served_prompts(client, p.url) for p in (p0, p1)]
            for mode in ("pull", "push", "pull", "push"):
                await ask(client, router.url, d_url, mode)
            after = [await served_prompts(client, p.url) for p in (p0, p1)]
            assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)

            p0.stop(timeout_s=5)
            # Pull: a refused connection is retried on the other P. Push: the health
            # check (1 s) or the first refused connection takes P0 out.
            for mode in ("pull", "pull", "push", "push", "pull", "push"):
                await ask(client, router.url, d_url, mode)
            assert await served_prompts(client, p1.url) > after[1]
    finally:
        router.stop()
