"""Two real NIXL agents in this process, P's and D's, each with a buffer of blocks standing
for its KV cache, D's known to P, and P's prepared descriptor lists of both: what the
tests of P's WRITE path post into. Needs NIXL installed: without it the tests fail."""

from __future__ import annotations

from typing import Any

import numpy as np

from scripts import bench_nixl


class AgentPair:
    """P's and D's agents and buffers (`params`' blocks each), P's buffer filled with
    `fill` (one value per block); `local` and `remote` are P's descriptor lists of its own
    blocks and of D's, one descriptor per block."""

    def __init__(self, name: str, params: bench_nixl.Params, fill: np.ndarray) -> None:
        self.p_agent = bench_nixl.make_agent(f"{name}-p", params)
        self.d_agent = bench_nixl.make_agent(f"{name}-d", params)
        self.p_buffer, self.d_buffer = bench_nixl.allocate(params), bench_nixl.allocate(params)
        self.p_buffer.fill_from(np.broadcast_to(fill, self.p_buffer.array.shape).copy())
        self._registrations = [bench_nixl.register(self.p_agent, self.p_buffer, params),
                               bench_nixl.register(self.d_agent, self.d_buffer, params)]
        remote = self.p_agent.add_remote_agent(self.d_agent.get_agent_metadata())
        self.local: Any = self.p_agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", bench_nixl.block_descs(self.p_buffer, params), "DRAM")
        self.remote: Any = self.p_agent.prep_xfer_dlist(
            remote, bench_nixl.block_descs(self.d_buffer, params), "DRAM")

    def close(self) -> None:
        self.local.release()
        self.remote.release()
        self.p_agent.deregister_memory(self._registrations[0])
        self.d_agent.deregister_memory(self._registrations[1])
