"""kv_aware balancing end to end: 2 P and 1 D of real vLLM CPU servers with our connector,
each publishing its KV cache events over ZMQ, and the router with `--prefill-policy
kv_aware --decode-policy kv_aware` and no event addresses in its config.

- discovery and sync: the router finds every server's publisher at its
  `GET /kv_event_sources` and has each one in sync (`pdproxy_kv_index_synced`) before
  any request, idle servers included;
- routing to where the KV is: once a long prompt's blocks are in the index of the P that
  served it, every request that shares that prefix (completions with other endings, in
  pull and push; chats with the same system prompt) goes to that P, the router predicts
  the shared tokens as hits (its access log's `prefill_hit`), and that P's own
  `vllm:prefix_cache_hits` grows by at least as many tokens;
- the answers' tokens equal those of one server computing the prompt from scratch;
- the token ids the router keys a request by (`tokenize_body` sent to vLLM's
  `/tokenize`) are the ids vLLM prefills for that request (`return_token_ids`): a
  completion, a chat with a system prompt and two turns, and a chat with `tools`.

The servers and the router start once for this module (`kv_pool_2p1d`), after the
session's pair is stopped (conftest orders these tests with the other pools').
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.pool.kv.tokens import tokenize_body
from proxy.protocol import Route, parse_request
from testbed.pd_protocol import metric, parse_metrics
from testbed.tiny_model import sample_text
from testbed.vllm_cpu import ServerStartError, VllmServer, free_port, run_servers, server_spec
from tests.conftest import until
from tests.e2e.conftest import (
    DUAL,
    DUAL_EXTRA_CONFIG,
    LOG_DIR,
    PAIR_START_TIMEOUT_S,
    PairManager,
    RouterProcess,
)
from tests.e2e.vllm_client import (
    CHAT,
    COMPLETIONS,
    MAX_TOKENS,
    TIMEOUT,
    common_prefix,
    reference_tokens,
)

pytestmark = pytest.mark.e2e

BLOCK_SIZE = 32  # vLLM's CPU attention wants multiples of 32 (its default there is 128)
PREFIX_BLOCKS = 8  # the shared prompt's full blocks
SYNC_TIMEOUT_S = 60.0  # discovery runs at the router's start; a replay takes at most 2 s
INDEX_TIMEOUT_S = 30.0  # a served prompt's blocks reach the index (one engine step + ZMQ)
LOG_TIMEOUT_S = 10.0  # the router writes a request's access line as it finishes
POLL_S = 0.2  # each look asks a server's /metrics or reads the router's log
SYNCED = "pdproxy_kv_index_synced"
INDEX_BLOCKS = "pdproxy_kv_index_blocks"
FALLBACKS = "pdproxy_kv_fallbacks_total"
EVENT_BATCHES = "pdproxy_kv_event_batches_total"
PREDICTED = "pdproxy_kv_predicted_hit_ratio_count"
PREFIX_HITS = "vllm:prefix_cache_hits_total"

PROMPT_RE = re.compile(r"prompt_tokens=(\d+)")
HIT_RE = re.compile(r"(prefill|decode)_hit=(\d+|\?)")


def kv_events_args() -> tuple[str, ...]:
    """A server's KV events on: its publisher bound on the loopback only.

    vLLM binds the PUB endpoint only when it looks like a wildcard (a `*` or `::` in it)
    and connects to it otherwise; `tcp://[::ffff:127.0.0.1]:port` (IPv4 loopback written
    as IPv6) is bound, and ZMQ binds it on 127.0.0.1 alone. The replay socket is always
    bound."""
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://[::ffff:127.0.0.1]:{free_port()}",
        "replay_endpoint": f"tcp://127.0.0.1:{free_port()}",
    }
    return ("--block-size", str(BLOCK_SIZE), "--max-num-seqs", "4",
            "--kv-events-config", json.dumps(config))


@dataclass(frozen=True)
class KvPool:
    prefills: list[VllmServer]
    decode: VllmServer
    router: RouterProcess

    @property
    def urls(self) -> list[str]:
        return [p.url for p in self.prefills] + [self.decode.url]


@pytest.fixture(scope="module")
def kv_pool_2p1d(pair_manager: PairManager, tiny_model: Path) -> Iterator[KvPool]:
    """Two P (core 0) and one D (core 1) with our connector and KV events, and the router
    balancing both clusters kv_aware; started once for the module."""
    pair_manager.close()  # at most one set of servers at a time
    specs = [
        server_spec("prefill", connector=DUAL, model_dir=tiny_model, log_dir=LOG_DIR,
                    name=f"kv-prefill{i}", kv_extra_config=DUAL_EXTRA_CONFIG,
                    extra_args=kv_events_args())
        for i in range(2)
    ] + [server_spec("decode", connector=DUAL, model_dir=tiny_model, log_dir=LOG_DIR,
                     name="kv-decode", kv_extra_config=DUAL_EXTRA_CONFIG,
                     extra_args=kv_events_args())]
    try:
        with run_servers(specs, start_timeout_s=PAIR_START_TIMEOUT_S) as servers:
            router = RouterProcess([s.url for s in servers[:2]], servers[2].url, "pull",
                                   ("--prefill-policy", "kv_aware",
                                    "--decode-policy", "kv_aware"))
            try:
                router.wait_healthy()
                yield KvPool(prefills=servers[:2], decode=servers[2], router=router)
            finally:
                router.stop()
    except ServerStartError as exc:
        pytest.fail(f"starting the kv_aware 2P1D pool failed: {exc}", pytrace=False)


# --- helpers ------------------------------------------------------------------------


async def samples_of(client: httpx.AsyncClient, url: str) -> dict[Any, float]:
    resp = await client.get(f"{url}/metrics")
    resp.raise_for_status()
    return parse_metrics(resp.text)


async def index_blocks(client: httpx.AsyncClient, pool: KvPool, url: str) -> float:
    """The blocks the router's KV index holds for the server at `url`."""
    return metric(await samples_of(client, pool.router.url), INDEX_BLOCKS, endpoint=url)


