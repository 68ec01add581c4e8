"""P's half of the dual connector's worker (`connector.worker.DualWorker`): the WRITE.

Each job (started when the step's metadata is bound, before the forward pass; or, for an
early WRITE, which P's channel thread sends straight here (`connector.prefill.early`),
right after the forward pass that completes the job's prompt) performs the NIXL
handshake with D's agent if none is cached yet (vLLM's own, on its background
executor), then WRITEs this rank's share of the blocks with vLLM's push descriptor code;
when every WRITE handle is done, the request is reported finished sending, which frees
P's blocks, and the outcome goes back to the scheduler in a `PushReport`. `release`
requests are reported finished at once. Each push is one record with its state
(`connector.prefill.outgoing`).

- A WRITE that failed or could not start: the blocks stay, under vLLM's own pull lease
  (`pull_fallback_ttl`), so that D can READ them instead; D's READ notification, the
  lease's end or a `release` order frees them.
- Progressive push (`connector.prefill.layers`): a push the step asks to write by layer
  (`PushStep.layered`), whose D registered before the forward pass that completes its
  prompt got to the layer (its early WRITE is in the inbox) and whose handshake with D is
  cached, is planned with vLLM's push code (recorded, not posted) and cut by layer; each
  layer's part is posted from vLLM's per-layer hook (`layer_saved`) as the forward pass
  computes it, the parts of layers computed before the match at once, the rest when the
  pass ends; the last layer's part, with D's notification, once every other part is
  done (the poller posts it). Until then a placeholder handle (`HELD`) keeps the push
  open in vLLM's bookkeeping. Anything else is written whole, as before.
- The write lease: each job comes with its deadline (`PushJob.write_within`): a WRITE not
  posted by then is not posted (it fails, as above), and the poller cancels the WRITE
  handles still in flight then (NIXL's release of a transfer in progress), so that D,
  which may have given up on the push, can reuse its blocks once that deadline, known to
  it, has passed (docs/ARCHITECTURE.md, section 5).

- On a GPU, a WRITE posted during or right after the forward pass first waits for the
  KV it reads to be written (`connector.prefill.fence`): a layer's parts behind a CUDA
  event recorded at its hook, on the fence's thread; a whole early WRITE behind a wait
  for the pass on the engine thread. On CPU the pass is synchronous: nothing waits, but
  a layer's parts are posted on the fence's thread all the same (`ThreadFence`).

Threads: the engine thread runs all of it but `poll_writes`, `_cancel` and
`_post_finals`, which the worker's poller thread runs, and `_post` and
`_finish_layered` (with its `_post_finals`), which the fence's thread runs (with a
`HostFence`, the engine thread). vLLM's push
code keeps its WRITE handles in the worker's `_sending_transfers` (with
`_send_failures`), under `_sending_transfers_lock`; this half keeps each posted WRITE's
deadline and the WRITEs the poller cancelled under that lock too, and the layered
pushes waiting for their final parts (`_finishing`); a layered push's parts are posted
under it. Its other state is the engine thread's. A `LayeredWrite` marks its parts
posted on the engine thread during the pass (`due`), and on the fence's thread after it
(`rest`, in `_finish_layered`), once the engine thread has let it go (`_layering`
emptied at the pass's end).
"""

from __future__ import annotations

import collections
import logging
import math
import queue
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from connector.prefill.channel import StartWrite
from connector.prefill.early import EarlyInbox
from connector.prefill.fence import Fence, HostFence
from connector.prefill.layers import (
    HELD,
    ChunkCover,
    LayeredWrite,
    PlannedWrite,
    RecordingAgent,
    RegionLayers,
    layout_refusal,
)
from connector.prefill.outgoing import OutgoingPush, OutgoingPushes, OutgoingState
from connector.protocol.step import PushJob, PushReport, PushStep
from connector.vllm_compat import RemoteMeta, ReqMeta

if TYPE_CHECKING:
    from connector.vllm_compat import KVConnectorTransferResults, PullPushWorker

logger = logging.getLogger("vllm.pd_connector.worker")

# How many requests let go of lately `PrefillWorker` remembers (a late chunk is dropped).
_DROPPED_KEPT = 1024


