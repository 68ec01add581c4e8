"""`nixl_progress_thread` on real NIXL (DRAM, UCX): an agent that vLLM's worker code builds
inside `agent_progress` progresses by itself in "event" mode, at no cost while idle.

The target agent is built in a child process exactly as vLLM's NIXL worker builds its own
(its module's `nixl_agent_config` and `NixlWrapper`), then never polled while a writer in
this process WRITEs into it. On CPU a WRITE completes only once the target's agent has
answered its flush: with the event-driven thread it does at once, without any thread
(`"off"`) it waits for the target's next poll. Needs NIXL and vLLM installed: without them
these tests fail.

What an idle agent costs in CPU (nothing, in "event" mode; a core, spinning) is measured
by `scripts.bench_idle`, not here: on a shared machine a bound on it fails for reasons
of its own."""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import time
from typing import Any

import numpy as np
import pytest

from scripts import bench_nixl

PARAMS = bench_nixl.Params(device="cpu", block_bytes=4096, blocks=8, iterations=1, warmup=0,
                           noncontiguous=False, one_block_rounds=0, progress_thread=False,
                           timeout=30.0)
NOTIF = b"progress-test"


def target(mode: str, conn: multiprocessing.connection.Connection) -> None:
    """The child: an agent built the way vLLM builds its own, a buffer the writer fills;
    it answers only on the pipe, and polls its agent only when told to."""
    import nixl._api as api
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    from connector.shared.progress import agent_progress

    # vLLM's module exports neither name explicitly
    factory = base_worker.nixl_agent_config  # type: ignore[attr-defined]
    binding_config = api.nixlBind.nixlAgentConfig
    with agent_progress(mode):  # type: ignore[arg-type]  # a ProgressMode
        agent = base_worker.NixlWrapper(  # type: ignore[attr-defined]
            f"target-{mode}", base_worker.nixl_agent_config(  # type: ignore[attr-defined]
                num_threads=4, capture_telemetry=True))
    restored = (base_worker.nixl_agent_config is factory  # type: ignore[attr-defined]
                and api.nixlBind.nixlAgentConfig is binding_config)
    buffer = bench_nixl.allocate(PARAMS)
    registration = bench_nixl.register(agent, buffer, PARAMS)
    conn.send({"metadata": agent.get_agent_metadata(),
               "descs": bench_nixl.block_descs(buffer, PARAMS), "restored": restored})
    conn.recv()  # the writer's WRITE is over (or not): only now poll the agent
    deadline, notified = time.monotonic() + 5.0, False
    while not notified and time.monotonic() < deadline:
        notified = NOTIF in sum(agent.get_new_notifs().values(), [])
        time.sleep(0.01)
    conn.send({"notified": notified, "bytes": buffer.read_back().tobytes()})
    conn.recv()
    agent.deregister_memory(registration)


def write_into(mode: str) -> dict[str, Any]:
    """Run a target of `mode`, WRITE into it once, watch the WRITE's state without the
    target polling; what the target and the writer saw."""
    context = multiprocessing.get_context("spawn")
    here, there = context.Pipe()
    child = context.Process(target=target, args=(mode, there), daemon=True)
    child.start()
    agent = bench_nixl.make_agent(f"writer-{mode}", PARAMS)
    buffer = bench_nixl.allocate(PARAMS)
    pattern = np.arange(buffer.array.size, dtype=np.uint64).astype(np.uint8) ^ 0x5A
    buffer.fill_from(pattern.reshape(buffer.array.shape))
    registration = bench_nixl.register(agent, buffer, PARAMS)
    try:
        assert here.poll(120), "the target did not start"
        hello = here.recv()
        remote_name = agent.add_remote_agent(hello["metadata"])
        local = agent.prep_xfer_dlist("NIXL_INIT_AGENT",
                                      bench_nixl.block_descs(buffer, PARAMS), "DRAM")
        remote = agent.prep_xfer_dlist(remote_name, hello["descs"], "DRAM")
        slots = np.arange(PARAMS.blocks, dtype=np.int32)
        xfer = agent.make_prepped_xfer("WRITE", local, slots, remote, slots, NOTIF)
        state = agent.transfer(xfer)
        # Nothing in the target shows that it had its chance to answer (it is not to be
        # polled): "off" is judged after a bounded second, far longer than "event" takes.
        deadline = time.monotonic() + 1.0
        while state == "PROC" and time.monotonic() < deadline:
            time.sleep(0.005)
            state = agent.check_xfer_state(xfer)
        unpolled_state = state
        here.send("poll now")  # and the writer polls too: it sends the notification
        deadline = time.monotonic() + 30.0
        while not here.poll(0.005) and time.monotonic() < deadline:
            if state == "PROC":
                state = agent.check_xfer_state(xfer)
        assert here.poll(0), "the target did not answer"
        seen = here.recv()
        here.send("done")
        xfer.release()
        for handle in (local, remote):
            handle.release()
        agent.remove_remote_agent(remote_name)
        child.join(30)
        return {**hello, **seen, "unpolled_state": unpolled_state, "final_state": state,
                "expected": buffer.read_back().tobytes()}
    finally:
        agent.deregister_memory(registration)
        if child.is_alive():
            child.kill()
            child.join(5)


@pytest.mark.parametrize("mode", ["event", "off"])
def test_a_write_into_an_unpolled_agent_completes_only_with_the_event_thread(mode: str) -> None:
    seen = write_into(mode)
    assert seen["restored"], "vLLM's and NIXL's names were not put back after the build"
    if mode == "event":
        assert seen["unpolled_state"] == "DONE", seen["unpolled_state"]
    else:
        assert seen["unpolled_state"] == "PROC", "the WRITE completed with nobody polling D"
    assert seen["final_state"] == "DONE" and seen["notified"]
    assert seen["bytes"] == seen["expected"], "the target's buffer does not hold the WRITE"
