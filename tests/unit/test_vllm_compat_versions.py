"""The three places where vLLM 0.32 and 0.33 differ for the connector, each handled in
`connector.vllm_compat`, exercised the way each version behaves:

1. `yield_req_data`'s third value (0.32: a cached request was resumed; 0.33: the blocks
   are the request's whole table), as `scheduled_blocks` and P's scheduler read it;
2. the registration generation (0.33): D keeps the agent of a P it met through a push
   when its first pull from that P names a generation;
3. the draft-model TP check of 0.33's push worker, which our WRITE path makes too.

The 0.32 side runs against the installed vLLM where that is 0.32, and the 0.33 side
against fakes shaped like 0.33's objects: `yield_req_data_033` below is a copy of 0.33's
function, and the fake workers carry the attributes 0.33's workers have. The tests marked
`vllm_next` run vLLM 0.33's own code (`_read_blocks_for_req`, the push worker's handshake
check): under 0.32 they are deselected, and `tests/integration/test_vllm_next.py` runs
this file again with 0.33's code (`.vllm-next`, from scripts/setup.sh) on the path.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, cast

import pytest
import vllm
from packaging.version import Version
from vllm.distributed.kv_transfer.kv_connector.utils import (
    EngineTransferInfo,
    TransferTopology,
)

import connector.prefill.scheduler_side as scheduler_side
import connector.vllm_compat as compat
from connector.connector import NixlDualConnector
from connector.prefill.prompts import PrefillPushes, PrefillState

INSTALLED_033 = Version(vllm.__version__).release[:2] >= (0, 33)
needs_033 = pytest.mark.vllm_next  # runs vLLM 0.33's own code (see the docstring)


# --- 1. yield_req_data's third value -------------------------------------------------------


def yield_req_data_032(out: Any) -> Iterator[tuple[str, Any, bool]]:
    """vLLM 0.32's `yield_req_data`, copied: (req_id, new block ids, preempted)."""
    for req in out.scheduled_new_reqs:
        yield req.req_id, req.block_ids, False
    cached = out.scheduled_cached_reqs
    yield from zip(cached.req_ids, cached.new_block_ids,
                   (rid in cached.resumed_req_ids for rid in cached.req_ids), strict=True)


def yield_req_data_033(out: Any) -> Iterator[tuple[str, Any, bool]]:
    """vLLM 0.33's `yield_req_data`, copied: (req_id, block ids, is_full_table)."""
    for req in out.scheduled_new_reqs:
        yield req.req_id, req.block_ids, True
    cached = out.scheduled_cached_reqs
    yield from zip(cached.req_ids, cached.new_block_ids,
                   (rid in cached.resumed_req_ids for rid in cached.req_ids), strict=True)


READERS = {"0.32": yield_req_data_032, "0.33": yield_req_data_033}


