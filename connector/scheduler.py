"""The dual connector's scheduler side: vLLM's pull scheduler, plus push per request.

A request is a push when its kv_transfer_params say `"transfer_mode": "push"` (the
router sets it on both legs, with the same `transfer_id`); anything else is vLLM's pull,
unchanged. The push part is two halves, one per side, each with its own side-channel
thread; this class composes them and forwards each of vLLM's calls to the side it
concerns:

- P (`do_remote_decode`): `connector.prefill.scheduler_side.PrefillScheduler` hands a
  finished push prefill's blocks to P's push registry, follows the prompts an early
  WRITE may start after, and tells the workers which WRITEs to start and which blocks to
  free.
- D (`do_remote_prefill`): `connector.decode.scheduler_side.DecodeScheduler` registers
  D's allocated blocks with P and waits, like a pull, for P's WRITE; a push that fails
  is read from P instead or recomputed.

Each step's orders to the workers (`PushStep`) are built here from both halves, in this
order: P's step number and the early WRITEs carried over, the prompts the step
completes, D's failed pushes, then the actions of P's channel.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

from connector.config import DualConfig
from connector.decode.scheduler_side import DecodeScheduler
from connector.prefill.scheduler_side import PrefillScheduler
from connector.protocol import http_params
from connector.protocol.step import PushStep
from connector.shared.stats import PushStats
from connector.vllm_compat import FEATURES, NixlPullConnectorScheduler, fence_device, on_cpu

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


def _dp_size(vllm_config: VllmConfig, engine_id: str) -> int | None:
    """How many data-parallel ranks this server has, as far as its engine knows: an MoE
    model's engines see the real size; a dense model's run as independent engines whose
    size vLLM resets to 1, known as data-parallel only by the `_dp{rank}` suffix vLLM puts
    on their engine id (then None: the size is unknown here)."""
    parallel = vllm_config.parallel_config
    if parallel.data_parallel_size > 1:
        return int(parallel.data_parallel_size)
    return None if engine_id.endswith(f"_dp{parallel.data_parallel_index}") else 1


class DualScheduler(NixlPullConnectorScheduler):
    """vLLM's pull scheduler, with P's half (`prefill`) and D's half (`decode`) of push."""

    def __init__(
        self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, engine_id, kv_cache_config)
        assert vllm_config.kv_transfer_config is not None
        config = DualConfig.from_extra_config(
            vllm_config.kv_transfer_config.kv_connector_extra_config)
        push_host = config.push_host or self.side_channel_host
        dp_index = vllm_config.parallel_config.data_parallel_index
        push_port = config.push_port + dp_index
        self.stats_interval = config.stats_interval
        push_wait_pause = config.wait_pause(on_cpu=on_cpu())
        early_write = config.writes_early(
            fenced=fence_device(vllm_config) is not None,
            world_size=vllm_config.parallel_config.world_size,
            tensor_parallel_size=vllm_config.parallel_config.tensor_parallel_size)
        keys = config.curve_keys()  # read at start: a bad key file fails the start
        # What this P tells the router it can do: push only if vLLM's push code writes a
        # prefix hit's tail right (checked at start, `vllm_compat`).
        push_supported = FEATURES["push_trims_decode_tail"]
        transfer_modes = list(http_params.TRANSFER_MODE_VALUES) if push_supported \
            else [http_params.PULL]
        if not push_supported:
            logger.error("push refused on this server: this vLLM's push code does not write "
                         "only the blocks D lacks on a prefix hit (checked at start); the "
                         "router is told pull only, and registrations are refused "
                         "(NACK push_unsupported)")
        self.stats = PushStats()  # both halves count here
        self.decode = DecodeScheduler(
            self, config, self.stats, wait_pause=push_wait_pause, dp_index=dp_index,
            curve=keys[1] if keys else None)
        self.prefill = PrefillScheduler(
            self, vllm_config, kv_cache_config, config, self.stats, push_host=push_host,
            push_port=push_port, dp_rank=dp_index, dp_size=_dp_size(vllm_config, engine_id),
            push_supported=push_supported, transfer_modes=transfer_modes,
            early_write=early_write, curve=keys[0] if keys else None)
        self.prefill.channel.start()
        self.decode.channel.start()
        # What the next step tells the workers (both halves add to it).
        self._step = PushStep()
        self._logged = (PushStats(), time.monotonic())
        self._refused: tuple[int, ...] = (0,) * 15  # the drop counts last logged
        logger.info("dual connector: modes %s; push side channel on %s:%d (%s); idle steps "
                    "while waiting for pushes pause %.1f ms; early WRITEs %s",
                    ",".join(http_params.TRANSFER_MODE_VALUES), push_host, push_port,
                    "CURVE-authenticated" if keys else "unauthenticated",
                    push_wait_pause * 1000, "on" if early_write else "off")

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = http_params.decode_params(request.kv_transfer_params)
        if params is None or not params.is_push or not params.do_remote_prefill:
            super().update_state_after_alloc(request, blocks, num_external_tokens)
            if params is not None and params.is_push and params.do_remote_decode:
                self.prefill.follow(request, params)
            return
        self.decode.register(request, params, blocks, num_external_tokens, self._step)

    def request_finished(
        self, request: Request, block_ids: BlockIds
    ) -> tuple[bool, dict[str, Any] | None]:
        params = http_params.decode_params(request.kv_transfer_params)
        if params is not None and params.is_push and not params.do_remote_decode:
            self.decode.request_finished(request, params)
            return False, None
        delay_free, answer = super().request_finished(request, block_ids)
        if params is None or not params.do_remote_decode:
            return delay_free, answer
        return self.prefill.request_finished(request.request_id, params, delay_free, answer)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self.check_threads()
        meta = super().build_connector_meta(scheduler_output)
        step, self._step = self._step, PushStep()
        self.prefill.begin_step(step, scheduler_output)
        self.decode.take_failures(step)
        self.prefill.take_actions(step)
        meta.push = step  # type: ignore[attr-defined]
        self._log_stats()
        self.decode.pause_if_idle(scheduler_output, step)
        return meta

    def check_threads(self) -> None:
        """Every step: raise ThreadDied if a side-channel thread died. vLLM's engine then
        stops with that error and its health check fails, so the server is restarted
        rather than serving on with pushes that can no longer work."""
        self.prefill.channel.check_alive()
        self.decode.channel.check_alive()

    def _log_stats(self) -> None:
        last, at = self._logged
        now = time.monotonic()
        channel, decode = self.prefill.channel, self.decode.channel
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
            "(%d blocks, mean %.1f ms, early %d, by layer %d, by chunk %d of %d chunks asked), "
            "offered for pull "
            "%d; registry matched %d "
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
            s.blocks_written, mean_ms, r.early, s.writes_by_layer, s.writes_by_chunk, r.chunks,
            s.pull_offers,
            r.matched,
            r.expired_registrations, r.expired_unclaimed, r.aborted, r.rejected + r.duplicates,
            r.lease_expired, s.registrations, s.received, s.pulled_instead, s.fell_back, s.aborted,
            r.abandoned, r.abandons_ignored, r.over_limit, r.too_many_blocks,
            r.foreign_aborts, r.tombstones_dropped, channel.refused_handshakes,
            channel.unidentified, channel.bad_messages, channel.unsent, channel.shed,
            channel.errors, decode.errors, decode.peers_closed, decode.no_socket)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        super().update_connector_output(connector_output)
        self.decode.received(connector_output)
        self.prefill.writes_ended(connector_output.kv_connector_worker_meta)

    def shutdown(self) -> None:
        super().shutdown()  # type: ignore[no-untyped-call]
        self.prefill.channel.stop()
        self.decode.stop()
