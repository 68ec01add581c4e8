"""Helpers shared by the end-to-end tests: request bodies, calls to vLLM (or the router
in front of it), its metrics, and the one-server reference for the token oracle."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx

from testbed.pd_protocol import (
    EXTERNAL_KV_TOKENS,
    answer_token_ids,
    metric,
    parse_metrics,
    sse_events,
    stream_token_ids,
)
from testbed.tiny_model import sample_text

TIMEOUT = httpx.Timeout(60.0)
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MAX_TOKENS = 12


def make_body(path: str) -> dict[str, Any]:
    """A greedy request with a fresh random prompt of about 130-260 tokens, generating
    exactly MAX_TOKENS tokens.

    Fresh, so no server has it in its prefix cache; random words, so outputs differ
    from prompt to prompt (a prompt that only differed in a nonce would not). EOS is
    ignored: a random prompt on which the tiny model ends early would fail the checks
    that every answer is MAX_TOKENS long (it did, once in many runs).
    """
    prompt = sample_text(uuid.uuid4().int % 2**32, lines=8)
    body: dict[str, Any] = {
        "model": "tiny",
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def get_metrics(client: httpx.AsyncClient, base_url: str) -> dict[Any, float]:
    resp = await client.get(f"{base_url}/metrics")
    resp.raise_for_status()
    return parse_metrics(resp.text)


async def wait_for_metric(
    client: httpx.AsyncClient,
    base_url: str,
    check: Callable[[dict[Any, float]], bool],
    *,
    timeout_s: float = 10.0,
) -> dict[Any, float]:
    """vLLM publishes stats a moment after it answers: poll until `check` holds."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = await get_metrics(client, base_url)
        if check(samples) or time.monotonic() > deadline:
            return samples
        await asyncio.sleep(0.1)


# Where D's prompt tokens came from, by vLLM's vllm:prompt_tokens_by_source.
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def by_source(samples: dict[Any, float]) -> dict[str, float]:
    """A server's prompt tokens so far, per source."""
    return {source: metric(samples, EXTERNAL_KV_TOKENS, source=source)
            for source in PROMPT_SOURCES}


async def served_by_mode(client: httpx.AsyncClient, decode_url: str, router_url: str,
                         path: str, body: dict[str, Any],
                         mode: str) -> tuple[dict[str, Any], dict[str, float]]:
    """`body` through the router by `mode` (200, and no fall back to another mode): the
    answer, and D's prompt tokens by source for it, waited for until they add up to the
    prompt (vLLM publishes them a moment after it answers)."""
    before = by_source(await get_metrics(client, decode_url))
    resp = await client.post(router_url + path, json=body, headers={"X-KV-Transfer-Mode": mode})
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-kv-transfer-mode"] == mode, "the router fell back"
    answer: dict[str, Any] = resp.json()
    prompt_tokens = int(answer["usage"]["prompt_tokens"])

    def counted(samples: dict[Any, float]) -> bool:
        now = by_source(samples)
        return sum(now[s] - before[s] for s in PROMPT_SOURCES) >= prompt_tokens

    after = by_source(await wait_for_metric(client, decode_url, counted))
    return answer, {s: after[s] - before[s] for s in PROMPT_SOURCES}


async def tokenize(client: httpx.AsyncClient, base_url: str, prompt: str) -> list[int]:
    resp = await client.post(f"{base_url}/tokenize", json={"model": "tiny", "prompt": prompt})
    assert resp.status_code == 200, resp.text
    return [int(t) for t in resp.json()["tokens"]]


def external_kv_tokens(samples: dict[Any, float]) -> float:
    return metric(samples, EXTERNAL_KV_TOKENS, source="external_kv_transfer")


async def decode(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    *,
    stream: bool,
    headers: dict[str, str] | None = None,
) -> tuple[list[int], int]:
    """Send `body` (streamed or not); return (generated token ids, prompt tokens)."""
    if not stream:
        resp = await client.post(url, json=body, headers=headers)
        assert resp.status_code == 200, resp.text
        answer = resp.json()
        return answer_token_ids(answer), int(answer["usage"]["prompt_tokens"])
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", url, json=streamed, headers=headers) as resp:
        assert resp.status_code == 200, (await resp.aread()).decode()
        events = sse_events([line async for line in resp.aiter_lines()])
    usage = next(e["usage"] for e in reversed(events) if e.get("usage"))
    return stream_token_ids(events), int(usage["prompt_tokens"])


async def reference_tokens(
    client: httpx.AsyncClient, base_url: str, path: str, body: dict[str, Any]
) -> list[int]:
    """The same request served whole by one server, computed from scratch."""
    fresh = {**body, "cache_salt": uuid.uuid4().hex}
    tokens, _ = await decode(client, base_url + path, fresh, stream=False)
    assert len(tokens) == MAX_TOKENS
    return tokens


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many ids two prompts share from their start."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
