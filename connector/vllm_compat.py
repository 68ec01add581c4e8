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

Supported: vLLM 0.32 and 0.33. Three changes of 0.33 matter to us, each handled below
by reading vLLM's own code (what a function returns, whether a field or attribute
exists; `FEATURES`), so that each version gets its behaviour:

1. `yield_req_data`'s third value: `preempted` in 0.32 (False for a new request, even
   one vLLM's second model runner lists again as new after a preemption), `is_full_table`
   in 0.33. `scheduled_blocks` gives `full_table` on both: the blocks given are all of
   the request's blocks, not more of them.
2. A registration generation (0.33): D drops its agent of a P and handshakes again when
   a pull names a newer generation than D loaded. D's workers also handshake with P to
   finish a push, and vLLM notes no generation then, so the first pull from that P would
   drop a fresh agent; `adopt_registration_generation` notes it first (see there why that
   is exact). D's registration over our side channel carries no generation: unchanged.
3. 0.33's push worker refuses a head-sharded draft model's KV under an MLA target between
   P and D of different TP sizes; `check_draft_tp` refuses our WRITE the same way (P then
   keeps the blocks for D to read).

What was checked on 0.33 (vLLM 0.33.0's CUDA wheel, imported on a CPU-only machine: its
Python modules import, its kernels do not load): every name imported here, every
`BORROWED` and `BORROWED_WITH_FEATURE` attribute and borrowed signature (the unit test
tests/unit/test_connector_vllm.py); the three differences against 0.33's own code
(tests/unit/test_vllm_compat_versions.py: its `_read_blocks_for_req`, its push worker's
handshake check); the connector's other unit tests; and NIXL agents built by 0.33's
worker module (tests/integration/test_nixl_progress.py). Not checked on 0.33: serving,
end to end (no CPU build of vLLM 0.33 exists; scripts/setup.sh installs 0.32.0, and the
end-to-end tests run on it).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, NamedTuple

import vllm
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

logger = logging.getLogger("vllm.pd_connector.vllm_compat")

# The vLLM releases this connector is tested with (keep in step with the `connector`
# extra in pyproject.toml and the version scripts/setup.sh installs).
SUPPORTED_VLLM_RANGE = ">=0.32,<0.34"
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
    import threading
    from collections import defaultdict

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


# --- where vLLM 0.32 and 0.33 differ ------------------------------------------------------
# Each difference is read from vLLM itself (what a function returns, whether a field or
# attribute exists), not from its version number, so a backport or a patched build gets the
# behaviour its code has. `FEATURES` says which this vLLM has.


class ScheduledBlocks(NamedTuple):
    """One request of a step, as vLLM's scheduler output has it."""

    request_id: str
    # Blocks per KV-cache group (None: the step gave it none).
    block_ids: tuple[list[int], ...] | None
    # `block_ids` are all of the request's blocks (a new request, or one resumed after a
    # preemption), not the blocks this step added to those it had.
    full_table: bool


def _flags_new_requests(reader: Callable[[Any], Iterator[tuple[str, Any, bool]]]) -> bool:
    """What `reader` (vLLM's `yield_req_data`) says for a new request: vLLM 0.33 yields
    `is_full_table`, True; vLLM 0.32 yields `preempted`, False (its value only says that a
    cached request was resumed: `block_ids` are then all of its blocks)."""
    output = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="new", block_ids=([],))],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[],
                                              resumed_req_ids=set()))
    return bool(next(iter(reader(output)))[2])


def scheduled_blocks(
    scheduler_output: SchedulerOutput,
    reader: Callable[[Any], Iterator[tuple[str, Any, bool]]] = yield_req_data,
) -> Iterator[ScheduledBlocks]:
    """The requests a step schedules, new and cached, with the blocks each was given, read
    with `reader` (vLLM's `yield_req_data`) and its third value taken as that vLLM means it.

    Under vLLM 0.32's meaning a new request is not flagged, yet its blocks are all of its
    blocks; that includes a preempted request that vLLM's second model runner lists again
    as new (flagged False there, while the first runner lists it as resumed, True)."""
    if reader is yield_req_data:
        full_table_flag = _YIELDS_FULL_TABLE
    else:
        full_table_flag = _flags_new_requests(reader)
    new: set[str] = set()
    if not full_table_flag:
        new = {request.req_id for request in scheduler_output.scheduled_new_reqs}
    for request_id, block_ids, flag in reader(scheduler_output):
        yield ScheduledBlocks(request_id, block_ids, full_table=flag or request_id in new)


