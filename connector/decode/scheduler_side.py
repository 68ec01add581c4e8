"""D's half of the dual connector's scheduler (`connector.scheduler.DualScheduler`).

D (`do_remote_prefill`): once blocks are allocated, D registers them with P over the side
channel (`DecodeChannel`) and waits, like a pull, in WAITING_FOR_REMOTE_KVS. Its workers
finish the receive on the WRITE's NIXL notification; if the push fails instead (P
refused, failed, went silent), the receive is failed (`PushStep.failed`) and vLLM
recomputes the prompt locally (with `kv_load_failure_policy: "recompute"`). When the
WRITE failed but every P worker kept the blocks, P offers them (`PushFailed.pull`) and
D's workers READ them instead (`PushStep.pull`), as in a pull.

Runs on the engine's scheduler thread, as a part of vLLM's pull scheduler (`_vllm`, whose
receive bookkeeping it fills for push requests); D's channel runs its own thread.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import zmq

from connector.decode.channel import DecodeChannel
from connector.decode.registered import DecodePushes, DecodeState
from connector.decode.wake import WakeListener
from connector.protocol import http_params
from connector.protocol.side_channel import EngineId, RegisterBlocks

if TYPE_CHECKING:
    from connector.config import DualConfig
    from connector.protocol.step import PushStep
    from connector.shared.keys import ClientKeys
    from connector.shared.stats import PushStats
    from connector.vllm_compat import (
        KVCacheBlocks,
        KVConnectorOutput,
        NixlPullConnectorScheduler,
        Request,
        SchedulerOutput,
    )

logger = logging.getLogger("vllm.pd_connector.scheduler")


class DecodeScheduler:
    """D's pushes, from the registration of their blocks with P to their arrival or end."""

    def __init__(
        self, vllm: NixlPullConnectorScheduler, config: DualConfig, stats: PushStats, *,
        wait_pause: float, dp_index: int, curve: ClientKeys | None,
    ) -> None:
        self._vllm = vllm
        self.stats = stats
        self.registration_ttl = config.registration_ttl
        self.push_wait_pause = wait_pause
        self._wake = self._wake_listener(vllm.engine_id, dp_index)
        self.channel = DecodeChannel(
            EngineId(vllm.engine_id), ack_timeout=config.ack_timeout,
            ping_interval=config.ping_interval, peer_timeout=config.peer_timeout,
            registration_ttl=config.registration_ttl, max_peers=config.max_peers,
            curve=curve)
        # The pushes this engine registered with a P.
        self._decode_pushes = DecodePushes()

    def register(self, request: Request, params: http_params.KVTransferParams,
                 blocks: KVCacheBlocks, num_external_tokens: int, step: PushStep) -> None:
        """D's push request got its blocks: register them with P, and have the step being
        built tell the workers to wait for P's WRITE instead of reading."""
        raw = request.kv_transfer_params
        assert raw is not None  # decoded by the caller
        raw[http_params.DO_REMOTE_PREFILL] = False  # register once, even after a preemption
        rid = request.request_id
        tid = http_params.transfer_id_of(params)
        peer = http_params.push_channel_address(params)
        if num_external_tokens <= 0:
            # Every prompt block was in D's prefix cache: nothing to receive. P's blocks
            # are freed by telling P we will not take them.
            if tid and peer:
                self.channel.abort(tid, peer=peer)
            return
        vllm = self._vllm
        local = vllm.get_exchange_clipped_blocks(blocks.get_unhashed_block_ids_all_groups())
        raw[http_params.REMOTE_BLOCK_IDS] = []  # vLLM's recv bookkeeping wants the key
        vllm._reqs_need_recv[rid] = (request, local, (), True)
        step.recv.add(rid)
        if not tid or peer is None:
            logger.warning("push for request %s lacks transfer_id or P's push_port (is P "
                           "running the dual connector?); computing the prompt here", rid)
            step.failed.add(rid)
            return
        self.channel.register(peer, RegisterBlocks(
            transfer_id=tid, engine_id=EngineId(vllm.engine_id), request_id=rid,
            tp_size=vllm.transfer_tp_size, tp_rank=0,
            block_ids=[list(group) for group in local], block_size=vllm.block_size,
            host=vllm.side_channel_host, port=vllm.side_channel_port,
            ttl_s=self.registration_ttl))
        self._decode_pushes.registered(rid, tid)
        self.stats.registrations += 1

    def request_finished(self, request: Request, params: http_params.KVTransferParams) -> None:
        """D's push request ended. If it still waits for P's WRITE (the client left),
        tell P; D's blocks are freed when P confirms nothing more will be written."""
        tid = self._decode_pushes.aborting(request.request_id)
        if tid is not None:
            self.channel.abort(tid)
        elif params.do_remote_prefill and request.kv_transfer_params is not None:
            # Ended before it was ever scheduled: no registration; P may hold the KV.
            request.kv_transfer_params[http_params.DO_REMOTE_PREFILL] = False
            peer = http_params.push_channel_address(params)
            tid = http_params.transfer_id_of(params)
            if peer and tid:
                self.channel.abort(tid, peer=peer)

    def take_failures(self, step: PushStep) -> None:
        """The pushes the channel gave up on, into the step being built: READ P's blocks
        where P offers them, else fail the receive (vLLM recomputes, or frees the blocks
        of a request that ended)."""
        for failure in self.channel.take_failures():
            rid = failure.request_id
            ended = self._decode_pushes.ended(rid)
            if ended is not None and ended.state is DecodeState.ABORTING:
                step.failed.add(rid)
                self.stats.aborted += 1
            elif failure.pull is not None:
                step.pull[rid] = failure.pull
                self.stats.pulled_instead += 1
                logger.info("push %s for request %s failed; reading P's blocks instead",
                            failure.transfer_id, rid)
            else:
                step.failed.add(rid)
                self.stats.fell_back += 1

    def pause_if_idle(self, scheduler_output: SchedulerOutput, step: PushStep) -> None:
        """If this step runs nothing and orders nothing, and all D does is wait for pushes,
        pause: vLLM would step again at once; a short pause leaves the CPU to others (P).
        A worker ends the pause when a push lands."""
        if not (self.push_wait_pause > 0 and self._decode_pushes.awaiting()
                and step.is_empty() and scheduler_output.total_num_scheduled_tokens == 0):
            return
        if self._wake is not None:
            self._wake.wait(self.push_wait_pause)  # a worker wakes it when a push lands
        else:
            time.sleep(self.push_wait_pause)

    def received(self, connector_output: KVConnectorOutput) -> None:
        """The receives the workers finished: a registered push's ends its transfer."""
        for rid in connector_output.finished_recving or ():
            tid = self._decode_pushes.received(rid)
            if tid is not None:
                self.channel.forget(tid)
                self.stats.received += rid not in connector_output.failed_recving

    def stop(self) -> None:
        self.channel.stop()
        if self._wake is not None:
            self._wake.close()

    def _wake_listener(self, engine_id: str, dp_index: int) -> WakeListener | None:
        """Where the workers wake the pausing engine when a push lands (None: no pause,
        or no IPC socket could be made; then the pause is a plain sleep)."""
        if self.push_wait_pause <= 0:
            return None
        try:
            return WakeListener(engine_id, dp_index)
        except (OSError, zmq.ZMQError) as exc:
            logger.warning("no wake-up socket for the push-wait pause (%s): a landed push "
                           "is seen up to %.1f ms late", exc, self.push_wait_pause * 1000)
            return None
