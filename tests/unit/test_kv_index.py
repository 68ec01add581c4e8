"""The KV index: vLLM's event encodings, the router's block keys, sequence gaps, wipes,
duplicates, bounds and credits (`proxy.pool.kv`)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from vllm.distributed import kv_events as vllm_events

from proxy.pool.kv.blocks import PromptBlocks, prompt_keys
from proxy.pool.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    Malformed,
    decode_batch,
)
from proxy.pool.kv.index import Applied, Duplicate, KvIndex, NeedReplay, SourceIndex, SourceState

BS = 4  # block size in these tests


def vllm_payload(*events: vllm_events.KVCacheEvent, rank: int | None = 0) -> bytes:
    """A batch exactly as vLLM's publisher encodes it (today's map-encoded events)."""
    batch = vllm_events.KVEventBatch(ts=1.0, events=list(events),  # type: ignore[arg-type]
                                     data_parallel_rank=rank)
    return msgspec.msgpack.encode(batch)


def vllm_stored(hashes: list[bytes], parent: bytes | None, tokens: list[int],
                extra_keys: list[tuple[Any, ...] | None] | None = None) -> vllm_events.BlockStored:
    return vllm_events.BlockStored(
        block_hashes=list(hashes), parent_block_hash=parent, token_ids=tokens, block_size=BS,
        lora_id=None, medium="GPU", lora_name=None, extra_keys=extra_keys)


def stored(hashes: list[int], parent: int | None, tokens: list[int], *,
           lora_name: str | None = None, extra_keys: tuple[Any, ...] | None = None,
           group_idx: int | None = None, medium: str | None = None) -> BlockStored:
    return BlockStored(block_hashes=tuple(hashes), parent_block_hash=parent, token_ids=tokens,
                       block_size=BS, lora_name=lora_name, extra_keys=extra_keys,
                       group_idx=group_idx, medium=medium)


def batch(*events: object) -> EventBatch:
    return EventBatch(1.0, tuple(events))  # type: ignore[arg-type]


TOKENS = list(range(100, 116))  # four blocks of four


# --- decoding ---------------------------------------------------------------------------


def test_decodes_vllms_own_map_encoding() -> None:
    payload = vllm_payload(
        vllm_stored([b"h1", b"h2"], None, TOKENS[:8], extra_keys=[("salt",), None]),
        vllm_events.BlockRemoved(block_hashes=[b"h2"], medium="GPU"),
        vllm_events.AllBlocksCleared(),
    )
    decoded = decode_batch(payload)
    assert decoded.data_parallel_rank == 0
    first, removed, cleared = decoded.events
    assert isinstance(first, BlockStored)
    assert first.block_hashes == (b"h1", b"h2") and first.token_ids == TOKENS[:8]
    assert first.extra_keys == (("salt",), None) and first.medium == "GPU"
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == (b"h2",)
    assert isinstance(cleared, AllBlocksCleared)


def test_decodes_the_earlier_array_encoding() -> None:
    payload = msgspec.msgpack.encode([2.5, [
        ["BlockStored", [11, 12], None, TOKENS[:8], BS, None, "GPU"],
        ["BlockRemoved", [12], "GPU"],
        ["AllBlocksCleared"],
    ]])
    decoded = decode_batch(payload)
    assert decoded.ts == 2.5 and decoded.data_parallel_rank is None
    assert decoded.events[0] == stored([11, 12], None, TOKENS[:8], medium="GPU")
    assert decoded.events[1] == BlockRemoved((12,), medium="GPU")
    assert isinstance(decoded.events[2], AllBlocksCleared)


@pytest.mark.parametrize("payload", [
    b"\xc1garbage",
    msgspec.msgpack.encode({"not": "a batch"}),
    msgspec.msgpack.encode([1.0, "events"]),
    msgspec.msgpack.encode([1.0, [["Unknown", 1]]]),
    msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": "x"}]]),
    msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, ["a"], 4, None, "GPU"]]]),
    msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [1, 2, 3, 4], 0, None, "GPU"]]]),
    msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1],
                                   "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
                                   "block_size": 4, "extra_keys": [None, None]}]]),
])
def test_anything_else_is_malformed(payload: bytes) -> None:
    with pytest.raises(Malformed):
        decode_batch(payload)


# --- keys -------------------------------------------------------------------------------


def test_keys_chain_from_the_prompts_start_and_need_the_same_extra_keys() -> None:
    keys = prompt_keys(TOKENS, BS)
    assert len(keys) == 4 and len(set(keys)) == 4
    assert prompt_keys(TOKENS[:10], BS) == keys[:2]  # a partial last block has no key
    assert prompt_keys([0] * 4 + TOKENS[4:], BS)[1] != keys[1]  # chained to the parent
    assert prompt_keys(TOKENS, BS, cache_salt="s") != keys
    assert prompt_keys(TOKENS, BS, lora="adapter") != keys


def test_an_events_blocks_get_the_keys_a_prompt_computes() -> None:
    source = SourceIndex("http://p", 0)
    source.accept(0, batch(stored([1, 2], None, TOKENS[:8]), stored([3], 2, TOKENS[8:12])))
    assert source.hits(prompt_keys(TOKENS, BS), now=0) == 3
    assert source.hits(prompt_keys(TOKENS[:4] + [9, 9, 9, 9] + TOKENS[8:], BS), now=0) == 1


def test_salted_and_lora_blocks_match_only_the_same_salt_and_adapter() -> None:
    source = SourceIndex("http://p", 0)
    # vLLM publishes extra keys untagged: the LoRA name on every block, the salt on the first
    source.accept(0, batch(stored([1, 2], None, TOKENS[:8], lora_name="a",
                                  extra_keys=(("a", "s"), ("a",)))))
    assert source.hits(prompt_keys(TOKENS, BS, lora="a", cache_salt="s"), now=0) == 2
    assert source.hits(prompt_keys(TOKENS, BS, lora="a"), now=0) == 0
    assert source.hits(prompt_keys(TOKENS, BS, cache_salt="s"), now=0) == 0
    assert source.lora_names == {"a"}


# --- sequence numbers -------------------------------------------------------------------


def test_a_gap_asks_for_a_replay_and_leaves_the_source_unknown() -> None:
    source = SourceIndex("http://p", 0)
    assert source.accept(0, batch(stored([1], None, TOKENS[:4]))) == Applied()
    assert source.state is SourceState.SYNCED
    assert source.accept(3, batch()) == NeedReplay(1)
    assert source.state.value == "unknown" and source.counts.gaps == 1
    assert len(source) == 1  # unknown, not empty
    # the replay delivers 1 and 2, then the live 3 applies
    assert source.accept(1, batch(stored([2], 1, TOKENS[4:8])), replayed=True) == Applied()
    assert source.accept(2, batch(), replayed=True) == Applied()
    assert source.accept(3, batch()) == Applied()
    assert source.state is SourceState.SYNCED and len(source) == 2


def test_joining_mid_stream_replays_from_zero() -> None:
    source = SourceIndex("http://p", 0)
    assert source.accept(7, batch()) == NeedReplay(0)
    assert source.accept(7, batch()) == NeedReplay(0)  # still missing 0..6
    source.lost(5)  # the publisher's buffer starts at 5
    assert source.accept(5, batch(), replayed=True) == Applied()
    assert source.accept(6, batch(), replayed=True) == Applied()
    assert source.accept(7, batch()) == Applied()
    assert "replay_incomplete" not in source.counts.wipes


def test_live_batches_a_replay_already_gave_are_duplicates() -> None:
    source = SourceIndex("http://p", 0)
    source.accept(0, batch())
    assert source.accept(2, batch()) == NeedReplay(1)
    for seq in (1, 2, 3):  # the replay ran on to 3, published meanwhile
        source.accept(seq, batch(), replayed=True)
    assert source.accept(2, batch()) == Duplicate()  # the live 2 and 3, queued meanwhile
    assert source.accept(3, batch()) == Duplicate()
    assert source.accept(4, batch()) == Applied()
    assert source.counts.wipes == {}


def test_a_live_sequence_that_goes_back_is_a_restarted_server() -> None:
    source = SourceIndex("http://p", 0)
    source.accept(0, batch(stored([1], None, TOKENS[:4])))
    source.accept(1, batch(stored([2], 1, TOKENS[4:8])))
    assert source.accept(0, batch(stored([9], None, TOKENS[:4]))) == Applied(wiped="restarted")
    assert len(source) == 1 and source.last_seq == 0


def test_a_replay_that_cannot_cover_a_gap_wipes_what_it_cannot_vouch_for() -> None:
    source = SourceIndex("http://p", 0)
    source.accept(0, batch(stored([1], None, TOKENS[:4])))
    assert source.accept(9, batch()) == NeedReplay(1)
    source.lost(9)
    assert len(source) == 0 and source.counts.wipes == {"replay_incomplete": 1}
    assert source.accept(9, batch()) == Applied()


# --- events -----------------------------------------------------------------------------


def test_duplicate_stores_and_removals_are_counted() -> None:
    source = SourceIndex("http://p", 0)
    keys = prompt_keys(TOKENS, BS)
    source.accept(0, batch(stored([1], None, TOKENS[:4]), stored([1], None, TOKENS[:4])))
    assert source.counts.duplicates == 1
    source.accept(1, batch(BlockRemoved((1,))))
    assert source.hits(keys, now=0) == 1  # one copy left
    source.accept(2, batch(BlockRemoved((1,)), BlockRemoved((1,))))
    assert source.hits(keys, now=0) == 0 and source.counts.unknown_removals == 1


def test_all_blocks_cleared_empties_the_source() -> None:
    source = SourceIndex("http://p", 0)
    source.accept(0, batch(stored([1, 2], None, TOKENS[:8])))
    source.accept(1, batch(AllBlocksCleared(), stored([3], None, TOKENS[:4])))
    assert len(source) == 1 and source.counts.wipes == {"cleared": 1}


def test_other_tiers_groups_orphans_and_partial_blocks_are_not_routed_to() -> None:
    source = SourceIndex("http://p", 0)
    source.accept(0, batch(
        stored([1], None, TOKENS[:4], medium="CPU"),
        stored([2], None, TOKENS[:4], group_idx=1),
        stored([3], 42, TOKENS[4:8]),  # parent never heard of
        stored([4], None, TOKENS[:3]),  # fewer tokens than a block
    ))
    assert len(source) == 0
    assert source.counts.ignored == 3 and source.counts.orphans == 1


def test_a_source_over_its_bound_is_wiped_not_grown() -> None:
    source = SourceIndex("http://p", 0, max_blocks=3)
    hashes = list(range(1, 5))
    outcome = source.accept(0, batch(stored(hashes, None, list(range(16)))))
    assert outcome == Applied(wiped="over_capacity") and len(source) == 0


# --- queries ----------------------------------------------------------------------------


def test_credits_count_until_they_expire_and_are_bounded() -> None:
    source = SourceIndex("http://p", 0)
    keys = prompt_keys(TOKENS, BS)
    source.credit(keys[:2], until=10.0)
    assert source.hits(keys, now=5.0) == 2
    assert source.hits(keys, now=11.0) == 0


def test_the_index_is_unknown_until_a_source_is_synced_and_forgets_servers() -> None:
    index = KvIndex()
    prompt = PromptBlocks(TOKENS)

    def hit_tokens() -> int | None:  # the events' block size wins over the fallback
        return index.hit_tokens("http://p", prompt, now=0, fallback_block_size=2 * BS)

    assert hit_tokens() is None
    source = index.source("http://p", 0)
    assert hit_tokens() is None  # nothing heard yet: unknown
    source.accept(0, batch(stored([1], None, TOKENS[:4])))
    other = index.source("http://p", 1)  # a second data-parallel rank holds more
    other.accept(0, batch(stored([1, 2], None, TOKENS[:8])))
    assert hit_tokens() == 2 * BS
    assert source.block_size == other.block_size == BS
    index.forget("http://p")
    assert index.sources("http://p") == [] and hit_tokens() is None


def test_a_source_with_no_stored_block_yet_takes_another_servers_block_size() -> None:
    index = KvIndex()
    index.source("http://p", 0).accept(0, batch(stored([1], None, TOKENS[:4])))
    fresh = index.source("http://q", 0)
    fresh.start_empty()
    prompt = PromptBlocks(TOKENS)
    index.credit("http://q", prompt, until=10.0, fallback_block_size=2 * BS)
    assert index.hit_tokens("http://q", prompt, now=0, fallback_block_size=2 * BS) == 16
    assert fresh.hits(prompt.keys(BS), now=0) == 4  # credited in the other server's size


def test_the_lent_block_size_follows_the_server_that_lends_it() -> None:
    """A source with nothing stored takes a lender's block size while its server stays,
    then another's; with no lender left, the fallback."""
    index = KvIndex()
    index.source("http://p", 0).accept(0, batch(stored([1], None, TOKENS[:4])))
    fresh = index.source("http://q", 0)
    fresh.start_empty()

    def credited_in(size: int) -> bool:  # credited afresh, in blocks of `size` tokens
        fresh.release()
        prompt = PromptBlocks(TOKENS)
        index.credit("http://q", prompt, until=10.0, fallback_block_size=3 * BS)
        return fresh.hits(prompt.keys(size), now=0) == len(TOKENS) // size

    assert credited_in(BS)  # p's
    index.forget("http://p")
    assert credited_in(3 * BS)  # nobody lends one: the fallback
    index.source("http://r", 0).accept(0, batch(BlockStored(
        block_hashes=(1,), parent_block_hash=None, token_ids=TOKENS[:8], block_size=2 * BS)))
    assert credited_in(2 * BS)  # a new lender, found again
    index.forget("http://r")
    assert credited_in(3 * BS)


