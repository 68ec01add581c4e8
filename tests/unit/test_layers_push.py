"""Progressive push's plan: a push's WRITEs cut by layer (`connector.prefill.layers`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from connector.prefill.layers import (
    LayeredWrite,
    PlannedWrite,
    RegionLayers,
    layout_refusal,
)

# Two layers, each with a K and a V region of 10 blocks: descriptor id = region * 10 + block.
NAMES = ["l0", "l0", "l1", "l1"]
BLOCKS = [10, 10, 10, 10]


def whole(local_blocks: list[int], remote_blocks: list[int], notif: bytes = b"r:1"
          ) -> PlannedWrite:
    """A WRITE as vLLM's push code builds it: every region's descriptors of the blocks."""
    local = np.concatenate([np.asarray(local_blocks) + r * 10 for r in range(4)])
    remote = np.concatenate([np.asarray(remote_blocks) + r * 100 for r in range(4)])
    return PlannedWrite("L", local.astype(np.int32), "R", remote.astype(np.int32), notif)


def test_a_write_is_cut_by_the_layer_of_its_local_descriptors() -> None:
    layers = RegionLayers(NAMES, BLOCKS)
    parts = layers.split(whole([1, 2, 3], [7, 8, 9]))
    assert len(parts) == 2
    first, second = parts
    assert first is not None and second is not None
    assert first.local_ids.tolist() == [1, 2, 3, 11, 12, 13]
    assert first.remote_ids.tolist() == [7, 8, 9, 107, 108, 109]
    assert second.local_ids.tolist() == [21, 22, 23, 31, 32, 33]
    assert second.remote_ids.tolist() == [207, 208, 209, 307, 308, 309]
    assert first.notif == second.notif == b""
    # Every descriptor lands in exactly one part, paired as before.
    joined = dict(zip(np.concatenate([first.local_ids, second.local_ids]).tolist(),
                      np.concatenate([first.remote_ids, second.remote_ids]).tolist(),
                      strict=True))
    w = whole([1, 2, 3], [7, 8, 9])
    assert joined == dict(zip(w.local_ids.tolist(), w.remote_ids.tolist(), strict=True))


def test_regions_of_unequal_sizes_are_told_apart_by_their_starts() -> None:
    layers = RegionLayers(["a", "b", "b"], [4, 2, 6])  # starts 0, 4, 6
    assert layers.layer_of(np.asarray([0, 3, 4, 5, 6, 11])).tolist() == [0, 0, 1, 1, 1, 1]


def test_a_layer_with_nothing_to_write_has_no_part() -> None:
    layers = RegionLayers(NAMES, BLOCKS)
    only_first = PlannedWrite("L", np.asarray([1, 11], np.int32), "R",
                              np.asarray([5, 6], np.int32), b"n")
    assert layers.split(only_first)[1] is None


def test_the_last_layer_carries_the_notification_and_waits_for_the_others() -> None:
    layers = RegionLayers(NAMES, BLOCKS)
    push = LayeredWrite.plan("r", [whole([1], [2], b"d0:1"), whole([1], [3], b"d1:1")],
                             layers)
    # One part per D rank for layer 0; the last layer's parts are the final ones.
    assert [p.notif for p in push.parts[0]] == [b"", b""]
    assert push.parts[1] == []
    assert [p.notif for p in push.final] == [b"d0:1", b"d1:1"]
    assert not push.all_parts_posted
    assert len(push.due([0])) == 2
    assert push.due([0]) == []  # posted once
    assert push.all_parts_posted  # layer 1 has only the final parts
    assert push.rest() == []
    assert push.blocks == 8


def test_a_late_start_posts_every_layer_computed_so_far_at_once() -> None:
    layers = RegionLayers(["a", "b", "c"], [10, 10, 10])
    write = PlannedWrite("L", np.asarray([1, 11, 21], np.int32), "R",
                         np.asarray([1, 11, 21], np.int32), b"n")
    push = LayeredWrite.plan("r", [write], layers)
    assert [p.local_ids.tolist() for p in push.due({0, 1})] == [[1], [11]]
    assert push.all_parts_posted
    assert [p.local_ids.tolist() for p in push.final] == [[21]]


def test_a_plan_with_nothing_to_write_is_refused() -> None:
    layers = RegionLayers(NAMES, BLOCKS)
    empty = PlannedWrite("L", np.asarray([], np.int32), "R", np.asarray([], np.int32), b"n")
    with pytest.raises(ValueError, match="nothing to write"):
        LayeredWrite.plan("r", [empty], layers)


def test_mismatched_descriptor_lists_are_refused() -> None:
    layers = RegionLayers(NAMES, BLOCKS)
    bad = PlannedWrite("L", np.asarray([1, 2], np.int32), "R", np.asarray([1], np.int32), b"")
    with pytest.raises(ValueError, match="2 local descriptors against 1 remote"):
        layers.split(bad)


@pytest.mark.parametrize(("kwargs", "why"), [
    ({"region_names": NAMES, "has_state": True, "groups": 1, "routed_by_layer": False},
     "Mamba state"),
    ({"region_names": NAMES, "has_state": False, "groups": 2, "routed_by_layer": False},
     "more than one KV cache group"),
    ({"region_names": NAMES, "has_state": False, "groups": 1, "routed_by_layer": True},
     "more than one KV cache group"),
    ({"region_names": ["a", "b", "a"], "has_state": False, "groups": 1,
      "routed_by_layer": False}, "layer a shares KV regions"),
    ({"region_names": [], "has_state": False, "groups": 1, "routed_by_layer": False},
     "no KV regions"),
])
def test_layouts_that_cannot_be_cut_say_why(kwargs: dict[str, Any], why: str) -> None:
    refusal = layout_refusal(**kwargs)
    assert refusal is not None and why in refusal


def test_a_dense_layout_can_be_cut() -> None:
    assert layout_refusal(region_names=NAMES, has_state=False, groups=1,
                          routed_by_layer=False) is None


class FakeAgent:
    def __init__(self) -> None:
        self.posted: list[tuple[str, list[int], bytes]] = []
        self.released: list[object] = []

    def make_prepped_xfer(self, op: str, local: object, local_ids: list[int], remote: object,
                          remote_ids: list[int], notif: bytes = b"") -> int:
        self.posted.append((op, list(local_ids), notif))
        return len(self.posted)

    def transfer(self, handle: object) -> str:
        return "PROC"

    def check_xfer_state(self, handle: object) -> str:
        return "DONE"

    def release_xfer_handle(self, handle: object) -> None:
        self.released.append(handle)

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        return {"x": [b"n"]}


def test_the_recording_agent_records_this_threads_writes_only_while_recording() -> None:
    import threading

    from connector.prefill.layers import HELD, RecordingAgent

    agent = FakeAgent()
    wrapped = RecordingAgent(agent)
    with wrapped.recording() as planned:
        handle = wrapped.make_prepped_xfer("WRITE", "L", [1, 2], "R", [3, 4], b"n")
        assert handle is HELD and wrapped.transfer(handle) == "PROC"
        other: list[object] = []  # another thread's WRITE, meanwhile, is posted
        thread = threading.Thread(target=lambda: other.append(
            wrapped.make_prepped_xfer("WRITE", "L", [5], "R", [6])))
        thread.start()
        thread.join()
        assert other == [1]
    assert [(p.local_ids.tolist(), p.remote_ids.tolist(), p.notif) for p in planned] == [
        ([1, 2], [3, 4], b"n")]
    assert agent.posted == [("WRITE", [5], b"")]
    assert wrapped.make_prepped_xfer("WRITE", "L", [7], "R", [8]) == 2  # posted again
    # The placeholder is in flight, and releasing it releases nothing of NIXL's.
    assert wrapped.check_xfer_state(HELD) == "PROC"
    wrapped.release_xfer_handle(HELD)
    assert agent.released == []
    assert wrapped.check_xfer_state(2) == "DONE"
    assert wrapped.get_new_notifs() == {"x": [b"n"]}  # everything else is the agent's


# --- P's worker: the final parts wait for every other part ------------------------------


class StatefulAgent(FakeAgent):
    """NIXL's agent with a state per handle, set by the test."""

    def __init__(self) -> None:
        super().__init__()
        self.states: dict[object, str] = {}

    def make_prepped_xfer(self, op: str, local: object, local_ids: list[int], remote: object,
                          remote_ids: list[int], notif: bytes = b"") -> int:
        handle = super().make_prepped_xfer(op, local, local_ids, remote, remote_ids, notif)
        self.states[handle] = "PROC"
        return handle

    def check_xfer_state(self, handle: object) -> str:
        return self.states[handle]


