"""D's half of the dual connector's worker (`connector.worker.DualWorker`): the receive.

- `recv` requests (`PushStep`) wait, without a READ, for the WRITE's notification
  (`"<D request id>:<P's world size>"`); `failed` ones are failed at once (vLLM then
  recomputes, or frees an aborted request's blocks).
- `pull` requests (the push failed, P offered its blocks) READ them with vLLM's pull
  code, as if they had been a pull from the start.
- A push whose every notification came is reported received once D's handshake with its
  P is done (vLLM finishes a receive with P's layout, from that handshake), or failed if
  that handshake failed.

Threads: the engine thread runs all of it but `poll_notifs`, which the worker's poller
thread runs while a push is awaited: it fetches the notifications (P's WRITE completes
only as fast as D's agent is polled) into `_inbox` (under `_inbox_lock`) for the engine
thread, and wakes the scheduler, which may be pausing (`connector.decode.wake`). The
records (`IncomingPushes`) are the engine thread's; the poller reads only their count of
awaited pushes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from connector.decode.incoming import IncomingPushes
from connector.decode.wake import WakeSender
from connector.shared.tp_plan import writers_per_decode_rank

if TYPE_CHECKING:
    from connector.protocol.side_channel import PullOffer
    from connector.protocol.step import PushStep
    from connector.vllm_compat import NixlConnectorMetadata, PullPushWorker

logger = logging.getLogger("vllm.pd_connector.worker")


class DecodeWorker:
    """The pushes this rank receives, each awaited until its WRITEs' notifications came,
    then landed until D's handshake with its P is done (`IncomingPushes`)."""

    def __init__(self, vllm: PullPushWorker, *, wake_at: tuple[str, int],
                 wake_poller: Callable[[], None]) -> None:
        self._vllm = vllm
        self._incoming = IncomingPushes()
        self._wake_poller = wake_poller  # the worker's poller fetches the notifications
        # The notifications the poller fetched, for the engine thread.
        self._inbox: list[list[bytes]] = []
        self._inbox_lock = threading.Lock()
        # Where the poller tells the scheduler, which may be pausing, that notifications
        # came.
        self._wake_at = wake_at

    def take_step(self, metadata: NixlConnectorMetadata, step: PushStep) -> None:
        """The step's receives to wait for, the pushes to fail, and those to READ."""
        vllm = self._vllm
        for rid in step.recv:  # wait for P's WRITE; vLLM's pull must not READ these
            meta = metadata.reqs_to_recv.pop(rid)
            meta.local_physical_block_ids = vllm._logical_to_kernel_block_ids(
                meta.local_block_ids, vllm._physical_blocks_per_logical_kv_block)
            vllm._recving_metadata[rid] = meta
            self._incoming.expect(rid)
            self._wake_poller()
            # vLLM finishes a receive with P's layout (from the NIXL handshake with P),
            # so D needs that handshake even though P does the writing: start it now,
            # while P computes the prompt. A full one: a later pull from P reuses it.
            assert meta.remote is not None
            vllm._ensure_handshake(meta.remote.engine_id, meta.remote.host, meta.remote.port,
                                   meta.tp_size, meta.dcp_size, meta.pp_size)
        for rid in step.failed:
            if self._incoming.cancel(rid):
                vllm._failed_recv_reqs.put(rid)
        for rid, offer in step.pull.items():
            self._pull_instead(rid, offer)

    def _pull_instead(self, rid: str, offer: PullOffer) -> None:
        """P's WRITE failed but P kept the blocks: READ them, as vLLM's pull does."""
        if not self._incoming.cancel(rid):
            return  # the push landed after all, or the request is gone
        meta = self._vllm._recving_metadata[rid]
        assert meta.remote is not None
        meta.remote.block_ids = [list(group) for group in offer.block_ids]
        meta.remote.request_id = offer.request_id
        self._vllm._read_blocks_for_req(rid, meta)

    def wake_sender(self) -> WakeSender:
        """The poller thread's own socket to the scheduler's wake-up listener."""
        return WakeSender(*self._wake_at)

    def poll_notifs(self, wake: WakeSender) -> bool:
        """While a push is awaited, fetch the notifications, keep them for the engine
        thread, which handles them in `take_inbox`'s caller, and `wake` the scheduler
        should it be pausing. True while a push is awaited."""
        if not self._incoming.awaiting:
            return False
        try:
            fetched = self._vllm.nixl_wrapper.get_new_notifs()
        except Exception:  # the engine thread meets it too when it polls, and reports it
            return True
        if fetched:
            with self._inbox_lock:
                self._inbox.extend(fetched.values())
            wake.wake()
        return True

    def take_inbox(self, fetched: list[list[bytes]]) -> list[list[bytes]]:
        """The notifications the poller fetched, then `fetched` (the engine thread's)."""
        with self._inbox_lock:
            fetched, self._inbox = self._inbox + fetched, []
        return fetched

    def awaits(self, req_id: str) -> bool:
        """Whether a push into `req_id` is awaited (its notification is a push's)."""
        return self._incoming.is_awaited(req_id)

    def push_arrived(self, req_id: str, producer_world_size: int) -> None:
        """One of P's ranks finished its WRITE into this rank. With P's tp k times D's, k
        of them do (`tp_plan`); with D's tp a multiple of P's, one P rank writes several D
        ranks, each notified once."""
        meta = self._vllm._recving_metadata[req_id]
        expected = meta.pp_size * writers_per_decode_rank(producer_world_size,
                                                          self._vllm.world_size)
        if self._incoming.notified(req_id, expected):
            self.finish_landed()

    def finish_landed(self) -> None:
        """Report the pushes that landed as received, once D's handshake with their P is
        done (vLLM reads P's layout from it); fail them if that handshake failed."""
        vllm = self._vllm
        for req_id in self._incoming.landed():
            meta = vllm._recving_metadata[req_id]
            assert meta.remote is not None
            engine = meta.remote.engine_id
            with vllm._handshake_lock:
                known, pending = engine in vllm._remote_agents, engine in vllm._handshake_futures
            if known:
                # No READ handle of ours: an empty entry lets vLLM report the receive done.
                vllm._recving_transfers.setdefault(req_id, [])
            elif not pending:
                logger.warning("push for %s arrived, but D's handshake with P %s failed; "
                               "computing the prompt here", req_id, engine)
                vllm._failed_recv_reqs.put(req_id)
            else:
                continue
            self._incoming.reported(req_id)