def test_prompt_blocks_compute_keys_once_per_block_size() -> None:
    prompt = PromptBlocks(TOKENS)
    assert prompt.keys(BS) is prompt.keys(BS)
    assert prompt.keys(8) == prompt_keys(TOKENS, 8)
    assert len(prompt) == 16


def test_a_prompt_held_whole_is_remembered_until_a_key_leaves() -> None:
    index = KvIndex()
    source = index.source("http://p", 0)
    source.accept(0, batch(stored([1, 2, 3, 4], None, TOKENS)))
    prompt = PromptBlocks(TOKENS)

    def hit_tokens() -> int | None:
        return index.hit_tokens("http://p", prompt, now=0, fallback_block_size=BS)

    def remembered() -> bool:
        return prompt.held_by.get("http://p") == (source, source.removals, 16)

    assert hit_tokens() == 16 and remembered()
    source.accept(1, batch(stored([1], None, TOKENS[:4])))  # a second copy: nothing left
    assert hit_tokens() == 16 and remembered()
    source.accept(2, batch(BlockRemoved((1,))))  # one copy of two: the key stays
    assert hit_tokens() == 16 and remembered()
    source.accept(3, batch(BlockRemoved((4,))))  # the last block goes
    assert hit_tokens() == 12 and not remembered()
    index.credit("http://p", prompt, until=10.0, fallback_block_size=BS)
    assert hit_tokens() == 16  # the credited block, not a memo of it
    assert not remembered()
    source.accept(4, batch(AllBlocksCleared()))
    assert index.hit_tokens("http://p", prompt, now=11.0, fallback_block_size=BS) == 0