async def predictions(client: httpx.AsyncClient, pool: KvPool) -> dict[str, float]:
    """Per leg, the picks kv_aware made with a known hit count (`pdproxy_kv_predicted_hit_ratio`)."""
    samples = await samples_of(client, pool.router.url)
    return {leg: metric(samples, PREDICTED, cluster=leg) for leg in ("prefill", "decode")}


async def prefix_hits(client: httpx.AsyncClient, url: str) -> float:
    return metric(await samples_of(client, url), PREFIX_HITS)


async def tokenize(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> list[int]:
    resp = await client.post(f"{url}/tokenize", json=body)
    assert resp.status_code == 200, resp.text
    return [int(t) for t in resp.json()["tokens"]]


async def long_text(client: httpx.AsyncClient, url: str, seed: int, min_tokens: int) -> str:
    """Pseudo-English of at least `min_tokens` tokens (and well under the context)."""
    for lines in range(6, 40, 2):
        text = sample_text(seed, lines=lines)
        if len(await tokenize(client, url, {"model": "tiny", "prompt": text})) >= min_tokens:
            return text
    raise AssertionError(f"no text of {min_tokens} tokens from seed {seed}")


@dataclass(frozen=True)
class Served:
    """One request through the router: its answer and the router's access-log line."""

    answer: dict[str, Any]
    prefill: str  # the P's URL ("-": none)
    decode: str
    prompt_tokens: int  # the router's count of the prompt's token ids
    hits: dict[str, int | None]  # cluster -> tokens the index said the chosen server held

    @property
    def tokens(self) -> list[int]:
        return [int(t) for t in self.answer["choices"][0]["token_ids"]]


def access_line(router: RouterProcess, request_id: str) -> str | None:
    marker = f"request_id={request_id} "
    text = router.log_path.read_text(errors="replace")
    return next((line for line in text.splitlines() if marker in line), None)


async def through_router(client: httpx.AsyncClient, pool: KvPool, path: str,
                         body: dict[str, Any], mode: str = "pull") -> Served:
    request_id = f"kv-{uuid.uuid4().hex[:12]}"
    resp = await client.post(pool.router.url + path, json=body,
                             headers={"X-Request-Id": request_id, "X-KV-Transfer-Mode": mode})
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-kv-transfer-mode"] == mode, "the router fell back"

    async def logged() -> str | None:
        return access_line(pool.router, request_id)

    line = await until(logged, f"the router's access line for {request_id}", LOG_TIMEOUT_S,
                       poll=POLL_S)
    fields = dict(part.split("=", 1) for part in line.split() if "=" in part)
    prompt = PROMPT_RE.search(line)
    assert prompt is not None, f"kv_aware's prediction is not in the access line: {line}"
    return Served(
        answer=resp.json(), prefill=fields["prefill"], decode=fields["decode"],
        prompt_tokens=int(prompt.group(1)),
        hits={leg: None if hit == "?" else int(hit) for leg, hit in HIT_RE.findall(line)},
    )


def completion(prompt: str) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True}


