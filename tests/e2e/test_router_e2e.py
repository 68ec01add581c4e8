"""The router in front of real vLLM 0.32 servers on CPU, in both modes.

- pull: a P/D pair with stock `NixlConnector`, the router in pull mode;
- push: a P/D pair with stock `NixlPushConnector`, the router in push mode (it probes P
  for its engine id and side channel, then sends both legs at once).
For completions and chat, streamed and not: the greedy tokens equal the same request
served whole by one server, the answer says the mode used, and D's /metrics shows that
the prompt's KV came over KV transfer (not recomputed). After the requests, no KV block
stays held on D, and nothing stays in flight in the router.
"""

from __future__ import annotations

import uuid

import httpx
import pytest

from scripts.pd_protocol import KV_USAGE, metric, parse_metrics
from scripts.vllm_cpu import Pair
from tests.e2e.conftest import ProxyFactory
from tests.e2e.vllm_client import (
    CHAT,
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

PATHS = [COMPLETIONS, CHAT]
STREAMS = [False, True]


async def through_router(
    client: httpx.AsyncClient, router_url: str, d_url: str, path: str, *, stream: bool, mode: str
) -> None:
    """One request through the router; check mode, tokens and the KV transfer."""
    body = make_body(path)
    request_id = f"e2e-{mode}-{uuid.uuid4().hex[:8]}"
    before = await get_metrics(client, d_url)
    # `decode` checks status 200 and returns (token ids, prompt tokens).
    tokens, prompt_tokens = await decode(
        client, router_url + path, body, stream=stream,
        headers={"X-Request-Id": request_id, "X-KV-Transfer-Mode": mode},
    )  # fmt: skip
    after = await wait_for_metric(
        client, d_url,
        lambda s: external_kv_tokens(s) - external_kv_tokens(before) >= prompt_tokens,
    )  # fmt: skip
    assert tokens == await reference_tokens(client, d_url, path, body), "tokens differ from one server's"
    assert external_kv_tokens(after) - external_kv_tokens(before) == prompt_tokens, (
        "D did not get the whole prompt's KV by transfer"
    )


async def used_mode(client: httpx.AsyncClient, router_url: str, mode: str) -> httpx.Response:
    r = await client.post(router_url + COMPLETIONS, json={**make_body(COMPLETIONS), "max_tokens": 2},
                          headers={"X-KV-Transfer-Mode": mode})
    assert r.status_code == 200, r.text
    return r


async def assert_nothing_held(client: httpx.AsyncClient, router_url: str, d_url: str) -> None:
    samples = await wait_for_metric(client, d_url, lambda s: metric(s, KV_USAGE) == 0.0, timeout_s=15)
    assert metric(samples, KV_USAGE) == 0.0, "D still holds KV blocks"
    router_metrics = parse_metrics((await client.get(router_url + "/metrics")).text)
    assert metric(router_metrics, "pdproxy_endpoint_in_flight") == 0.0


@pytest.mark.parametrize("stream", STREAMS, ids=["whole", "stream"])
@pytest.mark.parametrize("path", PATHS, ids=["completions", "chat"])
async def test_pull_through_router(pull_pair: Pair, proxy_for: ProxyFactory, path: str, stream: bool) -> None:
    router_url = proxy_for(pull_pair, "pull")
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        await through_router(client, router_url, pull_pair.decode_url, path, stream=stream, mode="pull")
        await assert_nothing_held(client, router_url, pull_pair.decode_url)


async def test_pull_only_pair_answers_a_push_request_by_pull(pull_pair: Pair, proxy_for: ProxyFactory) -> None:
    """A stock NixlConnector P says `transfer_mode: pull`: push falls back, and says so."""
    router_url = proxy_for(pull_pair, "pull")
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        r = await used_mode(client, router_url, "push")
    assert r.headers["x-kv-transfer-mode"] == "pull"
    assert r.headers["x-kv-transfer-mode-reason"] == "prefill_cannot_push"


@pytest.mark.parametrize("stream", STREAMS, ids=["whole", "stream"])
@pytest.mark.parametrize("path", PATHS, ids=["completions", "chat"])
async def test_push_through_router(push_pair: Pair, proxy_for: ProxyFactory, path: str, stream: bool) -> None:
    router_url = proxy_for(push_pair, "push")
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        await through_router(client, router_url, push_pair.decode_url, path, stream=stream, mode="push")
        await assert_nothing_held(client, router_url, push_pair.decode_url)


async def test_push_router_learned_p_coordinates_by_one_probe(push_pair: Pair, proxy_for: ProxyFactory) -> None:
    router_url = proxy_for(push_pair, "push")
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        for _ in range(2):
            r = await used_mode(client, router_url, "auto")
            assert r.headers["x-kv-transfer-mode"] == "push"
        samples = parse_metrics((await client.get(router_url + "/metrics")).text)
    assert metric(samples, "pdproxy_prefill_probes_total", result="ok") == 1.0
    assert metric(samples, "pdproxy_requests_total", mode="push", status="200") >= 2.0