def layered_worker() -> tuple[Any, StatefulAgent, LayeredWrite]:
    """P's worker half over a stand-in of vLLM's worker, with one layered push whose
    two layers' parts are posted (handles 1 and 2) and whose final part is not."""
    import threading
    from collections import defaultdict
    from types import SimpleNamespace

    from connector.prefill.layers import HELD, RecordingAgent
    from connector.prefill.worker_side import PrefillWorker

    agent = StatefulAgent()
    vllm = SimpleNamespace(
        _sending_transfers=defaultdict(list), _sending_transfers_lock=threading.Lock(),
        _send_failures=set(), nixl_wrapper=RecordingAgent(agent),
        _try_release_xfer_handle=lambda rid, handle: True)
    worker = PrefillWorker(vllm, pull_fallback_ttl=1.0, early_at=None,  # type: ignore[arg-type]
                           wake_poller=lambda: None)
    layers = RegionLayers(["a", "b", "c"], [10, 10, 10])
    write = PlannedWrite("L", np.asarray([1, 11, 21], np.int32), "R",
                         np.asarray([2, 12, 22], np.int32), b"d:1")
    push = LayeredWrite.plan("r", [write], layers)
    for part in push.rest():
        vllm._sending_transfers["r"].append(
            agent.make_prepped_xfer("WRITE", part.local_handle, part.local_ids.tolist(),
                                    part.remote_handle, part.remote_ids.tolist()))
    vllm._sending_transfers["r"].append(HELD)
    worker._finishing["r"] = push
    return worker, agent, push