def chat(messages: list[dict[str, str]], **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS,
            "temperature": 0, "return_token_ids": True, **extra}


def prompt_ids_of(path: str, answer: dict[str, Any]) -> list[int]:
    """The prompt's token ids vLLM reports for a request sent with return_token_ids."""
    ids = answer["prompt_token_ids"] if path == CHAT else answer["choices"][0]["prompt_token_ids"]
    assert ids, f"vLLM echoed no prompt_token_ids: {answer}"
    return [int(t) for t in ids]


async def holds_new_blocks(client: httpx.AsyncClient, pool: KvPool, url: str,
                           before: float, blocks: int) -> None:
    async def grown() -> bool:
        return await index_blocks(client, pool, url) >= before + blocks

    await until(grown, f"{blocks} more blocks of {url} in the router's KV index",
                INDEX_TIMEOUT_S, poll=POLL_S)


# --- tests --------------------------------------------------------------------------


async def test_the_router_finds_and_syncs_every_servers_kv_events(kv_pool_2p1d: KvPool) -> None:
    pool = kv_pool_2p1d
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        # vLLM lists its own publisher; the router was given none.
        for url in pool.urls:
            resp = await client.get(f"{url}/kv_event_sources")
            assert resp.status_code == 200, resp.text
            (source,) = resp.json().values()
            assert source["enable_kv_cache_events"] and source["endpoint"], source

        async def all_synced() -> dict[Any, float] | None:
            samples = await samples_of(client, pool.router.url)
            ok = all(metric(samples, SYNCED, endpoint=u) == 1 for u in pool.urls)
            return samples if ok else None

        samples = await until(all_synced, f"{SYNCED} = 1 for {pool.urls}", SYNC_TIMEOUT_S,
                              poll=POLL_S)
        for url in pool.urls:  # no request yet: every index is empty
            assert metric(samples, INDEX_BLOCKS, endpoint=url) == 0, url


