"""vLLM behind one wall: every vLLM name the connector uses, and the vLLM versions it
supports.

The connector subclasses vLLM's NIXL connector halves (`NixlPullConnectorScheduler`,
`NixlPullConnectorWorker`) and reuses private methods and attributes of theirs, which
vLLM changes between releases without notice. So this is the only module of `connector`
that imports `vllm`: the others import what they need from here. At import it checks the
installed vLLM against `SUPPORTED_VLLM` and refuses any other version with
`UnsupportedVllmVersion`, which names both; set `PDPROXY_ALLOW_UNSUPPORTED_VLLM=1` to
start anyway (logged as a warning; pushes may then fail in ways no test has seen).

`BORROWED` lists the private attributes of vLLM's classes that our subclasses read, set
or call. A unit test checks that every name imported here and every borrowed attribute
exists in the installed vLLM, with the signatures we call them with.

Why not vLLM 0.33 yet: it keeps all these names, but three of its changes matter to
us. The third value of `yield_req_data` changes meaning (in 0.32: the request resumed
after a preemption, so the blocks given are all of its blocks; see `scheduled_blocks`);
a registration generation makes D re-handshake with P after a push-first handshake; and
its push worker checks the draft model's TP, which our WRITE path (built on its
`_xfer_blocks_for_req`) skips. Supporting it means handling those three, then widening
`SUPPORTED_VLLM` (and the `connector` extra in pyproject.toml).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, NamedTuple

import vllm
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

logger = logging.getLogger("vllm.pd_connector.vllm_compat")

# The vLLM releases this connector is tested with (keep in step with the `connector`
# extra in pyproject.toml and the version scripts/setup.sh installs).
SUPPORTED_VLLM_RANGE = ">=0.32,<0.33"
SUPPORTED_VLLM = SpecifierSet(SUPPORTED_VLLM_RANGE)
# Set to 1 to start with a vLLM outside SUPPORTED_VLLM anyway.
ALLOW_UNSUPPORTED_ENV = "PDPROXY_ALLOW_UNSUPPORTED_VLLM"


class UnsupportedVllmVersion(RuntimeError):
    """The installed vLLM is outside `SUPPORTED_VLLM`."""


def check_vllm_version(installed: str, env: Mapping[str, str] | None = None) -> None:
    """Raise `UnsupportedVllmVersion` unless vLLM `installed` is in `SUPPORTED_VLLM`, or
    `env` (the process's environment by default) allows any version, which is logged."""
    env = os.environ if env is None else env
    try:
        supported = SUPPORTED_VLLM.contains(Version(installed), prereleases=True)
    except InvalidVersion:
        supported = False
    if supported:
        return
    problem = (f"the dual connector supports vLLM {SUPPORTED_VLLM_RANGE}, but vLLM {installed} is "
               "installed: it uses private parts of vLLM's NIXL connector that change "
               "between releases")
    if env.get(ALLOW_UNSUPPORTED_ENV, "") == "1":
        logger.warning("%s; starting anyway, since %s=1: pushes and pulls may fail in "
                       "untested ways", problem, ALLOW_UNSUPPORTED_ENV)
        return
    raise UnsupportedVllmVersion(
        f"{problem}. Install a supported vLLM (scripts/setup.sh), or set "
        f"{ALLOW_UNSUPPORTED_ENV}=1 to try this one at your own risk")


# Checked before the names below are imported: a vLLM that lacks one of them fails here
# with the versions named, not with an ImportError deep inside.
check_vllm_version(vllm.__version__)

# The imports follow the version check on purpose:
# ruff: noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import yield_req_data
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as nixl_base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlConnectorMetadata,
    RemoteMeta,
    ReqMeta,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
    NixlPullConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import (
    NixlPushConnectorWorker,
)
from vllm.platforms import current_platform

if TYPE_CHECKING:  # types for annotations only (re-exported: `X as X`)
    from vllm.config import VllmConfig as VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.utils import BlockIds as BlockIds
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorTransferResults as KVConnectorTransferResults,
    )
    from vllm.forward_context import ForwardContext as ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks as KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput as SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig as KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput as KVConnectorOutput
    from vllm.v1.request import Request as Request

# The private attributes of vLLM's classes that our subclasses use (methods, and fields
# their constructors set), by class. Our names for them, where we wrap one, are beside it.
BORROWED: dict[object, tuple[str, ...]] = {
    NixlPullConnectorScheduler: (
        "_reqs_need_recv", "_reqs_need_send", "_reqs_not_processed",
        "get_exchange_clipped_blocks", "side_channel_host", "side_channel_port",
        "transfer_tp_size", "block_size", "engine_id",
    ),
    NixlPullConnectorWorker: (
        "_logical_to_kernel_block_ids", "_physical_blocks_per_logical_kv_block",
        "_recving_metadata", "_recving_transfers", "_ensure_handshake", "_failed_recv_reqs",
        "_read_blocks_for_req", "_reqs_to_process", "_reqs_to_send", "_engine_last_active",
        "nixl_wrapper", "_pop_done_transfers", "_try_release_xfer_handle",
        "_handshake_lock", "_remote_agents", "_handshake_futures", "transfer_topo",
        "_handle_heartbeat", "xfer_stats", "expected_consumer_notifications_by_req",
        "consumer_notification_counts_by_req", "world_size",
    ),
    # Our worker reuses these two as its own methods; they need `_sending_transfers`,
    # `_sending_transfers_lock` and `_send_failures`, which our worker sets up itself.
    NixlPushConnectorWorker: (
        "_xfer_blocks_for_req", "_xfer_blocks", "_sending_transfers",
        "_sending_transfers_lock", "_send_failures",
    ),
    # progress.py swaps this factory while vLLM's worker builds its NIXL agent.
    nixl_base_worker: ("nixl_agent_config",),
}


class ScheduledBlocks(NamedTuple):
    """One request of a step, as vLLM's scheduler output has it."""

    request_id: str
    # The blocks the step added, one list per KV-cache group (None: none added).
    new_block_ids: tuple[list[int], ...] | None
    # Resumed after a preemption: `new_block_ids` are all of its blocks, not more of them.
    # (The meaning vLLM 0.32 gives this value; 0.33 changes it: see the module docstring.)
    resumed: bool


def scheduled_blocks(scheduler_output: SchedulerOutput) -> Iterator[ScheduledBlocks]:
    """The requests a step schedules, new and cached, with the blocks each was given."""
    for request_id, new_block_ids, resumed in yield_req_data(scheduler_output):
        yield ScheduledBlocks(request_id, new_block_ids, resumed)


def on_cpu() -> bool:
    """Whether vLLM runs on CPU here."""
    return bool(current_platform.is_cpu())


__all__ = [
    "ALLOW_UNSUPPORTED_ENV",
    "BORROWED",
    "SUPPORTED_VLLM",
    "SUPPORTED_VLLM_RANGE",
    "KVConnectorMetadata",
    "KVConnectorRole",
    "KVConnectorWorkerMetadata",
    "NixlBaseConnector",
    "NixlConnectorMetadata",
    "NixlPullConnectorScheduler",
    "NixlPullConnectorWorker",
    "NixlPushConnectorWorker",
    "RemoteMeta",
    "ReqMeta",
    "ScheduledBlocks",
    "UnsupportedVllmVersion",
    "check_vllm_version",
    "nixl_base_worker",
    "on_cpu",
    "scheduled_blocks",
]