class PrefillWorker:
    """P's WRITEs on this rank, from their job (or early WRITE) to the step that hands
    their blocks back to vLLM."""

    def __init__(self, vllm: PullPushWorker, *, pull_fallback_ttl: float,
                 early_at: tuple[str, int, int, int] | None, rank: int = 0,
                 wake_poller: Callable[[], None], fence: Fence | None = None) -> None:
        """`early_at`: this server's engine id, data-parallel index and push port, and
        this worker's rank, where P's channel thread sends early WRITEs (None: this
        server makes none); `rank`: this worker's (a job names the ranks it is for);
        `fence`: where those, and layers' WRITEs, wait for the forward's KV (None: a
        CPU's)."""
        self._vllm = vllm
        self._rank = rank
        self._fence: Fence = fence or HostFence()
        self._pull_fallback_ttl = pull_fallback_ttl
        self._wake_poller = wake_poller  # the worker's poller polls the WRITEs in flight
        # Under vLLM's `_sending_transfers_lock`: each posted WRITE's deadline (the write
        # lease), and the WRITEs the poller cancelled at theirs.
        self._write_deadlines: dict[str, float] = {}
        self._cancelled: set[str] = set()
        # One record per push this rank WRITEs, from its job (or early WRITE) to the step
        # that hands its blocks back to vLLM, and the ends for the next PushReport.
        self._outgoing = OutgoingPushes()
        # Early WRITEs from P's channel thread, if this server makes them; the number of
        # the step now running.
        self._early_inbox = None if early_at is None else EarlyInbox(StartWrite, *early_at)
        self._step_number = 0
        # Jobs whose handshake with D finished (P's request id, its error), from vLLM's
        # handshake executor.
        self._handshaken: queue.SimpleQueue[tuple[str, BaseException | None]] = (
            queue.SimpleQueue())
        # Progressive push: which layer each KV region holds (None: this worker writes
        # every push whole, `_layers_refusal` says why); the P requests this step asks
        # to write by layer, the layers its forward pass has computed so far, and the
        # layered pushes it is writing; then, under vLLM's lock, those waiting for their
        # other parts to be done before their final parts are posted.
        self._layers: RegionLayers | None = None
        self._layers_refusal: str | None = "the KV caches are not registered yet"
        self._layered_wanted: set[str] = set()
        self._computed: set[int] = set()
        self._layering: dict[str, LayeredWrite] = {}
        self._finishing: dict[str, LayeredWrite] = {}
        # Layered pushes that failed to start during the forward pass, ended after it:
        # vLLM's `start_load_kv` runs between the two, and a push ended before it would
        # go under vLLM's pull lease (`lease_for_pull`) while vLLM may still list the
        # request as not processed (its check that no such request has a lease fails).
        self._ending: list[tuple[OutgoingPush, str]] = []
        # Chunk WRITEs (a layered push whose prompt is computed in chunks: its blocks so
        # far, written while later chunks compute; `PushJob.chunk`): those taken from the
        # inbox and not started yet, with their steps and deadlines (the write lease, from
        # when they were taken); those this step writes by layer;
        # by request, the descriptors they posted, which its final WRITE skips; and, under
        # vLLM's lock, the requests one of whose chunk WRITEs failed or was cancelled (its
        # final WRITE then writes every block).
        self._chunk_jobs: list[tuple[PushJob, int, float]] = []
        self._chunking: dict[str, LayeredWrite] = {}
        self._chunked: dict[str, ChunkCover] = {}
        self._chunks_failed: set[str] = set()
        # The requests let go of lately (a chunk that comes after is not written).
        self._chunks_dropped: collections.OrderedDict[str, None] = collections.OrderedDict()

    def kv_caches_registered(self, *, groups: int) -> None:
        """After vLLM registered the KV caches with NIXL: can pushes be cut by layer?"""
        vllm = self._vllm
        names = list(getattr(vllm, "region_names", None) or ())
        self._layers_refusal = layout_refusal(
            region_names=names, has_state=bool(getattr(vllm, "_has_mamba", False)),
            groups=groups, routed_by_layer=bool(getattr(vllm, "_transfer_layer_group_ids", None)))
        if self._early_inbox is None:
            self._layers_refusal = "no early WRITEs on this server (pipeline stages, a KV " \
                                   "cache copied to a host buffer, or early_write off)"
        if self._layers_refusal is None:
            self._layers = RegionLayers(names, vllm.dst_region_num_blocks[vllm.engine_id])
            vllm.nixl_wrapper = RecordingAgent(vllm.nixl_wrapper)
            logger.info("pushes may be written layer by layer (%d layers)", len(self._layers))
        else:
            logger.info("pushes are written whole: %s", self._layers_refusal)

    # --- each step: the scheduler's orders ------------------------------------------------

    def begin_step(self, step: PushStep) -> None:
        """The step's number, and the early WRITEs of earlier steps that came late; the
        pushes this step would write by layer (started from its layers' hooks)."""
        self._step_number = step.number
        self._computed.clear()
        self._layered_wanted = step.layered if self._layers is not None else set()
        for rid in step.chunks_dropped:
            self._drop_chunks(rid)  # its request ended before its prompt was computed
        with self._vllm._sending_transfers_lock:
            for rid in step.chunks_failed & self._chunked.keys():
                self._chunks_failed.add(rid)  # chunks written from blocks vLLM took back
        self._start_early(forward_done=False)

    def take_step(self, step: PushStep) -> None:
        """The step's WRITEs to start, and the blocks to release."""
        waited = False
        for job in step.jobs:
            if job.ranks is not None and self._rank not in job.ranks:
                continue  # it came here early
            if job.early_step is not None and not waited:
                # An early WRITE that reached the engine instead: with vLLM's async
                # scheduling, the pass that computed its prompt may still run on a GPU.
                self._fence.wait_for_forward()
                waited = True
            self._start_job(job)
        self.write_handshaken()
        vllm = self._vllm
        for rid in step.release:
            # A failed push's blocks, kept for a READ that will not come: drop the lease
            # (vLLM's, unless they were not put under it yet).
            was = self._outgoing.release(rid)
            if was is None and rid in self._chunked:
                self._drop_chunks(rid)  # no final WRITE: D gave up on the push
            if was is None or was is OutgoingState.RELEASED:
                if vllm._reqs_to_send.pop(rid, None) is not None:
                    vllm._reqs_to_process.discard(rid)
            elif was is not OutgoingState.HELD:
                logger.warning("request %s: release of blocks a WRITE still reads (%s); "
                               "its end frees them", rid, was.value)

    def write_early(self) -> None:
        """Right after the step's forward pass (vLLM's `wait_for_save`): the layered
        pushes' parts not posted yet, then the early WRITEs of the prompts it completed,
        whole; each once the pass's KV is written (`fence`)."""
        for record, error in self._ending:
            self._end(record, error)
        self._ending = []
        if self._layering:
            pushes = list(self._layering.values())
            self._fence.after_queued_work(lambda: self._finish_layered(pushes))
            self._layering = {}
        for chunk in self._chunking.values():
            self._post_after_layer(chunk, chunk.rest())
        self._chunking = {}
        self._layered_wanted = set()
        self._start_early(forward_done=True)

    def layer_saved(self, layer_name: str) -> None:
        """vLLM's per-layer hook, during the forward pass: `layer_name`'s KV is computed.
        Post that layer's part of each layered push, starting those whose D registered
        since (their layers computed so far go at once)."""
        if not self._layered_wanted:
            return
        assert self._layers is not None
        layer = self._layers.index.get(layer_name)
        if layer is None:
            return
        self._computed.add(layer)
        self._start_early(forward_done=False)  # new matches from P's channel thread
        self._start_layered()
        for push in (*self._layering.values(), *self._chunking.values()):
            self._post_after_layer(push, push.due((layer,)))

    def _start_early(self, *, forward_done: bool) -> None:
        """Start the early WRITEs whose blocks are computed: their step is an earlier one,
        or this one once its forward pass is done; and, once it is, this step's chunk
        WRITEs not started during it. A chunk WRITE whose step is over is dropped (vLLM may
        have taken its blocks back since, preempting the request): the push's final WRITE
        carries its blocks."""
        if self._early_inbox is None:
            return
        for write in self._early_inbox.take():  # from P's channel thread, on this host
            now = time.monotonic()
            job = PushJob.of(write, now)
            if job.chunk:
                self._chunk_jobs.append((job, write.early_step or self._step_number,
                                         now + job.write_within))
            else:
                self._outgoing.early(job, write.early_step, deadline=now + job.write_within)
        current = self._step_number
        for job, _ in self._take_chunk_jobs(lambda job, step: step < current):
            logger.debug("push %s: a chunk's WRITE came after its step; the final WRITE "
                         "carries its blocks", job.transfer_id)
        chunks = self._take_chunk_jobs(lambda job, step: step == current) \
            if forward_done else []
        due = current if forward_done else current - 1
        records = list(self._outgoing.early_due(due))
        if chunks or records:
            # On a GPU the pass that computed their blocks may still run: this step's,
            # or, with vLLM's async scheduling, the step before.
            self._fence.wait_for_forward()
        for job, deadline in chunks:
            self._write_chunk(job, deadline, whole=True)
        for record in records:
            assert record.job is not None
            self._start_job(record.job)

    def _take_chunk_jobs(self, due: Callable[[PushJob, int], bool],
                         ) -> list[tuple[PushJob, float]]:
        """The chunk jobs waiting that are `due` (by job and step), with their deadlines,
        no longer waiting."""
        taken = [(job, deadline) for job, step, deadline in self._chunk_jobs if due(job, step)]
        if taken:
            self._chunk_jobs = [entry for entry in self._chunk_jobs
                                if not due(entry[0], entry[1])]
        return taken

    def lease_for_pull(self) -> None:
        """Put failed WRITEs' blocks under vLLM's pull lease. Only after vLLM's pull code
        has handled the step's `reqs_not_processed` (`start_load_kv`): it holds that none
        of those has a lease, and a push that fails at once is in that list in its step."""
        for rid, expiry in self._outgoing.take_held():
            self._vllm._reqs_to_process.add(rid)
            self._vllm._reqs_to_send[rid] = expiry

    def write_handshaken(self) -> None:
        """WRITE the jobs whose handshake with D finished since the last call."""
        while True:
            try:
                rid, error = self._handshaken.get_nowait()
            except queue.Empty:
                return
            record = self._outgoing.get(rid)
            if record is None or record.state is not OutgoingState.HANDSHAKING:
                continue  # cannot happen: only the handshake's end moves it on
            if error is None:
                self._outgoing.handshaken(record)
                self._write(record)
            else:
                self._end(record, f"handshake with D failed: {error}")

    # --- the WRITE, layer by layer ---------------------------------------------------------

    def _start_layered(self) -> None:
        """Start, by layer, the early WRITEs and chunk WRITEs of this step that it asks to
        write so."""
        if not self._layered_wanted:
            return
        for job, deadline in self._take_chunk_jobs(
                lambda job, step: step == self._step_number
                and job.request_id in self._layered_wanted):
            self._write_chunk(job, deadline, whole=False)
        for record in self._outgoing.early_due(self._step_number):
            if record.early_step == self._step_number \
                    and record.request_id in self._layered_wanted:
                self._write_layered(record)

    def _write_layered(self, record: OutgoingPush) -> None:
        job = record.job
        assert job is not None and self._layers is not None
        vllm = self._vllm
        with vllm._handshake_lock:
            ready = job.decode_engine_id in vllm._remote_agents
        if not ready or time.monotonic() >= record.deadline:
            # Written whole after the forward pass (its handshake, or its lapse, then).
            self._layered_wanted.discard(job.request_id)
            return
        self._outgoing.start(job, handshaking=False, now=time.perf_counter())
        record.layered = True
        if job.fail_on_purpose:
            self._ending.append((record, "WRITE failed on purpose (fail_write, "
                                         "fault_injection on)"))
            self._layered_wanted.discard(job.request_id)
            return
        try:
            push = LayeredWrite.plan(job.request_id, self._skip_chunks(job, self._plan(job)),
                                     self._layers)
        except Exception as exc:  # a layout vLLM's push code refuses, or NIXL itself
            logger.exception("push %s: WRITE could not start", job.transfer_id)
            self._ending.append((record, f"WRITE could not start: {exc}"))
            self._layered_wanted.discard(job.request_id)
            return
        self._hold(job.request_id, record.deadline)
        self._layering[job.request_id] = push
        self._post_after_layer(push, push.due(self._computed))
        self._wake_poller()

    def _hold(self, rid: str, deadline: float) -> None:
        """Keep `rid`'s push open in vLLM's bookkeeping (`HELD`, once) until its final
        parts are posted; its WRITEs are posted by `deadline` (the latest of its leases)."""
        vllm = self._vllm
        with vllm._sending_transfers_lock:
            handles = vllm._sending_transfers[rid]
            if HELD not in handles:
                handles.append(HELD)
            self._write_deadlines[rid] = max(self._write_deadlines.get(rid, deadline), deadline)

    # --- the WRITE of a chunk, and of what chunks left -------------------------------------

    def _write_chunk(self, job: PushJob, deadline: float, *, whole: bool) -> None:
        """Start a chunk's WRITE of this step, by layer: the layers computed so far at once,
        the others as the pass computes them (`whole`: the pass is done, all at once),
        none with a notification, none posted after `deadline`. One that cannot start now
        is dropped: the push's final WRITE writes its blocks."""
        vllm = self._vllm
        rid = job.request_id
        with vllm._handshake_lock:
            ready = job.decode_engine_id in vllm._remote_agents
        if self._layers is None or not ready or time.monotonic() >= deadline \
                or self._outgoing.get(rid) is not None or rid in self._chunks_dropped \
                or rid in self._chunking:
            # Left to the final WRITE (no handshake yet; its final began; a chunk of this
            # step being written already), or its request is gone.
            return
        try:
            planned = self._plan(job)
            chunk = LayeredWrite.plan(rid, planned, self._layers, notify=False)
        except Exception:  # a layout vLLM's push code refuses, or NIXL itself
            logger.exception("push %s: a chunk's WRITE could not start; the final WRITE "
                             "carries its blocks", job.transfer_id)
            return
        cover = self._chunked.setdefault(rid, ChunkCover())
        for write in planned:
            cover.add(write)
        self._hold(rid, deadline)
        if whole:
            self._post_after_layer(chunk, chunk.rest())
        else:
            self._chunking[rid] = chunk
            self._post_after_layer(chunk, chunk.due(self._computed))
        self._wake_poller()

    def _skip_chunks(self, job: PushJob, planned: list[PlannedWrite]) -> list[PlannedWrite]:
        """A push's planned WRITEs without what its chunk WRITEs posted."""
        cover = self._chunked.get(job.request_id)
        if cover is None:
            return planned
        record = self._outgoing.get(job.request_id)
        if record is not None:
            record.chunked = True
        return [write for write in map(cover.skip, planned) if write is not None]

    def _write_after_chunks(self, record: OutgoingPush) -> None:
        """The final WRITE of a push that chunk WRITEs began, started after the forward
        pass: what the chunks left, its final parts (D's notification) once every part,
        the chunks' too, is done (`_post_finals`)."""
        job = record.job
        assert job is not None and self._layers is not None
        try:
            push = LayeredWrite.plan(job.request_id, self._skip_chunks(job, self._plan(job)),
                                     self._layers)
        except Exception as exc:  # a layout vLLM's push code refuses, or NIXL itself
            logger.exception("push %s: WRITE could not start", job.transfer_id)
            self._end(record, f"WRITE could not start: {exc}")
            return
        self._hold(job.request_id, record.deadline)
        # Behind the fence: on a GPU the chunks' parts may still wait in it, and the
        # final part must follow them.
        self._fence.after_queued_work(lambda: self._finish_layered([push]))
        self._wake_poller()

    def _drop_chunks(self, rid: str) -> None:
        """`rid`'s push is over (or will have no final WRITE): forget its chunks, and let
        vLLM's bookkeeping end it once their WRITEs are done."""
        self._chunked.pop(rid, None)
        self._chunking.pop(rid, None)
        self._chunks_dropped[rid] = None
        while len(self._chunks_dropped) > _DROPPED_KEPT:
            self._chunks_dropped.popitem(last=False)
        self._take_chunk_jobs(lambda job, step: job.request_id == rid)
        with self._vllm._sending_transfers_lock:
            self._chunks_failed.discard(rid)
            self._drop_held(rid)

    def _plan(self, job: PushJob) -> list[PlannedWrite]:
        """The WRITEs vLLM's push code would post for `job`, recorded, not posted."""
        vllm = self._vllm
        key = f"{job.request_id}\x00plan"  # its handles (placeholders) are dropped below
        agent = vllm.nixl_wrapper
        assert isinstance(agent, RecordingAgent)
        vllm._engine_last_active[job.decode_engine_id] = time.perf_counter()
        with agent.recording() as planned:
            try:
                vllm._xfer_blocks_for_req(key, self._meta(job))
            finally:
                with vllm._sending_transfers_lock:
                    vllm._sending_transfers.pop(key, None)
        return planned

    def _post_after_layer(self, push: LayeredWrite, parts: list[PlannedWrite]) -> None:
        """Post `parts` once the layers they read are computed (`fence`)."""
        if parts:
            self._fence.after_queued_work(lambda: self._post(push, parts))

    def _finish_layered(self, pushes: list[LayeredWrite]) -> None:
        """After the forward pass (behind its fence): post each layered push's parts not
        posted yet, then hand it to `_post_finals` for its final parts."""
        for push in pushes:
            self._post(push, push.rest())
        with self._vllm._sending_transfers_lock:
            self._finishing.update((push.request_id, push) for push in pushes)
            self._post_finals()

    def _post(self, push: LayeredWrite, parts: list[PlannedWrite]) -> None:
        """Post `parts` of `push` (none with a notification), while the push is open (its
        placeholder handle in vLLM's bookkeeping: not failed, nor cancelled at the end of
        its write lease, which may have passed while a fence waited). A part that cannot
        be posted fails the push: its final parts are never posted. The fence's thread
        (a `HostFence`'s caller's)."""
        vllm = self._vllm
        agent = vllm.nixl_wrapper
        rid = push.request_id
        for part in parts:
            # The lock for one part at a time: over TCP a post copies its bytes, and the
            # engine thread and the poller take this lock every step.
            with vllm._sending_transfers_lock:
                handles = vllm._sending_transfers.get(rid)
                if not handles or HELD not in handles or not self._in_lease(rid):
                    return
                try:
                    handle = agent.make_prepped_xfer("WRITE", part.local_handle,
                                                     part.local_ids, part.remote_handle,
                                                     part.remote_ids, b"")
                    handles.append(handle)
                    agent.transfer(handle)
                except Exception:
                    logger.exception("push of request %s: a layer's WRITE could not be "
                                     "posted", rid)
                    self._drop_held(rid)
                    vllm._send_failures.add(rid)
                    return

    def _in_lease(self, rid: str) -> bool:
        """(Under vLLM's lock.) Whether `rid`'s WRITEs may still be posted: its write
        lease has not ended. One that has is failed here (the poller cancels what is in
        flight at the same deadline), so that nothing is posted after it."""
        if time.monotonic() < self._write_deadlines.get(rid, math.inf):
            return True
        self._drop_held(rid)
        self._vllm._send_failures.add(rid)
        return False

    def _post_finals(self) -> None:
        """(Under vLLM's lock; engine, poller or fence thread.) Post the final parts, with
        D's notification, of each layered push whose other parts are all done; drop those
        that failed or were cancelled meanwhile, or whose write lease ended."""
        vllm = self._vllm
        agent = vllm.nixl_wrapper
        for rid, push in list(self._finishing.items()):
            handles = vllm._sending_transfers.get(rid)
            if not handles or HELD not in handles:  # cancelled at its deadline, or failed
                del self._finishing[rid]
                continue
            if rid in self._chunks_failed or rid in vllm._send_failures \
                    or not self._in_lease(rid):
                # a part (a chunk's, maybe) failed or was cancelled, or the write lease
                # ended: D reads instead
                self._drop_held(rid)
                vllm._send_failures.add(rid)
                continue
            states = [agent.check_xfer_state(h) for h in handles if h is not HELD]
            if any(state not in ("DONE", "PROC") for state in states):
                self._drop_held(rid)  # vLLM's bookkeeping reports the failed part
                continue
            if any(state == "PROC" for state in states):
                continue
            try:
                for part in push.final:
                    handle = agent.make_prepped_xfer(
                        "WRITE", part.local_handle, part.local_ids, part.remote_handle,
                        part.remote_ids, part.notif)
                    handles.append(handle)
                    agent.transfer(handle)
            except Exception:
                logger.exception("push of request %s: its last layer's WRITE could not be "
                                 "posted", rid)
                vllm._send_failures.add(rid)
            self._drop_held(rid)

    def _drop_held(self, rid: str) -> None:
        """(Under vLLM's lock.) The layered push `rid` posts nothing more: its handles
        decide its end."""
        handles = self._vllm._sending_transfers.get(rid)
        if handles is not None and HELD in handles:
            handles.remove(HELD)
        self._finishing.pop(rid, None)

    # --- the WRITE, whole ------------------------------------------------------------------

    def _start_job(self, job: PushJob) -> None:
        future = self._vllm._ensure_handshake(
            job.decode_engine_id, job.decode_host, job.decode_port, job.decode_tp_size)
        record = self._outgoing.start(job, handshaking=future is not None,
                                      now=time.perf_counter(),
                                      deadline=time.monotonic() + job.write_within)
        if future is None:
            self._write(record)
            return

        def handshake_done(f: Future[Any], rid: str = job.request_id) -> None:
            self._handshaken.put((rid, f.exception()))

        future.add_done_callback(handshake_done)

    def _write(self, record: OutgoingPush) -> None:
        job = record.job
        assert job is not None and record.state is OutgoingState.WRITING
        if job.fail_on_purpose:
            self._end(record, "WRITE failed on purpose (fail_write, fault_injection on)")
            return
        if time.monotonic() >= record.deadline:
            self._end(record, "not posted: its write lease ended first (D may have given up "
                              "on the push, and may reuse its blocks)")
            return
        if job.request_id in self._chunked:
            self._write_after_chunks(record)
            return
        vllm = self._vllm
        vllm._engine_last_active[job.decode_engine_id] = time.perf_counter()
        try:
            vllm._xfer_blocks_for_req(job.request_id, self._meta(job))
        except Exception as exc:  # a layout vLLM's push code refuses, or NIXL itself
            logger.exception("push %s: WRITE could not start", job.transfer_id)
            self._end(record, f"WRITE could not start: {exc}")
            return
        with vllm._sending_transfers_lock:
            submitted = bool(vllm._sending_transfers.get(job.request_id))
            if submitted:
                self._write_deadlines[job.request_id] = record.deadline
        if not submitted:
            self._end(record, "WRITE could not start (see the log above)")
            return
        if self.poll_writes():  # a small WRITE is often done at its first poll
            self._wake_poller()

    def _meta(self, job: PushJob) -> ReqMeta:
        """What vLLM's push code takes for `job`'s WRITE (a fresh one: it changes it)."""
        vllm = self._vllm
        local = [list(group) for group in job.block_ids]
        return ReqMeta(
            local_block_ids=local,
            local_physical_block_ids=vllm._logical_to_kernel_block_ids(
                local, vllm._physical_blocks_per_logical_kv_block),
            tp_size=vllm.world_size,
            remote=RemoteMeta(
                block_ids=[list(group) for group in job.decode_block_ids], host="", port=0,
                engine_id=job.decode_engine_id, request_id=job.decode_request_id),
        )

    def poll_writes(self) -> bool:
        """Poll every WRITE in flight once: NIXL moves a WRITE's bytes, and sends its
        notification, only while it is polled. True while any is still going.

        Only polls, but for a WRITE still in flight at its deadline (the write lease),
        whose handles it cancels (NIXL's release of a transfer in progress; one that NIXL
        cannot cancel yet is tried again at the next poll). The engine thread collects
        and releases finished handles (under the same lock) in `transfer_results`."""
        pending = False
        now = time.monotonic()
        vllm = self._vllm
        with vllm._sending_transfers_lock:
            for rid, handles in vllm._sending_transfers.items():
                overdue = self._write_deadlines.get(rid, math.inf) <= now
                for handle in list(handles):
                    try:
                        in_flight = vllm.nixl_wrapper.check_xfer_state(handle) == "PROC"
                    except Exception:  # the engine thread reports it when it polls
                        continue
                    if in_flight and overdue and self._cancel(rid, handle):
                        handles.remove(handle)
                    else:
                        pending |= in_flight
            if self._finishing:
                self._post_finals()
        return pending

    def _cancel(self, rid: str, handle: int) -> bool:
        """Cancel a WRITE handle of `rid` in flight past its deadline (under the lock):
        True once NIXL released it (nothing more of it is written)."""
        if not self._vllm._try_release_xfer_handle(rid, handle):  # logs why, keeps it
            return False
        if rid not in self._cancelled:
            logger.warning("request %s: a push WRITE still in flight at the end of its write "
                           "lease was cancelled", rid)
        self._cancelled.add(rid)
        self._vllm._send_failures.add(rid)
        return True

    def _end(self, record: OutgoingPush, error: str | None) -> None:
        """The job is over on this rank: report the outcome, and free P's blocks, or,
        when the WRITE failed, keep them under vLLM's pull lease for D to READ."""
        self._outgoing.ended(record, error, now=time.perf_counter(),
                             lease_ttl=self._pull_fallback_ttl)
        if record.request_id in self._chunked:
            self._drop_chunks(record.request_id)

    # --- each step: what finished ---------------------------------------------------------

    def transfer_results(self, results: KVConnectorTransferResults) -> None:
        """The WRITEs whose handles are all done, ended; the blocks released since the
        last step, reported finished sending in `results` (vLLM's, of this step)."""
        vllm = self._vllm
        with vllm._sending_transfers_lock:
            done, failed = vllm._pop_done_transfers(vllm._sending_transfers)
            failed |= vllm._send_failures  # from submitting WRITEs, since the last step
            vllm._send_failures.clear()
            for rid in failed - self._chunked.keys():
                # A layered push's part failed: no final part, the push fails. Its other
                # parts may still wait in the fence (not in `_finishing` yet), and vLLM
                # has let go of the failed handle: what keeps the push open goes now.
                # (A chunked push's failure is kept in `_chunks_failed`, below.)
                self._drop_held(rid)
            self._chunks_failed |= failed & self._chunked.keys()
            cancelled = self._cancelled & done
            self._cancelled -= done
            for rid in done:
                self._write_deadlines.pop(rid, None)
        self._outgoing.failed(failed)
        for rid in done:
            record = self._outgoing.get(rid)
            if record is not None and record.state is OutgoingState.WRITING:
                self._end(record, "WRITE cancelled: not done when its write lease ended"
                          if rid in cancelled else "WRITE failed" if record.failed else None)
        released = self._outgoing.take_released()
        if released:
            results.finished_sending.update(released)

    def read_done(self, req_id: str, expected: int, done: set[str]) -> None:
        """D finished reading `req_id` (pull). Same accounting as vLLM's pull worker."""
        vllm = self._vllm
        if req_id not in vllm._reqs_to_send and req_id not in vllm._reqs_to_process:
            vllm.xfer_stats.record_notification_after_expiry()  # type: ignore[no-untyped-call]
            logger.error("KV blocks of unknown request %s were read by a decode worker; "
                         "they may have expired", req_id)
            return
        vllm.expected_consumer_notifications_by_req[req_id] = expected
        vllm.consumer_notification_counts_by_req[req_id] += 1
        if vllm.consumer_notification_counts_by_req[req_id] == expected:
            done.add(req_id)
            del vllm.consumer_notification_counts_by_req[req_id]
            del vllm.expected_consumer_notifications_by_req[req_id]
            vllm._reqs_to_process.remove(req_id)
            vllm._reqs_to_send.pop(req_id, None)

    def take_report(self) -> PushReport | None:
        return self._outgoing.take_report()

    def close_inbox(self) -> None:
        if self._early_inbox is not None:
            self._early_inbox.close()

    def close_fence(self) -> None:
        """At shutdown, before the poller stops: post what the fence holds (bounded)."""
        self._fence.close()

    def release_writes(self) -> None:
        """At shutdown: release every WRITE handle still held (the poller has stopped)."""
        vllm = self._vllm
        with vllm._sending_transfers_lock:
            for handles in vllm._sending_transfers.values():
                for handle in handles:
                    vllm._try_release_xfer_handle("shutdown", handle)
            vllm._sending_transfers.clear()
            self._write_deadlines.clear()
