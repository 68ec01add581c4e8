"""Progressive push over real NIXL: each layer's WRITE lands as its layer is computed,
and D's notification comes only once every layer has landed.

P's half of a worker (`PrefillWorker`, on a bare stand-in of vLLM's worker) drives real
NIXL agents in this process: P's buffer stands for P's KV cache, D's for D's. The cache
has two layers, each a K and a V region of 4 blocks (descriptor = region x 4 + block), as
vLLM registers them. vLLM's push code is played by `plan`: one WRITE of every region's
descriptors of the push's blocks, with D's notification, which the worker records (not
posts) and cuts by layer. The test then plays the forward pass: layer 0's hook, layer
1's hook, the pass's end. Needs NIXL installed: without it these fail."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from connector.prefill.layers import RecordingAgent, RegionLayers
from connector.prefill.worker_side import PrefillWorker
from connector.protocol.side_channel import TransferId
from connector.protocol.step import PushJob, PushStep
from scripts import bench_nixl
from tests.conftest import until_sync
from tests.integration.nixl_kit import AgentPair

BLOCK_BYTES = 4096
PARAMS = bench_nixl.Params(device="cpu", block_bytes=BLOCK_BYTES, blocks=16, iterations=1,
                           warmup=0, noncontiguous=False, one_block_rounds=0,
                           progress_thread=False, timeout=30.0)
REGIONS = ["layer.0", "layer.0", "layer.1", "layer.1"]  # K and V of each layer
BLOCKS_PER_REGION = 4
P_BLOCKS, D_BLOCKS = [1, 3], [0, 2]  # the push's blocks on each side
STEP = 7
RID = "p-req"


def descs(blocks: list[int]) -> np.ndarray:
    """Every region's descriptors of `blocks`, region by region (vLLM's order)."""
    ids: np.ndarray = np.concatenate([np.asarray(blocks) + r * BLOCKS_PER_REGION
                                      for r in range(len(REGIONS))]).astype(np.int32)
    return ids


class LayeredPath(AgentPair):
    """P's and D's agents and buffers (P's block n holds n + 1), and P's worker half."""

    def __init__(self) -> None:
        kv = (np.arange(PARAMS.pool_blocks, dtype=np.uint8) + 1)[:, None]
        super().__init__("layered-test", PARAMS, kv)
        self.notifs: list[bytes] = []
        self.worker = self._worker()

    def _worker(self) -> Any:
        vllm: Any = SimpleNamespace(
            _sending_transfers=defaultdict(list), _sending_transfers_lock=threading.Lock(),
            _send_failures=set(), _engine_last_active={}, world_size=1,
            _physical_blocks_per_logical_kv_block=1,
            nixl_wrapper=RecordingAgent(self.p_agent), _handshake_lock=threading.Lock(),
            _remote_agents={"d-engine": {0: "d"}})
        vllm._logical_to_kernel_block_ids = lambda ids, _ratio: ids

        def try_release(rid: str, handle: Any) -> bool:
            vllm.nixl_wrapper.release_xfer_handle(handle)
            return True

        def plan(rid: str, meta: Any) -> None:  # vLLM's push code: one WRITE, notified
            handle = vllm.nixl_wrapper.make_prepped_xfer(
                "WRITE", self.local, descs(meta.local_block_ids[0]), self.remote,
                descs(meta.remote.block_ids[0]), f"{meta.remote.request_id}:1".encode())
            vllm.nixl_wrapper.transfer(handle)
            vllm._sending_transfers[rid].append(handle)

        vllm._try_release_xfer_handle = try_release
        vllm._xfer_blocks_for_req = plan
        vllm._pop_done_transfers = lambda transfers: pop_done(vllm, transfers)
        worker: Any = PrefillWorker(vllm, pull_fallback_ttl=30.0, early_at=None,
                                    wake_poller=lambda: None)
        worker._layers = RegionLayers(REGIONS, [BLOCKS_PER_REGION] * len(REGIONS))
        return worker

    def layer_written(self, layer: int) -> bool:
        """Whether D holds P's KV of the push's blocks in both of `layer`'s regions."""
        d = np.asarray(self.d_buffer.read_back())
        for region in (2 * layer, 2 * layer + 1):
            for p_block, d_block in zip(P_BLOCKS, D_BLOCKS, strict=True):
                want = region * BLOCKS_PER_REGION + p_block + 1
                if not (d[region * BLOCKS_PER_REGION + d_block] == want).all():
                    return False
        return True

    def progress(self) -> None:
        """Poll D's agent (as D's worker does while it awaits a push) and P's WRITEs."""
        for notifs in self.d_agent.get_new_notifs().values():
            self.notifs += notifs
        self.worker.poll_writes()



def pop_done(vllm: Any, transfers: dict[str, list[Any]]) -> tuple[set[str], set[str]]:
    """vLLM's `_pop_done_transfers`: release the done handles; a request with none left
    is done, one with a failed handle failed."""
    done, failed = set(), set()
    for rid, handles in list(transfers.items()):
        left = []
        for handle in handles:
            state = vllm.nixl_wrapper.check_xfer_state(handle)
            if state == "DONE":
                vllm.nixl_wrapper.release_xfer_handle(handle)
            elif state == "PROC":
                left.append(handle)
            else:
                failed.add(rid)
        if left:
            transfers[rid] = left
        else:
            del transfers[rid]
            done.add(rid)
    return done, failed


@pytest.fixture
def path() -> Iterator[LayeredPath]:
    made = LayeredPath()
    try:
        yield made
    finally:
        made.close()


def until(condition: Any, what: str, path: LayeredPath, timeout: float = 10.0) -> None:
    """`condition()` within `timeout` seconds, polling both agents meanwhile (NIXL moves
    a WRITE, and delivers its notification, only while they are polled)."""
    def polled() -> bool:
        path.progress()
        return bool(condition())

    until_sync(polled, what, timeout)


def job() -> PushJob:
    return PushJob(transfer_id=TransferId("t-layers"), request_id=RID, block_ids=[P_BLOCKS],
                   decode_engine_id="d-engine", decode_request_id="d-req", decode_host="",
                   decode_port=0, decode_tp_size=1, decode_block_ids=[D_BLOCKS],
                   write_within=30.0)


def test_each_layer_lands_as_computed_and_d_is_notified_after_the_last(
    path: LayeredPath,
) -> None:
    worker = path.worker
    worker._outgoing.early(job(), STEP, deadline=time.monotonic() + 30.0)  # D registered
    worker.begin_step(PushStep(layered={RID}, number=STEP))

    worker.layer_saved("layer.0")  # the forward pass computed layer 0: its WRITE goes
    until(lambda: path.layer_written(0), "layer 0 on D", path)
    for _ in range(50):
        path.progress()
    assert not path.layer_written(1), "layer 1 was written before it was computed"
    assert path.notifs == [], "D was notified before every layer landed"

    worker.layer_saved("layer.1")  # the last layer: its part waits for the others
    worker.write_early()  # the forward pass ended
    until(lambda: path.notifs == [b"d-req:1"], "D's notification", path)
    assert path.layer_written(0) and path.layer_written(1)

    end = freed(worker, path)
    assert end.error is None and end.layered
    assert worker._vllm._sending_transfers == {}, "a handle is still held"


def test_a_match_in_mid_pass_writes_the_layers_computed_so_far_at_once(
    path: LayeredPath,
) -> None:
    """D's registration reaches P after layer 0 was computed: layer 0 goes at the match,
    with no hook to wait for; the rest as before."""
    worker = path.worker
    worker.begin_step(PushStep(layered={RID}, number=STEP))
    worker.layer_saved("layer.0")  # nothing to write yet: no match
    assert worker._vllm._sending_transfers == {}
    worker._outgoing.early(job(), STEP, deadline=time.monotonic() + 30.0)  # D registers
    worker.layer_saved("layer.1")  # the match is seen here: layer 0 goes now
    until(lambda: path.layer_written(0), "layer 0 on D", path)
    worker.write_early()
    until(lambda: path.notifs == [b"d-req:1"], "D's notification", path)
    assert path.layer_written(1)


def chunk_job() -> PushJob:
    """The WRITE of the prompt's first chunk: P's block 1 into D's block 0, no notice."""
    return PushJob(transfer_id=TransferId("t-layers"), request_id=RID, block_ids=[[1]],
                   decode_engine_id="d-engine", decode_request_id="d-req", decode_host="",
                   decode_port=0, decode_tp_size=1, decode_block_ids=[[0]],
                   write_within=30.0, chunk=True)


def forward_pass(worker: Any, step: int) -> None:
    """Engine step `step`, writing `RID` by layer: both layers' hooks, the pass's end."""
    worker.begin_step(PushStep(layered={RID}, number=step))
    worker.layer_saved("layer.0")
    worker.layer_saved("layer.1")
    worker.write_early()


def first_chunk(worker: Any) -> None:
    """The prompt's first chunk (P's block 1 into D's block 0), written in its step."""
    worker._early_inbox = SimpleNamespace(take=lambda: [])
    worker._chunk_jobs.append((chunk_job(), STEP - 1, time.monotonic() + 30.0))  # early
    forward_pass(worker, STEP - 1)


def freed(worker: Any, path: LayeredPath) -> Any:
    """Wait for P's blocks to be handed back to vLLM; the push's end on this rank."""
    results = SimpleNamespace(finished_sending=set())
    until(lambda: (worker.transfer_results(results), RID in results.finished_sending)[1],
          "P's blocks freed", path)
    (end,) = worker.take_report().ended.values()
    return end


def test_a_chunk_lands_while_the_next_computes_and_the_final_write_skips_it(
    path: LayeredPath,
) -> None:
    """The prompt in two chunks: the first chunk's block is written layer by layer during
    its own step, without a notification; the last step's WRITE writes only the block
    the chunk left, and D's notification comes once both have landed."""
    worker = path.worker
    first_chunk(worker)

    def chunk_landed() -> bool:
        d = np.asarray(path.d_buffer.read_back())
        return all((d[region * BLOCKS_PER_REGION] == region * BLOCKS_PER_REGION + 2).all()
                   for region in range(len(REGIONS)))

    until(chunk_landed, "the first chunk's block on D, every layer", path)
    assert path.notifs == [], "a chunk's WRITE notified D"
    assert RID in worker._vllm._sending_transfers, "the push is not held open"

    posted = count_posts(worker)
    worker._outgoing.early(job(), STEP, deadline=time.monotonic() + 30.0)  # the last step
    forward_pass(worker, STEP)
    until(lambda: path.notifs == [b"d-req:1"], "D's notification", path)
    assert path.layer_written(0) and path.layer_written(1)

    end = freed(worker, path)
    assert end.error is None and end.layered and end.chunked
    assert sorted(i for ids in posted for i in ids) == sorted(descs([3]).tolist()), (
        "the final WRITE did not write exactly the block the chunk left")
    assert worker._vllm._sending_transfers == {} and worker._chunked == {}


def count_posts(worker: Any) -> list[list[int]]:
    """The local descriptor ids of each WRITE the worker posts from now on."""
    posted: list[list[int]] = []
    recording = worker._vllm.nixl_wrapper
    agent = recording._agent

    class Counting:
        def __getattr__(self, name: str) -> Any:
            return getattr(agent, name)

        def make_prepped_xfer(self, op: str, local: Any, local_ids: Any, *args: Any,
                              **kwargs: Any) -> Any:
            posted.append([int(i) for i in local_ids])
            return agent.make_prepped_xfer(op, local, local_ids, *args, **kwargs)

    recording._agent = Counting()
    return posted


class HeldBackFence:
    """A fence whose thread lags: its actions run only when the test says (as the fence
    thread of a CPU or GPU server may still post earlier layers when the step ends)."""

    def __init__(self) -> None:
        self.queued: list[Any] = []

    def after_queued_work(self, action: Any) -> None:
        self.queued.append(action)

    def wait_for_forward(self) -> None:
        return None

    def close(self) -> None:
        return None

    def run(self) -> None:
        actions, self.queued = self.queued, []
        for action in actions:
            action()


def a_part_failed(worker: Any) -> None:
    """A WRITE handle of the push failed, and vLLM's bookkeeping reports it at the step's
    end (as vLLM's code does, through `_send_failures`)."""
    with worker._vllm._sending_transfers_lock:
        worker._vllm._send_failures.add(RID)
    worker.transfer_results(SimpleNamespace(finished_sending=set()))


def failed_and_kept(worker: Any, path: LayeredPath, what: str) -> None:
    """Wait for the push's end: failed, its blocks kept for D to read; D never notified
    of it (`what` failed)."""
    results = SimpleNamespace(finished_sending=set())

    def ended() -> bool:
        worker.transfer_results(results)
        report = worker.take_report()
        if report is None or not report.ended:
            return False
        (end,) = report.ended.values()
        assert end.error is not None and end.holding_ranks == 1, end
        return True

    until(ended, "the push's end", path)
    for _ in range(50):
        path.progress()
    assert path.notifs == [], f"D was notified of a push {what} of which failed"


def test_a_part_that_fails_before_the_fence_finishes_the_push_fails_it(
    path: LayeredPath,
) -> None:
    """A layer's part failed, and vLLM's bookkeeping said so at the step's end, while
    the push's last parts still waited in the fence: the push must fail (D reads it),
    never post its final part with D's notification."""
    worker = path.worker
    fence = worker._fence = HeldBackFence()
    worker._outgoing.early(job(), STEP, deadline=time.monotonic() + 30.0)
    worker.begin_step(PushStep(layered={RID}, number=STEP))
    worker.layer_saved("layer.0")
    fence.run()  # layer 0's part posted
    worker.layer_saved("layer.1")
    worker.write_early()  # the pass's end: its rest and final wait in the fence
    a_part_failed(worker)
    fence.run()  # the fence catches up
    failed_and_kept(worker, path, "a part")


def test_no_part_is_posted_after_the_write_lease(path: LayeredPath) -> None:
    """The fence got to a push's parts only after its write lease ended: none is posted
    (D may have given up on the push), and the push fails."""
    worker = path.worker
    fence = worker._fence = HeldBackFence()
    worker._outgoing.early(job(), STEP, deadline=time.monotonic() + 30.0)
    worker.begin_step(PushStep(layered={RID}, number=STEP))
    worker.layer_saved("layer.0")
    worker.layer_saved("layer.1")
    worker.write_early()
    posted = count_posts(worker)
    with worker._vllm._sending_transfers_lock:  # the lease ends while the fence lags
        worker._write_deadlines[RID] = time.monotonic()
    fence.run()
    assert posted == [], "a part was posted after the write lease"
    until(lambda: (worker.transfer_results(SimpleNamespace(finished_sending=set())),
                   not worker._vllm._sending_transfers)[1], "the push let go", path)
    assert path.notifs == []


def test_a_failed_chunk_fails_the_push_so_that_d_reads_it_instead(path: LayeredPath) -> None:
    """One of a chunk's WRITE handles failed (vLLM's bookkeeping says so): the final
    WRITE must not notify D of a prompt with a hole in it; the push fails, and P keeps
    its blocks for D to read."""
    worker = path.worker
    first_chunk(worker)
    a_part_failed(worker)

    worker._outgoing.early(job(), STEP, deadline=time.monotonic() + 30.0)
    forward_pass(worker, STEP)
    failed_and_kept(worker, path, "a chunk")
    assert worker._chunked == {}


def test_a_request_that_ends_after_its_chunks_holds_nothing(path: LayeredPath) -> None:
    """P's request ended with chunks written and no final WRITE (aborted; vLLM freed its
    blocks): P's scheduler says so with a step, and the worker lets the push go from
    vLLM's bookkeeping once the chunks' WRITEs are done, reporting nothing finished."""
    worker = path.worker
    first_chunk(worker)
    assert RID in worker._vllm._sending_transfers
    dropped = PushStep(number=STEP, chunks_dropped={RID})
    worker.begin_step(dropped)
    worker.take_step(dropped)
    results = SimpleNamespace(finished_sending=set())
    until(lambda: (worker.transfer_results(results), not worker._vllm._sending_transfers)[1],
          "the chunk's handles done and released", path)
    assert worker._chunked == {} and results.finished_sending == set()
    assert path.notifs == []


@pytest.mark.parametrize("arrives", ["mid-pass", "after-the-last-layer", "after-its-step"])
def test_a_chunk_asked_for_late_is_written_in_its_step_or_left_to_the_final_write(
    path: LayeredPath, arrives: str,
) -> None:
    """D registered while P computed the first chunk, so the chunk's WRITE reaches P's
    worker during that step's pass (its layers computed so far go at once), or after its
    last layer (all at once, at the pass's end); or only once the step is over: then it is
    dropped (vLLM may have taken the blocks back since), and the final WRITE writes the
    chunk's block with the rest."""
    worker = path.worker
    worker._early_inbox = SimpleNamespace(take=lambda: [])
    posted = count_posts(worker)

    def chunk_asked() -> None:
        worker._chunk_jobs.append((chunk_job(), STEP - 1, time.monotonic() + 30.0))

    worker.begin_step(PushStep(layered={RID}, number=STEP - 1))
    worker.layer_saved("layer.0")
    if arrives == "mid-pass":
        chunk_asked()
    worker.layer_saved("layer.1")
    # Mid-pass, it was taken up at a layer's hook, to be written by layer.
    assert (RID in worker._chunking) is (arrives == "mid-pass")
    if arrives == "after-the-last-layer":
        chunk_asked()
    worker.write_early()
    if arrives == "after-its-step":
        chunk_asked()
    forward_pass(worker, STEP)  # the next chunk, whose progress asks for nothing new
    written_early = arrives != "after-its-step"
    assert (RID in worker._chunked) is written_early
    assert sorted(i for ids in posted for i in ids) == (
        sorted(descs([1]).tolist()) if written_early else []), "not the chunk's block"

    posted.clear()
    worker._outgoing.early(job(), STEP + 1, deadline=time.monotonic() + 30.0)  # the last
    forward_pass(worker, STEP + 1)
    until(lambda: path.notifs == [b"d-req:1"], "D's notification", path)
    assert path.layer_written(0) and path.layer_written(1)
    end = freed(worker, path)
    assert end.error is None and end.chunked is written_early
    left = [3] if written_early else [1, 3]
    assert sorted(i for ids in posted for i in ids) == sorted(descs(left).tolist()), (
        f"the final WRITE did not write exactly blocks {left}")
    assert worker._chunk_jobs == [] and worker._vllm._sending_transfers == {}
