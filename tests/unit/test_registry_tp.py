"""Pushes between tensor-parallel sizes: the mapping rule P's registry applies
(`connector.shared.tp_plan`), held to vLLM's own push mapping, and the registry's answers."""

from __future__ import annotations

from typing import Any

import pytest

from connector.prefill.registry import (
    PushRegistry,
    Ready,
    RegistryConfig,
    Rejected,
    TransferState,
    Waiting,
)
from connector.protocol.side_channel import EngineId, NackReason, RegisterBlocks, TransferId
from connector.shared import tp_plan
from connector.shared.tp_plan import HeadWrite
from tests.unit.registry_kit import GrantedRegistry

T1 = TransferId("t-1")


def registry(prefill_tp: int, **overrides: Any) -> PushRegistry:
    return GrantedRegistry(RegistryConfig(engine_id=EngineId("p"), block_size=16,
                                       tp_size=prefill_tp, **overrides))


def registration(decode_tp: int, tp_rank: int = 0) -> RegisterBlocks:
    return RegisterBlocks(transfer_id=T1, engine_id=EngineId("d"), request_id="d-req",
                          tp_size=decode_tp, tp_rank=tp_rank, block_ids=[[0, 1]],
                          block_size=16, host="127.0.0.1", port=5601, ttl_s=60.0)


# --- the rule ------------------------------------------------------------------------------


@pytest.mark.parametrize(("prefill_tp", "decode_tp", "kv_heads", "mla"), [
    pytest.param(1, 1, 2, False, id="equal-1"),
    pytest.param(4, 4, 8, False, id="equal-4"),
    pytest.param(2, 1, 2, False, id="p2-d1"),
    pytest.param(8, 2, 8, False, id="p8-d2"),
    pytest.param(4, 1, 2, False, id="p4-d1-p-replicates"),
    pytest.param(1, 2, 2, False, id="p1-d2"),
    pytest.param(2, 8, 8, False, id="p2-d8"),
    pytest.param(1, 4, 1, True, id="p1-d4-mla"),
    pytest.param(1, 4, None, False, id="p1-d4-heads-unknown"),
])
def test_supported_pairs(prefill_tp: int, decode_tp: int, kv_heads: int | None,
                         mla: bool) -> None:
    assert tp_plan.refusal(prefill_tp, decode_tp, kv_heads=kv_heads, mla=mla) is None


@pytest.mark.parametrize(("prefill_tp", "decode_tp", "kv_heads", "named"), [
    pytest.param(2, 3, 8, "one tp size is a multiple of the other", id="p2-d3"),
    pytest.param(4, 6, 8, "decode tp 6, prefill tp 4", id="p4-d6"),
    pytest.param(3, 2, 8, "one tp size is a multiple of the other", id="p3-d2"),
    pytest.param(1, 4, 2, "exceeds the model's 2 KV heads", id="p1-d4-d-replicates"),
    pytest.param(2, 4, 2, "run D with tp <= max(prefill tp, KV heads)", id="p2-d4-d-replicates"),
])
def test_unsupported_pairs_say_why(prefill_tp: int, decode_tp: int, kv_heads: int,
                                   named: str) -> None:
    why = tp_plan.refusal(prefill_tp, decode_tp, kv_heads=kv_heads)
    assert why is not None and named in why


@pytest.mark.parametrize(("prefill_tp", "decode_tp", "rank", "targets"), [
    pytest.param(2, 2, 1, (1,), id="equal"),
    pytest.param(2, 1, 1, (0,), id="p2-d1"),
    pytest.param(4, 2, 3, (1,), id="p4-d2"),
    pytest.param(1, 2, 0, (0, 1), id="p1-d2"),
    pytest.param(2, 8, 1, (4, 5, 6, 7), id="p2-d8"),
])
def test_decode_targets(prefill_tp: int, decode_tp: int, rank: int,
                        targets: tuple[int, ...]) -> None:
    assert tp_plan.decode_targets(prefill_tp, decode_tp, rank) == targets


@pytest.mark.parametrize(("prefill_tp", "decode_tp", "kv_heads", "rank", "writes"), [
    pytest.param(1, 1, 4, 0, (HeadWrite(0, 0, 0, 4),), id="equal"),
    pytest.param(2, 1, 4, 1, (HeadWrite(0, 0, 2, 2),), id="p2-d1-second-half"),
    pytest.param(4, 1, 2, 3, (HeadWrite(0, 0, 1, 1),), id="p4-d1-replicated-p"),
    pytest.param(1, 2, 4, 0, (HeadWrite(0, 0, 0, 2), HeadWrite(1, 2, 0, 2)), id="p1-d2"),
    pytest.param(1, 2, 1, 0, (HeadWrite(0, 0, 0, 1), HeadWrite(1, 0, 0, 1)), id="p1-d2-mla"),
])
def test_head_writes(prefill_tp: int, decode_tp: int, kv_heads: int, rank: int,
                     writes: tuple[HeadWrite, ...]) -> None:
    assert tp_plan.head_writes(prefill_tp, decode_tp, rank, kv_heads=kv_heads) == writes


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(3, 2), (0, 1)])
def test_the_plan_refuses_an_unsupported_pair(prefill_tp: int, decode_tp: int) -> None:
    with pytest.raises(ValueError, match="tp"):
        tp_plan.decode_targets(prefill_tp, decode_tp, 0)


