"""The dual connector's scheduler side: vLLM's pull scheduler, plus push per request.

A request is a push when its kv_transfer_params say `"transfer_mode": "push"` (the
router sets it on both legs, with the same `transfer_id`); anything else is vLLM's pull,
unchanged. The push part, on each side:

- P (`do_remote_decode`): when the prefill finishes, its blocks are handed to the push
  registry (through `PrefillChannel`) instead of vLLM's pull lease. The registry matches
  them with D's registration and asks for a WRITE (`PushStep.jobs`), or says to free them
  (`PushStep.release`: D aborted, nobody registered in time, a duplicate...).
- D (`do_remote_prefill`): once blocks are allocated, D registers them with P over the
  side channel (`DecodeChannel`) and waits, like a pull, in WAITING_FOR_REMOTE_KVS. Its
  workers finish the receive on the WRITE's NIXL notification; if the push fails instead
  (P refused, failed, went silent), the receive is failed (`PushStep.failed`) and vLLM
  recomputes the prompt locally (with `kv_load_failure_policy: "recompute"`). When the
  WRITE failed but every P worker kept the blocks, P offers them (`PushFailed.pull`)
  and D's workers READ them instead (`PushStep.pull`), as in a pull.

Every P answer also says what this P can do (`transfer_modes`) and where its push side
channel is (`push_host`, `push_port`), which the router passes on to D. A probe (the
router's one-token prefill that asks for these coordinates, `"probe": true`) frees its
blocks at once.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq

from connector.config import DualConfig
from connector.decode.channel import DecodeChannel
from connector.decode.registered import DecodePushes, DecodeState
from connector.decode.wake import WakeListener
from connector.prefill.channel import FreeBlocks, PrefillChannel, StartWrite
from connector.prefill.prompts import PrefillPush, PrefillPushes, PrefillState
from connector.prefill.registry import PushRegistry, RegistryConfig
from connector.protocol import http_params
from connector.protocol.side_channel import EngineId, RegisterBlocks, TransferId
from connector.protocol.step import PushJob, PushReport, PushStep, WriteTally
from connector.shared import tp_plan
from connector.vllm_compat import (
    FEATURES,
    NixlPullConnectorScheduler,
    on_cpu,
    scheduled_blocks,
)

if TYPE_CHECKING:
    from connector.vllm_compat import (
        BlockIds,
        KVCacheBlocks,
        KVCacheConfig,
        KVConnectorMetadata,
        KVConnectorOutput,
        Request,
        SchedulerOutput,
        VllmConfig,
    )

logger = logging.getLogger("vllm.pd_connector.scheduler")

# How long a step waits for the side channel to match a just-finished prefill, so its
# WRITE starts in this step rather than the next.
CATCH_UP_S = 0.005


@dataclass(slots=True)
class PushStats:
    """This engine's counts, logged every `stats_interval` when they changed. P's registry
    adds its own (matched, expired, aborted, refused) from the channel thread."""

    pull_prefills: int = 0  # P: prefills kept for a D to read
    push_prefills: int = 0  # P: prefills handed to the push registry
    probes: int = 0  # P: probes answered (blocks freed at once)
    writes_done: int = 0  # P: pushes written
    writes_failed: int = 0
    blocks_written: int = 0
    write_seconds: float = 0.0  # P: summed WRITE time, registration match to completion
    registrations: int = 0  # D: pushes registered with a P
    received: int = 0  # D: pushes whose KV arrived
    pull_offers: int = 0  # P: failed WRITEs whose blocks P kept for D to read
    pulled_instead: int = 0  # D: failed pushes read from P instead
    fell_back: int = 0  # D: pushes that failed: the prompt was recomputed
    aborted: int = 0  # D: pushes ended by D's own abort (client gone)


def _dp_size(vllm_config: VllmConfig, engine_id: str) -> int | None:
    """How many data-parallel ranks this server has, as far as its engine knows: an MoE
    model's engines see the real size; a dense model's run as independent engines whose
    size vLLM resets to 1, known as data-parallel only by the `_dp{rank}` suffix vLLM puts
    on their engine id (then None: the size is unknown here)."""
    parallel = vllm_config.parallel_config
    if parallel.data_parallel_size > 1:
        return int(parallel.data_parallel_size)
    return None if engine_id.endswith(f"_dp{parallel.data_parallel_index}") else 1


def transfer_id_of(params: http_params.KVTransferParams) -> TransferId | None:
    """The router's `transfer_id`, naming this push on P and D; None when absent."""
    return TransferId(params.transfer_id) if params.transfer_id else None