def _output(new: dict[str, list[int]], cached: dict[str, list[int] | None],
            resumed: frozenset[str] = frozenset(), scheduled: dict[str, int] | None = None) -> Any:
    """The fields of vLLM's SchedulerOutput that `yield_req_data` and P's scheduler read."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=rid, block_ids=(blocks,))
                            for rid, blocks in new.items()],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=list(cached), resumed_req_ids=set(resumed),
            new_block_ids=[None if b is None else (b,) for b in cached.values()]),
        num_scheduled_tokens=scheduled or {})


@pytest.mark.parametrize("version", READERS)
def test_new_and_resumed_requests_carry_their_whole_table_in_either_version(
        version: str) -> None:
    # "moved" is a preempted request listed again as new (vLLM's second model runner);
    # "back" is one the first runner lists as resumed.
    output = _output(new={"fresh": [1, 2], "moved": [7]},
                     cached={"more": [3], "idle": None, "back": [4, 5]},
                     resumed=frozenset({"back"}))
    got = list(compat.scheduled_blocks(output, reader=READERS[version]))
    assert got == [
        compat.ScheduledBlocks("fresh", ([1, 2],), full_table=True),
        compat.ScheduledBlocks("moved", ([7],), full_table=True),
        compat.ScheduledBlocks("more", ([3],), full_table=False),
        compat.ScheduledBlocks("idle", None, full_table=False),
        compat.ScheduledBlocks("back", ([4, 5],), full_table=True),
    ]


def test_the_third_value_is_read_as_the_installed_vllm_means_it() -> None:
    assert compat.FEATURES["full_table_flag"] is INSTALLED_033
    output = _output(new={"fresh": [1]}, cached={"more": [2]})
    assert [b.full_table for b in compat.scheduled_blocks(output)] == [True, False]


def _follow(pushes: PrefillPushes, rid: str, prompt_tokens: int) -> None:
    request = SimpleNamespace(request_id=rid, num_computed_tokens=0,
                              num_prompt_tokens=prompt_tokens)
    pushes.scheduled(cast(Any, request), cast(Any, "t-" + rid), fail_on_purpose=False,
                     follow=True)


@pytest.mark.parametrize("version", READERS)
def test_p_follows_a_push_prompt_through_a_preemption_in_either_version(
        version: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """P's scheduler (`_prompts_completing`) keeps a followed prompt's blocks: adds a
    chunk's new blocks, and takes the whole table again when the request comes back from
    a preemption listed as new, which vLLM 0.32 flags False."""
    monkeypatch.setattr(scheduler_side, "scheduled_blocks",
                        lambda out: compat.scheduled_blocks(out, reader=READERS[version]))
    pushes = PrefillPushes()
    _follow(pushes, "r", prompt_tokens=64)
    fake = SimpleNamespace(_prefill_pushes=pushes, _vllm=SimpleNamespace(
        get_exchange_clipped_blocks=lambda blocks: blocks))
    completing = scheduler_side.PrefillScheduler._prompts_completing

    def step(output: Any) -> list[str]:
        return [r.request.request_id for r in completing(cast(Any, fake), output, [])]

    assert step(_output(new={"r": [1, 2]}, cached={}, scheduled={"r": 16})) == []
    assert step(_output(new={}, cached={"r": [3]}, scheduled={"r": 16})) == []
    record = pushes.get("r")
    assert record is not None and record.block_ids == [[1, 2, 3]]
    # preempted: its blocks were freed; it comes back with new ones, all of them
    assert step(_output(new={"r": [8, 9]}, cached={}, scheduled={"r": 64})) == ["r"]
    assert record.state is PrefillState.COMPLETING and record.block_ids == [[8, 9]]


# --- 2. the registration generation ----------------------------------------------------------


def _decode_worker(cls: type[Any], *, generations: bool, loaded: set[str]) -> Any:
    """A D worker with the attributes vLLM's pull worker has (0.33's
    `_remote_registration_generations` only with `generations`), its `__init__` not run;
    `loaded`: the P engines whose agents it holds."""
    worker = object.__new__(cls)
    worker._remote_agents = {engine: {0: f"agent-{engine}"} for engine in loaded}
    worker._handshake_lock = threading.RLock()
    if generations:
        worker._remote_registration_generations = {}
    return worker


def _pull_meta(engine: str, generation: int | None) -> Any:
    """A pull's ReqMeta, with 0.33's `registration_generation` unless None (0.32)."""
    remote: dict[str, Any] = {"engine_id": engine, "block_ids": [[1]], "host": "127.0.0.1",
                              "port": 5600, "request_id": "p-1"}
    if generation is not None:
        remote["registration_generation"] = generation
    return SimpleNamespace(remote=SimpleNamespace(**remote), local_block_ids=[[1]])


class _Worker:
    """Stands in for vLLM's worker class where only attributes are read."""


@pytest.mark.parametrize(("loaded", "known", "generation", "expected"), [
    pytest.param({"P"}, {}, 2, {"P": 2}, id="agent-from-a-push-takes-the-generation"),
    pytest.param(set(), {}, 2, {}, id="no-agent-vllm-handshakes-itself"),
    pytest.param({"P"}, {"P": 1}, 2, {"P": 1}, id="known-generation-left-to-vllm"),
    pytest.param({"P"}, {}, 0, {}, id="a-push-fallback-read-names-none"),
])
def test_a_push_met_p_gets_its_generation_on_vllm_033(
        loaded: set[str], known: dict[str, int], generation: int,
        expected: dict[str, int]) -> None:
    worker = _decode_worker(_Worker, generations=True, loaded=loaded)
    worker._remote_registration_generations.update(known)
    compat.adopt_registration_generation(worker, _pull_meta("P", generation))
    assert worker._remote_registration_generations == expected


def test_generations_change_nothing_on_vllm_032() -> None:
    worker = _decode_worker(_Worker, generations=False, loaded={"P"})
    before = dict(vars(worker))
    compat.adopt_registration_generation(worker, _pull_meta("P", None))
    assert vars(worker) == before


