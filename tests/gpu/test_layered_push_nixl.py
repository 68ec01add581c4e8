"""A progressive push written by real NIXL out of GPU memory, each layer behind its fence.

P's and D's KV caches are laid out as vLLM lays them out (one K and one V tensor per
layer, each a NIXL region of blocks) in GPU memory, each registered with a NIXL agent of
its own (UCX). A forward pass of several layers writes P's KV on a CUDA stream, each layer
taking its time; after each layer, as vLLM's per-layer hook does, the connector's own
plan (`connector.prefill.layers`: `RegionLayers`, `LayeredWrite`) gives that layer's part
of the push, and the fence (`connector.prefill.fence`) posts it as a NIXL WRITE into D's
blocks. The last layer's part carries D's notification and goes once every other part is
done, as P's worker sends it. D then holds every layer of every block, as P computed it.

What is left out: vLLM itself (its hooks, its CUDA graphs), two GPUs or two hosts (both
agents share one GPU, so UCX moves the KV within it), and the side channel.

Needs a CUDA GPU, PyTorch and NIXL; not in the default test run (`tests/gpu`, see
docs/development.md). Fails, not skips, without them.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import nixl  # noqa: F401  (the package picks its CUDA build; fails loudly when missing)
import numpy as np
import pytest
import torch
from nixl._api import nixl_agent, nixl_agent_config

from connector.prefill.fence import CudaFence, Fence, HostFence
from connector.prefill.layers import LayeredWrite, PlannedWrite, RegionLayers
from tests.gpu import clock
from tests.gpu.clock import measure_cycles_per_ms, spin

LAYERS = 4
BLOCKS = 16  # per region
BLOCK_FLOATS = 4096  # 16 KiB blocks
LAYER_MS = 30.0
P_BLOCKS = [3, 5, 7, 8]  # the prompt's blocks on P ...
D_BLOCKS = [1, 2, 9, 12]  # ... and the blocks D registered for it
NOTIFICATION = b"req-1:1"
WAIT_S = 20.0



@pytest.fixture(scope="module")
def cycles_per_ms() -> float:
    return measure_cycles_per_ms()


class KvCache:
    """One server's KV cache on the GPU: a K and a V tensor per layer, each a NIXL region of
    `BLOCKS` blocks, in vLLM's region order (layer by layer)."""

    def __init__(self, device: str = "cuda") -> None:
        self.regions = [torch.zeros(BLOCKS, BLOCK_FLOATS, device=device)
                        for _ in range(2 * LAYERS)]
        self.names = [f"model.layers.{layer}.attn" for layer in range(LAYERS) for _ in "kv"]
        self.device = torch.cuda.current_device() if device == "cuda" else 0
        self.mem_type = "VRAM" if device == "cuda" else "DRAM"
        self.block_bytes = BLOCK_FLOATS * 4

    def memory(self) -> list[tuple[int, int, int, str]]:
        return [(t.data_ptr(), t.numel() * 4, self.device, "") for t in self.regions]

    def descriptors(self) -> np.ndarray:
        """One (address, length, device) row per (region, block): a block's descriptor id
        is its region's start plus the block, as in vLLM."""
        rows = [(t.data_ptr() + block * self.block_bytes, self.block_bytes, self.device)
                for t in self.regions for block in range(BLOCKS)]
        return np.asarray(rows, dtype=np.uint64)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.regions[2 * layer], self.regions[2 * layer + 1]


def descriptor_ids(blocks: list[int]) -> np.ndarray:
    return np.asarray([region * BLOCKS + block for region in range(2 * LAYERS)
                       for block in blocks], dtype=np.int32)


def wait_for(condition: Callable[[], bool], what: str, *, then: Callable[[], object]) -> None:
    """Poll `condition`, calling `then` between looks (to progress an agent)."""
    clock.wait_for(condition, what, timeout=WAIT_S, then=then, poll=0.001)


@contextmanager
def agents(p_cache: KvCache, d_cache: KvCache) -> Iterator[tuple[Any, Any, Any, Any]]:
    """P's and D's NIXL agents, their caches registered, P knowing D: (P's agent, D's
    agent, P's prepared local descriptors, P's prepared descriptors of D's blocks)."""
    config = nixl_agent_config(backends=["UCX"])
    p_agent = nixl_agent(f"p-{uuid.uuid4().hex[:8]}", config)
    d_agent = nixl_agent(f"d-{uuid.uuid4().hex[:8]}", config)
    p_memory = p_agent.register_memory(p_cache.memory(), p_cache.mem_type)
    d_memory = d_agent.register_memory(d_cache.memory(), d_cache.mem_type)
    d_name = p_agent.add_remote_agent(d_agent.get_agent_metadata())
    local = p_agent.prep_xfer_dlist("NIXL_INIT_AGENT", p_cache.descriptors(), p_cache.mem_type)
    remote = p_agent.prep_xfer_dlist(d_name, d_cache.descriptors(), d_cache.mem_type)
    try:
        yield p_agent, d_agent, local, remote
    finally:
        p_agent.release_dlist_handle(local)
        p_agent.release_dlist_handle(remote)
        p_agent.remove_remote_agent(d_name)
        p_agent.deregister_memory(p_memory)
        d_agent.deregister_memory(d_memory)


