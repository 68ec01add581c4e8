"""kv_aware balancing through the router, against fake vLLM servers whose prefix caches
publish vLLM's KV events over real ZMQ (`testbed.fake_kv_cache`): publishers found at
`/kv_event_sources`, prompts tokenized by `/tokenize`, requests sent where their prefix
is cached, gaps replayed, restarts wiped, garbage dropped, servers that left forgotten,
and load alone when no events are known."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

import httpx
import pytest

from proxy.flow.router import Router
from proxy.pool.endpoints import ClusterName
from proxy.pool.kv.blocks import PromptBlocks
from proxy.pool.kv.index import SourceState
from testbed.fake_kv_cache import FakePrefixCache, fake_tokenize
from testbed.fake_vllm import Fabric, FakeVLLM, start
from tests.conftest import serve_router, until

BODY = {"model": "fake-model", "max_tokens": 2}
BLOCK = 16


class Pools:
    def __init__(self, prefill: list[FakeVLLM], decode: list[FakeVLLM], p_urls: list[str],
                 d_urls: list[str]) -> None:
        self.prefill, self.decode, self.p_urls, self.d_urls = prefill, decode, p_urls, d_urls

    def config(self, **balance: Any) -> dict[str, Any]:
        return {"prefill": self.p_urls, "decode": self.d_urls, "mode": "pull",
                "balance": {"prefill": "kv_aware", "decode": "kv_aware",
                            "kv_aware": {"discovery_interval": 0.2}, **balance}}

    def cache(self, fake: FakeVLLM) -> FakePrefixCache:
        assert fake.kv_cache is not None
        return fake.kv_cache


@pytest.fixture
async def pools() -> AsyncIterator[Pools]:
    fabric = Fabric()
    async with AsyncExitStack() as stack:
        fakes: list[FakeVLLM] = []
        urls = []
        for i, role in enumerate(["prefill", "prefill", "decode", "decode"]):
            cache = FakePrefixCache(num_blocks=64, block_size=BLOCK)
            cache.start()
            stack.push_async_callback(cache.aclose)
            fake = FakeVLLM(role, engine_id=f"engine-{i}", fabric=fabric, kv_cache=cache)
            runner, url = await start(fake)
            stack.push_async_callback(runner.cleanup)
            fakes.append(fake)
            urls.append(url)
        yield Pools(fakes[:2], fakes[2:], urls[:2], urls[2:])


def router_of(app: Any) -> Router:
    router: Router = app.state.router
    return router


async def synced(router: Router, urls: list[str]) -> None:
    assert router.kv_index is not None
    index = router.kv_index
    await until(lambda: all(s.state is SourceState.SYNCED for u in urls for s in index.sources(u))
                and all(index.sources(u) for u in urls), f"KV events of {urls} in sync")


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


async def complete(client: httpx.AsyncClient, url: str, **body: Any) -> httpx.Response:
    r = await client.post(f"{url}/v1/completions", json={**BODY, **body})
    assert r.status_code == 200, r.text
    return r


def served_by(fakes: list[FakeVLLM]) -> list[int]:
    """Requests each server served (a push probe of P's coordinates is not one)."""
    return [sum(1 for s in f.seen if not (s.body.get("kv_transfer_params") or {}).get("probe"))
            for f in fakes]


async def test_prompts_go_to_the_servers_that_cache_their_prefix(pools: Pools) -> None:
    document = words("doc", 8 * BLOCK)
    async with serve_router(**pools.config(), admin_token="t") as (url, app), httpx.AsyncClient(timeout=10) as client:
        router = router_of(app)
        await synced(router, pools.p_urls + pools.d_urls)
        # The document was read on P1 (and D1) before, by another router: only its events tell.
        pools.cache(pools.prefill[1]).serve(fake_tokenize(document))
        pools.cache(pools.decode[1]).serve(fake_tokenize(document))
        assert router.kv_index is not None
        index = router.kv_index
        await until(lambda: len(index.sources(pools.p_urls[1])[0]) == 8
                    and len(index.sources(pools.d_urls[1])[0]) == 8, "P1's and D1's blocks indexed")
        for i in range(6):
            await complete(client, url, prompt=f"{document} question {i}")
        assert served_by(pools.prefill) == [0, 6]
        assert served_by(pools.decode) == [0, 6]
        hits = [s.cached_tokens for s in pools.prefill[1].seen]
        assert hits == [8 * BLOCK] * 6  # each found the whole document in P1's cache
        text = (await client.get(f"{url}/metrics")).text
        assert 'pdproxy_kv_predicted_hit_ratio_count{cluster="prefill"} 6.0' in text
        # what P itself says it hit (its usage's cached_tokens) agrees with the prediction
        assert 'pdproxy_kv_actual_hit_ratio_count{cluster="prefill"} 6.0' in text
        assert 'pdproxy_kv_actual_hit_ratio_bucket{cluster="prefill",le="0.75"} 0.0' in text
        assert f'pdproxy_kv_index_blocks{{endpoint="{pools.p_urls[1]}",rank="0"}}' in text
        admin = (await client.get(f"{url}/admin/kv", headers={"Authorization": "Bearer t"})).json()
        p1 = next(s for s in admin["sources"] if s["url"] == pools.p_urls[1])
        assert p1["state"] == "synced" and p1["block_size"] == BLOCK
        assert p1["blocks"] >= 8 and p1["events"]["stored"] >= 8


async def test_a_burst_of_one_new_prefix_stays_on_one_server(pools: Pools) -> None:
    """No events can arrive between requests sent back to back: the credit given at
    routing time keeps the burst together."""
    shared = words("sys", 4 * BLOCK)
    config = pools.config(kv_aware={"discovery_interval": 0.2, "tokens_per_request": 16})
    async with serve_router(**config) as (url, app), httpx.AsyncClient(timeout=10) as client:
        await synced(router_of(app), pools.p_urls)
        for i in range(8):
            await complete(client, url, prompt=f"{shared} user {i}")
    assert sorted(served_by(pools.prefill)) == [0, 8]


async def test_token_id_prompts_need_no_tokenize_and_a_chat_is_tokenized(pools: Pools) -> None:
    ids = list(range(1, 6 * BLOCK + 1))
    async with serve_router(**pools.config()) as (url, app), httpx.AsyncClient(timeout=10) as client:
        router = router_of(app)
        await synced(router, pools.p_urls)
        pools.cache(pools.prefill[0]).serve(ids)
        assert router.kv_index is not None
        index = router.kv_index
        await until(lambda: len(index.sources(pools.p_urls[0])[0]) == 6, "P0's blocks indexed")
        await complete(client, url, prompt=ids + [7, 7, 7])
        assert served_by(pools.prefill) == [1, 0]
        messages = [{"role": "system", "content": words("policy", 3 * BLOCK)},
                    {"role": "user", "content": "hello"}]
        r = await client.post(f"{url}/v1/chat/completions", json={**BODY, "messages": messages})
        assert r.status_code == 200, r.text
        chosen = 0 if len(pools.prefill[0].seen) == 2 else 1
        # the chat's system prompt is now cached where it went: the next turn follows it
        await until(lambda: len(index.sources(pools.p_urls[chosen])[0]) >= 6 + 3 * (chosen == 0)
                    or len(index.sources(pools.p_urls[chosen])[0]) >= 3, "the chat's blocks indexed")
        messages += [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "more"}]
        r = await client.post(f"{url}/v1/chat/completions", json={**BODY, "messages": messages})
        assert r.status_code == 200, r.text
        assert pools.prefill[chosen].seen[-1].body["messages"] == messages


