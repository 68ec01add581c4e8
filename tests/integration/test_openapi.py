"""The OpenAPI document at /openapi.json describes every public route the router serves,
and nothing it does not; the errors it declares are the router's error shape."""

from __future__ import annotations

from typing import Any

import httpx
from starlette.routing import Route

from tests.conftest import serve_router

TOKEN = "openapi-test-token"
UNREACHABLE = {"prefill": ["http://127.0.0.1:9"], "decode": ["http://127.0.0.1:9"]}


async def document(client: httpx.AsyncClient, url: str) -> dict[str, Any]:
    r = await client.get(f"{url}/openapi.json")
    assert r.status_code == 200
    doc: dict[str, Any] = r.json()
    assert doc["openapi"].startswith("3.")
    return doc


async def test_every_documented_route_is_served_and_every_served_route_documented() -> None:
    async with serve_router(**UNREACHABLE, admin_token=TOKEN) as (url, app), \
            httpx.AsyncClient(timeout=10, headers={"Authorization": f"Bearer {TOKEN}"}) as client:
        doc = await document(client, url)
        documented = {(path, method.upper()) for path, item in doc["paths"].items() for method in item}
        served = {(route.path, method) for route in app.api.routes if isinstance(route, Route)
                  for method in (route.methods or ()) if method != "HEAD"
                  and route.path != "/openapi.json"}
        served |= {("/v1/completions", "POST"), ("/v1/chat/completions", "POST")}  # fast path
        assert documented == served
        for path, method in sorted(documented):  # each answers that method (no 405)
            r = await client.request(method, url + path, json={})
            assert r.status_code != 405, (path, method, r.text)


async def test_inference_errors_match_the_declared_error_schema() -> None:
    async with serve_router(**UNREACHABLE) as (url, _), httpx.AsyncClient(timeout=10) as client:
        doc = await document(client, url)
        assert not any(p.startswith("/admin") for p in doc["paths"])  # no admin API: not listed
        post = doc["paths"]["/v1/completions"]["post"]
        declared = {int(s) for s in post["responses"] if s != "200"}
        assert {400, 404, 413, 502, 503, 504} <= declared
        error = doc["components"]["schemas"]["Error"]["properties"]["error"]
        r = await client.post(f"{url}/v1/completions", json={"prompt": "no model"})
        assert r.status_code == 400 and r.status_code in declared
        assert set(error["required"]) <= set(r.json()["error"])
        assert {p["name"] for p in post["parameters"]} == {"X-KV-Transfer-Mode", "X-KV-Push-Layers",
                                                        "X-Request-Id"}