@pytest.mark.parametrize(("prefill_tp", "decode_tp", "expected"),
                         [(1, 1, 1), (2, 1, 2), (4, 2, 2), (1, 2, 1), (2, 8, 1)])
def test_every_write_into_a_decode_rank_is_awaited(prefill_tp: int, decode_tp: int,
                                                    expected: int) -> None:
    """D's count is the number of P ranks that target each D rank."""
    assert tp_plan.writers_per_decode_rank(prefill_tp, decode_tp) == expected
    for decode_rank in range(decode_tp):
        writers = [r for r in range(prefill_tp)
                   if decode_rank in tp_plan.decode_targets(prefill_tp, decode_tp, r)]
        assert len(writers) == expected


# --- held to vLLM's push mapping -------------------------------------------------------------

PAIRS = [(1, 1, 2), (2, 2, 2), (2, 1, 2), (4, 1, 2), (4, 2, 8), (8, 2, 8), (1, 2, 2),
         (2, 8, 8), (1, 4, 4)]


def _vllm_mapping(prefill_tp: int, decode_tp: int, kv_heads: int, rank: int) -> Any:
    """vLLM's mapping seen from P's rank `rank`, as its push worker computes it at the
    handshake with D (P local, D remote)."""
    from vllm.distributed.kv_transfer.kv_connector.utils import TransferTopology
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import (
        compute_tp_mapping,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    topology = TransferTopology(tp_rank=rank, tp_size=prefill_tp, block_size=16,
                                engine_id="p", is_mla=False, is_mamba=False,
                                total_num_kv_heads=kv_heads, attn_backends=[])
    return topology, compute_tp_mapping(topology, decode_tp, (FullAttentionSpec,))


@pytest.mark.parametrize(("prefill_tp", "decode_tp", "kv_heads"), PAIRS)
def test_the_plan_writes_the_ranks_and_head_slots_vllm_does(
    prefill_tp: int, decode_tp: int, kv_heads: int
) -> None:
    for rank in range(prefill_tp):
        topology, mapping = _vllm_mapping(prefill_tp, decode_tp, kv_heads, rank)
        targets = tp_plan.decode_targets(prefill_tp, decode_tp, rank)
        assert mapping.all_source_ranks == targets
        assert tuple(topology.handshake_target_ranks(decode_tp)) == targets
        writes = tp_plan.head_writes(prefill_tp, decode_tp, rank, kv_heads=kv_heads)
        if prefill_tp > decode_tp:  # vLLM's head slot in D's block, in P ranks' heads
            (write,) = writes
            assert write.decode_offset == mapping.rank_offset_factor * tp_plan.heads_per_rank(
                prefill_tp, kv_heads)
        elif prefill_tp < decode_tp:  # vLLM splits P's block in equal chunks, in order
            share = tp_plan.heads_per_rank(decode_tp, kv_heads)
            assert [w.prefill_offset for w in writes] == [i * share for i in range(len(writes))]


def test_the_refused_replicating_decode_is_one_vllm_writes_partly() -> None:
    """Why D tp > KV heads (and > P's tp) is refused: vLLM writes some of D's ranks only."""
    _, mapping = _vllm_mapping(1, 4, 2, 0)
    assert mapping.all_source_ranks != (0, 1, 2, 3)
    assert tp_plan.refusal(1, 4, kv_heads=2) is not None


# --- the registry's answers ----------------------------------------------------------------


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 1), (2, 1), (1, 2), (4, 2), (2, 4)])
def test_a_registration_of_a_mappable_tp_is_matched(prefill_tp: int, decode_tp: int) -> None:
    r = registry(prefill_tp, kv_heads=8)
    assert r.register(registration(decode_tp), now=0.0) == Waiting(
        T1, TransferState.AWAITING_PREFILL)
    ready = r.prefill_finished(T1, [[7, 8]], request_id="p-req", now=1.0)
    assert isinstance(ready, Ready) and ready.registration.tp_size == decode_tp


@pytest.mark.parametrize(("prefill_tp", "decode_tp", "tp_rank", "named"), [
    pytest.param(2, 3, 0, "decode tp 3, prefill tp 2", id="p2-d3"),
    pytest.param(1, 16, 0, "exceeds the model's 8 KV heads", id="d-replicates"),
    pytest.param(2, 2, 1, "rank 1 of decode tp 2", id="not-rank-0"),
])
def test_an_unmappable_registration_is_refused_tp_mismatch(
    prefill_tp: int, decode_tp: int, tp_rank: int, named: str
) -> None:
    r = registry(prefill_tp, kv_heads=8)
    outcome = r.register(registration(decode_tp, tp_rank), now=0.0)
    assert isinstance(outcome, Rejected) and outcome.reason is NackReason.TP_MISMATCH
    assert named in outcome.message and "tensor-parallel mismatch" in outcome.message
    assert len(r) == 0 and r.snapshot().counters.rejected == 1