def test_the_registration_generation_is_detected_from_vllms_metadata() -> None:
    fields = {f.name for f in dataclasses.fields(compat.RemoteMeta)}
    assert compat.FEATURES["registration_generations"] is ("registration_generation" in fields)
    assert compat.FEATURES["registration_generations"] is INSTALLED_033


class _Stop(Exception):
    """Raised where vLLM's READ would start: the test has seen what it checks."""


class _StopOnWrite(dict[str, float]):
    def __setitem__(self, key: str, value: float) -> None:
        raise _Stop(key)


@dataclasses.dataclass
class _Seen:
    dropped: list[str] = dataclasses.field(default_factory=list)  # agents thrown away
    handshakes: list[str] = dataclasses.field(default_factory=list)  # started again
    read: bool = False  # reached the READ, with the agent it held


def _real_read(worker: Any, meta: Any, read: Any) -> _Seen:
    """Run vLLM's `_read_blocks_for_req` (`read`) on `worker`, stopped where it would
    READ; what it did to P's agent on its way."""
    seen = _Seen()
    worker._invalid_remote_engines = set()
    worker.transfer_topo = object()
    worker._engine_last_active = _StopOnWrite()

    def cleanup(engine: str, **_: Any) -> None:
        seen.dropped.append(engine)
        worker._remote_agents.pop(engine)

    worker._cleanup_remote_engine = cleanup
    worker._background_nixl_handshake = lambda rid, engine, meta: seen.handshakes.append(engine)
    try:
        read(worker, "req-1", meta)
    except _Stop:
        seen.read = True
    return seen


@needs_033
def test_vllm_033_alone_drops_the_agent_of_a_p_met_through_a_push() -> None:
    """Without our adoption: vLLM 0.33's own `_read_blocks_for_req` throws away D's fresh
    agent of P at D's first pull from it, and handshakes again."""
    worker = _decode_worker(compat.PullPushWorker, generations=True, loaded={"P"})
    seen = _real_read(worker, _pull_meta("P", 1),
                      compat.NixlPullConnectorWorker._read_blocks_for_req)
    assert seen == _Seen(dropped=["P"], handshakes=["P"], read=False)


def test_our_worker_keeps_the_agent_of_a_p_met_through_a_push() -> None:
    """With our adoption (`PullPushWorker._read_blocks_for_req`), vLLM's own code reads
    with the agent D already has: nothing dropped, no new handshake. On vLLM 0.32 the
    same holds with no generation at all."""
    worker = _decode_worker(compat.PullPushWorker, generations=INSTALLED_033, loaded={"P"})
    meta = _pull_meta("P", 1 if INSTALLED_033 else None)
    seen = _real_read(worker, meta, compat.PullPushWorker._read_blocks_for_req)
    assert seen == _Seen(read=True)
    if INSTALLED_033:
        assert worker._remote_registration_generations == {"P": 1}


@needs_033
def test_a_newer_generation_still_makes_d_handshake_again() -> None:
    worker = _decode_worker(compat.PullPushWorker, generations=True, loaded={"P"})
    worker._remote_registration_generations["P"] = 1
    seen = _real_read(worker, _pull_meta("P", 2), compat.PullPushWorker._read_blocks_for_req)
    assert seen == _Seen(dropped=["P"], handshakes=["P"], read=False)
    assert worker._remote_registration_generations == {"P": 2}


def test_our_connector_keeps_vllms_refusal_of_sleep_mode() -> None:
    """The adoption is exact because P never publishes a new registration while it runs:
    only a wake-up from sleep mode does, which vLLM 0.33 refuses for our connector."""
    assert "supports_sleep_mode" not in vars(NixlDualConnector)
    refuses = getattr(NixlDualConnector, "supports_sleep_mode", None)
    if compat.FEATURES["registration_generations"]:
        assert refuses is not None and refuses(SimpleNamespace()) is False


# --- 3. the draft model's TP, on P's WRITE ---------------------------------------------------


def _topology(local_tp: int, decode_tp: int) -> TransferTopology:
    """vLLM's TransferTopology as P's worker has it after its handshake with D "D"."""
    topology = TransferTopology(tp_rank=0, tp_size=local_tp, block_size=16, engine_id="P",
                                is_mla=True, is_mamba=False, total_num_kv_heads=8,
                                attn_backends=[])
    topology.register_remote_engine("D", EngineTransferInfo(
        remote_tp_size=decode_tp, remote_block_len=1024, remote_block_size=16,
        remote_physical_blocks_per_logical=1))
    return topology