async def test_a_prompt_sent_again_is_not_tokenized_again(pools: Pools) -> None:
    """The cache of prompts seen lately: the same text (model, options, salt) is tokenized
    once; another option, salt or text is tokenized anew; the cache keeps to its bound."""
    document = words("doc", 4 * BLOCK)
    config = pools.config(kv_aware={"discovery_interval": 0.2,
                                    "tokenize_cache_tokens": 3 * 4 * BLOCK})
    async with serve_router(**config) as (url, app), httpx.AsyncClient(timeout=10) as client:
        router = router_of(app)
        await synced(router, pools.p_urls + pools.d_urls)

        def calls() -> int:
            return sum(f.tokenized for f in pools.prefill + pools.decode)

        for _ in range(3):
            await complete(client, url, prompt=document)
        assert calls() == 1
        await complete(client, url, prompt=document, add_special_tokens=False)
        await complete(client, url, prompt=document, cache_salt="tenant-b")
        assert calls() == 3
        # ids need no call, and the keys of ids sent again are not hashed again
        ids = list(range(1, 4 * BLOCK + 1))
        await complete(client, url, prompt=ids)
        await complete(client, url, prompt=ids)
        assert calls() == 3
        assert router.tokenizer is not None
        cache = router.tokenizer.cache
        assert cache.tokens <= 3 * 4 * BLOCK and len(cache) == 3  # the oldest text went out
        await complete(client, url, prompt=document)
        assert calls() == 4
        text = (await client.get(f"{url}/metrics")).text
        assert 'pdproxy_kv_tokenize_cache_total{result="hit"} 3.0' in text
        assert 'pdproxy_kv_tokenize_cache_total{result="miss"} 5.0' in text


