"""A request's prompt as token ids, exactly as the vLLM server will make them.

KV-aware routing compares a prompt's blocks of tokens with what each server caches, so
it needs the very ids vLLM computes: its tokenizer, its special tokens, and for a chat the
model's chat template rendered as vLLM renders it (system prompt, turns, tools, the
generation prompt). Rather than copy that rendering, the router asks a server of the
request's model: vLLM's `POST /tokenize` takes a completion's prompt or a chat's messages
with the same options as the request (`add_special_tokens`, `add_generation_prompt`,
`continue_final_message`, `chat_template`, `chat_template_kwargs`, `tools`) and answers
the ids it would prefill. A completion given as token ids needs no call.

`PromptBlocks` (`proxy.pool.kv.blocks`) then keys the ids per block size, once per size,
for every server of a request's legs.

Not scored (None): prompts with images or other non-text parts (their multimodal block
keys are not computable here), batched completions, and any request whose tokenize call
fails (the policy then falls back to load; counted by the caller).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

from proxy.errors import Overloaded, UpstreamError
from proxy.metrics import RouterMetrics
from proxy.pool.kv.blocks import PromptBlocks
from proxy.protocol import ClientRequest, Route
from proxy.upstream.client import UpstreamClient

if TYPE_CHECKING:
    from proxy.pool.endpoints import Endpoint

logger = logging.getLogger("pdproxy.kv")

# The request's fields that change what vLLM tokenizes, passed on to /tokenize as they are.
_CHAT_OPTIONS: tuple[str, ...] = ("add_generation_prompt", "continue_final_message", "add_special_tokens",
                 "chat_template", "chat_template_kwargs", "tools")
_COMPLETION_OPTIONS: tuple[str, ...] = ("add_special_tokens",)


def token_ids_of(request: ClientRequest) -> list[int] | None:
    """A completion's prompt given as token ids (one prompt, not a batch), else None."""
    prompt = request.body.get("prompt")
    if (request.route is Route.COMPLETIONS and isinstance(prompt, list) and prompt
            and all(type(t) is int for t in prompt)):
        return prompt
    return None


def tokenize_body(request: ClientRequest) -> dict[str, Any] | None:
    """The body of vLLM's /tokenize for this request, or None when it cannot be scored
    (non-text content, a batch, no prompt)."""
    body = request.body
    if request.route is Route.CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                _text_only(m) for m in messages):
            return None
        out: dict[str, Any] = {"model": request.model, "messages": messages}
        options = _CHAT_OPTIONS
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            return None
        out = {"model": request.model, "prompt": prompt}
        options = _COMPLETION_OPTIONS
    for name in options:
        if name in body:
            out[name] = body[name]
    return out


def _text_only(message: object) -> bool:
    if not isinstance(message, dict):
        return False
    content = message.get("content")
    if content is None or isinstance(content, str):
        return True
    return isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" for p in content)


def cache_salt_of(request: ClientRequest) -> str | None:
    salt = request.body.get("cache_salt")
    return salt if isinstance(salt, str) and salt else None


class PromptTokenizer:
    """A request's `PromptBlocks`, from its token ids or a server's `POST /tokenize`.

    The server asked is a healthy one of the request's model with the fewest requests in
    flight (`servers`); its answer is used as is (vLLM's own ids). A failed call leaves
    the request unscored (None), counted by `pdproxy_kv_fallbacks_total{reason=no_tokens}`."""

    def __init__(self, client: UpstreamClient, servers: Callable[[], Sequence[Endpoint]],
                 *, timeout: float, metrics: RouterMetrics,
                 lora_names: Callable[[], Collection[str]] = frozenset) -> None:
        self._client = client
        self._servers = servers
        self._timeout = timeout
        self._metrics = metrics
        self._lora_names = lora_names  # adapters the servers' events named
        self._failing = False  # warned once per failing streak

    async def blocks(self, request: ClientRequest) -> PromptBlocks | None:
        tokens = token_ids_of(request)
        if tokens is None:
            tokens = await self._tokenize(request)
        if tokens is None:
            return None
        lora = request.model if request.model in self._lora_names() else None
        return PromptBlocks(tokens, lora=lora, cache_salt=cache_salt_of(request))

    async def _tokenize(self, request: ClientRequest) -> list[int] | None:
        body = tokenize_body(request)
        servers = [e for e in self._servers() if e.healthy and e.serves(request.model)]
        if body is None or not servers:
            return None
        server = min(servers, key=lambda e: e.in_flight)
        started = time.perf_counter()
        try:
            answer = await self._client.post_json(
                f"{server.url}/tokenize", body, headers={}, endpoint=server.url,
                cluster=server.cluster.value, timeout=self._timeout)
        except (UpstreamError, Overloaded) as exc:
            if not self._failing:
                self._failing = True
                logger.warning("kv_aware: POST /tokenize to %s failed, requests are scored by "
                               "load until it works: %s", server.url, exc)
            return None
        self._metrics.kv_tokenize_seconds.observe(time.perf_counter() - started)
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            return None
        self._failing = False
        return tokens
