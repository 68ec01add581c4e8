"""vLLM's side of the P/D contract, checked against real vLLM 0.32 servers (no router).

What the router relies on (docs/ARCHITECTURE.md, section 6), hand-verified once and
kept true here:
- pull: P's 1-token answer carries kv_transfer_params; D given them gets its prompt's
  KV over NIXL (not recomputed) and generates the same greedy tokens as one server.
- push: with both legs sent at once under one X-Request-Id, P WRITEs the KV into D's
  blocks; D's tokens again equal one server's. A probe names P's engine and side channel.

The reference ("one server") is D itself, asked with a fresh `cache_salt` so its prefix
cache (which now holds the transferred KV) cannot be used: the reference is computed
from scratch.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import httpx
import pytest

from testbed.pd_protocol import (
    KV_USAGE,
    NIXL_BYTES,
    PREFILL_ANSWER_KEYS,
    metric,
    prefill_leg,
    probe_body,
    pull_decode_leg,
    push_decode_leg,
    remote_request_id,
)
from testbed.vllm_cpu import Pair
from tests.e2e.vllm_client import (
    CHAT,
    COMPLETIONS,
    TIMEOUT,
    decode,
    external_kv_tokens,
    get_metrics,
    make_body,
    reference_tokens,
    tokenize,
    wait_for_metric,
)

pytestmark = pytest.mark.e2e

# --------------------------------------------------------------------------- pull


async def test_pull_prefill_answer_names_the_kv(pull_pair: Pair) -> None:
    body = make_body(COMPLETIONS)
    request_id = f"pull-{uuid.uuid4().hex[:8]}"
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        resp = await client.post(
            pull_pair.prefill_url + COMPLETIONS,
            json=prefill_leg(body),
            headers={"X-Request-Id": request_id},
        )
        assert resp.status_code == 200, resp.text
        answer = resp.json()
        params = answer["kv_transfer_params"]
        # Finish the hand-over, so P does not hold the blocks until its lease ends.
        await decode(
            client, pull_pair.decode_url + COMPLETIONS, pull_decode_leg(body, params), stream=False
        )
    assert PREFILL_ANSWER_KEYS <= params.keys(), params
    assert params["do_remote_prefill"] is True
    assert params["do_remote_decode"] is False
    assert params["transfer_mode"] == "pull"
    assert params["remote_host"] == "127.0.0.1"
    assert params["remote_port"] == pull_pair.prefill.spec.side_channel_port
    assert params["tp_size"] == 1
    assert params["remote_num_tokens"] == answer["usage"]["prompt_tokens"]
    # One list of block ids per KV-cache group; the tiny model has one group.
    assert len(params["remote_block_ids"]) == 1 and params["remote_block_ids"][0]
    # vLLM's id: "cmpl-<X-Request-Id>-<choice index>-<8 random hex>" for completions.
    assert params["remote_request_id"].startswith(remote_request_id(request_id, chat=False) + "-")
    assert answer["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT], ids=["completions", "chat"])
async def test_pull_hand_over_matches_one_server(pull_pair: Pair, path: str, stream: bool) -> None:
    body = make_body(path)
    p_url, d_url = pull_pair.prefill_url, pull_pair.decode_url
    headers = {"X-Request-Id": f"pull-{uuid.uuid4().hex[:8]}"}
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        before = await get_metrics(client, d_url)
        resp = await client.post(p_url + path, json=prefill_leg(body), headers=headers)
        assert resp.status_code == 200, resp.text
        p_params = resp.json()["kv_transfer_params"]
        assert p_params and p_params["transfer_mode"] == "pull"

        tokens, prompt_tokens = await decode(
            client, d_url + path, pull_decode_leg(body, p_params),
            stream=stream, headers=headers,
        )  # fmt: skip
        after = await wait_for_metric(
            client, d_url,
            lambda s: external_kv_tokens(s) - external_kv_tokens(before) >= prompt_tokens,
        )  # fmt: skip
        assert tokens == await reference_tokens(client, d_url, path, body)

    # The whole prompt's KV came over NIXL (D READs in pull), none was recomputed.
    assert external_kv_tokens(after) - external_kv_tokens(before) == prompt_tokens
    assert metric(after, NIXL_BYTES) > metric(before, NIXL_BYTES)


async def test_token_oracle_catches_wrong_kv(pull_pair: Pair) -> None:
    """The oracle has teeth: D fed another prompt's KV generates different tokens."""
    body = make_body(COMPLETIONS)
    p_url, d_url = pull_pair.prefill_url + COMPLETIONS, pull_pair.decode_url + COMPLETIONS
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        # Another prompt of exactly the same length in tokens, so the same block count.
        length = len(await tokenize(client, pull_pair.decode_url, body["prompt"]))
        other_ids = await tokenize(client, pull_pair.decode_url, make_body(COMPLETIONS)["prompt"])
        while len(other_ids) < length:
            other_ids += other_ids[1:]  # keep one BOS in front
        other = {**body, "prompt": other_ids[:length]}

        own = (await client.post(p_url, json=prefill_leg(body))).json()["kv_transfer_params"]
        wrong = (await client.post(p_url, json=prefill_leg(other))).json()["kv_transfer_params"]
        assert wrong["remote_num_tokens"] == own["remote_num_tokens"] == length
        tokens, _ = await decode(client, d_url, pull_decode_leg(body, wrong), stream=False)
        # Let P free the blocks of `body` too (D reads them, generating one token).
        await decode(client, d_url, {**pull_decode_leg(body, own), "max_tokens": 1}, stream=False)
        assert tokens != await reference_tokens(client, pull_pair.decode_url, COMPLETIONS, body)


