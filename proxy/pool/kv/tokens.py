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

A prompt sent again (the same text or ids, model, template options, adapter and cache
salt) takes its ids and keys from `TokenizedPrompts`, a cache bounded in tokens
(`balance.kv_aware.tokenize_cache_tokens`): neither the /tokenize call nor the hashing is
repeated. On a 2-core machine, with 1k-token prompts, the call and the hashing were most
of kv_aware's cost per request (`scripts.bench --kv-aware`). A server's tokenizer is
taken as fixed for a model name: a model replaced under the same name (a new tokenizer)
may have its prompts scored by old ids until they leave the cache, which misroutes
them by cache, never changes an answer.

Not scored (None): prompts with images or other non-text parts (their multimodal block
keys are not computable here), batched completions, and any request whose tokenize call
fails (the policy then falls back to load; counted by the caller).
"""

from __future__ import annotations

import logging
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from proxy.errors import Overloaded, UpstreamError
from proxy.metrics import RouterMetrics
from proxy.pool.kv.answers import TokenizeAnswer
from proxy.pool.kv.blocks import HeldBy, Key, PromptBlocks
from proxy.protocol import ClientRequest, Route
from proxy.upstream.client import UpstreamClient

if TYPE_CHECKING:
    from proxy.pool.endpoints import Endpoint

logger = logging.getLogger("pdproxy.kv")

# The request's fields that change what vLLM tokenizes, passed on to /tokenize as they are.
_CHAT_OPTIONS: tuple[str, ...] = ("add_generation_prompt", "continue_final_message", "add_special_tokens",
                 "chat_template", "chat_template_kwargs", "tools")
_COMPLETION_OPTIONS: tuple[str, ...] = ("add_special_tokens",)
_HIT, _MISS = ("hit",), ("miss",)  # pdproxy_kv_tokenize_cache_total's label sets


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


class _Tokenized:
    """A cached prompt: its ids (packed: 8 bytes a token), its keys per block size and
    the index sources that held all of them (`PromptBlocks.held_by`)."""

    __slots__ = ("tokens", "keys_by_size", "held_by")

    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens = array("q", tokens)
        self.keys_by_size: dict[int, list[Key]] = {}
        self.held_by: HeldBy = {}


class TokenizedPrompts:
    """The prompts seen lately, least recently used first out, holding at most
    `max_tokens` tokens in all (0: no cache)."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.tokens = 0
        self._entries: OrderedDict[int, _Tokenized] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: int) -> _Tokenized | None:
        found = self._entries.get(key)
        if found is not None:
            self._entries.move_to_end(key)
        return found

    def put(self, key: int, tokens: Sequence[int]) -> _Tokenized:
        entry = _Tokenized(tokens)
        if len(tokens) > self.max_tokens:
            return entry  # larger than the whole cache: used once, not kept
        old = self._entries.pop(key, None)
        if old is not None:
            self.tokens -= len(old.tokens)
        self._entries[key] = entry
        self.tokens += len(tokens)
        while self.tokens > self.max_tokens:
            _, evicted = self._entries.popitem(last=False)
            self.tokens -= len(evicted.tokens)
        return entry


_encode_key = msgspec.msgpack.Encoder().encode


def _cache_key(*parts: Any) -> int:
    """What decides a prompt's ids and keys, hashed: 64 bits of the process's keyed
    SipHash over their msgpack encoding (as block keys are: a client cannot aim at a
    collision, and a chance one among the cache's prompts is about 1 in 10^13 a lookup;
    it would misroute a request by cache, never change an answer). JSON and blake2b
    took 11.8 us for a 1k-token text prompt and 14.3 us for 1k ids, this 1.5 and 4.6
    (measured on a 2-core machine); it was 5% of kv_aware's CPU per request (the
    profile scenario)."""
    try:
        return hash(_encode_key(parts))
    except OverflowError:  # an integer past msgpack's 64 bits (JSON allows it)
        return hash(b"json:" + msgspec.json.encode(parts))


class PromptTokenizer:
    """A request's `PromptBlocks`, from its token ids or a server's `POST /tokenize`,
    through the cache of prompts seen lately.

    The server asked is a healthy one of the request's model with the fewest requests in
    flight (`servers`); its answer is used as is (vLLM's own ids). A failed call leaves
    the request unscored (None), counted by `pdproxy_kv_fallbacks_total{reason=no_tokens}`."""

    def __init__(self, client: UpstreamClient, servers: Callable[[], Sequence[Endpoint]],
                 *, timeout: float, metrics: RouterMetrics,
                 lora_names: Callable[[], Collection[str]] = frozenset,
                 cache_tokens: int = 0) -> None:
        self._client = client
        self._servers = servers
        self._timeout = timeout
        self._metrics = metrics
        self._lora_names = lora_names  # adapters the servers' events named
        self._failing = False  # warned once per failing streak
        self.cache = TokenizedPrompts(cache_tokens)
        self._cache_results = metrics.kv_tokenize_cache
        for result in (_HIT, _MISS):  # both exposed at 0 from the start
            metrics.kv_tokenize_cache.labels(*result)

    async def blocks(self, request: ClientRequest) -> PromptBlocks | None:
        lora = request.model if request.model in self._lora_names() else None
        salt = cache_salt_of(request)
        tokens = request.token_ids  # a completion's prompt given as ids (parse_request checked them)
        body = None if tokens is not None else tokenize_body(request)
        if tokens is None and body is None:
            return None
        key = None
        if self.cache.max_tokens:
            key = _cache_key(tokens if tokens is not None else body, lora, salt)
            entry = self.cache.get(key)
            if entry is not None:
                self._cache_results.inc(_HIT)
                return PromptBlocks(entry.tokens, lora=lora, cache_salt=salt,
                                    keys_by_size=entry.keys_by_size, held_by=entry.held_by)
            self._cache_results.inc(_MISS)
        if tokens is None:
            assert body is not None
            tokens = await self._tokenize(request, body)
            if tokens is None:
                return None
        if key is None:
            return PromptBlocks(tokens, lora=lora, cache_salt=salt)
        entry = self.cache.put(key, tokens)
        return PromptBlocks(entry.tokens, lora=lora, cache_salt=salt,
                            keys_by_size=entry.keys_by_size, held_by=entry.held_by)

    async def _tokenize(self, request: ClientRequest, body: dict[str, Any]) -> list[int] | None:
        servers = [e for e in self._servers() if e.healthy and e.serves(request.model)]
        if not servers:
            return None
        server = min(servers, key=lambda e: e.in_flight)
        started = time.perf_counter()
        try:
            answer = await self._client.post_json(
                f"{server.url}/tokenize", body, headers={}, endpoint=server.url,
                cluster=server.cluster.value, timeout=self._timeout, type=TokenizeAnswer)
        except (UpstreamError, Overloaded) as exc:
            if not self._failing:
                self._failing = True
                logger.warning("kv_aware: POST /tokenize to %s failed, requests are scored by "
                               "load until it works: %s", server.url, exc)
            return None
        self._metrics.kv_tokenize_seconds.observe(time.perf_counter() - started)
        self._failing = False
        checked: TokenizeAnswer = answer
        return checked.tokens