class DualScheduler(NixlPullConnectorScheduler):
    def __init__(
        self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, engine_id, kv_cache_config)
        assert vllm_config.kv_transfer_config is not None
        config = DualConfig.from_extra_config(
            vllm_config.kv_transfer_config.kv_connector_extra_config)
        self.push_host = config.push_host or self.side_channel_host
        dp_index = vllm_config.parallel_config.data_parallel_index
        self.push_port = config.push_port + dp_index
        # Told in every answer, so the router can pin a push to this engine (the
        # X-data-parallel-rank header) and give D this rank's coordinates.
        self.dp_rank, self.dp_size = dp_index, _dp_size(vllm_config, engine_id)
        self.registration_ttl = config.registration_ttl
        self.stats_interval = config.stats_interval
        self.pull_fallback_ttl = config.pull_fallback_ttl
        self.fault_injection = config.fault_injection
        self.push_wait_pause = config.wait_pause(on_cpu=on_cpu())
        self.early_write = config.writes_early(
            on_cpu=on_cpu(),
            world_size=vllm_config.parallel_config.world_size)
        self._wake = self._wake_listener(engine_id, dp_index)
        keys = config.curve_keys()  # read at start: a bad key file fails the start
        # What this P tells the router it can do: push only if vLLM's push code writes a
        # prefix hit's tail right (checked at start, `vllm_compat`).
        self.push_supported = FEATURES["push_trims_decode_tail"]
        self.transfer_modes = list(http_params.TRANSFER_MODE_VALUES) if self.push_supported \
            else [http_params.PULL]
        if not self.push_supported:
            logger.error("push refused on this server: this vLLM's push code does not write "
                         "only the blocks D lacks on a prefix hit (checked at start); the "
                         "router is told pull only, and registrations are refused "
                         "(NACK push_unsupported)")
        registry = PushRegistry(RegistryConfig(
            engine_id=EngineId(engine_id), block_size=self.block_size,
            tp_size=self.transfer_tp_size, registration_ttl=config.registration_ttl,
            unclaimed_ttl=config.unclaimed_ttl, num_blocks=kv_cache_config.num_blocks or None,
            num_groups=len(kv_cache_config.kv_cache_groups) or None,
            max_pending_per_peer=config.max_pending_per_peer, max_pending=config.max_pending,
            lease_s=config.write_lease, write_s=config.write_timeout,
            kv_heads=vllm_config.model_config.get_total_num_kv_heads(),
            mla=vllm_config.model_config.use_mla,
            mamba=tp_plan.keeps_state(vllm_config.model_config),
            push_supported=self.push_supported))
        self.prefill_channel = PrefillChannel(
            registry, self.push_host, self.push_port,
            early_to=(engine_id, dp_index) if self.early_write else None,
            curve=keys[0] if keys else None)
        self.decode_channel = DecodeChannel(
            EngineId(engine_id), ack_timeout=config.ack_timeout,
            ping_interval=config.ping_interval, peer_timeout=config.peer_timeout,
            registration_ttl=config.registration_ttl, max_peers=config.max_peers,
            curve=keys[1] if keys else None)
        self.prefill_channel.start()
        self.decode_channel.start()
        # D: the pushes this engine registered with a P; and what the next step tells the
        # workers about them.
        self._decode_pushes = DecodePushes()
        self._step = PushStep()
        # P: WRITEs some of P's workers (TP x PP ranks) finished, waiting for the rest.
        self._write_tally = WriteTally(vllm_config.parallel_config.world_size)
        # P: the push requests computing their prompt, until they end; the number of the
        # step being built; and early WRITEs that reached the engine instead of the
        # worker, for the next step.
        self._prefill_pushes = PrefillPushes()
        self._step_number = 0
        self._next_step_jobs: list[StartWrite] = []
        self.stats = PushStats()
        self._logged = (PushStats(), time.monotonic())
        self._refused: tuple[int, ...] = (0,) * 15  # the drop counts last logged
        logger.info("dual connector: modes %s; push side channel on %s:%d (%s); idle steps "
                    "while waiting for pushes pause %.1f ms; early WRITEs %s",
                    ",".join(http_params.TRANSFER_MODE_VALUES), self.push_host, self.push_port,
                    "CURVE-authenticated" if keys else "unauthenticated",
                    self.push_wait_pause * 1000, "on" if self.early_write else "off")

    # --- D: register allocated blocks with P ---------------------------------------------

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = http_params.decode_params(request.kv_transfer_params)
        if params is None or not params.is_push or not params.do_remote_prefill:
            super().update_state_after_alloc(request, blocks, num_external_tokens)
            if params is not None and params.is_push and params.do_remote_decode:
                self._follow_prefill(request, params)
            return
        raw = request.kv_transfer_params
        assert raw is not None  # decoded above
        raw[http_params.DO_REMOTE_PREFILL] = False  # register once, even after a preemption
        rid = request.request_id
        tid = transfer_id_of(params)
        peer = http_params.push_channel_address(params)
        if num_external_tokens <= 0:
            # Every prompt block was in D's prefix cache: nothing to receive. P's blocks
            # are freed by telling P we will not take them.
            if tid and peer:
                self.decode_channel.abort(tid, peer=peer)
            return
        local = self.get_exchange_clipped_blocks(blocks.get_unhashed_block_ids_all_groups())
        raw[http_params.REMOTE_BLOCK_IDS] = []  # vLLM's recv bookkeeping wants the key
        self._reqs_need_recv[rid] = (request, local, (), True)
        self._step.recv.add(rid)
        if not tid or peer is None:
            logger.warning("push for request %s lacks transfer_id or P's push_port (is P "
                           "running the dual connector?); computing the prompt here", rid)
            self._step.failed.add(rid)
            return
        self.decode_channel.register(peer, RegisterBlocks(
            transfer_id=tid, engine_id=EngineId(self.engine_id), request_id=rid,
            tp_size=self.transfer_tp_size, tp_rank=0,
            block_ids=[list(group) for group in local], block_size=self.block_size,
            host=self.side_channel_host, port=self.side_channel_port,
            ttl_s=self.registration_ttl))
        self._decode_pushes.registered(rid, tid)
        self.stats.registrations += 1

    def _follow_prefill(self, request: Request, params: http_params.KVTransferParams) -> None:
        """P: a push request was scheduled. Follow its blocks step by step if its WRITE
        may start right after the forward pass that completes its prompt: only when that
        pass also finishes the request (max_tokens 1, as the router sends), since P's
        blocks are freed as soon as the WRITE is done."""
        self._prefill_pushes.scheduled(
            request, transfer_id_of(params),
            fail_on_purpose=self.fault_injection and params.fail_write,
            follow=self.early_write and not params.probe and request.max_tokens == 1)

    # --- both: a request ends ---------------------------------------------------------

    def request_finished(
        self, request: Request, block_ids: BlockIds
    ) -> tuple[bool, dict[str, Any] | None]:
        params = http_params.decode_params(request.kv_transfer_params)
        if params is not None and params.is_push and not params.do_remote_decode:
            return self._decode_push_finished(request, params)
        delay_free, answer = super().request_finished(request, block_ids)
        if params is None or not params.do_remote_decode:
            return delay_free, answer
        rid = request.request_id
        if params.is_push:
            delay_free, done = self._prefill_push_finished(rid, params, delay_free, answer)
            if not done:
                return delay_free, answer
        elif params.probe and delay_free:
            self._stop_pull_lease(rid)  # nobody will read a probe's KV
            delay_free = False
            self.stats.probes += 1
        elif delay_free:
            self.stats.pull_prefills += 1
        if answer is not None:
            answer[http_params.TRANSFER_MODES] = list(self.transfer_modes)
            answer[http_params.PUSH_HOST] = self.push_host
            answer[http_params.PUSH_PORT] = self.push_port
            answer[http_params.DP_RANK] = self.dp_rank
            if self.dp_size is not None:
                answer[http_params.DP_SIZE] = self.dp_size
        return delay_free, answer

    def _prefill_push_finished(
        self, rid: str, params: http_params.KVTransferParams, delay_free: bool,
        answer: dict[str, Any] | None,
    ) -> tuple[bool, bool]:
        """P's push request ended: hand its blocks to the push registry (then True, with
        whether vLLM must keep them), or tell the registry it was aborted (False)."""
        tid = transfer_id_of(params)
        record = self._prefill_pushes.finished(rid)
        fail_on_purpose = record is not None and record.fail_on_purpose
        completed = record.block_ids if record is not None \
            and record.state is PrefillState.COMPLETING else None
        if completed is not None and tid:
            # Its last step computed the whole prompt, whatever ended the request (even
            # an abort): the registry may have matched it then, and a WRITE may be
            # reading these blocks. They go to the registry like any prefill's.
            if answer is not None \
                    and [list(g) for g in answer[http_params.REMOTE_BLOCK_IDS]] != completed:
                logger.error("push %s: request %s holds blocks %s, not the %s its last "
                             "step was given", tid, rid, answer[http_params.REMOTE_BLOCK_IDS],
                             completed)
            delay_free = True
        elif not delay_free or not tid or answer is None:
            if tid:
                self.prefill_channel.prefill_aborted(tid)
            return delay_free, False
        else:
            completed = answer[http_params.REMOTE_BLOCK_IDS]
        # The push registry holds these blocks now, not vLLM's pull lease.
        self._stop_pull_lease(rid)
        self.prefill_channel.prefill_finished(tid, rid, completed,
                                              fail_on_purpose=fail_on_purpose)
        if answer is not None:
            answer[http_params.TRANSFER_MODE] = http_params.PUSH
        self.stats.push_prefills += 1
        return delay_free, True

    def _stop_pull_lease(self, request_id: str) -> None:
        self._reqs_need_send.pop(request_id, None)
        self._reqs_not_processed.add(request_id)

    def _decode_push_finished(
        self, request: Request, params: http_params.KVTransferParams
    ) -> tuple[bool, dict[str, Any] | None]:
        """D's push request ended. If it still waits for P's WRITE (the client left),
        tell P; D's blocks are freed when P confirms nothing more will be written."""
        tid = self._decode_pushes.aborting(request.request_id)
        if tid is not None:
            self.decode_channel.abort(tid)
        elif params.do_remote_prefill and request.kv_transfer_params is not None:
            # Ended before it was ever scheduled: no registration; P may hold the KV.
            request.kv_transfer_params[http_params.DO_REMOTE_PREFILL] = False
            peer, tid = http_params.push_channel_address(params), transfer_id_of(params)
            if peer and tid:
                self.decode_channel.abort(tid, peer=peer)
        return False, None

    # --- both: each step ----------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self.check_threads()
        meta = super().build_connector_meta(scheduler_output)
        step, self._step = self._step, PushStep()
        self._step_number += 1
        step.number = self._step_number
        now = time.monotonic()  # each job's write lease, as a lifetime from here
        step.jobs = [PushJob.of(write, now) for write in self._next_step_jobs]
        self._next_step_jobs = []
        for record in self._prompts_completing(scheduler_output):
            # If D has registered, or does before this step ends, P's worker WRITEs right
            # after this step's forward pass.
            assert record.transfer_id is not None and record.block_ids is not None
            self.prefill_channel.prefill_completing(
                record.transfer_id, record.request.request_id, record.block_ids,
                self._step_number, fail_on_purpose=record.fail_on_purpose)
        for failure in self.decode_channel.take_failures():
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
        self.prefill_channel.wait_caught_up(CATCH_UP_S)  # a prefill that just finished
        for action in self.prefill_channel.take_actions():
            if isinstance(action, StartWrite):
                if action.early_step is not None and action.early_step >= self._step_number:
                    self._next_step_jobs.append(action)  # its prompt's forward has not run yet
                else:
                    step.jobs.append(PushJob.of(action, time.monotonic()))
            elif isinstance(action, FreeBlocks):
                step.release.add(action.request_id)
        meta.push = step  # type: ignore[attr-defined]
        self._log_stats()
        if self._only_awaiting_pushes(scheduler_output, step):
            if self._wake is not None:
                self._wake.wait(self.push_wait_pause)  # a worker wakes it when a push lands
            else:
                time.sleep(self.push_wait_pause)
        return meta

    def check_threads(self) -> None:
        """Every step: raise ThreadDied if a side-channel thread died. vLLM's engine then
        stops with that error and its health check fails, so the server is restarted
        rather than serving on with pushes that can no longer work."""
        self.prefill_channel.check_alive()
        self.decode_channel.check_alive()

    def _prompts_completing(self, scheduler_output: SchedulerOutput) -> Iterator[PrefillPush]:
        """P: the followed push prefills this step completes, each now COMPLETING with all
        of its blocks (clipped as for the exchange: what `request_finished` will hand
        over). Updates the blocks of the others (a prompt in chunks gets more blocks each
        step)."""
        for rid, new_blocks, full_table in scheduled_blocks(scheduler_output):
            record = self._prefill_pushes.get(rid)
            if record is None or record.state is not PrefillState.FOLLOWED:
                continue
            if new_blocks is not None:
                if record.block_ids is None or full_table:  # first step, or after preemption
                    record.block_ids = [list(group) for group in new_blocks]
                else:
                    for group, new in zip(record.block_ids, new_blocks, strict=True):
                        group.extend(new)
            request = record.request
            scheduled = scheduler_output.num_scheduled_tokens.get(rid, 0)
            if record.block_ids is not None \
                    and request.num_computed_tokens + scheduled >= request.num_prompt_tokens:
                clipped = self.get_exchange_clipped_blocks(record.block_ids)
                self._prefill_pushes.completing(record, [list(group) for group in clipped])
                yield record

    def _wake_listener(self, engine_id: str, dp_index: int) -> WakeListener | None:
        """D: where the workers wake the pausing engine when a push lands (None: no pause,
        or no IPC socket could be made; then the pause is a plain sleep)."""
        if self.push_wait_pause <= 0:
            return None
        try:
            return WakeListener(engine_id, dp_index)
        except (OSError, zmq.ZMQError) as exc:
            logger.warning("no wake-up socket for the push-wait pause (%s): a landed push "
                           "is seen up to %.1f ms late", exc, self.push_wait_pause * 1000)
            return None

    def _only_awaiting_pushes(self, scheduler_output: SchedulerOutput, step: PushStep) -> bool:
        """D: this step runs nothing and orders nothing; all D does is wait for pushes.
        vLLM would step again at once; a short pause leaves the CPU to others (P)."""
        return (self.push_wait_pause > 0 and self._decode_pushes.awaiting() and step.is_empty()
                and scheduler_output.total_num_scheduled_tokens == 0)

    def _log_stats(self) -> None:
        last, at = self._logged
        now = time.monotonic()
        channel, decode = self.prefill_channel, self.decode_channel
        s, r = self.stats, channel.counters
        refused = (r.over_limit, r.too_many_blocks, r.foreign_aborts, r.abandoned,
                   r.abandons_ignored, r.tombstones_dropped, channel.refused_handshakes,
                   channel.unidentified, channel.bad_messages, channel.unsent, channel.shed,
                   channel.errors, decode.errors, decode.peers_closed, decode.no_socket)
        if now - at < self.stats_interval or (self.stats == last and refused == self._refused):
            return
        self._logged = (dataclasses.replace(self.stats), now)
        self._refused = refused
        mean_ms = s.write_seconds / s.writes_done * 1000 if s.writes_done else 0.0
        logger.info(
            "push stats: P prefills pull %d push %d probes %d; writes done %d failed %d "
            "(%d blocks, mean %.1f ms, early %d), offered for pull %d; registry matched %d "
            "expired %d+%d aborted %d refused %d, write leases lapsed %d; D registered %d "
            "received %d pulled instead "
            "%d fell back %d aborted %d; abandoned %d (ignored %d); dropped: over the "
            "pending limits %d, too many blocks or groups %d, aborts not from the registrant "
            "%d, oldest tombstones %d, peers refused by CURVE %d, unidentified messages %d, "
            "undecodable messages %d, answers to peers not connected %d, messages of "
            "unknown peers shed past the handling share %d; errors survived by the channel "
            "threads: P %d, D %d; "
            "D's sockets to P closed %d, registrations with no socket %d",
            s.pull_prefills, s.push_prefills, s.probes, s.writes_done, s.writes_failed,
            s.blocks_written, mean_ms, r.early, s.pull_offers, r.matched,
            r.expired_registrations, r.expired_unclaimed, r.aborted, r.rejected + r.duplicates,
            r.lease_expired, s.registrations, s.received, s.pulled_instead, s.fell_back, s.aborted,
            r.abandoned, r.abandons_ignored, r.over_limit, r.too_many_blocks,
            r.foreign_aborts, r.tombstones_dropped, channel.refused_handshakes,
            channel.unidentified, channel.bad_messages, channel.unsent, channel.shed,
            channel.errors, decode.errors, decode.peers_closed, decode.no_socket)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        super().update_connector_output(connector_output)
        for rid in connector_output.finished_recving or ():
            tid = self._decode_pushes.received(rid)
            if tid is not None:
                self.decode_channel.forget(tid)
                self.stats.received += rid not in connector_output.failed_recving
        report = connector_output.kv_connector_worker_meta
        if isinstance(report, PushReport):
            for tid, end in self._write_tally.add(report).items():
                # Every rank kept its blocks: D may read them all. Otherwise the ranks
                # that kept theirs free them when their lease ends.
                offer = end.error is not None and end.holding_ranks == end.ranks
                self.prefill_channel.write_ended(
                    tid, end.error, pull_ttl=self.pull_fallback_ttl if offer else None)
                self.stats.pull_offers += offer
                if end.error is None:
                    self.stats.writes_done += 1
                    self.stats.blocks_written += end.blocks
                    self.stats.write_seconds += end.seconds
                    logger.debug("push %s: %d blocks written in %.1f ms", tid, end.blocks,
                                 end.seconds * 1000)
                else:
                    self.stats.writes_failed += 1
                    logger.warning("push %s: WRITE failed: %s", tid, end.error)

    def shutdown(self) -> None:
        super().shutdown()  # type: ignore[no-untyped-call]
        self.prefill_channel.stop()
        self.decode_channel.stop()
        if self._wake is not None:
            self._wake.close()
