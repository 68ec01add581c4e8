"""Pushes between tensor-parallel sizes on real NIXL (DRAM, UCX), one NIXL agent per rank
as vLLM has, P's ranks in this process and D's in a child process.

Each side holds the model's KV heads split over its ranks (`connector.shared.tp_plan`); P's
ranks WRITE their blocks, head by head, where the plan puts them, each WRITE carrying the
notification vLLM's push worker sends (`<D request id>:<P's tp>`). D counts them per rank
with the connector's own bookkeeping (`IncomingPushes`, expecting
`writers_per_decode_rank`) and reports when its push landed. P's ranks write one after
the other, so the test sees that a D rank fed by several P ranks does not land before
the last of them, and that what it holds then is exactly its heads of P's blocks, in the
blocks D registered, and nothing else. Needs NIXL installed: without it these fail."""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import time
from functools import partial
from typing import Any

import numpy as np
import pytest

from connector.decode.incoming import IncomingPushes
from connector.shared import tp_plan
from scripts import bench_nixl
from tests.conftest import until_sync

KV_HEADS = 4
HEAD_BYTES = 256  # one head's bytes in one block (tokens x head size, of K and V)
POOL = 8  # blocks each rank holds
P_BLOCKS = [1, 2, 5]  # P's blocks of the prompt
D_BLOCKS = [3, 0, 6]  # D's, as D registered them: P's block i goes to D's block i
D_REQUEST = "d-req-1"
PARAMS = bench_nixl.Params(device="cpu", block_bytes=HEAD_BYTES, blocks=POOL, iterations=1,
                           warmup=0, noncontiguous=False, one_block_rounds=0,
                           progress_thread=False, timeout=60.0)
WAIT_S = 30.0


def kv(block: int, head: int) -> np.ndarray:
    """The prompt's KV bytes of one head in P's block `block`: never zero, different for
    every (block, head)."""
    return ((np.arange(HEAD_BYTES) + block * 31 + head * 7) % 251 + 1).astype(np.uint8)


def heads_of(rank: int, tp: int) -> range:
    first = rank * KV_HEADS // tp
    return range(first, first + tp_plan.heads_per_rank(tp, KV_HEADS))


def rank_buffer(tp: int) -> np.ndarray:
    """One rank's KV cache: POOL blocks of its heads, heads contiguous within a block."""
    return np.zeros((POOL, tp_plan.heads_per_rank(tp, KV_HEADS), HEAD_BYTES), dtype=np.uint8)


def address(buffer: np.ndarray, block: int, head: int) -> int:
    return int(buffer.ctypes.data) + (block * int(buffer.shape[1]) + head) * HEAD_BYTES


# --- D: the child ----------------------------------------------------------------------------


def decode_side(prefill_tp: int, decode_tp: int,
                conn: multiprocessing.connection.Connection) -> None:
    """D's ranks: an agent and a buffer each; report every notification, and whether the
    push landed on that rank with it, with the rank's buffer; stop when told."""
    agents = [bench_nixl.make_agent(f"d-rank-{rank}", PARAMS) for rank in range(decode_tp)]
    buffers = [rank_buffer(decode_tp) for _ in range(decode_tp)]
    registrations = [agent.register_memory([(int(b.ctypes.data), b.nbytes, 0, "")], "DRAM")
                     for agent, b in zip(agents, buffers, strict=True)]
    incoming = [IncomingPushes() for _ in range(decode_tp)]
    for pushes in incoming:
        pushes.expect(D_REQUEST)
    conn.send([{"metadata": agent.get_agent_metadata(), "base": int(b.ctypes.data)}
               for agent, b in zip(agents, buffers, strict=True)])
    deadline = time.monotonic() + WAIT_S
    try:
        while time.monotonic() < deadline and not conn.poll(0):
            for rank, agent in enumerate(agents):
                for notifs in agent.get_new_notifs().values():
                    for notif in notifs:
                        request_id, count = notif.decode().rsplit(":", 1)
                        expected = tp_plan.writers_per_decode_rank(int(count), decode_tp)
                        landed = incoming[rank].notified(request_id, expected)
                        conn.send({"rank": rank, "landed": landed,
                                   "buffer": buffers[rank].copy() if landed else None})
            time.sleep(0.001)
    finally:
        conn.send({"final": [b.copy() for b in buffers]})
        for agent, registration in zip(agents, registrations, strict=True):
            agent.deregister_memory(registration)


# --- P: this process -------------------------------------------------------------------------


