"""`NixlDualConnector`: the class vLLM loads. One NIXL connector, pull or push per request.

    --kv-transfer-config '{"kv_connector": "NixlDualConnector",
                           "kv_connector_module_path": "connector",
                           "kv_role": "kv_both",
                           "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"push_port": 5700}}'

The same class runs on P and D. Like vLLM's own NIXL connectors, this facade only picks
the scheduler-side or worker-side object for its role and forwards to it; the work is in
`connector.scheduler` (pull per vLLM, push per request) and `connector.worker`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from connector.config import ConfigError, DualConfig
from connector.protocol.step import PushReport
from connector.scheduler import DualScheduler
from connector.vllm_compat import (
    KVConnectorMetadata,
    KVConnectorRole,
    NixlBaseConnector,
    NixlConnectorMetadata,
)
from connector.worker import DualWorker

if TYPE_CHECKING:
    import torch

    from connector.vllm_compat import ForwardContext, KVCacheConfig, VllmConfig


class NixlDualConnector(NixlBaseConnector):
    """Pull (vLLM's READ path) or push (WRITE, registered over our side channel), chosen
    per request by `kv_transfer_params["transfer_mode"]`; pull when it is absent."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = DualScheduler(vllm_config, self.engine_id,
                                                     kv_cache_config)
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = DualWorker(vllm_config, self.engine_id, kv_cache_config)
        else:
            raise ValueError(f"unsupported KV connector role: {role}")

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Asked by vLLM at start on a GPU: with `push_layers: on` (every push written
        layer by layer) the per-layer hook must run during the forward pass, which a full
        CUDA graph's replay skips; vLLM then captures piecewise graphs. `auto` does not
        ask: its pushes (1,024 tokens and up by default) are prefills larger than vLLM's
        largest captured batch by default (512 tokens) and run outside full graphs; one
        that a full graph runs is written whole after the pass, never too early
        (`connector.prefill.fence`)."""
        try:
            config = DualConfig.from_extra_config(extra_config)
        except ConfigError:
            return False  # the connector's start says what is wrong
        return config.push_layers == "on"

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Called before each step's forward pass: the push orders are taken here, so P's
        WRITEs run while the forward computes instead of after it (a whole prefill
        chunk later)."""
        super().bind_connector_metadata(connector_metadata)
        if isinstance(self.connector_worker, DualWorker):
            assert isinstance(connector_metadata, NixlConnectorMetadata)
            self.connector_worker.start_step(connector_metadata)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: Any, **kwargs: Any) -> None:
        """On exit of each attention layer, during the forward pass: P WRITEs that
        layer's KV of the pushes written by layer (`DualWorker.layer_saved`)."""
        if isinstance(self.connector_worker, DualWorker):
            self.connector_worker.layer_saved(layer_name)

    def wait_for_save(self) -> None:
        """After the step's forward pass: P's early WRITEs (see `PrefillWorker.write_early`)."""
        super().wait_for_save()  # type: ignore[no-untyped-call]
        if isinstance(self.connector_worker, DualWorker):
            self.connector_worker.write_early()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert isinstance(self.connector_worker, DualWorker)
        assert isinstance(self._connector_metadata, NixlConnectorMetadata)
        self.connector_worker.start_load_kv(self._connector_metadata)

    def build_connector_worker_meta(self) -> PushReport | None:
        if not isinstance(self.connector_worker, DualWorker):
            return None
        return self.connector_worker.take_report()