def test_the_last_layer_waits_until_every_other_part_is_done() -> None:
    from connector.prefill.layers import HELD

    worker, agent, _ = layered_worker()
    vllm = worker._vllm
    with vllm._sending_transfers_lock:
        worker._post_finals()
    assert len(agent.posted) == 2, "the final part went while a part was in flight"
    agent.states[1] = agent.states[2] = "DONE"
    with vllm._sending_transfers_lock:
        worker._post_finals()
    assert agent.posted[-1] == ("WRITE", [21], b"d:1"), "the final part carries D's notice"
    assert HELD not in vllm._sending_transfers["r"], "the push is open still"
    assert "r" not in worker._finishing


def test_a_failed_part_means_no_final_part_and_the_push_fails() -> None:
    from connector.prefill.layers import HELD

    worker, agent, _ = layered_worker()
    agent.states[1], agent.states[2] = "DONE", "ERR"
    vllm = worker._vllm
    with vllm._sending_transfers_lock:
        worker._post_finals()
    assert len(agent.posted) == 2, "no notification may follow a failed layer"
    assert HELD not in vllm._sending_transfers["r"]  # vLLM's bookkeeping ends it: failed
    assert "r" not in worker._finishing


def test_a_push_past_its_write_lease_is_cancelled_whole_and_never_notified() -> None:
    from connector.prefill.layers import HELD

    worker, agent, _ = layered_worker()
    worker._write_deadlines["r"] = 0.0  # long past
    assert worker.poll_writes() is False  # every handle cancelled: nothing in flight
    vllm = worker._vllm
    assert vllm._sending_transfers["r"] == [] and HELD not in vllm._sending_transfers["r"]
    assert "r" in vllm._send_failures and "r" not in worker._finishing
    assert len(agent.posted) == 2, "the final part was posted after the lease"


# --- chunks: written without a notification, skipped by the final WRITE ------------------


def test_a_chunks_write_has_every_layer_as_a_part_and_no_notification() -> None:
    layers = RegionLayers(NAMES, BLOCKS)
    chunk = LayeredWrite.plan("r", [whole([1, 2], [5, 6])], layers, notify=False)
    assert chunk.final == []
    assert [sorted(p.local_ids.tolist()) for p in chunk.rest()] == [[1, 2, 11, 12],
                                                                     [21, 22, 31, 32]]
    assert all(part.notif == b"" for layer in chunk.parts for part in layer)


def test_the_final_write_skips_what_chunks_wrote_but_keeps_its_notification() -> None:
    from connector.prefill.layers import ChunkCover

    layers = RegionLayers(NAMES, BLOCKS)
    cover = ChunkCover()
    cover.add(whole([1, 2], [5, 6], notif=b"d:1"))  # a chunk's plan: blocks 1, 2
    final = cover.skip(whole([1, 2, 3], [5, 6, 7], notif=b"d:1"))
    assert final is not None
    assert sorted(final.local_ids.tolist()) == [3, 13, 23, 33], "only block 3 is left"
    push = LayeredWrite.plan("r", [final], layers)
    assert push.final[0].notif == b"d:1" and push.final[0].local_ids.tolist() == [23, 33]
    # the same P block into another D block is no chunk's: kept
    other = cover.skip(whole([1], [9], notif=b""))
    assert other is not None and other.local_ids.size == 4
    # all of it written by chunks: a WRITE with D's notification keeps one pair for it
    kept = cover.skip(whole([1, 2], [5, 6], notif=b"d:1"))
    assert kept is not None and kept.local_ids.size == 1 and kept.notif == b"d:1"
    assert cover.skip(whole([1, 2], [5, 6], notif=b"")) is None