async def test_a_gap_is_replayed_and_a_restart_wipes_the_server(pools: Pools) -> None:
    async with serve_router(**pools.config()) as (url, app):
        router = router_of(app)
        await synced(router, pools.p_urls)
        assert router.kv_index is not None
        source = router.kv_index.sources(pools.p_urls[0])[0]
        cache = pools.cache(pools.prefill[0])
        tokens = list(range(1, 4 * BLOCK + 1))
        hashes = cache.hashes(tokens)
        cache.publish([cache.stored_event(hashes[:1], None, tokens[:BLOCK])])
        await until(lambda: len(source) == 1, "the first batch applied")
        # Two batches lost on the live socket (still in the replay buffer), then one arrives.
        cache.publish([cache.stored_event(hashes[1:2], hashes[0], tokens[BLOCK:2 * BLOCK])],
                      send=False)
        cache.publish([cache.stored_event(hashes[2:3], hashes[1], tokens[2 * BLOCK:3 * BLOCK])],
                      send=False)
        cache.publish([cache.stored_event(hashes[3:], hashes[2], tokens[3 * BLOCK:])])
        await until(lambda: len(source) == 4, "the gap replayed and the batch applied")
        assert source.counts.gaps == 1 and cache.replay_requests >= 1
        assert source.state is SourceState.SYNCED
        # The server restarts: numbering from 0, an empty cache.
        cache.restart()
        cache.publish([cache.stored_event(hashes[:1], None, tokens[:BLOCK])])
        await until(lambda: source.counts.wipes.get("restarted") == 1, "the restart seen")
        assert len(source) == 1
        # AllBlocksCleared empties it.
        cache.clear()
        await until(lambda: len(source) == 0, "the clear applied")


async def test_garbage_is_dropped_and_counted_and_events_go_on(pools: Pools) -> None:
    async with serve_router(**pools.config()) as (url, app), httpx.AsyncClient(timeout=10) as client:
        router = router_of(app)
        await synced(router, pools.p_urls)
        cache = pools.cache(pools.prefill[0])
        for frames in ([b"only one frame"], [b"", b"short", b"x"], [b"", (99).to_bytes(8, "big"),
                                                                      b"\xc1 not msgpack"]):
            cache.send_raw(frames)
        cache.serve(list(range(1, BLOCK + 1)))
        assert router.kv_index is not None
        source = router.kv_index.sources(pools.p_urls[0])[0]
        await until(lambda: len(source) == 1, "a good batch after the garbage applied")
        text = (await client.get(f"{url}/metrics")).text
        assert f'pdproxy_kv_events_dropped_total{{endpoint="{pools.p_urls[0]}",reason="frames"}} 2.0' in text
        assert f'pdproxy_kv_events_dropped_total{{endpoint="{pools.p_urls[0]}",reason="malformed"}} 1.0' in text