def adopt_registration_generation(worker: NixlPullConnectorWorker, meta: ReqMeta) -> None:
    """D, before vLLM's pull code reads `meta`'s blocks from P (`_read_blocks_for_req`):
    if D holds P's agent from a push (D's workers handshake with P to finish a push) and
    has no registration generation for P yet, take the one `meta` carries as the agent's.

    vLLM 0.33 numbers P's KV-cache registrations (`remote_registration_generation` in P's
    answer) and drops the agent it holds of a P, then handshakes again, when a pull names
    a newer generation than the one D loaded. It notes the generation only on its pull
    path, so the first pull after a push-first handshake would find none and throw away a
    fresh agent, with a READ of a failed push (`pull` offer) perhaps still in flight.
    Taking the number is exact for our P: P publishes a new registration only when it
    wakes from sleep mode, which vLLM 0.33 refuses for this connector (vLLM's
    `NixlBaseConnector.supports_sleep_mode`, which we keep), so an engine's generation is
    the one it started with. A no-op on vLLM 0.32, whose worker has no generations."""
    generations: dict[str, int] | None = getattr(
        worker, "_remote_registration_generations", None)
    remote = meta.remote
    if generations is None or remote is None:
        return
    generation = int(getattr(remote, "registration_generation", 0))
    engine = remote.engine_id
    if generation <= 0 or engine in generations:
        return  # nothing to adopt (a push's own READ carries 0), or vLLM knows it
    with worker._handshake_lock:
        loaded = engine in worker._remote_agents
    if loaded:
        generations[engine] = generation


class DraftTpMismatch(NotImplementedError):
    """A WRITE that vLLM's own push worker would refuse: see `check_draft_tp`."""


def check_draft_tp(worker: NixlPullConnectorWorker, decode_engine_id: str) -> None:
    """P, before a WRITE into D's blocks: raise `DraftTpMismatch` where vLLM 0.33's push
    worker refuses D at its handshake: a draft model whose KV is split by heads under an
    MLA target model (`_head_sharded_draft_regions`, from vLLM 0.33) between a P and a D
    of different TP sizes. Our WRITE reuses that worker's descriptor code, but P's
    handshake with D is the pull worker's, which lacks the check. Then P keeps the blocks
    and D reads them instead, the pull that vLLM's message advises. A no-op on vLLM 0.32,
    which does not know such drafts (nor checks them)."""
    if not getattr(worker, "_head_sharded_draft_regions", None):
        return
    topology = worker.transfer_topo
    assert topology is not None  # set when the KV caches were registered
    decode_tp = topology.get_engine_info(decode_engine_id).remote_tp_size
    if decode_tp != topology.tp_size:
        raise DraftTpMismatch(
            f"push does not support a head-sharded draft's KV under an MLA target between "
            f"different TP sizes (P {topology.tp_size}, D {decode_tp}); P keeps the blocks "
            "for D to read (pull)")


class PullPushWorker(NixlPullConnectorWorker):
    """vLLM's pull worker with its push worker's WRITE code, and the differences between
    the vLLM versions we support handled (`connector.worker.DualWorker` builds on it).

    vLLM's push worker turns one request's blocks into per-rank WRITE descriptors (TP
    mapping, block-size ratios, prefix caching, MLA replication). We reuse that code as
    is; it needs `_sending_transfers`, its lock and `_send_failures`, which the subclass
    sets up."""

    # Set up by the subclass; declared here for the code that reaches them through this
    # type (P's half of the worker, `connector.prefill.worker_side`).
    _sending_transfers: defaultdict[str, list[int]]
    _sending_transfers_lock: threading.Lock
    _send_failures: set[str]

    _xfer_blocks = NixlPushConnectorWorker._xfer_blocks

    def _xfer_blocks_for_req(self, req_id: str, meta: ReqMeta) -> None:
        assert meta.remote is not None
        check_draft_tp(self, meta.remote.engine_id)
        NixlPushConnectorWorker._xfer_blocks_for_req(self, req_id, meta)  # type: ignore[arg-type]

    def _read_blocks_for_req(self, req_id: str, meta: ReqMeta) -> None:
        adopt_registration_generation(self, meta)
        super()._read_blocks_for_req(req_id, meta)


_YIELDS_FULL_TABLE = _flags_new_requests(yield_req_data)