async def test_requests_sharing_a_prefix_go_to_the_p_that_caches_it(kv_pool_2p1d: KvPool) -> None:
    pool = kv_pool_2p1d
    d_url = pool.decode.url
    p_urls = [p.url for p in pool.prefills]
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        # --- completions: A, then A + other endings -------------------------------
        prefix = await long_text(client, d_url, seed=101, min_tokens=PREFIX_BLOCKS * BLOCK_SIZE + 4)
        prefix_ids = await tokenize(client, d_url, {"model": "tiny", "prompt": prefix})
        predicted_before = await predictions(client, pool)
        before = {u: await index_blocks(client, pool, u) for u in pool.urls}
        first = await through_router(client, pool, COMPLETIONS, completion(prefix))
        holder = first.prefill
        assert holder in p_urls, first
        assert first.hits == {"prefill": 0, "decode": 0}, first.hits  # nobody holds it yet
        assert first.prompt_tokens == len(prefix_ids) == first.answer["usage"]["prompt_tokens"]
        assert first.tokens == await reference_tokens(client, d_url, COMPLETIONS,
                                                      completion(prefix))
        # Its blocks reach the index from both servers' events: P computed them, D got
        # them by KV transfer.
        for url in (holder, d_url):
            await holds_new_blocks(client, pool, url, before[url], len(prefix_ids) // BLOCK_SIZE)

        for i, mode in enumerate(("pull", "push", "pull")):
            text = f"{prefix} {sample_text(200 + i, lines=2)}"
            ids = await tokenize(client, d_url, {"model": "tiny", "prompt": text})
            shared = common_prefix(prefix_ids, ids) // BLOCK_SIZE * BLOCK_SIZE
            assert shared >= PREFIX_BLOCKS * BLOCK_SIZE, (len(prefix_ids), shared)
            hits_before = await prefix_hits(client, holder)
            served = await through_router(client, pool, COMPLETIONS, completion(text), mode)
            assert served.prefill == holder, f"request {i} ({mode}) went to {served.prefill}"
            assert served.decode == d_url
            for leg in ("prefill", "decode"):
                hit = served.hits.get(leg)
                assert hit is not None and hit >= shared, served.hits
            assert served.prompt_tokens == len(ids)

            async def hits_grown(before: float = hits_before, want: int = shared) -> bool:
                return await prefix_hits(client, holder) - before >= want

            await until(hits_grown, f"{holder}'s {PREFIX_HITS} up by {shared}",
                        INDEX_TIMEOUT_S, poll=POLL_S)
            assert served.tokens == await reference_tokens(client, d_url, COMPLETIONS,
                                                           completion(text)), mode

        # --- chats sharing a long system prompt ------------------------------------
        system = {"role": "system",
                  "content": await long_text(client, d_url, seed=303,
                                             min_tokens=PREFIX_BLOCKS * BLOCK_SIZE + 4)}
        opening = chat([system, {"role": "user", "content": sample_text(400, lines=1)}])
        opening_ids = await tokenize(client, d_url, tokenize_body_of(CHAT, opening))
        before = {u: await index_blocks(client, pool, u) for u in p_urls}
        first_chat = await through_router(client, pool, CHAT, opening)
        chat_holder = first_chat.prefill
        assert chat_holder in p_urls, first_chat
        assert first_chat.hits.get("prefill") == 0, first_chat.hits  # a new prefix
        await holds_new_blocks(client, pool, chat_holder, before[chat_holder],
                               len(opening_ids) // BLOCK_SIZE)
        turns = [
            [system, {"role": "user", "content": sample_text(401, lines=1)}],
            [system, {"role": "user", "content": sample_text(402, lines=1)},
             {"role": "assistant", "content": sample_text(403, lines=1)},
             {"role": "user", "content": sample_text(404, lines=1)}],
        ]
        for messages in turns:
            body = chat(messages)
            ids = await tokenize(client, d_url, tokenize_body_of(CHAT, body))
            shared = common_prefix(opening_ids, ids) // BLOCK_SIZE * BLOCK_SIZE
            assert shared >= PREFIX_BLOCKS * BLOCK_SIZE, (len(opening_ids), shared)
            hits_before = await prefix_hits(client, chat_holder)
            served = await through_router(client, pool, CHAT, body)
            assert served.prefill == chat_holder, f"a chat went to {served.prefill}"
            hit = served.hits.get("prefill")
            assert hit is not None and hit >= shared, served.hits

            async def chat_hits_grown(before: float = hits_before, want: int = shared) -> bool:
                return await prefix_hits(client, chat_holder) - before >= want

            await until(chat_hits_grown, f"{chat_holder}'s {PREFIX_HITS} up by {shared}",
                        INDEX_TIMEOUT_S, poll=POLL_S)
            assert served.tokens == await reference_tokens(client, d_url, CHAT, body)

        # --- an unrelated prompt: nobody holds it, and it is served right -----------
        fresh = await long_text(client, d_url, seed=505, min_tokens=PREFIX_BLOCKS * BLOCK_SIZE)
        served = await through_router(client, pool, COMPLETIONS, completion(fresh))
        assert served.prefill in p_urls
        assert served.hits.get("prefill") == 0, served.hits
        assert served.tokens == await reference_tokens(client, d_url, COMPLETIONS,
                                                       completion(fresh))

        # Every one of the 8 picks on each leg was scored by the index, none by load alone.
        samples = await samples_of(client, pool.router.url)
        assert metric(samples, FALLBACKS) == 0, "a pick fell back to load alone"
        assert await predictions(client, pool) == {
            leg: n + 8 for leg, n in predicted_before.items()}
        assert metric(samples, EVENT_BATCHES, endpoint=holder, outcome="applied") > 0


def tokenize_body_of(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """What the router sends to vLLM's /tokenize for `body`."""
    route = Route.CHAT if path == CHAT else Route.COMPLETIONS
    request = parse_request(route, json.dumps(body).encode(), {}, max_body_bytes=1 << 20)
    found = tokenize_body(request)
    assert found is not None, f"the router would not score {body}"
    return found


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    },
}


async def test_the_routers_token_ids_are_the_ones_vllm_prefills(kv_pool_2p1d: KvPool) -> None:
    pool = kv_pool_2p1d
    two_turns = [
        {"role": "system", "content": sample_text(600, lines=2)},
        {"role": "user", "content": sample_text(601, lines=1)},
        {"role": "assistant", "content": sample_text(602, lines=1)},
        {"role": "user", "content": sample_text(603, lines=1)},
    ]
    cases = {
        "completion": (COMPLETIONS, completion(sample_text(604, lines=3))),
        "chat, system prompt and two turns": (CHAT, chat(two_turns)),
        # The tiny model's template ignores tools; vLLM still takes them, on /tokenize too.
        "chat with tools": (CHAT, chat(two_turns[:2], tools=[WEATHER_TOOL], tool_choice="none")),
    }
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        for name, (path, body) in cases.items():
            ids = await tokenize(client, pool.prefills[0].url, tokenize_body_of(path, body))
            served = await through_router(client, pool, path, body)
            assert served.prompt_tokens == len(ids), name
            assert prompt_ids_of(path, served.answer) == ids, name