def _prefill_worker(cls: type[Any], *, draft_regions: set[int] | None, local_tp: int,
                    decode_tp: int) -> Any:
    """P's worker: 0.33's `_head_sharded_draft_regions` unless None (0.32)."""
    worker = object.__new__(cls)
    worker.transfer_topo = _topology(local_tp, decode_tp)
    if draft_regions is not None:
        worker._head_sharded_draft_regions = draft_regions
    return worker


DRAFT_CASES = [
    pytest.param({3}, 2, 1, True, id="draft-p2-d1-refused"),
    pytest.param({3}, 1, 2, True, id="draft-p1-d2-refused"),
    pytest.param({3}, 2, 2, False, id="draft-same-tp-written"),
    pytest.param(set(), 2, 1, False, id="no-draft-written"),
]


@pytest.mark.parametrize(("regions", "local_tp", "decode_tp", "refused"), DRAFT_CASES)
def test_a_head_sharded_draft_between_tp_sizes_is_refused_on_vllm_033(
        regions: set[int], local_tp: int, decode_tp: int, refused: bool) -> None:
    worker = _prefill_worker(_Worker, draft_regions=regions, local_tp=local_tp,
                             decode_tp=decode_tp)
    if refused:
        with pytest.raises(compat.DraftTpMismatch, match=rf"P {local_tp}, D {decode_tp}"):
            compat.check_draft_tp(worker, "D")
    else:
        compat.check_draft_tp(worker, "D")


def test_vllm_032_has_no_draft_check() -> None:
    worker = _prefill_worker(_Worker, draft_regions=None, local_tp=2, decode_tp=1)
    compat.check_draft_tp(worker, "D")


def test_the_write_is_refused_before_any_descriptor_is_made(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`PullPushWorker._xfer_blocks_for_req` (what `DualWorker._write` calls) checks first,
    and calls vLLM's push code only for a WRITE that passes."""
    calls: list[str] = []
    monkeypatch.setattr(compat.NixlPushConnectorWorker, "_xfer_blocks_for_req",
                        lambda self, rid, meta: calls.append(rid))
    meta = cast(Any, SimpleNamespace(remote=SimpleNamespace(engine_id="D")))
    refused = _prefill_worker(compat.PullPushWorker, draft_regions={3}, local_tp=2,
                              decode_tp=1)
    with pytest.raises(compat.DraftTpMismatch):
        refused._xfer_blocks_for_req("p-1", meta)
    passed = _prefill_worker(compat.PullPushWorker, draft_regions={3}, local_tp=2,
                             decode_tp=2)
    passed._xfer_blocks_for_req("p-2", meta)
    assert calls == ["p-2"]


@needs_033
@pytest.mark.parametrize(("regions", "local_tp", "decode_tp", "refused"), DRAFT_CASES)
def test_our_draft_check_refuses_what_vllms_push_worker_refuses(
        regions: set[int], local_tp: int, decode_tp: int, refused: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.33's push-worker check itself, on the same worker state (the base
    validation it runs first, which needs a real handshake, stubbed out)."""
    monkeypatch.setattr(compat.nixl_base_worker.NixlBaseConnectorWorker,
                        "_validate_remote_agent_handshake", lambda *args, **kwargs: None)
    push = _prefill_worker(compat.NixlPushConnectorWorker, draft_regions=regions,
                           local_tp=local_tp, decode_tp=decode_tp)
    try:
        compat.NixlPushConnectorWorker._validate_remote_agent_handshake(
            push, cast(Any, SimpleNamespace(engine_id="D")), decode_tp)
        vllm_refuses = False
    except NotImplementedError:
        vllm_refuses = True
    assert vllm_refuses is refused
    ours = _prefill_worker(_Worker, draft_regions=regions, local_tp=local_tp,
                           decode_tp=decode_tp)
    try:
        compat.check_draft_tp(ours, "D")
        we_refuse = False
    except compat.DraftTpMismatch:
        we_refuse = True
    assert we_refuse is vllm_refuses


def test_the_draft_check_is_detected_from_vllms_push_worker() -> None:
    assert compat.FEATURES["draft_tp_check"] is INSTALLED_033