class Prefill:
    """P's ranks, each an agent whose buffer holds its heads of the prompt's blocks."""

    def __init__(self, tp: int) -> None:
        self.tp = tp
        self.agents = [bench_nixl.make_agent(f"p-rank-{rank}", PARAMS) for rank in range(tp)]
        self.buffers = [rank_buffer(tp) for _ in range(tp)]
        for rank, buffer in enumerate(self.buffers):
            for block in range(POOL):
                for slot, head in enumerate(heads_of(rank, tp)):
                    buffer[block, slot] = kv(block, head)
        self.registrations = [
            agent.register_memory([(int(b.ctypes.data), b.nbytes, 0, "")], "DRAM")
            for agent, b in zip(self.agents, self.buffers, strict=True)]
        self.handles: list[Any] = []

    def write(self, rank: int, decode: list[dict[str, Any]], decode_tp: int) -> list[Any]:
        """Rank `rank`'s WRITEs, one per D rank the plan maps it to; their handles."""
        agent, buffer, xfers = self.agents[rank], self.buffers[rank], []
        decode_buffer = rank_buffer(decode_tp)  # D's geometry, to compute D's addresses
        for write in tp_plan.head_writes(self.tp, decode_tp, rank, kv_heads=KV_HEADS):
            target = decode[write.decode_rank]
            remote_name = agent.add_remote_agent(target["metadata"])
            length = write.count * HEAD_BYTES
            local_rows = [(address(buffer, block, write.prefill_offset), length, 0)
                          for block in P_BLOCKS]
            remote_rows = [(address(decode_buffer, block, write.decode_offset)
                            - int(decode_buffer.ctypes.data) + target["base"], length, 0)
                           for block in D_BLOCKS]
            local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local_rows, "DRAM")
            remote = agent.prep_xfer_dlist(remote_name, remote_rows, "DRAM")
            self.handles += [local, remote]
            slots = np.arange(len(P_BLOCKS), dtype=np.int32)
            xfer = agent.make_prepped_xfer("WRITE", local, slots, remote, slots,
                                           f"{D_REQUEST}:{self.tp}".encode())
            assert agent.transfer(xfer) in ("PROC", "DONE")
            xfers.append((agent, xfer))
        return xfers

    def close(self) -> None:
        for handle in self.handles:
            handle.release()
        for agent, registration in zip(self.agents, self.registrations, strict=True):
            agent.deregister_memory(registration)


def expected_decode(rank: int, decode_tp: int) -> np.ndarray:
    """What D's rank holds once the push landed: its heads of P's blocks, in D's blocks."""
    buffer = rank_buffer(decode_tp)
    for p_block, d_block in zip(P_BLOCKS, D_BLOCKS, strict=True):
        for slot, head in enumerate(heads_of(rank, decode_tp)):
            buffer[d_block, slot] = kv(p_block, head)
    return buffer


def all_done(xfers: list[tuple[Any, Any]]) -> bool:
    states = [agent.check_xfer_state(xfer) for agent, xfer in xfers]
    assert "ERR" not in states, states
    return all(state == "DONE" for state in states)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [
    pytest.param(2, 1, id="p2-d1"),
    pytest.param(1, 2, id="p1-d2"),
    pytest.param(2, 2, id="p2-d2"),
])
def test_a_push_lands_each_head_on_the_decode_rank_that_holds_it(
    prefill_tp: int, decode_tp: int
) -> None:
    assert tp_plan.refusal(prefill_tp, decode_tp, kv_heads=KV_HEADS) is None
    context = multiprocessing.get_context("spawn")
    here, there = context.Pipe()
    child = context.Process(target=decode_side, args=(prefill_tp, decode_tp, there),
                            daemon=True)
    child.start()
    prefill = Prefill(prefill_tp)
    events: list[dict[str, Any]] = []

    def received() -> dict[str, Any] | None:
        return here.recv() if here.poll(0) else None

    def next_event(what: str) -> dict[str, Any]:
        event = until_sync(received, what, WAIT_S)
        assert event is not None
        return event

    try:
        assert here.poll(120), "D's process did not start"
        decode = here.recv()
        written: dict[int, int] = dict.fromkeys(range(decode_tp), 0)  # P ranks, per D rank
        for rank in range(prefill_tp):  # one P rank after the other
            xfers = prefill.write(rank, decode, decode_tp)
            until_sync(partial(all_done, xfers), f"P rank {rank}'s WRITEs", WAIT_S)
            targets = tp_plan.decode_targets(prefill_tp, decode_tp, rank)
            seen = [next_event(f"the notifications of P rank {rank}'s WRITEs")
                    for _ in targets]
            events += seen
            assert sorted(event["rank"] for event in seen) == list(targets), seen
            for event in seen:
                target = event["rank"]
                written[target] += 1
                complete = written[target] == tp_plan.writers_per_decode_rank(
                    prefill_tp, decode_tp)
                assert event["landed"] is complete, (target, written, event["landed"])
                if complete:  # landed with its notification: every byte is there
                    np.testing.assert_array_equal(event["buffer"],
                                                  expected_decode(target, decode_tp))
            for _, xfer in xfers:
                xfer.release()
        here.send("stop")
        final: list[np.ndarray] = next_event("D's buffers")["final"]
        for rank in range(decode_tp):
            np.testing.assert_array_equal(final[rank], expected_decode(rank, decode_tp))
        assert sum(e["landed"] for e in events) == decode_tp  # each D rank landed once
        assert len(events) == decode_tp * tp_plan.writers_per_decode_rank(prefill_tp,
                                                                            decode_tp)
        child.join(30)
        assert child.exitcode == 0
    finally:
        prefill.close()
        if child.is_alive():
            child.kill()
            child.join(5)