async def test_without_events_the_policy_picks_by_load_and_says_so(pools: Pools) -> None:
    for fake in pools.prefill + pools.decode:
        fake.kv_cache = None  # /kv_event_sources lists none: events off
    async with serve_router(**pools.config()) as (url, app), httpx.AsyncClient(timeout=10) as client:
        for i in range(6):
            await complete(client, url, prompt=words(f"q{i}", 40))
        text = (await client.get(f"{url}/metrics")).text
    assert served_by(pools.prefill) == [3, 3]  # by load: equals taken in turn
    assert 'pdproxy_kv_fallbacks_total{cluster="prefill",reason="no_publisher"}' in text
    assert 'pdproxy_kv_fallbacks_total{cluster="prefill",reason="not_synced"} 6.0' in text


async def test_a_server_that_leaves_takes_its_index_with_it(pools: Pools) -> None:
    async with serve_router(**pools.config()) as (url, app):
        router = router_of(app)
        await synced(router, pools.p_urls)
        pools.cache(pools.prefill[1]).serve(list(range(1, BLOCK + 1)))
        assert router.kv_index is not None
        index = router.kv_index
        await until(lambda: len(index.sources(pools.p_urls[1])[0]) == 1, "P1's block indexed")
        router.membership.remove(ClusterName.PREFILL, pools.p_urls[1])
        await until(lambda: not index.sources(pools.p_urls[1]), "P1's index dropped")


async def test_auto_goes_local_when_decode_already_holds_the_prompt(pools: Pools) -> None:
    """Conditional disaggregation by cache: D holds all but a few tokens of the prompt,
    so D computes the rest itself and no P is asked; a prompt D lacks goes through P."""
    config = pools.config()
    config.update(mode="auto", auto={"local": True, "local_cached_tokens": 2 * BLOCK})
    document = words("doc", 6 * BLOCK)
    async with serve_router(**config) as (url, app), httpx.AsyncClient(timeout=10) as client:
        router = router_of(app)
        await synced(router, pools.p_urls + pools.d_urls)
        pools.cache(pools.decode[0]).serve(fake_tokenize(document))
        assert router.kv_index is not None
        index = router.kv_index
        await until(lambda: len(index.sources(pools.d_urls[0])[0]) == 6, "D0's blocks indexed")
        r = await complete(client, url, prompt=f"{document} and a short question")
        assert r.headers["x-kv-transfer-mode"] == "local"
        assert served_by(pools.prefill) == [0, 0]
        assert served_by(pools.decode) == [1, 0]
        assert "kv_transfer_params" not in pools.decode[0].seen[0].body
        r = await complete(client, url, prompt=words("fresh", 6 * BLOCK))
        assert r.headers["x-kv-transfer-mode"] != "local"
        assert sum(served_by(pools.prefill)) == 1
        text = (await client.get(f"{url}/metrics")).text
    assert 'pdproxy_auto_mode_decisions_total{mode="local",reason="auto_local_cached"} 1.0' in text


