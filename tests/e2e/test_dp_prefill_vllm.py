"""A data-parallel P on real vLLM CPU: `--data-parallel-size 2` with our connector (two
engines behind P's one URL, P on both cores), D as usual, the router in push mode.

vLLM's side first: a request pinned with `X-data-parallel-rank` runs on that rank, whose
answer names its own engine (`_dp{rank}`), side channel and push port (offset by the
rank) and `dp_rank`; a rank P does not have is refused with 400. Then pushes through the
router: both ranks take some, the tokens equal one server's, and D's metrics show each
prompt's KV came by transfer.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import httpx
import pytest

from testbed.pd_protocol import metric, probe_body
from testbed.vllm_cpu import Pair
from tests.e2e.conftest import ProxyFactory
from tests.e2e.vllm_client import (
    COMPLETIONS,
    TIMEOUT,
    decode,
    external_kv_tokens,
    get_metrics,
    make_body,
    reference_tokens,
    wait_for_metric,
)

pytestmark = pytest.mark.e2e

RANK_HEADER = "X-data-parallel-rank"
PUSHES = 4
FINISHED = "vllm:request_success_total"  # per engine: label engine="<rank>"


async def probe_rank(client: httpx.AsyncClient, running: Pair, rank: int) -> httpx.Response:
    body = probe_body()
    body["kv_transfer_params"] = {**body["kv_transfer_params"], "probe": True}
    return await client.post(running.prefill_url + COMPLETIONS, json=body,
                             headers={RANK_HEADER: str(rank)})


def received(samples: dict[Any, float], *, before: dict[Any, float], tokens: int) -> bool:
    return external_kv_tokens(samples) - external_kv_tokens(before) >= tokens


def finished(samples: dict[Any, float], *, before: dict[Any, float], requests: int) -> bool:
    return metric(samples, FINISHED) - metric(before, FINISHED) >= requests


async def test_push_through_the_router_uses_each_rank_of_a_data_parallel_p(
    dual_dp_pair: Pair, proxy_for: ProxyFactory
) -> None:
    running = dual_dp_pair
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        ranks: dict[int, dict[str, Any]] = {}
        for rank in (0, 1):
            resp = await probe_rank(client, running, rank)
            assert resp.status_code == 200, resp.text
            ranks[rank] = resp.json()["kv_transfer_params"]
            assert ranks[rank]["dp_rank"] == rank
            assert ranks[rank]["remote_engine_id"].endswith(f"_dp{rank}"), ranks[rank]
        assert ranks[1]["remote_port"] == ranks[0]["remote_port"] + 1
        assert ranks[1]["push_port"] == ranks[0]["push_port"] + 1
        refused = await probe_rank(client, running, 2)
        assert refused.status_code == 400 and "data_parallel_rank" in refused.text, refused.text

        router_url = proxy_for(running, "push")
        p_before = await get_metrics(client, running.prefill_url)
        for i in range(PUSHES):
            body = make_body(COMPLETIONS)
            d_before = await get_metrics(client, running.decode_url)
            tokens, prompt_tokens = await decode(client, router_url + COMPLETIONS, body,
                                                 stream=i % 2 == 1)
            d_after = await wait_for_metric(client, running.decode_url, partial(
                received, before=d_before, tokens=prompt_tokens))
            assert external_kv_tokens(d_after) - external_kv_tokens(d_before) == prompt_tokens, (
                f"push {i}: D did not get the whole prompt's KV by transfer")
            assert tokens == await reference_tokens(client, running.decode_url, COMPLETIONS, body), (
                f"push {i}: tokens differ from one server's")
        p_after = await wait_for_metric(client, running.prefill_url, partial(
            finished, before=p_before, requests=PUSHES))
        router = (await client.get(router_url + "/metrics")).text
    assert (f'pdproxy_requests_total{{mode="push",route="/v1/completions",status="200"}} '
            f'{float(PUSHES)}') in router, "every request was a push"
    assert "pdproxy_mode_fallbacks_total{" not in router
    per_rank = {rank: metric(p_after, FINISHED, engine=str(rank))
                - metric(p_before, FINISHED, engine=str(rank)) for rank in (0, 1)}
    # One at a time, the router's pins take turns: each rank ran half (a late probe of
    # the router's start may add one).
    assert all(PUSHES // 2 <= n <= PUSHES // 2 + 1 for n in per_rank.values()), per_rank