async def test_pull_frees_kv_blocks_on_both_sides(pull_pair: Pair) -> None:
    """After a hand-over, P frees its blocks once D has read them; D frees on finish.

    Usage must come back to where it was before (not to zero: an earlier probe of P by a
    router test may still hold its one block for P's 30 s lease)."""
    body = make_body(COMPLETIONS)
    urls = (pull_pair.prefill_url, pull_pair.decode_url)
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        before = {url: metric(await get_metrics(client, url), KV_USAGE) for url in urls}
        resp = await client.post(pull_pair.prefill_url + COMPLETIONS, json=prefill_leg(body))
        p_params = resp.json()["kv_transfer_params"]
        await decode(
            client, pull_pair.decode_url + COMPLETIONS, pull_decode_leg(body, p_params),
            stream=False,
        )  # fmt: skip
        for url in urls:
            def freed(s: dict[Any, float], url: str = url) -> bool:
                return metric(s, KV_USAGE) <= before[url]

            samples = await wait_for_metric(client, url, freed, timeout_s=15)
            assert metric(samples, KV_USAGE) <= before[url], f"{url} still holds KV blocks"


# --------------------------------------------------------------------------- push

_probes: dict[tuple[str, int | None], dict[str, Any]] = {}  # by P's URL and pid


async def push_probe(client: httpx.AsyncClient, running: Pair) -> dict[str, Any]:
    """P's probe answer's kv_transfer_params, once per P (each probe pins a block 30 s)."""
    key = (running.prefill_url, running.prefill.pid)
    if key not in _probes:
        resp = await client.post(running.prefill_url + COMPLETIONS, json=probe_body())
        assert resp.status_code == 200, resp.text
        _probes[key] = resp.json()["kv_transfer_params"]
    return _probes[key]


async def test_push_probe_names_engine_and_side_channel(push_pair: Pair) -> None:
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        params = await push_probe(client, push_pair)
    assert PREFILL_ANSWER_KEYS <= params.keys(), params
    assert params["transfer_mode"] == "push"
    assert isinstance(params["remote_engine_id"], str) and params["remote_engine_id"]
    assert params["remote_host"] == "127.0.0.1"
    assert params["remote_port"] == push_pair.prefill.spec.side_channel_port
    assert params["tp_size"] == 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT], ids=["completions", "chat"])
async def test_push_hand_over_with_both_legs_at_once(
    push_pair: Pair, path: str, stream: bool
) -> None:
    body = make_body(path)
    p_url, d_url = push_pair.prefill_url, push_pair.decode_url
    request_id = f"push-{uuid.uuid4().hex[:8]}"
    headers = {"X-Request-Id": request_id}  # the same on both legs: stock push needs it
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        probe = await push_probe(client, push_pair)
        d_before = await get_metrics(client, d_url)
        p_before = await get_metrics(client, p_url)

        p_resp, (tokens, prompt_tokens) = await asyncio.gather(
            client.post(p_url + path, json=prefill_leg(body), headers=headers),
            decode(
                client, d_url + path, push_decode_leg(body, probe, request_id=request_id),
                stream=stream, headers=headers,
            ),
        )  # fmt: skip
        assert p_resp.status_code == 200, p_resp.text
        assert p_resp.json()["kv_transfer_params"]["transfer_mode"] == "push"

        d_after = await wait_for_metric(
            client, d_url,
            lambda s: external_kv_tokens(s) - external_kv_tokens(d_before) >= prompt_tokens,
        )  # fmt: skip
        p_after = await wait_for_metric(
            client, p_url, lambda s: metric(s, NIXL_BYTES) > metric(p_before, NIXL_BYTES)
        )
        assert tokens == await reference_tokens(client, d_url, path, body)

    # The whole prompt's KV came over NIXL (P WRITEs in push), none was recomputed.
    assert external_kv_tokens(d_after) - external_kv_tokens(d_before) == prompt_tokens
    assert metric(p_after, NIXL_BYTES) > metric(p_before, NIXL_BYTES)