def test_a_remembered_server_out_of_sync_is_unknown_again() -> None:
    index = KvIndex()
    source = index.source("http://p", 0)
    source.accept(0, batch(stored([1, 2, 3, 4], None, TOKENS)))
    prompt = PromptBlocks(TOKENS)
    assert index.hit_tokens("http://p", prompt, now=0, fallback_block_size=BS) == 16
    assert prompt.held_by  # remembered
    assert source.accept(5, batch(BlockRemoved((4,)))) == NeedReplay(1)  # a gap
    assert index.hit_tokens("http://p", prompt, now=0, fallback_block_size=BS) is None
    index.forget("http://p")  # and a server that left holds nothing, memo or not
    source = index.source("http://p", 0)
    source.start_empty()
    assert index.hit_tokens("http://p", prompt, now=0, fallback_block_size=BS) == 0


def test_a_prompt_held_whole_counts_its_full_blocks_only() -> None:
    index = KvIndex()
    index.source("http://p", 0).accept(0, batch(stored([1, 2, 3, 4], None, TOKENS)))
    prompt = PromptBlocks(TOKENS + [7, 7])  # four full blocks and two tokens more

    def hit_tokens() -> int | None:
        return index.hit_tokens("http://p", prompt, now=0, fallback_block_size=BS)

    assert hit_tokens() == 16  # walked: the four blocks
    assert prompt.held_by  # remembered as held whole
    assert hit_tokens() == 16  # from the memo: still not the two tokens past them


