"""P's half of the dual connector's scheduler (`connector.scheduler.DualScheduler`).

P (`do_remote_decode`): when a push prefill finishes, its blocks are handed to the push
registry (through `PrefillChannel`) instead of vLLM's pull lease. The registry matches
them with D's registration and asks for a WRITE (`PushStep.jobs`), or says to free them
(`PushStep.release`: D aborted, nobody registered in time, a duplicate...). A push
request whose WRITE may start right after the forward pass that completes its prompt (an
early WRITE) is followed step by step (`connector.prefill.prompts`).

Every P answer also says what this P can do (`transfer_modes`) and where its push side
channel is (`push_host`, `push_port`), which the router passes on to D. A probe (the
router's one-token prefill that asks for these coordinates, `"probe": true`) frees its
blocks at once.

Runs on the engine's scheduler thread, as a part of vLLM's pull scheduler (`_vllm`, whose
pull lease it takes over for push requests); P's channel runs its own thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from connector.prefill.channel import FreeBlocks, PrefillChannel, StartWrite
from connector.prefill.prompts import PrefillPush, PrefillPushes, PrefillState
from connector.prefill.registry import PushRegistry, RegistryConfig
from connector.protocol import http_params
from connector.protocol.side_channel import EngineId
from connector.protocol.step import PushJob, PushReport, PushStep, WriteTally
from connector.shared import tp_plan
from connector.vllm_compat import scheduled_blocks

if TYPE_CHECKING:
    from connector.config import DualConfig
    from connector.shared.keys import ServerKeys
    from connector.shared.stats import PushStats
    from connector.vllm_compat import (
        KVCacheConfig,
        KVConnectorWorkerMetadata,
        NixlPullConnectorScheduler,
        Request,
        SchedulerOutput,
        VllmConfig,
    )

logger = logging.getLogger("vllm.pd_connector.scheduler")

# How long a step waits for the side channel to match a just-finished prefill, so its
# WRITE starts in this step rather than the next.
CATCH_UP_S = 0.005


# A preempted push's chunk count: it asks for no more chunks.
NO_MORE_CHUNKS = 2**62


class PrefillScheduler:
    """P's push requests, from their first scheduled step to their WRITE's end."""

    def __init__(
        self, vllm: NixlPullConnectorScheduler, vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig, config: DualConfig, stats: PushStats, *,
        push_host: str, push_port: int, dp_rank: int, dp_size: int | None,
        push_supported: bool, transfer_modes: list[str], early_write: bool,
        curve: ServerKeys | None,
    ) -> None:
        self._vllm = vllm
        self.stats = stats
        self.push_host, self.push_port = push_host, push_port
        # Told in every answer, so the router can pin a push to this engine (the
        # X-data-parallel-rank header) and give D this rank's coordinates.
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.transfer_modes = transfer_modes
        self.early_write = early_write
        self.fault_injection = config.fault_injection
        self.pull_fallback_ttl = config.pull_fallback_ttl
        self._config = config  # whether a push is written layer by layer (`writes_layers`)
        registry = PushRegistry(RegistryConfig(
            engine_id=EngineId(vllm.engine_id), block_size=vllm.block_size,
            tp_size=vllm.transfer_tp_size, registration_ttl=config.registration_ttl,
            unclaimed_ttl=config.unclaimed_ttl, num_blocks=kv_cache_config.num_blocks or None,
            num_groups=len(kv_cache_config.kv_cache_groups) or None,
            max_pending_per_peer=config.max_pending_per_peer, max_pending=config.max_pending,
            lease_s=config.write_lease, write_s=config.write_timeout,
            kv_heads=vllm_config.model_config.get_total_num_kv_heads(),
            mla=vllm_config.model_config.use_mla,
            mamba=tp_plan.keeps_state(vllm_config.model_config),
            push_supported=push_supported))
        self.channel = PrefillChannel(
            registry, push_host, push_port,
            early_to=(vllm.engine_id, dp_rank, vllm_config.parallel_config.world_size)
            if early_write else None, curve=curve)
        # WRITEs some of P's workers (TP x PP ranks) finished, waiting for the rest.
        self._write_tally = WriteTally(vllm_config.parallel_config.world_size)
        # The push requests computing their prompt, until they end; the number of the
        # step being built; and early WRITEs that reached the engine instead of the
        # worker, for the next step.
        self._prefill_pushes = PrefillPushes()
        # Chunks of a layered push's prompt written while later chunks compute (the
        # registry pairs P's blocks with D's as vLLM's push code would for the whole
        # prompt, which speculative decoding's extra slots would shift); requests that
        # ended with chunks written and no final WRITE, for the next step (P's workers
        # let go of them).
        self._chunk_writes = early_write and vllm_config.speculative_config is None
        self._chunks_dropped: set[str] = set()
        self._chunks_preempted: set[str] = set()
        self._step_number = 0
        self._next_step_jobs: list[StartWrite] = []

    def follow(self, request: Request, params: http_params.KVTransferParams) -> None:
        """A push request was scheduled. Follow its blocks step by step if its WRITE may
        start right after the forward pass that completes its prompt: only when that
        pass also finishes the request (max_tokens 1, as the router sends), since P's
        blocks are freed as soon as the WRITE is done. A followed push may be written
        layer by layer (the request's `push_layers`, else `DualConfig.push_layers`)."""
        self._prefill_pushes.scheduled(
            request, http_params.transfer_id_of(params),
            fail_on_purpose=self.fault_injection and params.fail_write,
            follow=self.early_write and not params.probe and request.max_tokens == 1,
            layered=self._config.writes_layers(params.push_layers, request.num_prompt_tokens))

    def request_finished(
        self, rid: str, params: http_params.KVTransferParams, delay_free: bool,
        answer: dict[str, Any] | None,
    ) -> tuple[bool, dict[str, Any] | None]:
        """P's request ended (vLLM's pull scheduler has answered `delay_free`, `answer`):
        a push's blocks go to the push registry, a probe's are freed; the answer says
        what this P can do and where its push side channel is."""
        if params.is_push:
            delay_free, done = self._push_finished(rid, params, delay_free, answer)
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

    def _push_finished(
        self, rid: str, params: http_params.KVTransferParams, delay_free: bool,
        answer: dict[str, Any] | None,
    ) -> tuple[bool, bool]:
        """P's push request ended: hand its blocks to the push registry (then True, with
        whether vLLM must keep them), or tell the registry it was aborted (False)."""
        tid = http_params.transfer_id_of(params)
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
                self.channel.prefill_aborted(tid)
            if record is not None and record.chunk_blocks:
                self._chunks_dropped.add(rid)
            return delay_free, False
        else:
            completed = answer[http_params.REMOTE_BLOCK_IDS]
        # The push registry holds these blocks now, not vLLM's pull lease.
        self._stop_pull_lease(rid)
        self.channel.prefill_finished(tid, rid, completed, fail_on_purpose=fail_on_purpose)
        if answer is not None:
            answer[http_params.TRANSFER_MODE] = http_params.PUSH
        self.stats.push_prefills += 1
        return delay_free, True

    def _stop_pull_lease(self, request_id: str) -> None:
        self._vllm._reqs_need_send.pop(request_id, None)
        self._vllm._reqs_not_processed.add(request_id)

    def begin_step(self, step: PushStep, scheduler_output: SchedulerOutput) -> None:
        """The step being built: number it, carry over the early WRITEs that came for it,
        and tell the registry of the prompts it completes."""
        self._step_number += 1
        step.number = self._step_number
        now = time.monotonic()  # each job's write lease, as a lifetime from here
        step.jobs = [PushJob.of(write, now) for write in self._next_step_jobs]
        self._next_step_jobs = []
        step.chunks_dropped, self._chunks_dropped = self._chunks_dropped, set()
        chunks: list[tuple[PrefillPush, list[int]]] = []
        completing = list(self._prompts_completing(scheduler_output, chunks))
        step.chunks_failed, self._chunks_preempted = self._chunks_preempted, set()
        for record in completing:
            # If D has registered, or does before this step ends, P's worker WRITEs right
            # after this step's forward pass; a layered one, while that pass computes it,
            # if D registered in time.
            assert record.transfer_id is not None and record.block_ids is not None
            if record.layered:
                step.layered.add(record.request.request_id)
            self.channel.prefill_completing(
                record.transfer_id, record.request.request_id, record.block_ids,
                self._step_number, fail_on_purpose=record.fail_on_purpose)
        for record, blocks in chunks:
            # A chunk of a layered push's prompt, not its last: if D has registered, P's
            # worker WRITEs its blocks layer by layer while this step computes them.
            assert record.transfer_id is not None
            step.layered.add(record.request.request_id)
            self.channel.prefill_progress(
                record.transfer_id, record.request.request_id, [blocks],
                self._prompt_blocks(record.request), self._step_number)

    def take_actions(self, step: PushStep) -> None:
        """What P's channel asks of the engine, into the step being built: WRITEs to start
        (an early one whose prompt's forward has not run yet waits for the next step) and
        blocks to free."""
        self.channel.wait_caught_up(CATCH_UP_S)  # a prefill that just finished
        for action in self.channel.take_actions():
            if isinstance(action, StartWrite):
                if action.early_step is not None and action.early_step >= self._step_number:
                    self._next_step_jobs.append(action)  # its prompt's forward has not run yet
                else:
                    step.jobs.append(PushJob.of(action, time.monotonic()))
            elif isinstance(action, FreeBlocks):
                step.release.add(action.request_id)

    def _prompt_blocks(self, request: Request) -> int:
        return -(-request.num_prompt_tokens // self._vllm.block_size)

    def _prompts_completing(self, scheduler_output: SchedulerOutput,
                            chunks: list[tuple[PrefillPush, list[int]]],
                            ) -> Iterator[PrefillPush]:
        """The followed push prefills this step completes, each now COMPLETING with all
        of its blocks (clipped as for the exchange: what `request_finished` will hand
        over). Updates the blocks of the others (a prompt in chunks gets more blocks each
        step), and adds to `chunks` the layered ones this step computes a chunk of (not
        the last) with their first blocks whose KV is whole after it, when those are more
        than earlier chunks covered: one KV-cache group and no speculative decoding only,
        so that P's blocks pair with D's as vLLM's push code pairs them."""
        for rid, new_blocks, full_table in scheduled_blocks(scheduler_output):
            record = self._prefill_pushes.get(rid)
            if record is None or record.state is not PrefillState.FOLLOWED:
                continue
            if new_blocks is not None:
                if record.block_ids is None or full_table:  # first step, or after preemption
                    if record.block_ids is not None and record.chunk_blocks:
                        # Preempted after chunk WRITEs, which may have read blocks vLLM
                        # took back: the push fails (D reads it), no more chunks.
                        self._chunks_preempted.add(rid)
                        record.chunk_blocks = NO_MORE_CHUNKS
                    record.block_ids = [list(group) for group in new_blocks]
                else:
                    for group, new in zip(record.block_ids, new_blocks, strict=True):
                        group.extend(new)
            request = record.request
            scheduled = scheduler_output.num_scheduled_tokens.get(rid, 0)
            if record.block_ids is None:
                continue
            computed = request.num_computed_tokens + scheduled
            if computed >= request.num_prompt_tokens:
                clipped = self._vllm.get_exchange_clipped_blocks(record.block_ids)
                self._prefill_pushes.completing(record, [list(group) for group in clipped])
                yield record
            elif record.layered and self._chunk_writes and len(record.block_ids) == 1:
                whole = min(computed // self._vllm.block_size, len(record.block_ids[0]))
                if whole > record.chunk_blocks and record.transfer_id is not None:
                    record.chunk_blocks = whole
                    chunks.append((record, list(record.block_ids[0][:whole])))

    def writes_ended(self, report: KVConnectorWorkerMetadata | None) -> None:
        """The workers' report: tell the registry of each WRITE every rank has ended."""
        if not isinstance(report, PushReport):
            return
        for tid, end in self._write_tally.add(report).items():
            # Every rank kept its blocks: D may read them all. Otherwise the ranks that
            # kept theirs free them when their lease ends.
            offer = end.error is not None and end.holding_ranks == end.ranks
            self.channel.write_ended(
                tid, end.error, pull_ttl=self.pull_fallback_ttl if offer else None)
            self.stats.pull_offers += offer
            if end.error is None:
                self.stats.writes_done += 1
                self.stats.writes_by_layer += end.layered
                self.stats.writes_by_chunk += end.chunked
                self.stats.blocks_written += end.blocks
                self.stats.write_seconds += end.seconds
                logger.debug("push %s: %d blocks written in %.1f ms", tid, end.blocks,
                             end.seconds * 1000)
            else:
                self.stats.writes_failed += 1
                logger.warning("push %s: WRITE failed: %s", tid, end.error)
