"""The router driven by the official `openai` Python client, against real vLLM on CPU,
in pull and push mode: completions and chat, streamed and not. The text must equal the
same request served whole by one server, and the answer must say the mode used."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import openai
import pytest

from testbed.vllm_cpu import Pair
from tests.e2e.conftest import ProxyFactory
from tests.e2e.vllm_client import MAX_TOKENS, TIMEOUT, make_body

pytestmark = pytest.mark.e2e


async def one_server_text(d_url: str, path: str, body: dict[str, Any]) -> str:
    """The reference: D alone, from scratch (a fresh cache_salt defeats its prefix cache)."""
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        r = await client.post(d_url + path, json={**body, "cache_salt": uuid.uuid4().hex})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return str(choice.get("text") or choice["message"]["content"] or "")


async def ask_with_openai(router_url: str, *, chat: bool, stream: bool, mode: str, body: dict[str, Any]) -> tuple[str, str]:
    """Send `body` with the openai client; return (text, X-KV-Transfer-Mode of the answer)."""
    client = openai.AsyncOpenAI(base_url=router_url + "/v1", api_key="unused", timeout=60)
    headers = {"X-KV-Transfer-Mode": mode}
    async with client:
        if chat:
            messages = body["messages"]
            if stream:
                chunks = await client.chat.completions.create(
                    messages=messages, stream=True, model="tiny", max_tokens=MAX_TOKENS,
                    temperature=0, extra_headers=headers)
                text = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
                return text, chunks.response.headers["x-kv-transfer-mode"]
            raw_chat = await client.chat.completions.with_raw_response.create(
                messages=messages, model="tiny", max_tokens=MAX_TOKENS, temperature=0,
                extra_headers=headers)
            answer = raw_chat.parse().choices[0].message.content or ""
            return answer, raw_chat.headers["x-kv-transfer-mode"]
        if stream:
            events = await client.completions.create(
                prompt=body["prompt"], stream=True, model="tiny", max_tokens=MAX_TOKENS,
                temperature=0, extra_headers=headers)
            text = "".join([c.choices[0].text async for c in events if c.choices])
            return text, events.response.headers["x-kv-transfer-mode"]
        raw = await client.completions.with_raw_response.create(
            prompt=body["prompt"], model="tiny", max_tokens=MAX_TOKENS, temperature=0,
            extra_headers=headers)
        return raw.parse().choices[0].text, raw.headers["x-kv-transfer-mode"]


CASES = [(chat, stream) for chat in (False, True) for stream in (False, True)]
IDS = [f"{'chat' if c else 'completions'}-{'stream' if s else 'whole'}" for c, s in CASES]


@pytest.mark.parametrize("chat,stream", CASES, ids=IDS)
async def test_openai_client_pull(pull_pair: Pair, proxy_for: ProxyFactory, chat: bool, stream: bool) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {k: v for k, v in make_body(path).items() if k != "return_token_ids"}
    text, used = await ask_with_openai(proxy_for(pull_pair, "pull"), chat=chat, stream=stream, mode="pull", body=body)
    assert used == "pull"
    assert text == await one_server_text(pull_pair.decode_url, path, body)


@pytest.mark.parametrize("chat,stream", CASES, ids=IDS)
async def test_openai_client_push(push_pair: Pair, proxy_for: ProxyFactory, chat: bool, stream: bool) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {k: v for k, v in make_body(path).items() if k != "return_token_ids"}
    text, used = await ask_with_openai(proxy_for(push_pair, "push"), chat=chat, stream=stream, mode="push", body=body)
    assert used == "push"
    assert text == await one_server_text(push_pair.decode_url, path, body)
