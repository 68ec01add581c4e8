"""A model with Mamba state between tp sizes: a TP-2 P and a TP-1 D of the tiny Granite 4
hybrid (`testbed.tiny_families`), our connector on both, started once for the module.

vLLM moves Mamba state only between equal tp sizes; on CPU its READ between tp sizes
completes but gives wrong tokens (vLLM 0.32, measured: docs/models.md). So both modes are
refused and D computes the prompt: a push by P's registry (`NACK tp_mismatch`, before any
WRITE: logged on both, counted in P's `refused` and D's `fell back`), a pull by D's
worker at the NIXL handshake (logged, `vllm:nixl_num_failed_transfers`). Through the
router each way: the tokens equal one server's, and D got nothing by transfer.

A TP-2 server's two workers are bound one per core, as in test_push_tp_vllm.py."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from testbed.pd_protocol import metric
from testbed.vllm_cpu import Pair, Role, server_spec
from tests.e2e.conftest import (
    DUAL,
    DUAL_EXTRA_CONFIG,
    LOG_DIR,
    PairManager,
    ProxyFactory,
)
from tests.e2e.test_block_sizes_vllm import FAILED_TRANSFERS, logged, through_router
from tests.e2e.test_model_families_vllm import FAMILIES, family_model
from tests.e2e.vllm_client import TIMEOUT, get_metrics

pytestmark = pytest.mark.e2e

FAMILY = "granitemoehybrid"
TP: dict[Role, int] = {"prefill": 2, "decode": 1}
BIND = {1: {"prefill": "0", "decode": "1"}, 2: {"prefill": "0|1", "decode": "0|1"}}


@pytest.fixture(scope="module")
def mamba_tp_pair(pair_manager: PairManager) -> Iterator[Pair]:
    """The Mamba hybrid on a TP-2 P and a TP-1 D."""
    model_dir = family_model(FAMILY)
    extra_args, extra_env = FAMILIES[FAMILY]
    specs = [server_spec(role, connector=DUAL, model_dir=model_dir, log_dir=LOG_DIR,
                         name=f"{role}-{FAMILY}-tp{tp}", kv_extra_config=DUAL_EXTRA_CONFIG,
                         extra_args=(*extra_args, "--tensor-parallel-size", str(tp)),
                         extra_env={**extra_env, "VLLM_CPU_OMP_THREADS_BIND": BIND[tp][role]})
             for role, tp in TP.items()]
    with pair_manager.own_pair(specs, f"{FAMILY} tp {TP}") as running:
        yield running


async def test_mamba_state_between_tp_sizes_is_refused_both_ways(
    mamba_tp_pair: Pair, proxy_for: ProxyFactory
) -> None:
    router_url = proxy_for(mamba_tp_pair, "pull")
    prefill, decode = mamba_tp_pair.prefill, mamba_tp_pair.decode
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        failed_before = metric(await get_metrics(client, decode.url), FAILED_TRANSFERS)
        for mode in ("push", "pull"):
            _, delta = await through_router(client, mamba_tp_pair, router_url, mode)
            assert delta["external_kv_transfer"] == 0, f"{mode}: D got KV after all: {delta}"
        why = "the model keeps Mamba state"
        await logged(client, prefill, rf"push \S+ refused: tensor-parallel mismatch: {why}, "
                                      r"which push moves only between equal tp sizes; "
                                      r"decode tp 1, prefill tp 2")
        await logged(client, decode, rf"P refused the registration: tp_mismatch: .*{why}")
        await logged(client, prefill, r"push stats: .* refused [1-9]\d*,")
        await logged(client, decode, r"push stats: .* fell back [1-9]\d* ")
        await logged(client, decode, rf"refused the KV transfer handshake with \S+: {why}, .*"
                                     r"local tp 1, peer tp 2")
        failed = metric(await get_metrics(client, decode.url), FAILED_TRANSFERS)
        assert failed > failed_before, "D counted no failed transfer for the refused pull"
