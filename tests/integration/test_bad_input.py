"""Bad input gets an OpenAI-shaped error with the right status and reaches no upstream."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.conftest import serve_router
from tests.integration.conftest import Pair

GOOD: dict[str, Any] = {"model": "fake-model", "prompt": "hi", "max_tokens": 2}
CHAT: dict[str, Any] = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}

Case = tuple[str, str, bytes | dict[str, Any], dict[str, str], int, str | None]
CASES: list[Case] = [
    # (name, route, raw body or json, headers, status, param)
    ("invalid json", "/v1/completions", b"{not json", {}, 400, None),
    ("array body", "/v1/completions", b"[1, 2]", {}, 400, None),
    ("empty body", "/v1/completions", b"", {}, 400, None),
    ("missing model", "/v1/completions", {"prompt": "hi"}, {}, 400, "model"),
    ("model not a string", "/v1/completions", {**GOOD, "model": 3}, {}, 400, "model"),
    ("missing prompt", "/v1/completions", {"model": "fake-model"}, {}, 400, "prompt"),
    ("prompt wrong type", "/v1/completions", {**GOOD, "prompt": {"a": 1}}, {}, 400, "prompt"),
    ("batch of prompts", "/v1/completions", {**GOOD, "prompt": ["a", "b"]}, {}, 400, "prompt"),
    ("missing messages", "/v1/chat/completions", {"model": "fake-model"}, {}, 400, "messages"),
    ("message without role", "/v1/chat/completions", {**CHAT, "messages": [{"content": "x"}]}, {}, 400, "messages"),
    ("stream not bool", "/v1/completions", {**GOOD, "stream": "yes"}, {}, 400, "stream"),
    ("max_tokens negative", "/v1/completions", {**GOOD, "max_tokens": -1}, {}, 400, "max_tokens"),
    ("max_tokens string", "/v1/completions", {**GOOD, "max_tokens": "5"}, {}, 400, "max_tokens"),
    ("n > 1", "/v1/completions", {**GOOD, "n": 2}, {}, 400, "n"),
    ("best_of > 1", "/v1/completions", {**GOOD, "best_of": 3}, {}, 400, "best_of"),
    ("client kv params", "/v1/completions", {**GOOD, "kv_transfer_params": {}}, {}, 400, "kv_transfer_params"),
    ("bad mode header", "/v1/completions", GOOD, {"X-KV-Transfer-Mode": "teleport"}, 400, "X-KV-Transfer-Mode"),
    ("bad request id", "/v1/completions", GOOD, {"X-Request-Id": "a b\tc"}, 400, "X-Request-Id"),
    ("unknown model", "/v1/completions", {**GOOD, "model": "gpt-17"}, {}, 404, "model"),
    ("unknown model chat", "/v1/chat/completions", {**CHAT, "model": "nope"}, {}, 404, "model"),
]


@pytest.mark.parametrize("name,route,body,headers,status,param", CASES, ids=[c[0] for c in CASES])
async def test_bad_request_is_refused(
    pair: Pair, name: str, route: str, body: object, headers: dict[str, str], status: int, param: str | None
) -> None:
    async with serve_router(prefill=[pair.p_url], decode=[pair.d_url]) as (url, _):
        async with httpx.AsyncClient(base_url=url) as client:
            if isinstance(body, bytes):
                r = await client.post(route, content=body, headers=headers)
            else:
                r = await client.post(route, json=body, headers=headers)
            still_serves = await client.post("/v1/completions", json=GOOD)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"] and error["code"] == status
    assert error["param"] == param
    # Only the good request that followed reached the upstreams, and it was served.
    assert still_serves.status_code == 200
    assert [s.body["prompt"] for s in pair.prefill.seen + pair.decode.seen] == ["hi", "hi"]


async def test_body_over_the_limit_is_413(pair: Pair) -> None:
    async with serve_router(prefill=[pair.p_url], decode=[pair.d_url], limits={"max_body_bytes": 1000}) as (url, _):
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.post("/v1/completions", json={**GOOD, "prompt": "x" * 2000})
    assert r.status_code == 413
    assert r.json()["error"]["code"] == 413
    assert pair.prefill.seen == []


@pytest.mark.parametrize("method,path,status", [("GET", "/v1/nothing", 404), ("POST", "/v2/completions", 404),
                                                ("GET", "/v1/completions", 405)])
async def test_unknown_routes(pair: Pair, method: str, path: str, status: int) -> None:
    async with serve_router(prefill=[pair.p_url], decode=[pair.d_url]) as (url, _):
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.request(method, path)
    assert r.status_code == status
    assert r.json()["error"]["code"] == status