def test_an_mla_registry_takes_a_decode_tp_beyond_the_heads() -> None:
    r = registry(1, kv_heads=1, mla=True)
    assert isinstance(r.register(registration(4), now=0.0), Waiting)


# --- D's worker: a push lands once every expected WRITE notified ----------------------------


@pytest.mark.parametrize(("prefill_tp", "decode_tp", "pp_size", "writes"), [
    pytest.param(1, 1, 1, 1, id="equal"),
    pytest.param(2, 1, 1, 2, id="p2-d1"),
    pytest.param(1, 2, 1, 1, id="p1-d2"),
    pytest.param(4, 2, 2, 4, id="p4-d2-pp2"),
])
def test_d_worker_lands_a_push_only_with_its_last_write(
    prefill_tp: int, decode_tp: int, pp_size: int, writes: int
) -> None:
    from types import SimpleNamespace
    from typing import Any, cast

    from connector.decode.worker_side import DecodeWorker

    landed: list[int] = []
    vllm = SimpleNamespace(world_size=decode_tp,
                           _recving_metadata={"d-req": SimpleNamespace(pp_size=pp_size)})
    worker = DecodeWorker(cast(Any, vllm), wake_at=("engine", 0), wake_poller=lambda: None)
    incoming = worker._incoming
    worker.finish_landed = lambda: landed.append(incoming.awaiting)  # type: ignore[method-assign]
    incoming.expect("d-req")
    for notification in range(writes):
        assert not landed, f"landed after {notification} of {writes} WRITEs"
        worker.push_arrived("d-req", prefill_tp)
    assert landed == [0] and incoming.landed() == ["d-req"]


# --- models with Mamba state: equal tp sizes only ------------------------------------------


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2), (4, 2)])
def test_a_mamba_model_is_refused_unequal_tp_sizes(prefill_tp: int, decode_tp: int) -> None:
    why = tp_plan.refusal(prefill_tp, decode_tp, kv_heads=8, mamba=True)
    assert why is not None and "Mamba state" in why
    assert f"decode tp {decode_tp}, prefill tp {prefill_tp}" in why
    assert tp_plan.refusal(prefill_tp, decode_tp, kv_heads=8) is None  # KV alone maps


def test_a_mamba_registry_refuses_unequal_tp_before_any_write() -> None:
    r = registry(2, kv_heads=8, mamba=True)
    r.prefill_finished(T1, [[7, 8]], request_id="p-req", now=0.0)  # P's prefill is done
    outcome = r.register(registration(1), now=1.0)
    assert isinstance(outcome, Rejected) and outcome.reason is NackReason.TP_MISMATCH
    assert "Mamba state" in outcome.message and "tensor-parallel mismatch" in outcome.message
    assert outcome.block_ids == [[7, 8]]  # P frees its blocks; nothing is written
    assert len(r) == 0 and r.snapshot().counters.rejected == 1


@pytest.mark.parametrize("tp", [1, 2])
def test_a_mamba_registry_matches_equal_tp(tp: int) -> None:
    r = registry(tp, kv_heads=8, mamba=True)
    assert r.register(registration(tp), now=0.0) == Waiting(T1, TransferState.AWAITING_PREFILL)
    assert isinstance(r.prefill_finished(T1, [[7, 8]], request_id="p-req", now=1.0), Ready)


# --- a transfer between block sizes: refused on CPU at the handshake ------------------------


def test_a_cpu_worker_refuses_a_peer_of_another_block_size() -> None:
    from connector.worker import block_size_refusal

    why = block_size_refusal((128, 1), (64, 1), on_cpu=True)
    assert why is not None and "local 128" in why and "peer 64" in why
    # The same logical size from other kernel pages is another layout too.
    assert block_size_refusal((32, 4), (32, 2), on_cpu=True) is not None
    assert block_size_refusal((128, 1), (128, 1), on_cpu=True) is None
    assert block_size_refusal((128, 1), (64, 1), on_cpu=False) is None  # vLLM's own on GPU


def test_a_cpu_worker_refuses_mamba_state_between_tp_sizes() -> None:
    from connector.worker import state_tp_refusal

    why = state_tp_refusal(1, 2, keeps_state=True, on_cpu=True)
    assert why is not None and "Mamba state" in why and "local tp 1, peer tp 2" in why
    assert state_tp_refusal(2, 2, keeps_state=True, on_cpu=True) is None
    assert state_tp_refusal(1, 2, keeps_state=False, on_cpu=True) is None  # KV alone maps
    assert state_tp_refusal(1, 2, keeps_state=True, on_cpu=False) is None  # vLLM's own on GPU


@pytest.mark.parametrize(("is_hybrid", "has_inner_state", "keeps"), [
    (True, True, True), (False, True, True), (False, False, False)])
def test_a_model_keeps_state_when_vllm_says_hybrid_or_inner_state(
        is_hybrid: bool, has_inner_state: bool, keeps: bool) -> None:
    from types import SimpleNamespace

    config = SimpleNamespace(is_hybrid=is_hybrid, has_inner_state=has_inner_state)
    assert tp_plan.keeps_state(config) is keeps
