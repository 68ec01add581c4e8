"""A data-parallel P (several engines behind one URL) under push, on fakes: the router
probes every rank, pins each push's P leg to a rank with `X-data-parallel-rank` and gives
D that rank's coordinates; pull goes unpinned."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from proxy.pool.endpoints import DataParallelRanks
from testbed.fake_vllm import FakeVLLM, Seen, start
from tests.conftest import serve_router, until
from tests.integration.conftest import Pair, fake_pair

COMPLETION = {"model": "fake-model", "prompt": "hello there", "max_tokens": 3}
TOKEN = "dp-admin"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
RANK_HEADER = "x-data-parallel-rank"


@pytest.fixture
async def dp_pair() -> AsyncIterator[Pair]:
    """A fake P with 2 data-parallel ranks (push ports 5700, 5701) and a fake D, sharing a
    fabric: D fails a push whose coordinates name another engine than the one that ran it."""
    async with fake_pair(dp_size=2, push_port=5700) as made:
        yield made


def probes(fake: FakeVLLM) -> list[Seen]:
    return [s for s in fake.seen if s.body["kv_transfer_params"].get("probe")]


def legs(fake: FakeVLLM) -> list[Seen]:
    return [s for s in fake.seen if not s.body.get("kv_transfer_params", {}).get("probe")]


def check_pushes_pinned(pair: Pair) -> Counter[int]:
    """Every push's P leg was pinned to the rank that ran it, and D was given that rank's
    coordinates; returns the pushes per rank."""
    by_transfer = {s.body["kv_transfer_params"]["transfer_id"]: s for s in legs(pair.prefill)}
    per_rank: Counter[int] = Counter()
    for d_seen in pair.decode.seen:
        params = d_seen.body["kv_transfer_params"]
        p_seen = by_transfer[params["transfer_id"]]
        rank = p_seen.rank
        assert rank is not None and p_seen.headers[RANK_HEADER] == str(rank)
        assert params["remote_engine_id"] == pair.prefill.rank_engine_ids[rank]
        assert params["remote_port"] == 5601 + rank
        assert params["push_port"] == 5700 + rank
        assert RANK_HEADER not in d_seen.headers, "only P's leg is pinned"
        per_rank[rank] += 1
    return per_rank


async def push_all(client: httpx.AsyncClient, n: int, **extra: Any) -> None:
    for _ in range(n):
        r = await client.post("/v1/completions", json={**COMPLETION, **extra})
        assert r.status_code == 200, r.text
        assert r.headers["x-kv-transfer-mode"] == "push"


async def test_every_rank_probed_and_pushes_pinned(dp_pair: Pair) -> None:
    async with serve_router(prefill=[dp_pair.p_url], decode=[dp_pair.d_url], mode="push",
                            admin_token=TOKEN) as (url, _):
        async with httpx.AsyncClient(base_url=url) as client:
            await push_all(client, 4)
            await push_all(client, 2, stream=True)
            listing = (await client.get("/admin/endpoints", headers=AUTH)).json()
            metrics = (await client.get("/metrics")).text
    assert sorted(s.headers[RANK_HEADER] for s in probes(dp_pair.prefill)) == ["0", "1"]
    # One at a time, nothing in flight: the ranks take turns.
    assert check_pushes_pinned(dp_pair) == {0: 3, 1: 3}
    (p_state,) = [e for e in listing["endpoints"] if e["cluster"] == "prefill"]
    dp = p_state["data_parallel"]
    assert dp["size"] == 2 and dp["missing"] == []
    assert [(r["rank"], r["engine_id"], r["side_channel"], r["push_port"]) for r in dp["ranks"]] == [
        (0, "engine-p0_dp0", "127.0.0.1:5601", 5700), (1, "engine-p0_dp1", "127.0.0.1:5602", 5701)]
    for rank in (0, 1):
        assert (f'pdproxy_prefill_rank_pushes_in_flight{{endpoint="{dp_pair.p_url}",'
                f'engine_id="engine-p0_dp{rank}",rank="{rank}"}} 0.0') in metrics


async def test_concurrent_pushes_spread_over_ranks(dp_pair: Pair) -> None:
    dp_pair.prefill.behavior.delay = 0.3  # the pushes overlap on P
    async with serve_router(prefill=[dp_pair.p_url], decode=[dp_pair.d_url], mode="push") as (url, app):
        async with httpx.AsyncClient(base_url=url) as client:
            await push_all(client, 1)  # probes done
            answers = await asyncio.gather(*(client.post("/v1/completions", json=COMPLETION)
                                             for _ in range(4)))
        ranks = app.state.router.prefill.endpoints[0].learned_ranks
        assert ranks is not None and all(n == 0 for _r, _c, n in ranks.rows())
    assert [r.status_code for r in answers] == [200] * 4
    counts = check_pushes_pinned(dp_pair)
    assert sum(counts.values()) == 5 and abs(counts[0] - counts[1]) == 1, counts


async def test_size_not_told_is_found_by_the_rank_p_refuses(pair: Pair) -> None:
    fabric = pair.decode.fabric
    p = FakeVLLM("prefill", engine_id="dense", side_channel_port=5601, fabric=fabric,
                 dp_size=3, push_port=5700)
    p.behavior.tell_dp_size = False  # a dense model's engines do not know the size
    runner, p_url = await start(p)
    try:
        async with serve_router(prefill=[p_url], decode=[pair.d_url], mode="push") as (url, app):
            async with httpx.AsyncClient(base_url=url) as client:
                await push_all(client, 6)
            ranks = app.state.router.prefill.endpoints[0].learned_ranks
            assert ranks is not None and ranks.size == 3 and ranks.missing() == []
    finally:
        await runner.cleanup()
    # Ranks 0, 1, 2 answered; 3 was refused as vLLM refuses it (400), and ended the search.
    assert [(s.headers[RANK_HEADER], s.outcome) for s in probes(p)] == [
        ("0", "ok"), ("1", "ok"), ("2", "ok"), ("3", "failed")]
    pair.prefill = p
    assert check_pushes_pinned(pair) == {0: 2, 1: 2, 2: 2}


async def test_rank_restart_is_noticed_from_its_answers(dp_pair: Pair) -> None:
    async with serve_router(prefill=[dp_pair.p_url], decode=[dp_pair.d_url], mode="push") as (url, app):
        async with httpx.AsyncClient(base_url=url) as client:
            await push_all(client, 2)
            new_id = dp_pair.prefill.restart_rank(1)
            # Pulls run on the ranks in turn (not pinned); rank 1's answer tells its new id.
            for _ in range(2):
                r = await client.post("/v1/completions", json=COMPLETION,
                                      headers={"X-KV-Transfer-Mode": "pull"})
                assert r.status_code == 200
            ranks = app.state.router.prefill.endpoints[0].learned_ranks
            assert ranks is not None
            rank1 = ranks.get(1)
            assert rank1 is not None and rank1.engine_id == new_id
            before = len(dp_pair.decode.seen)
            await push_all(client, 4)
    assert len(probes(dp_pair.prefill)) == 2, "no probe again: the answers told"
    pushed = [s.body["kv_transfer_params"]["remote_engine_id"] for s in dp_pair.decode.seen[before:]]
    assert sorted(pushed) == sorted(["engine-p0_dp0", new_id] * 2)


async def test_pull_is_not_pinned(dp_pair: Pair) -> None:
    async with serve_router(prefill=[dp_pair.p_url], decode=[dp_pair.d_url], mode="pull") as (url, _):
        async with httpx.AsyncClient(base_url=url) as client:
            for _ in range(4):
                r = await client.post("/v1/completions", json=COMPLETION)
                assert r.status_code == 200 and r.headers["x-kv-transfer-mode"] == "pull"
    assert not probes(dp_pair.prefill), "pull needs no probe"
    assert all(RANK_HEADER not in s.headers for s in dp_pair.prefill.seen)
    # D got the coordinates of the rank that ran each prefill (P's own answer).
    ran = [dp_pair.prefill.rank_engine_ids[s.rank or 0] for s in dp_pair.prefill.seen]
    told = [s.body["kv_transfer_params"]["remote_engine_id"] for s in dp_pair.decode.seen]
    assert told == ran and set(ran) == {"engine-p0_dp0", "engine-p0_dp1"}


async def test_unknown_rank_is_skipped_then_probed_again(dp_pair: Pair) -> None:
    dp_pair.prefill.behavior.down_ranks = [1]  # rank 1's probe fails
    async with serve_router(prefill=[dp_pair.p_url], decode=[dp_pair.d_url], mode="push",
                            probe_retry_interval=0.2) as (url, app):
        def ranks_of() -> DataParallelRanks:
            ranks = app.state.router.prefill.endpoints[0].learned_ranks
            assert isinstance(ranks, DataParallelRanks)
            return ranks

        async with httpx.AsyncClient(base_url=url) as client:
            await push_all(client, 3)
            assert ranks_of().missing() == [1]
            assert check_pushes_pinned(dp_pair) == {0: 3}, "only the known rank is used"
            dp_pair.prefill.behavior.down_ranks = []

            async def rank_1_learned() -> bool:
                await push_all(client, 1)  # a push asks for the missing ranks again
                return ranks_of().missing() == []

            await until(rank_1_learned, "rank 1 probed again after probe_retry_interval")
            await push_all(client, 2)
    assert check_pushes_pinned(dp_pair)[1] >= 1


async def test_rank_refused_after_p_shrank_relearns_and_pulls(dp_pair: Pair) -> None:
    async with serve_router(prefill=[dp_pair.p_url], decode=[dp_pair.d_url], mode="push") as (url, app):
        async with httpx.AsyncClient(base_url=url) as client:
            await push_all(client, 1)
            dp_pair.prefill.dp_size = 1  # P restarted with one engine: rank 1 is refused
            recovered = []
            for _ in range(2):  # the ranks take turns: one of two is pinned to rank 1
                r = await client.post("/v1/completions", json=COMPLETION)
                assert r.status_code == 200, r.text
                recovered.append(r.headers.get("x-kv-transfer-recovery"))
            assert "pull" in recovered
            p = app.state.router.prefill.endpoints[0]
            assert p.learned_ranks is None and p.coordinates.engine_id == "engine-p0"
            r = await client.post("/v1/completions", json=COMPLETION)
    assert r.headers["x-kv-transfer-mode"] == "push"
    assert RANK_HEADER not in dp_pair.prefill.seen[-1].headers, "one engine: no pin"


def test_connector_tells_what_its_engine_knows_of_the_size() -> None:
    from connector.scheduler import _dp_size  # imports vLLM: only here

    def config(size: int, index: int) -> Any:
        return SimpleNamespace(parallel_config=SimpleNamespace(
            data_parallel_size=size, data_parallel_index=index))

    assert _dp_size(config(1, 0), "engine") == 1  # one engine
    assert _dp_size(config(4, 2), "engine_dp2") == 4  # an MoE model's engines know
    # A dense model's ranks run as engines of size 1: only vLLM's suffix says DP.
    assert _dp_size(config(1, 0), "engine_dp0") is None
    assert _dp_size(config(1, 1), "engine_dp1") is None