async def test_a_publisher_whose_replay_does_not_answer_stays_unknown_until_it_is_heard(
        pools: Pools) -> None:
    """Blocks it cached before the router came are unknown, so it is not taken as empty
    until a live batch arrives; then what cannot be replayed is given up, and it counts
    what it hears from there."""
    cache = pools.cache(pools.prefill[0])
    cache.answer_replays = False
    config = pools.config(kv_aware={"discovery_interval": 0.2, "replay_timeout": 0.2})
    async with serve_router(**config) as (url, app):
        router = router_of(app)
        await synced(router, pools.p_urls[1:])
        assert router.kv_index is not None
        index = router.kv_index
        await until(lambda: cache.replay_requests >= 1, "the catch-up asked")
        source = index.sources(pools.p_urls[0])[0]
        await until(lambda: source.state is SourceState.UNKNOWN and source.last_seq is None
                    and index.hit_tokens(pools.p_urls[0], PromptBlocks(list(range(BLOCK))), now=0,
                                         fallback_block_size=BLOCK) is None, "P0 still unknown")
        cache.seq = 5  # it published 0-4 before the router came
        cache.serve(list(range(1, BLOCK + 1)))
        await until(lambda: source.state is SourceState.SYNCED and len(source) == 1,
                    "P0 in sync from its first live batch")
        assert source.counts.wipes == {"joined_late": 1} and cache.replay_requests >= 2


async def test_an_oversized_message_is_dropped_and_later_events_still_apply(pools: Pools) -> None:
    config = pools.config(kv_aware={"discovery_interval": 0.2, "max_event_bytes": 4096})
    async with serve_router(**config) as (url, app):
        router = router_of(app)
        await synced(router, pools.p_urls)
        assert router.kv_index is not None
        source = router.kv_index.sources(pools.p_urls[0])[0]
        cache = pools.cache(pools.prefill[0])
        cache.send_raw([b"", (0).to_bytes(8, "big"), b"\x00" * 100_000])  # over the cap
        cache.serve(list(range(1, 2 * BLOCK + 1)))
        # ZMQ drops the oversized message (and the connection, which it makes again); the
        # batch sent meanwhile comes back by the gap's replay if the live copy was lost
        cache.serve(list(range(1000, 1000 + BLOCK)))
        await until(lambda: len(source) == 3, "the batches after the oversized one applied",
                    timeout=10)


async def test_a_flood_of_garbage_does_not_starve_requests(pools: Pools) -> None:
    async with serve_router(**pools.config()) as (url, app), httpx.AsyncClient(timeout=10) as client:
        router = router_of(app)
        await synced(router, pools.p_urls)
        cache = pools.cache(pools.prefill[0])
        for _ in range(20_000):  # as fast as this process can send
            cache.send_raw([b"", (7).to_bytes(8, "big"), b"\xc1"])
        await complete(client, url, prompt=words("during", 3 * BLOCK))  # served meanwhile
        text = (await client.get(f"{url}/metrics")).text
        assert f'pdproxy_kv_events_dropped_total{{endpoint="{pools.p_urls[0]}",reason="malformed"}}' \
            in text
        cache.serve(list(range(1, BLOCK + 1)))
        assert router.kv_index is not None
        source = router.kv_index.sources(pools.p_urls[0])[0]
        await until(lambda: len(source) >= 1, "events after the flood applied", timeout=20)


async def test_a_servers_index_is_bounded_by_its_kv_cache_blocks(pools: Pools) -> None:
    """Its /metrics say how many blocks it has (vllm:cache_config_info): more blocks in
    its events than that is a lie, and wipes only its own entries."""
    async with serve_router(**pools.config()) as (url, app):
        router = router_of(app)
        await synced(router, pools.p_urls)
        assert router.kv_index is not None
        liar = router.kv_index.sources(pools.p_urls[0])[0]
        honest = router.kv_index.sources(pools.p_urls[1])[0]
        await until(lambda: liar.max_blocks == 64 and honest.max_blocks == 64,
                    "the bound learned from /metrics")
        pools.cache(pools.prefill[1]).serve(list(range(1, 4 * BLOCK + 1)))
        cache = pools.cache(pools.prefill[0])
        tokens = list(range(1, 65 * BLOCK + 1))
        cache.publish([cache.stored_event(cache.hashes(tokens), None, tokens)])  # 65 > 64
        await until(lambda: liar.counts.wipes.get("over_capacity") == 1, "the liar wiped")
        assert len(liar) == 0
        await until(lambda: len(honest) == 4, "the other server's index untouched")