def test_a_prompt_held_whole_is_walked_again_when_the_block_size_changes() -> None:
    source = SourceIndex("http://p", 0)
    source.accept(0, batch(stored([1, 2, 3, 4], None, TOKENS)))
    prompt = PromptBlocks(TOKENS)
    assert source.hits(prompt.keys(BS), now=0, held_by=prompt.held_by) == 4
    source.accept(1, batch(BlockStored(block_hashes=(9,), parent_block_hash=None,
                                       token_ids=TOKENS[:8], block_size=2 * BS)))
    assert source.hits(prompt.keys(2 * BS), now=0, held_by=prompt.held_by) == 1


def test_a_forgotten_servers_sources_are_emptied() -> None:
    index = KvIndex()
    source = index.source("http://p", 0)
    source.accept(0, batch(stored([1, 2], None, TOKENS[:8])))
    prompt = PromptBlocks(TOKENS)
    index.credit("http://p", prompt, until=10.0, fallback_block_size=BS)
    index.forget("http://p")
    assert len(source) == 0 and source.hits(prompt.keys(BS), now=0) == 0


def test_the_tokenize_caches_key_tells_prompts_apart_even_past_64_bit_integers() -> None:
    from proxy.pool.kv.tokens import _cache_key

    body = {"model": "m", "prompt": "a b c"}
    assert _cache_key(body, None, None) == _cache_key(dict(body), None, None)
    assert _cache_key(body, None, None) != _cache_key(body, "lora", None)
    assert _cache_key(body, None, None) != _cache_key(body, None, "salt")
    assert _cache_key([1, 2], None, None) != _cache_key([1, 3], None, None)
    huge = {**body, "chat_template_kwargs": {"n": 2 ** 70}}  # past msgpack's integers
    assert _cache_key(huge, None, None) != _cache_key({**huge, "chat_template_kwargs": {
        "n": 2 ** 71}}, None, None)


def test_the_index_knows_every_sources_adapters_until_their_server_leaves() -> None:
    index = KvIndex()
    index.source("http://p", 0).accept(0, batch(stored([1], None, TOKENS[:4], lora_name="a")))
    index.source("http://q", 0).accept(0, batch(stored([1], None, TOKENS[:4], lora_name="b")))
    assert index.lora_names() == {"a", "b"}
    index.forget("http://p")
    assert index.lora_names() == {"b"}
