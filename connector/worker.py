"""The dual connector's worker side: vLLM's pull worker, plus the push WRITE path.

Pull requests go through vLLM's `NixlPullConnectorWorker` untouched (READ, notify P).
Push is two halves, one per side, which this class composes; each step's push orders
(`PushStep`, from the scheduler) are taken when the step's metadata is bound, before the
forward pass (`start_step`), D's first, then P's:

- D: `connector.decode.worker_side.DecodeWorker` waits for P's WRITE into the `recv`
  requests (no READ), fails the `failed` ones, and READs from P the `pull` ones (the
  push failed, P kept its blocks).
- P: `connector.prefill.worker_side.PrefillWorker` WRITEs each job's blocks into D's
  with vLLM's push code (after the NIXL handshake with D), under the job's write lease;
  an early WRITE, right after the forward pass that completes its prompt
  (`write_early`); a WRITE that fails keeps its blocks under vLLM's pull lease for D to
  READ; `release` requests are reported finished at once.

This class keeps what is neither side's: the handshake checks of a peer
(`add_remote_agent`), vLLM's NIXL notifications, sorted to their side
(`_get_new_notifs`), and the poller thread.

A small poller thread (`_poll`) keeps both ends of a push moving between engine steps:
NIXL moves a WRITE only while the agents at both ends are polled, and the engine polls
once per step, which on P is after a whole forward pass. On P it polls the WRITEs in
flight; on D, while a push is awaited, it fetches the notifications for the engine
thread. The engine thread still collects finished WRITEs in `get_transfer_results`, and
handles every notification (the scheduler keeps the engines stepping while a push is
alive). Each poll is guarded like the side-channel threads' passes
(`connector.shared.channel_thread.Guard`): an exception is counted and logged, and
polling goes on; a poller that dies makes the next step raise `ThreadDied`
(`start_step`), which stops the engine and fails vLLM's health check, instead of leaving
pushes stuck.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from connector.config import DualConfig
from connector.decode.wake import WakeSender
from connector.decode.worker_side import DecodeWorker
from connector.prefill.fence import fence_for, full_graph_note
from connector.prefill.worker_side import PrefillWorker
from connector.protocol.step import PushReport, PushStep
from connector.shared.channel_thread import Guard
from connector.shared.pages import small_pages
from connector.shared.progress import agent_progress
from connector.shared.tp_plan import keeps_state
from connector.vllm_compat import NixlConnectorMetadata, PullPushWorker, fence_device, on_cpu

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
    """vLLM's pull worker, with P's half (`prefill`) and D's half (`decode`) of push."""

    def __init__(
        self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig
    ) -> None:
        assert vllm_config.kv_transfer_config is not None
        config = DualConfig.from_extra_config(
            vllm_config.kv_transfer_config.kv_connector_extra_config)
        with agent_progress(config.nixl_progress_thread):
            super().__init__(vllm_config, engine_id, kv_cache_config)
        # What the handshake checks a peer against (`add_remote_agent`).
        self._local_tp = vllm_config.parallel_config.tensor_parallel_size
        self._keeps_state = keeps_state(vllm_config.model_config)
        # vLLM's push code's own state, by P's request id, which it fills (it runs on this
        # object: `_xfer_blocks_for_req`) and P's half reads, the poller under the lock:
        # WRITE handles, and those that failed (folded into P's records each step).
        self._sending_transfers: defaultdict[str, list[int]] = defaultdict(list)
        self._sending_transfers_lock = threading.Lock()
        self._send_failures: set[str] = set()
        # The poller thread (started with the first push), woken when a push starts.
        self._poll_wanted = threading.Event()
        self._stopping = threading.Event()
        self._poller: threading.Thread | None = None
        self._poller_guard = Guard("pd-nixl-poller")
        dp_index = vllm_config.parallel_config.data_parallel_index
        device = fence_device(vllm_config)
        parallel = vllm_config.parallel_config
        early = config.writes_early(device is not None, parallel.world_size,
                                    parallel.tensor_parallel_size)
        self.prefill = PrefillWorker(
            self, pull_fallback_ttl=config.pull_fallback_ttl,
            early_at=(engine_id, dp_index, config.push_port + dp_index, self.tp_rank)
            if early else None, rank=self.tp_rank,
            wake_poller=self._wake_poller,
            fence=fence_for(device) if early and device is not None else None)
        note = full_graph_note(vllm_config.compilation_config) if device == "cuda" else None
        if note is not None and early and config.push_layers != "off":
            logger.info("pushes by layer: %s", note)
        self.decode = DecodeWorker(self, wake_at=(engine_id, dp_index),
                                   wake_poller=self._wake_poller)
        self._kv_cache_groups = len(kv_cache_config.kv_cache_groups)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        cache = next(iter(kv_caches.values()), None)
        if cache is not None and cache.device.type == "cpu" and small_pages(cache.data_ptr()):
            logger.info("the KV cache is on 4 KiB pages: start vLLM with "
                        "THP_MEM_ALLOC_ENABLE=1 to put it on huge pages, which makes KV "
                        "transfers between CPU servers (pull and push) faster")
        super().register_kv_caches(kv_caches)
        self.prefill.kv_caches_registered(groups=self._kv_cache_groups)

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
        self.prefill.begin_step(step)  # its number; early WRITEs of earlier steps, late
        self.decode.take_step(metadata, step)
        self.prefill.take_step(step)

    def layer_saved(self, layer_name: str) -> None:
        """P, during the forward pass (vLLM's `save_kv_layer`): a layer's KV is computed;
        the layered pushes WRITE it."""
        self.prefill.layer_saved(layer_name)

    def write_early(self) -> None:
        """P, right after the step's forward pass (vLLM's `wait_for_save`): the layered
        pushes' last parts, and the early WRITEs of the prompts it completed."""
        self.prefill.write_early()

    def start_load_kv(self, metadata: NixlConnectorMetadata) -> None:
        """After the forward pass: vLLM's pull READs, and WRITEs whose handshake ended."""
        super().start_load_kv(metadata)
        self.prefill.lease_for_pull()
        self.prefill.write_handshaken()

    # --- the poller thread ----------------------------------------------------------------

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
            wake = self.decode.wake_sender()  # this thread's own socket
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
        """One poll of P's WRITEs in flight and of D's notifications, under the guard:
        True while there is more to poll (a failed poll is tried again, a little later;
        too many in a row raise ThreadDied)."""
        try:
            busy = self.prefill.poll_writes() | self.decode.poll_notifs(wake)
        except Exception as exc:
            self._stopping.wait(self._poller_guard.pass_failed(exc))
            return True
        self._poller_guard.pass_done()
        return busy

    # --- each step: what finished ------------------------------------------------------

    def get_transfer_results(self) -> KVConnectorTransferResults:
        self.decode.finish_landed()  # pushes that waited for D's handshake with P
        results = super().get_transfer_results()
        self.prefill.transfer_results(results)
        return results

    def _get_new_notifs(self) -> set[str]:
        """NIXL notifications: a WRITE into D's blocks is complete (D, push), or D has
        read P's blocks (P, pull: vLLM's accounting). Heartbeats extend pull leases."""
        assert self.transfer_topo is not None
        read_by_d: set[str] = set()
        fetched = self.decode.take_inbox(list(self.nixl_wrapper.get_new_notifs().values()))
        for notifs in fetched:
            for notif in notifs:
                msg = notif.decode("utf-8")
                if msg.startswith("HB:"):
                    self._handle_heartbeat(msg[3:])
                    continue
                req_id, count = msg.rsplit(":", 1)
                if self.decode.awaits(req_id):
                    self.decode.push_arrived(req_id, int(count))
                else:
                    self.prefill.read_done(req_id, int(count), read_by_d)
        return read_by_d

    def take_report(self) -> PushReport | None:
        return self.prefill.take_report()

    def shutdown(self) -> None:
        self.prefill.close_inbox()
        self.prefill.close_fence()  # WRITEs it still held are posted first
        self._stopping.set()
        self._poll_wanted.set()
        if self._poller is not None:
            self._poller.join(timeout=2)
        self.prefill.release_writes()
        super().shutdown()
