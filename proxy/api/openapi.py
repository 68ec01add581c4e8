"""The router's OpenAPI document, served at /openapi.json.

The inference routes run on an ASGI fast path, outside FastAPI's routing, so FastAPI
cannot describe them: this module does, by hand, for every public route. Request
bodies are OpenAI's (the router forwards fields it does not know), so only the fields
the router itself checks are described; the headers and error answers are the router's.
"""

from __future__ import annotations

from typing import Any

from connector.protocol.http_params import (
    PUSH_LAYERS_HEADER,
    REQUEST_ID_HEADER,
    TRANSFER_MODE_HEADER,
)

ERROR = {"$ref": "#/components/schemas/Error"}


def _answer(description: str, content_type: str = "application/json",
            schema: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"description": description,
            "content": {content_type: {"schema": schema or {"type": "object"}}}}


def _errors(*statuses: int) -> dict[str, Any]:
    meaning = {
        400: "invalid request (the message names the field)",
        401: "missing or wrong API key (client keys when configured; the admin token)",
        404: "unknown model, or no such server",
        409: "conflict (already a member, or the last server of its cluster)",
        413: "request body too large",
        502: "a prefill or decode server failed, or answered what the router cannot use",
        503: "no healthy server for this request (the message says which cluster or model), "
             "or over a limit of the router's (no upstream connection free within "
             "timeouts.pool, limits.max_in_flight): retry after Retry-After",
        504: "a server did not answer within its time limit",
    }
    return {str(s): _answer(meaning[s], schema=ERROR) for s in statuses}


_MODE_HEADER = {
    "name": TRANSFER_MODE_HEADER, "in": "header", "required": False,
    "schema": {"type": "string", "enum": ["pull", "push", "local", "auto"]},
    "description": "KV hand-over for this request; overrides the configured mode "
                   "(local: no prefill server, the decode server computes the prompt).",
}
_PUSH_LAYERS_HEADER = {
    "name": PUSH_LAYERS_HEADER, "in": "header", "required": False,
    "schema": {"type": "string", "enum": ["on", "off", "auto"]},
    "description": "For a push: the prefill server writes the KV layer by layer while it "
                   "computes (on) or whole when it is done (off); auto or absent: the "
                   "router decides where it learns which is faster (auto.push_layers: "
                   "learn, the default), else the prefill server's connector "
                   "(push_layers). A prefill server set to push_layers: off writes whole "
                   "whatever is asked.",
}
_REQUEST_ID_HEADER = {
    "name": REQUEST_ID_HEADER, "in": "header", "required": False,
    "schema": {"type": "string", "pattern": "^[A-Za-z0-9._:-]{1,128}$"},
    "description": "Your id for the request; both legs get it (else one is generated).",
}
_ANSWER_HEADERS = {
    TRANSFER_MODE_HEADER: {"schema": {"type": "string", "enum": ["pull", "push", "local"]},
                           "description": "The mode used."},
    "X-KV-Transfer-Mode-Reason": {"schema": {"type": "string"},
                                  "description": "Why the asked mode was not used (only then)."},
    REQUEST_ID_HEADER: {"schema": {"type": "string"}, "description": "The request's id."},
    "X-KV-Transfer-Recovery": {
        "schema": {"type": "string", "enum": ["pull", "recompute"]},
        "description": "A push whose prefill failed was answered this way (only then)."},
    PUSH_LAYERS_HEADER: {
        "schema": {"type": "string", "enum": ["on", "off"]},
        "description": "Whether the router asked for the push to be written layer by "
                       "layer (only where it learns that, auto.push_layers: learn, and the "
                       "request ran as a push); a prefill server set to push_layers: off "
                       "writes whole all the same."},
}


def _inference(summary: str, prompt_field: dict[str, Any]) -> dict[str, Any]:
    body = {
        "type": "object",
        "required": ["model", *prompt_field],
        "additionalProperties": True,
        "properties": {
            "model": {"type": "string", "minLength": 1},
            **prompt_field,
            "stream": {"type": "boolean", "default": False},
            "max_tokens": {"type": "integer", "minimum": 1},
        },
    }
    answer = _answer("the answer of the decode server (a server-sent event stream when "
                     "`stream` is true)")
    answer["content"]["text/event-stream"] = {"schema": {"type": "string"}}
    answer["headers"] = _ANSWER_HEADERS
    return {"post": {
        "summary": summary,
        "parameters": [_MODE_HEADER, _PUSH_LAYERS_HEADER, _REQUEST_ID_HEADER],
        "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
        "responses": {"200": answer, **_errors(400, 401, 404, 413, 502, 503, 504)},
    }}


def _admin(summary: str, method: str, *statuses: int) -> dict[str, Any]:
    return {method: {"summary": summary, "security": [{"adminToken": []}],
                     "responses": {"200": _answer("done"), **_errors(401, *statuses)}}}


def openapi_document(*, admin: bool) -> dict[str, Any]:
    """The OpenAPI 3.1 document; the admin routes only when the admin API is on."""
    paths: dict[str, Any] = {
        "/v1/completions": _inference(
            "A completion, through a prefill and a decode server",
            {"prompt": {"description": "text, token ids, or a batch of either"}}),
        "/v1/chat/completions": _inference(
            "A chat completion, through a prefill and a decode server",
            {"messages": {"type": "array", "minItems": 1, "items": {"type": "object"}}}),
        "/v1/models": {"get": {"summary": "The models the servers serve (their union)",
                               "responses": {"200": _answer("an OpenAI model list")}}},
        "/health": {"get": {"summary": "200 while at least one P and one D are healthy",
                            "responses": {"200": _answer("healthy"),
                                          "503": _answer("degraded")}}},
        "/metrics": {"get": {"summary": "Prometheus metrics",
                             "responses": {"200": _answer("text exposition format",
                                                          "text/plain", {"type": "string"})}}},
    }
    if admin:
        paths["/admin/endpoints"] = {
            **_admin("Every server and its state", "get"),
            **_admin("Add a server: {cluster, url, ...endpoint options}", "post", 400, 409),
            **_admin("Remove a server (?cluster=&url=)", "delete", 404, 409),
        }
        paths["/admin/endpoints/drain"] = _admin(
            "Drain a server, or take it back: {cluster, url, draining}", "post", 400, 404)
        paths["/admin/auto"] = _admin("What auto mode has measured", "get")
        paths["/admin/kv"] = _admin("kv_aware's index: each server's KV event sources", "get")
    return {
        "openapi": "3.1.0",
        "info": {"title": "pd-proxy", "version": "1",
                 "summary": "OpenAI-compatible router for vLLM prefill/decode disaggregation"},
        "paths": paths,
        "components": {
            "schemas": {"Error": {
                "type": "object", "required": ["error"],
                "properties": {"error": {
                    "type": "object", "required": ["message", "type", "code"],
                    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                                   "param": {"type": ["string", "null"]},
                                   "code": {"type": "integer"}}}}}},
            "securitySchemes": {"adminToken": {"type": "http", "scheme": "bearer"}},
        },
    }
