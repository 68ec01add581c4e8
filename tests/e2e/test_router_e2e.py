"""The router in front of real vLLM 0.32 servers on CPU, in both modes.

- pull: a P/D pair with stock `NixlConnector`, the router in pull mode;
- push: a P/D pair with stock `NixlPushConnector`, the router in push mode (it probes P
  for its engine id and side channel, then sends both legs at once);
- local: on the pull pair's router, `X-KV-Transfer-Mode: local` sends D alone the
  request, and D computes the prompt (no request reaches P).
For completions and chat, streamed and not: the greedy tokens equal the same request
served whole by one server, the answer says the mode used, and D's /metrics shows that
the prompt's KV came over KV transfer (not recomputed). After the requests, no KV block
stays held on D, and nothing stays in flight in the router.
"""

from __future__ import annotations

import uuid

import httpx
import pytest

from testbed.pd_protocol import KV_USAGE, metric, parse_metrics
from testbed.vllm_cpu import Pair
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


REQUESTS_DONE = "vllm:request_success_total"  # every finished request, by finish reason
PROMPT_TOKENS = "vllm:prompt_tokens_total"


async def test_local_through_router_reaches_d_alone(pull_pair: Pair, proxy_for: ProxyFactory) -> None:
    """`X-KV-Transfer-Mode: local` on the running pull pair and router: D computes the
    prompt itself. The tokens equal one server's, no request reaches P (its vLLM
    counters stand still while D's count both requests), no KV came by transfer, and the
    router counts the requests as mode=local."""
    router_url = proxy_for(pull_pair, "pull")
    p_url, d_url = pull_pair.prefill_url, pull_pair.decode_url
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        p_before, d_before = await get_metrics(client, p_url), await get_metrics(client, d_url)
        router_before = parse_metrics((await client.get(router_url + "/metrics")).text)
        cases = [(COMPLETIONS, False), (CHAT, True)]
        answers = []
        for path, stream in cases:
            body = make_body(path)
            tokens, _ = await decode(client, router_url + path, body, stream=stream,
                                     headers={"X-KV-Transfer-Mode": "local"})
            answers.append((path, body, tokens))
        # D's stats show both requests: vLLM has published what it did for them
        d_after = await wait_for_metric(
            client, d_url,
            lambda s: metric(s, REQUESTS_DONE) - metric(d_before, REQUESTS_DONE) >= len(cases))
        p_after = await get_metrics(client, p_url)
        router_after = parse_metrics((await client.get(router_url + "/metrics")).text)
        for path, body, tokens in answers:
            assert tokens == await reference_tokens(client, d_url, path, body), (
                f"{path}: tokens differ from one server's")
    assert metric(d_after, REQUESTS_DONE) - metric(d_before, REQUESTS_DONE) == len(cases)
    assert external_kv_tokens(d_after) == external_kv_tokens(d_before), "no KV came by transfer"
    for name in (REQUESTS_DONE, PROMPT_TOKENS):
        assert metric(p_after, name) == metric(p_before, name), f"P's {name} moved: P was used"
    counted = (metric(router_after, "pdproxy_requests_total", mode="local", status="200")
               - metric(router_before, "pdproxy_requests_total", mode="local", status="200"))
    assert counted == len(cases)
    assert metric(router_after, "pdproxy_prefill_latency_seconds_count", mode="local") == 0.0
