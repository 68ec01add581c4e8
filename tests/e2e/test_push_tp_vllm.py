"""Pushes between tensor-parallel sizes on real vLLM CPU servers, through the router: a
P and a D with our `NixlDualConnector` and different `--tensor-parallel-size`. The push
is not refused (the router did not fall back), D got the whole prompt's KV by transfer,
and the greedy tokens equal one server's computed from scratch; afterwards neither
server holds a KV block.

A TP-2 server runs two workers, each bound to one of the machine's two cores
(`VLLM_CPU_OMP_THREADS_BIND=0|1`). The tests stop the session's shared pair first, since
only one pair may run at a time (see conftest)."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from testbed.pd_protocol import KV_USAGE, answer_token_ids, metric
from testbed.vllm_cpu import Pair, Role, server_spec
from tests.e2e.conftest import (
    DUAL,
    DUAL_EXTRA_CONFIG,
    LOG_DIR,
    PairManager,
    ProxyFactory,
)
from tests.e2e.test_dual_connector import (
    assert_nothing_held,
    push_registered_first,
    push_stats,
)
from tests.e2e.vllm_client import (
    COMPLETIONS,
    TIMEOUT,
    external_kv_tokens,
    get_metrics,
    make_body,
    reference_tokens,
    wait_for_metric,
)

pytestmark = pytest.mark.e2e

# (P's tp, D's tp) and the cores each server's workers are bound to (rank r on the r-th).
PAIRS = {"p2-d1": (2, 1), "p1-d2": (1, 2)}
BIND = {1: {"prefill": "0", "decode": "1"}, 2: {"prefill": "0|1", "decode": "0|1"}}
PREFILL: Role = "prefill"
DECODE: Role = "decode"


@pytest.fixture(params=list(PAIRS), scope="module")
def tp_pair(request: pytest.FixtureRequest, pair_manager: PairManager,
            tiny_model: Path) -> Iterator[Pair]:
    """A P and a D with our connector, of the tensor-parallel sizes PAIRS names."""
    prefill_tp, decode_tp = PAIRS[request.param]
    specs = [
        server_spec(role, connector=DUAL, model_dir=tiny_model, log_dir=LOG_DIR,
                    name=f"{role}-tp{tp}", kv_extra_config=DUAL_EXTRA_CONFIG,
                    extra_args=("--tensor-parallel-size", str(tp)),
                    extra_env={"VLLM_CPU_OMP_THREADS_BIND": BIND[tp][role]})
        for role, tp in ((PREFILL, prefill_tp), (DECODE, decode_tp))
    ]
    with pair_manager.own_pair(specs, request.param) as running:
        yield running


def transferred(before: dict[Any, float], tokens: int, samples: dict[Any, float]) -> bool:
    """D's metrics `samples` count `tokens` more prompt tokens got by KV transfer."""
    return external_kv_tokens(samples) - external_kv_tokens(before) >= tokens


async def test_a_push_by_layer_between_tp_sizes_gives_one_servers_tokens(
    tp_pair: Pair,
) -> None:
    """D registers before P computes the prompt, and the push asks for layers: P writes
    it layer by layer, each D rank notified once every layer landed. P with one worker
    (p1-d2) writes one part per D rank and layer; P with two (p2-d1), whose workers each
    get the early WRITE, writes its two ranks' shares by layer. Either way: one server's
    tokens, the whole prompt by transfer, and nothing held afterwards. The pair's first
    test: a whole push first makes P's NIXL handshakes with D (a push to a D P has no
    handshake with yet is written whole), so that P's count of pushes by layer, 0 on the
    fresh pair, is 1 after the second."""
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        await push_registered_first(client, tp_pair, push_layers=False)
        body, _, d_before, (tokens, prompt_tokens) = await push_registered_first(
            client, tp_pair, push_layers=True)
        after = await wait_for_metric(client, tp_pair.decode_url,
                                      partial(transferred, d_before, prompt_tokens))
        assert external_kv_tokens(after) - external_kv_tokens(d_before) == prompt_tokens
        assert tokens == await reference_tokens(client, tp_pair.decode_url, COMPLETIONS, body)
        await assert_nothing_held(client, tp_pair)
        await push_stats(client, tp_pair.prefill, r"by layer 1\b")


async def test_a_push_between_tp_sizes_gives_one_servers_tokens(
    tp_pair: Pair, proxy_for: ProxyFactory
) -> None:
    router_url = proxy_for(tp_pair, "push")
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        # The second push reuses both NIXL handshakes, and asks to go layer by layer: it
        # is, when D registers in time (one part per P rank, D rank and layer).
        for layers in ("off", "on"):
            body = make_body(COMPLETIONS)
            before = await get_metrics(client, tp_pair.decode_url)
            resp = await client.post(router_url + COMPLETIONS, json=body, headers={
                "X-KV-Transfer-Mode": "push", "X-KV-Push-Layers": layers})
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-kv-transfer-mode"] == "push", "the router fell back"
            answer = resp.json()
            prompt_tokens = int(answer["usage"]["prompt_tokens"])
            after = await wait_for_metric(client, tp_pair.decode_url,
                                          partial(transferred, before, prompt_tokens))
            assert external_kv_tokens(after) - external_kv_tokens(before) == prompt_tokens, (
                "D did not get the whole prompt's KV by transfer (it recomputed)")
            assert answer_token_ids(answer) == await reference_tokens(
                client, tp_pair.decode_url, COMPLETIONS, body), "tokens differ from one server's"
        for name, url in (("P", tp_pair.prefill_url), ("D", tp_pair.decode_url)):
            samples = await wait_for_metric(client, url, lambda s: metric(s, KV_USAGE) == 0.0)
            assert metric(samples, KV_USAGE) == 0.0, f"{name} still holds KV blocks"