def layered_push(fence: Fence, cycles_per_ms: float) -> np.ndarray:
    """One progressive push while P's forward pass computes: D's cache afterwards, on the
    host, as (region, block, float)."""
    torch.cuda.synchronize()
    p_cache, d_cache = KvCache(), KvCache()
    torch.cuda.synchronize()
    forward = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with agents(p_cache, d_cache) as (p_agent, d_agent, local, remote):
        plan = LayeredWrite.plan("req-1", [PlannedWrite(
            local, descriptor_ids(P_BLOCKS), remote, descriptor_ids(D_BLOCKS), NOTIFICATION)],
            RegionLayers(p_cache.names, [BLOCKS] * len(p_cache.names)))
        handles: list[Any] = []
        pass_over: list[bool] = []
        seen: list[bytes] = []  # D's notifications

        def progress() -> None:
            """Both agents at work: P's, to complete its WRITEs and send the notification
            after the last; D's, to take them in."""
            all_done()
            seen.extend(message for messages in d_agent.get_new_notifs().values()
                        for message in messages)

        lock = threading.Lock()  # P's agent, from the fence's thread and the poller's

        def post(parts: list[PlannedWrite]) -> None:
            for part in parts:
                with lock:
                    handle = p_agent.make_prepped_xfer(
                        "WRITE", part.local_handle, part.local_ids, part.remote_handle,
                        part.remote_ids, part.notif)
                    assert p_agent.transfer(handle) != "ERR", "NIXL refused a WRITE"
                    handles.append(handle)

        def all_done() -> bool:
            with lock:
                states = [p_agent.check_xfer_state(handle) for handle in handles]
            assert "ERR" not in states, "a WRITE failed"
            return all(state == "DONE" for state in states)

        with torch.cuda.stream(forward):
            for layer in range(LAYERS):
                spin(int(LAYER_MS * cycles_per_ms))
                k, v = p_cache.layer(layer)
                k.fill_(layer + 1)
                v.fill_(-(layer + 1))
                fence.after_queued_work(partial(post, plan.due([layer])))  # the hook

            def after_the_pass() -> None:
                post(plan.rest())
                pass_over.append(True)

            fence.after_queued_work(after_the_pass)
        # P's poller: the final part (D's notification) once every other part is done.
        wait_for(lambda: bool(pass_over) and all_done(), "every layer's part written",
                 then=progress)
        assert NOTIFICATION not in seen, "D was told before the last layer was written"
        post(plan.final)
        wait_for(lambda: NOTIFICATION in seen and all_done(), "D's notification",
                 then=progress)
        for handle in handles:
            p_agent.release_xfer_handle(handle)
        torch.cuda.synchronize()
        return torch.stack(d_cache.regions).cpu().numpy()


def landed(d_kv: np.ndarray) -> list[bool]:
    """Per layer: whether D's blocks hold the layer's K and V as P computed them."""
    return [bool((d_kv[2 * layer][D_BLOCKS] == layer + 1).all()
                 and (d_kv[2 * layer + 1][D_BLOCKS] == -(layer + 1)).all())
            for layer in range(LAYERS)]


def test_every_layer_of_every_block_lands_before_ds_notification(cycles_per_ms: float) -> None:
    fence = CudaFence()
    try:
        d_kv = layered_push(fence, cycles_per_ms)
    finally:
        fence.close()
    assert landed(d_kv) == [True] * LAYERS
    others = [block for block in range(BLOCKS) if block not in D_BLOCKS]
    assert not d_kv[:, others].any(), "a WRITE landed outside the blocks D registered"


def test_without_the_fence_nixl_writes_kv_not_yet_computed(cycles_per_ms: float) -> None:
    """The control: posted from the hook at once, NIXL reads P's layers before the GPU
    wrote them, and D is told of KV it does not hold."""
    d_kv = layered_push(HostFence(), cycles_per_ms)
    assert not all(landed(d_kv)), "every layer landed without a fence: the test cannot tell"
