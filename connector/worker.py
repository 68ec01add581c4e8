"""The dual connector's worker side: vLLM's pull worker, plus the push WRITE path.

Pull requests go through vLLM's `NixlPullConnectorWorker` untouched (READ, notify P).
Push adds, per step (`PushStep`, from the scheduler):

- D: `recv` requests wait, without a READ, for the WRITE's notification
  (`"<D request id>:<P's world size>"`); `failed` ones are failed at once (vLLM then
  recomputes, or frees an aborted request's blocks).
- P: each job (started in `start_step`, when the step's metadata is bound, before the
  forward pass; or, for an early WRITE, which P's channel thread sends straight here
  (`connector.prefill.early`), in `write_early`, right after the forward pass that completes the
  job's prompt) performs the NIXL handshake with D's agent if none is cached yet
  (vLLM's own, on its background executor), then WRITEs this rank's share of the blocks
  with vLLM's push descriptor code; when every WRITE handle is done, the request is
  reported finished sending, which frees P's blocks, and the outcome goes back to the
  scheduler in a `PushReport`. `release` requests are reported finished at once. Each
  push is one record with its state (`connector.prefill.outgoing`).
- P, a WRITE that failed or could not start: the blocks stay, under vLLM's own pull
  lease (`pull_fallback_ttl`), so that D can READ them instead; D's READ notification,
  the lease's end or a `release` order frees them.
- P, the write lease: each job comes with its deadline (`PushJob.write_within`): a WRITE
  not posted by then is not posted (it fails, as above), and the poller cancels the
  WRITE handles still in flight then (NIXL's release of a transfer in progress), so that
  D, which may have given up on the push, can reuse its blocks once that deadline, known
  to it, has passed (docs/ARCHITECTURE.md, section 5).
- D: `pull` requests (the push failed, P offered its blocks) READ them with vLLM's pull
  code, as if they had been a pull from the start.

A small poller thread (`_poll`) keeps both ends of a push moving between engine steps:
NIXL moves a WRITE only while the agents at both ends are polled, and the engine polls
once per step, which on P is after a whole forward pass. On P it polls the WRITEs in
flight; on D, while a push is awaited, it fetches the notifications for the engine
thread. The engine thread still collects finished WRITEs in `get_transfer_results`, and
handles every notification (the scheduler keeps the engines stepping while a push is
alive). Each poll is guarded like the side-channel threads' passes
(`connector.shared.channel_thread.Guard`): an exception is counted and logged, and polling goes
on; a poller that dies makes the next step raise `ThreadDied` (`start_step`), which
stops the engine and fails vLLM's health check, instead of leaving pushes stuck.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import defaultdict
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from connector.config import DualConfig
from connector.decode.incoming import IncomingPushes
from connector.decode.wake import WakeSender
from connector.prefill.channel import StartWrite
from connector.prefill.early import EarlyInbox
from connector.prefill.outgoing import OutgoingPush, OutgoingPushes, OutgoingState
from connector.protocol.side_channel import PullOffer
from connector.protocol.step import PushJob, PushReport, PushStep
from connector.shared.channel_thread import Guard
from connector.shared.pages import small_pages
from connector.shared.progress import agent_progress
from connector.shared.tp_plan import keeps_state, writers_per_decode_rank
from connector.vllm_compat import (
    NixlConnectorMetadata,
    PullPushWorker,
    RemoteMeta,
    ReqMeta,
    on_cpu,
)

if TYPE_CHECKING:
    import torch

    from connector.vllm_compat import KVCacheConfig, KVConnectorTransferResults, VllmConfig

logger = logging.getLogger("vllm.pd_connector.worker")

_POLL_S = 0.0002  # between two polls of the poller thread, while it has work


def block_size_refusal(local: tuple[int, int], remote: tuple[int, int], *,
                       on_cpu: bool) -> str | None:
    """Why this worker refuses a transfer with a peer, from each side's (kernel block
    size, kernel blocks per logical block); None: it does not. Only CPU servers refuse
    (vLLM's READ between block sizes gives wrong tokens there; on GPU it is vLLM's own,
    untested here)."""
    if not on_cpu or local == remote:
        return None
    return (f"KV block size mismatch: local {local[0] * local[1]} (kernel {local[0]}), "
            f"peer {remote[0] * remote[1]} (kernel {remote[0]}); vLLM's transfer between "
            "block sizes is not correct on CPU: start P and D with the same --block-size")


def state_tp_refusal(local_tp: int, remote_tp: int, *, keeps_state: bool,
                     on_cpu: bool) -> str | None:
    """Why this worker refuses a transfer of a model with Mamba state with a peer of
    another tp size; None: it does not. Only CPU servers refuse (vLLM's READ of the state
    between tp sizes gives wrong tokens there; on GPU it is vLLM's own, untested here)."""
    if not on_cpu or not keeps_state or local_tp == remote_tp:
        return None
    return (f"the model keeps Mamba state, and vLLM's transfer of it between tp sizes is "
            f"not correct on CPU: local tp {local_tp}, peer tp {remote_tp}; run P and D "
            "with the same --tensor-parallel-size")


class DualWorker(PullPushWorker):
    # vLLM's pull worker, with its push worker's WRITE code (`_xfer_blocks_for_req`),
    # which needs `_sending_transfers`, its lock and `_send_failures`, set below.

    def __init__(
        self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig
    ) -> None:
        assert vllm_config.kv_transfer_config is not None
        config = DualConfig.from_extra_config(
            vllm_config.kv_transfer_config.kv_connector_extra_config)
        with agent_progress(config.nixl_progress_thread):
            super().__init__(vllm_config, engine_id, kv_cache_config)
        self._pull_fallback_ttl = config.pull_fallback_ttl
        # What the handshake checks a peer against (`add_remote_agent`).
        self._local_tp = vllm_config.parallel_config.tensor_parallel_size
        self._keeps_state = keeps_state(vllm_config.model_config)
        # P: vLLM's push code's own state, by P's request id, which it fills and our
        # poller reads (under the lock): WRITE handles, and those that failed (folded
        # into our records each step).
        self._sending_transfers: defaultdict[str, list[int]] = defaultdict(list)
        self._sending_transfers_lock = threading.Lock()
        self._send_failures: set[str] = set()
        # P, under that lock too: each posted WRITE's deadline (the write lease), and the
        # WRITEs the poller cancelled at theirs.
        self._write_deadlines: dict[str, float] = {}
        self._cancelled: set[str] = set()
        # P: one record per push this rank WRITEs, from its job (or early WRITE) to the
        # step that hands its blocks back to vLLM, and the ends for the next PushReport.
        self._outgoing = OutgoingPushes()
        # P: early WRITEs from P's channel thread, if this server makes them; the number
        # of the step now running.
        self._early_inbox: EarlyInbox | None = None
        if config.writes_early(on_cpu(), vllm_config.parallel_config.world_size):
            dp_index = vllm_config.parallel_config.data_parallel_index
            self._early_inbox = EarlyInbox(StartWrite, engine_id, dp_index,
                                           config.push_port + dp_index)
        self._step_number = 0
        # P: jobs whose handshake with D finished (P's request id, its error), from vLLM's
        # handshake executor.
        self._handshaken: queue.SimpleQueue[tuple[str, BaseException | None]] = (
            queue.SimpleQueue())
        # D: the pushes this worker receives, each awaited until its WRITEs' notifications
        # came, then landed until D's handshake with its P is done (`IncomingPushes`).
        self._incoming = IncomingPushes()
        # The poller thread (started with the first push), woken when a push starts; and
        # the notifications it fetched on D, for the engine thread.
        self._poll_wanted = threading.Event()
        self._stopping = threading.Event()
        self._poller: threading.Thread | None = None
        self._poller_guard = Guard("pd-nixl-poller")
        self._inbox: list[list[bytes]] = []
        self._inbox_lock = threading.Lock()
        # D: where the poller tells the scheduler, which may be pausing, that
        # notifications came.
        self._wake_at = (engine_id, vllm_config.parallel_config.data_parallel_index)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        cache = next(iter(kv_caches.values()), None)
        if cache is not None and cache.device.type == "cpu" and small_pages(cache.data_ptr()):
            logger.info("the KV cache is on 4 KiB pages: start vLLM with "
                        "THP_MEM_ALLOC_ENABLE=1 to put it on huge pages, which makes KV "
                        "transfers between CPU servers (pull and push) faster")
        super().register_kv_caches(kv_caches)

    def add_remote_agent(self, nixl_agent_meta: Any, remote_tp_rank: int = 0,
                         remote_tp_size: int = 1, *args: Any, **kwargs: Any) -> str:
        """vLLM's handshake step with a peer's agent, refusing on a CPU server a peer whose
        KV blocks differ in size from this one's, or, for a model with Mamba state, whose
        tp size differs: vLLM 0.32's READ of either on CPU gives wrong tokens (measured:
        docs/models.md). The refusal fails the handshake, so vLLM fails the requests that
        waited on it (counted in its `vllm:nixl_num_failed_transfers`) and D computes
        their prompts itself (`kv_load_failure_policy: recompute`). A push of either never
        gets here: P refuses the registration (`NACK block_size_mismatch`, `tp_mismatch`)."""
        why = block_size_refusal(
            (self.block_size, self._physical_blocks_per_logical_kv_block),
            (nixl_agent_meta.block_size,
             getattr(nixl_agent_meta, "physical_blocks_per_logical_kv_block", 1)),
            on_cpu=on_cpu()) or state_tp_refusal(
            self._local_tp, remote_tp_size, keeps_state=self._keeps_state, on_cpu=on_cpu())
        if why is not None:
            logger.warning("refused the KV transfer handshake with %s: %s; the requests that "
                           "waited on it are computed here", nixl_agent_meta.engine_id, why)
            raise RuntimeError(why)
        return str(super().add_remote_agent(nixl_agent_meta, remote_tp_rank, remote_tp_size,
                                            *args, **kwargs))

    # --- each step: the scheduler's orders ------------------------------------------------

    def start_step(self, metadata: NixlConnectorMetadata) -> None:
        """The step's push orders, as soon as its metadata is bound (before the forward
        pass): D's waits and failures, P's WRITEs and releases. Raises ThreadDied first if
        the poller thread died."""
        self.check_poller()
        step: PushStep = getattr(metadata, "push", None) or PushStep()
        self._step_number = step.number
        self._start_early(forward_done=False)  # those of earlier steps that came late
        for rid in step.recv:  # D: wait for P's WRITE; vLLM's pull must not READ these
            meta = metadata.reqs_to_recv.pop(rid)
            meta.local_physical_block_ids = self._logical_to_kernel_block_ids(
                meta.local_block_ids, self._physical_blocks_per_logical_kv_block)
            self._recving_metadata[rid] = meta
            self._incoming.expect(rid)
            self._wake_poller()
            # vLLM finishes a receive with P's layout (from the NIXL handshake with P),
            # so D needs that handshake even though P does the writing: start it now,
            # while P computes the prompt. A full one: a later pull from P reuses it.
            assert meta.remote is not None
            self._ensure_handshake(meta.remote.engine_id, meta.remote.host, meta.remote.port,
                                   meta.tp_size, meta.dcp_size, meta.pp_size)
        for rid in step.failed:
            if self._incoming.cancel(rid):
                self._failed_recv_reqs.put(rid)
        for rid, offer in step.pull.items():
            self._pull_instead(rid, offer)
        for job in step.jobs:
            self._start_job(job)
        self._write_handshaken()
        for rid in step.release:
            # A failed push's blocks, kept for a READ that will not come: drop the lease
            # (vLLM's, unless they were not put under it yet).
            was = self._outgoing.release(rid)
            if was is None or was is OutgoingState.RELEASED:
                if self._reqs_to_send.pop(rid, None) is not None:
                    self._reqs_to_process.discard(rid)
            elif was is not OutgoingState.HELD:
                logger.warning("request %s: release of blocks a WRITE still reads (%s); "
                               "its end frees them", rid, was.value)

    def write_early(self) -> None:
        """P, right after the step's forward pass (vLLM's `wait_for_save`): start the
        early WRITEs of the prompts it completed. CPU servers only, where the forward is
        done when this is called."""
        self._start_early(forward_done=True)

    def _start_early(self, *, forward_done: bool) -> None:
        """Start the early WRITEs whose prompt is computed: their step is an earlier one,
        or this one once its forward pass is done."""
        if self._early_inbox is None:
            return
        for write in self._early_inbox.take():  # from P's channel thread, on this host
            now = time.monotonic()
            job = PushJob.of(write, now)
            self._outgoing.early(job, write.early_step, deadline=now + job.write_within)
        due = self._step_number if forward_done else self._step_number - 1
        for record in self._outgoing.early_due(due):
            assert record.job is not None
            self._start_job(record.job)

    def _pull_instead(self, rid: str, offer: PullOffer) -> None:
        """D: P's WRITE failed but P kept the blocks: READ them, as vLLM's pull does."""
        if not self._incoming.cancel(rid):
            return  # the push landed after all, or the request is gone
        meta = self._recving_metadata[rid]
        assert meta.remote is not None
        meta.remote.block_ids = [list(group) for group in offer.block_ids]
        meta.remote.request_id = offer.request_id
        self._read_blocks_for_req(rid, meta)

    def start_load_kv(self, metadata: NixlConnectorMetadata) -> None:
        """After the forward pass: vLLM's pull READs, and WRITEs whose handshake ended."""
        super().start_load_kv(metadata)
        self._lease_for_pull()
        self._write_handshaken()

    def _lease_for_pull(self) -> None:
        """P: put failed WRITEs' blocks under vLLM's pull lease. Only here, after vLLM's
        pull code has handled the step's `reqs_not_processed`: it holds that none of
        those has a lease, and a push that fails at once is in that list in its step."""
        for rid, expiry in self._outgoing.take_held():
            self._reqs_to_process.add(rid)
            self._reqs_to_send[rid] = expiry

    def _write_handshaken(self) -> None:
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

    # --- P: the WRITE ---------------------------------------------------------------------

    def _start_job(self, job: PushJob) -> None:
        future = self._ensure_handshake(
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
        local = [list(group) for group in job.block_ids]
        meta = ReqMeta(
            local_block_ids=local,
            local_physical_block_ids=self._logical_to_kernel_block_ids(
                local, self._physical_blocks_per_logical_kv_block),
            tp_size=self.world_size,
            remote=RemoteMeta(
                block_ids=[list(group) for group in job.decode_block_ids], host="", port=0,
                engine_id=job.decode_engine_id, request_id=job.decode_request_id),
        )
        self._engine_last_active[job.decode_engine_id] = time.perf_counter()
        try:
            self._xfer_blocks_for_req(job.request_id, meta)
        except Exception as exc:  # a layout vLLM's push code refuses, or NIXL itself
            logger.exception("push %s: WRITE could not start", job.transfer_id)
            self._end(record, f"WRITE could not start: {exc}")
            return
        with self._sending_transfers_lock:
            submitted = bool(self._sending_transfers.get(job.request_id))
            if submitted:
                self._write_deadlines[job.request_id] = record.deadline
        if not submitted:
            self._end(record, "WRITE could not start (see the log above)")
            return
        if self._poll_writes():  # a small WRITE is often done at its first poll
            self._wake_poller()

    def _wake_poller(self) -> None:
        if self._poller is None:
            self._poller = threading.Thread(target=self._poll, name="pd-nixl-poller",
                                            daemon=True)
            self._poller.start()
        self._poll_wanted.set()

    def check_poller(self) -> None:
        """Raise ThreadDied if the poller thread ended while the worker runs."""
        if self._poller is not None and not self._stopping.is_set():
            self._poller_guard.check(self._poller.is_alive())

    def _poll(self) -> None:
        """The poller thread: poll while P has WRITEs in flight or D awaits a push, then
        sleep until the next push starts."""
        try:
            wake = WakeSender(*self._wake_at)  # this thread's own socket
            try:
                while not self._stopping.is_set():
                    self._poll_wanted.wait()
                    self._poll_wanted.clear()
                    while not self._stopping.is_set() and self._poll_once(wake):
                        time.sleep(_POLL_S)
            finally:
                wake.close()
        except BaseException as exc:  # whatever ends the thread is said, and seen by the engine
            self._poller_guard.died(exc)

    def _poll_once(self, wake: WakeSender) -> bool:
        """One poll of the WRITEs in flight and of D's notifications, under the guard:
        True while there is more to poll (a failed poll is tried again, a little later;
        too many in a row raise ThreadDied)."""
        try:
            busy = self._poll_writes() | self._poll_notifs(wake)
        except Exception as exc:
            self._stopping.wait(self._poller_guard.pass_failed(exc))
            return True
        self._poller_guard.pass_done()
        return busy

    def _poll_writes(self) -> bool:
        """Poll every WRITE in flight once: NIXL moves a WRITE's bytes, and sends its
        notification, only while it is polled. True while any is still going.

        Only polls, but for a WRITE still in flight at its deadline (the write lease),
        whose handles it cancels (NIXL's release of a transfer in progress; one that NIXL
        cannot cancel yet is tried again at the next poll). The engine thread collects
        and releases finished handles (under the same lock) in `get_transfer_results`."""
        pending = False
        now = time.monotonic()
        with self._sending_transfers_lock:
            for rid, handles in self._sending_transfers.items():
                overdue = self._write_deadlines.get(rid, math.inf) <= now
                for handle in list(handles):
                    try:
                        in_flight = self.nixl_wrapper.check_xfer_state(handle) == "PROC"
                    except Exception:  # the engine thread reports it when it polls
                        continue
                    if in_flight and overdue and self._cancel(rid, handle):
                        handles.remove(handle)
                    else:
                        pending |= in_flight
        return pending

    def _cancel(self, rid: str, handle: int) -> bool:
        """Cancel a WRITE handle of `rid` in flight past its deadline (under the lock):
        True once NIXL released it (nothing more of it is written)."""
        if not self._try_release_xfer_handle(rid, handle):  # logs why, keeps the handle
            return False
        if rid not in self._cancelled:
            logger.warning("request %s: a push WRITE still in flight at the end of its write "
                           "lease was cancelled", rid)
        self._cancelled.add(rid)
        self._send_failures.add(rid)
        return True

    def _poll_notifs(self, wake: WakeSender) -> bool:
        """D: while a push is awaited, fetch the notifications (P's WRITE completes only
        as fast as D's agent is polled), keep them for the engine thread, which handles
        them in `_get_new_notifs`, and `wake` the scheduler should it be pausing. True
        while a push is awaited."""
        if not self._incoming.awaiting:
            return False
        try:
            fetched = self.nixl_wrapper.get_new_notifs()
        except Exception:  # the engine thread meets it too when it polls, and reports it
            return True
        if fetched:
            with self._inbox_lock:
                self._inbox.extend(fetched.values())
            wake.wake()
        return True

    def _end(self, record: OutgoingPush, error: str | None) -> None:
        """The job is over on this rank: report the outcome, and free P's blocks, or,
        when the WRITE failed, keep them under vLLM's pull lease for D to READ."""
        self._outgoing.ended(record, error, now=time.perf_counter(),
                             lease_ttl=self._pull_fallback_ttl)

    # --- each step: what finished ------------------------------------------------------

    def get_transfer_results(self) -> KVConnectorTransferResults:
        self._finish_landed()  # pushes that waited for D's handshake with P
        results = super().get_transfer_results()
        with self._sending_transfers_lock:
            done, failed = self._pop_done_transfers(self._sending_transfers)
            failed |= self._send_failures  # from submitting WRITEs, since the last step
            self._send_failures.clear()
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
        return results

    def _get_new_notifs(self) -> set[str]:
        """NIXL notifications: a WRITE into D's blocks is complete (D, push), or D has
        read P's blocks (P, pull: vLLM's accounting). Heartbeats extend pull leases."""
        assert self.transfer_topo is not None
        read_by_d: set[str] = set()
        fetched = list(self.nixl_wrapper.get_new_notifs().values())
        with self._inbox_lock:
            fetched, self._inbox = self._inbox + fetched, []
        for notifs in fetched:
            for notif in notifs:
                msg = notif.decode("utf-8")
                if msg.startswith("HB:"):
                    self._handle_heartbeat(msg[3:])
                    continue
                req_id, count = msg.rsplit(":", 1)
                if self._incoming.is_awaited(req_id):
                    self._push_arrived(req_id, int(count))
                else:
                    self._pull_read_done(req_id, int(count), read_by_d)
        return read_by_d

    def _push_arrived(self, req_id: str, producer_world_size: int) -> None:
        """D: one of P's ranks finished its WRITE into this rank. With P's tp k times D's,
        k of them do (`tp_plan`); with D's tp a multiple of P's, one P rank writes several
        D ranks, each notified once."""
        meta = self._recving_metadata[req_id]
        expected = meta.pp_size * writers_per_decode_rank(producer_world_size, self.world_size)
        if self._incoming.notified(req_id, expected):
            self._finish_landed()

    def _finish_landed(self) -> None:
        """D: report the pushes that landed as received, once D's handshake with their P
        is done (vLLM reads P's layout from it); fail them if that handshake failed."""
        for req_id in self._incoming.landed():
            meta = self._recving_metadata[req_id]
            assert meta.remote is not None
            engine = meta.remote.engine_id
            with self._handshake_lock:
                known, pending = engine in self._remote_agents, engine in self._handshake_futures
            if known:
                # No READ handle of ours: an empty entry lets vLLM report the receive done.
                self._recving_transfers.setdefault(req_id, [])
            elif not pending:
                logger.warning("push for %s arrived, but D's handshake with P %s failed; "
                               "computing the prompt here", req_id, engine)
                self._failed_recv_reqs.put(req_id)
            else:
                continue
            self._incoming.reported(req_id)

    def _pull_read_done(self, req_id: str, expected: int, done: set[str]) -> None:
        """P: D finished reading `req_id` (pull). Same accounting as vLLM's pull worker."""
        if req_id not in self._reqs_to_send and req_id not in self._reqs_to_process:
            self.xfer_stats.record_notification_after_expiry()  # type: ignore[no-untyped-call]
            logger.error("KV blocks of unknown request %s were read by a decode worker; "
                         "they may have expired", req_id)
            return
        self.expected_consumer_notifications_by_req[req_id] = expected
        self.consumer_notification_counts_by_req[req_id] += 1
        if self.consumer_notification_counts_by_req[req_id] == expected:
            done.add(req_id)
            del self.consumer_notification_counts_by_req[req_id]
            del self.expected_consumer_notifications_by_req[req_id]
            self._reqs_to_process.remove(req_id)
            self._reqs_to_send.pop(req_id, None)

    def take_report(self) -> PushReport | None:
        return self._outgoing.take_report()

    def shutdown(self) -> None:
        if self._early_inbox is not None:
            self._early_inbox.close()
        self._stopping.set()
        self._poll_wanted.set()
        if self._poller is not None:
            self._poller.join(timeout=2)
        with self._sending_transfers_lock:
            for handles in self._sending_transfers.values():
                for handle in handles:
                    self._try_release_xfer_handle("shutdown", handle)
            self._sending_transfers.clear()
            self._write_deadlines.clear()
        super().shutdown()