class _TrimProbe:
    """A stand-in push worker of a dense model, for `push_trims_to_decode_tail`."""

    _has_mamba = False
    _group_spec_types: tuple[object, ...] = ()


def push_trims_to_decode_tail() -> bool:
    """Whether this vLLM's push WRITEs only the tail D lacks on a prefix hit: D registers
    its uncached blocks only, and vLLM's push code (which our worker reuses) must trim
    P's blocks to the matching tail. A front trim (a bug vLLM fixed in mid-2026) would
    write the prompt's head into D's tail blocks: a wrong answer, silently. Asked of
    vLLM's own code: P holds blocks 1-4, D lacks two; the WRITE must go from P's 3 and 4.
    Any other answer, or a method that is not there or takes other arguments, is False."""
    try:
        decode, prefill = NixlPushConnectorWorker._apply_prefix_caching(
            _TrimProbe(),  # type: ignore[arg-type]
            decode_block_ids=[[7, 8]], prefill_block_ids=[[1, 2, 3, 4]],
            decode_physical_per_logical=1, prefill_physical_per_logical=1)
        return ([list(group) for group in prefill] == [[3, 4]]
                and [list(group) for group in decode] == [[7, 8]])
    except Exception:
        return False

# Which of vLLM 0.33's differences this vLLM has, read from its code.
FEATURES: dict[str, bool] = {
    # `yield_req_data`'s third value is `is_full_table` (0.32: `preempted`).
    "full_table_flag": _YIELDS_FULL_TABLE,
    # Pulls name P's registration generation; D handshakes again when it grows.
    "registration_generations": "registration_generation" in {
        f.name for f in dataclasses.fields(RemoteMeta)},
    # The push worker refuses a head-sharded draft between different TP sizes.
    "draft_tp_check": "_validate_remote_agent_handshake" in vars(NixlPushConnectorWorker),
    # On a prefix hit on D, push WRITEs only the tail D lacks (without it, P refuses
    # pushes: see `push_trims_to_decode_tail`).
    "push_trims_decode_tail": push_trims_to_decode_tail(),
}

# What the helpers above read of a vLLM with each feature (with getattr and the older
# behaviour as default, so they run on vLLM 0.32 too); checked like `BORROWED` where the
# feature is present.
BORROWED_WITH_FEATURE: dict[str, dict[object, tuple[str, ...]]] = {
    "registration_generations": {
        NixlPullConnectorWorker: ("_remote_registration_generations", "_remote_agents",
                                  "_handshake_lock", "_read_blocks_for_req"),
    },
    "draft_tp_check": {
        NixlPullConnectorWorker: ("_head_sharded_draft_regions", "transfer_topo"),
    },
}


def on_cpu() -> bool:
    """Whether vLLM runs on CPU here."""
    return bool(current_platform.is_cpu())


def fence_device(vllm_config: VllmConfig) -> str | None:
    """Where P's early and layered WRITEs can wait for the KV the forward pass writes
    (`connector.prefill.fence`): "cpu" (the pass is synchronous), "cuda" (CUDA events on
    the KV cache NIXL reads), or None: neither (a KV cache copied to a host buffer after
    the pass, or another device), and P WRITEs at the next step, as vLLM does."""
    if current_platform.is_cpu():
        return "cpu"
    kv = vllm_config.kv_transfer_config
    if current_platform.is_cuda_alike() and kv is not None and kv.kv_buffer_device == "cuda":
        return "cuda"
    return None


__all__ = [
    "ALLOW_UNSUPPORTED_ENV",
    "BORROWED",
    "BORROWED_WITH_FEATURE",
    "FEATURES",
    "SUPPORTED_VLLM",
    "SUPPORTED_VLLM_RANGE",
    "DraftTpMismatch",
    "KVConnectorMetadata",
    "KVConnectorRole",
    "KVConnectorWorkerMetadata",
    "NixlBaseConnector",
    "NixlConnectorMetadata",
    "NixlPullConnectorScheduler",
    "NixlPullConnectorWorker",
    "NixlPushConnectorWorker",
    "PullPushWorker",
    "RemoteMeta",
    "ReqMeta",
    "ScheduledBlocks",
    "UnsupportedVllmVersion",
    "adopt_registration_generation",
    "check_draft_tp",
    "check_vllm_version",
    "fence_device",
    "nixl_base_worker",
    "on_cpu",
    "push_trims_to_decode_tail",
    "scheduled_blocks",
]
