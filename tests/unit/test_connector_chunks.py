"""P's scheduler asks for a chunk's WRITE each step that computes a chunk of a layered
push's prompt, not its last (`PrefillScheduler._prompts_completing`)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

from connector.prefill import scheduler_side
from connector.prefill.prompts import PrefillPushes, PrefillState
from tests.unit.test_vllm_compat_versions import _output

BLOCK = 16


def scheduler(*, layered: bool, chunk_writes: bool = True) -> tuple[Any, Any]:
    pushes = PrefillPushes()
    request = SimpleNamespace(request_id="r", num_computed_tokens=0, num_prompt_tokens=40)
    pushes.scheduled(cast(Any, request), cast(Any, "t-r"), fail_on_purpose=False,
                     follow=True, layered=layered)
    fake = SimpleNamespace(_prefill_pushes=pushes, _chunk_writes=chunk_writes,
                           _vllm=SimpleNamespace(block_size=BLOCK,
                                                 get_exchange_clipped_blocks=lambda b: b))
    return fake, request


def run(fake: Any, output: Any) -> tuple[list[str], list[list[int]]]:
    chunks: list[tuple[Any, list[int]]] = []
    done = [r.request.request_id for r in scheduler_side.PrefillScheduler._prompts_completing(
        fake, output, chunks)]
    return done, [blocks for _, blocks in chunks]


def test_each_chunk_but_the_last_asks_for_the_blocks_whole_after_it() -> None:
    """40 tokens in chunks of 24 and 16 (block size 16): after the first chunk one block
    is whole (the second holds 8 of its 16 tokens), so the chunk asks for it alone; the
    last chunk completes the prompt: the push's own WRITE, no chunk."""
    fake, request = scheduler(layered=True)
    assert run(fake, _output(new={"r": [7, 8]}, cached={}, scheduled={"r": 24})) == ([], [[7]])
    request.num_computed_tokens = 24
    assert run(fake, _output(new={}, cached={"r": [9]}, scheduled={"r": 16})) == (["r"], [])
    record = fake._prefill_pushes.get("r")
    assert record.state is PrefillState.COMPLETING and record.block_ids == [[7, 8, 9]]


def test_a_chunk_that_makes_no_new_block_whole_asks_for_nothing() -> None:
    fake, request = scheduler(layered=True)
    assert run(fake, _output(new={"r": [7]}, cached={}, scheduled={"r": 8})) == ([], [])
    request.num_computed_tokens = 8
    assert run(fake, _output(new={}, cached={"r": None}, scheduled={"r": 8})) == ([], [[7]])
    request.num_computed_tokens = 16
    assert run(fake, _output(new={}, cached={"r": [8]}, scheduled={"r": 8})) == ([], [])


def test_no_chunks_for_a_whole_push_or_where_chunks_are_off() -> None:
    for fake, _ in (scheduler(layered=False), scheduler(layered=True, chunk_writes=False)):
        assert run(fake, _output(new={"r": [7, 8]}, cached={}, scheduled={"r": 24}))[1] == []
