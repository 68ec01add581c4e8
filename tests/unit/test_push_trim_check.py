"""P takes pushes only if its vLLM's push code writes a prefix hit's tail right: D
registers only the blocks it lacks, and vLLM's push code must trim P's blocks to the
matching tail (a front trim would write the prompt's head into D's tail blocks)."""

from __future__ import annotations

from typing import Any

import pytest

from connector import vllm_compat
from connector.prefill.registry import PushRegistry, RegistryConfig, Rejected
from connector.protocol.side_channel import EngineId, NackReason, RegisterBlocks, TransferId


def test_the_installed_vllm_trims_to_ds_tail() -> None:
    assert vllm_compat.push_trims_to_decode_tail()
    assert vllm_compat.FEATURES["push_trims_decode_tail"]


def _front_trim(self: Any, decode_block_ids: Any, prefill_block_ids: Any,
                decode_physical_per_logical: int,
                prefill_physical_per_logical: int) -> tuple[Any, Any]:
    """The bug the check is for: P's first blocks, not its last."""
    return decode_block_ids, [group[:len(d)] for group, d in
                              zip(prefill_block_ids, decode_block_ids, strict=True)]


def _other_signature(self: Any, decode: Any, prefill: Any) -> tuple[Any, Any]:
    return decode, prefill


@pytest.mark.parametrize("broken", [_front_trim, _other_signature])
def test_a_vllm_that_trims_otherwise_fails_the_check(
    monkeypatch: pytest.MonkeyPatch, broken: Any
) -> None:
    monkeypatch.setattr(vllm_compat.NixlPushConnectorWorker, "_apply_prefix_caching", broken)
    assert not vllm_compat.push_trims_to_decode_tail()


def test_a_p_without_push_refuses_every_registration() -> None:
    registry = PushRegistry(RegistryConfig(engine_id=EngineId("p"), block_size=16,
                                           push_supported=False))
    outcome = registry.register(
        RegisterBlocks(transfer_id=TransferId("t-1"), engine_id=EngineId("d"),
                       request_id="d-req", tp_size=1, tp_rank=0, block_ids=[[0, 1]],
                       block_size=16, host="127.0.0.1", port=5601, ttl_s=60.0),
        now=0.0)
    assert isinstance(outcome, Rejected) and outcome.reason is NackReason.PUSH_UNSUPPORTED
    assert "prefix-hit check" in outcome.message
    assert len(registry) == 0 and registry.snapshot().counters.rejected == 1
