"""vLLM's KV cache events, decoded from what its ZMQ publisher sends.

A vLLM server started with `--kv-events-config '{"enable_kv_cache_events": true, ...}'`
publishes, after every engine step that changed its prefix cache, one message of three
frames: topic, an 8-byte big-endian sequence number, and a msgpack `KVEventBatch`
`[ts, [event, ...], data_parallel_rank]`. Its events:

- `BlockStored`: blocks that entered the prefix cache, a chain: `block_hashes` (vLLM's
  hashes, bytes or int), `parent_block_hash` (the block before the first, None at the
  prompt's start), `token_ids` (all their tokens, `block_size` per block), `lora_name`,
  `extra_keys` (per block: LoRA name, multimodal `(identifier, offset)` pairs, cache salt),
  and `group_idx` (the KV cache group, for hybrid models).
- `BlockRemoved`: blocks evicted, by vLLM's hash.
- `AllBlocksCleared`: the whole cache was reset.

vLLM encodes an event as a map with a `type` key (today) or as an array whose first
item is the type (earlier releases); both are read here, by field name or position, and
anything else is `Malformed`. Unknown fields are ignored, so a newer vLLM's additions do
not break decoding.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import msgspec

# An array-encoded event's fields after its type, in vLLM's declaration order.
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                  "medium", "lora_name", "extra_keys", "group_idx")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")

# vLLM's prefix-cache tier; only blocks in the accelerator's cache are routed to
# (None: an older vLLM that does not say, which has only that tier).
ROUTED_MEDIA = (None, "GPU")


class Malformed(ValueError):
    """A message that is not a KV event batch as vLLM sends it."""


class BlockStored(msgspec.Struct, frozen=True):
    block_hashes: tuple[Hashable, ...]
    parent_block_hash: Hashable | None
    token_ids: Sequence[int]
    block_size: int
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None  # one entry per block, or None
    group_idx: int | None = None
    medium: str | None = None


class BlockRemoved(msgspec.Struct, frozen=True):
    block_hashes: tuple[Hashable, ...]
    group_idx: int | None = None
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, frozen=True):
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, frozen=True):
    ts: float
    events: tuple[KvEvent, ...]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder()


def decode_batch(payload: bytes) -> EventBatch:
    """One published batch. Raises `Malformed` for anything else."""
    try:
        raw = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise Malformed(f"not msgpack: {exc}") from None
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and 2 <= len(raw) <= 3:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) == 3 else None
    else:
        raise Malformed("a batch is [ts, events, data_parallel_rank]")
    if not isinstance(ts, int | float) or not isinstance(events, list):
        raise Malformed("a batch needs a numeric ts and a list of events")
    if rank is not None and not isinstance(rank, int):
        raise Malformed("data_parallel_rank is not an integer")
    return EventBatch(float(ts), tuple(decode_event(e) for e in events), rank)


def decode_event(raw: object) -> KvEvent:
    """One event, map- or array-encoded."""
    if isinstance(raw, dict):
        kind, fields = raw.get("type"), raw
    elif isinstance(raw, list) and raw:
        kind = raw[0]
        names = _STORED_FIELDS if kind == "BlockStored" else _REMOVED_FIELDS
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        raise Malformed("an event is a map with a type, or an array starting with one")
    if kind == "BlockStored":
        return _stored(fields)
    if kind == "BlockRemoved":
        return BlockRemoved(_hashes(fields.get("block_hashes")), _group(fields),
                            _medium(fields))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise Malformed(f"unknown event type {kind!r}")


def _stored(fields: dict[str, Any]) -> BlockStored:
    hashes = _hashes(fields.get("block_hashes"))
    parent = fields.get("parent_block_hash")
    tokens, size = fields.get("token_ids"), fields.get("block_size")
    if parent is not None and not isinstance(parent, bytes | int):
        raise Malformed("parent_block_hash is not bytes or an integer")
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise Malformed("token_ids is not a list of integers")
    if type(size) is not int or size < 1:
        raise Malformed("block_size is not a positive integer")
    lora = fields.get("lora_name")
    extra = fields.get("extra_keys")
    if extra is not None and (not isinstance(extra, list) or len(extra) != len(hashes)):
        raise Malformed("extra_keys is not one entry per block")
    return BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=size,
        lora_name=lora if isinstance(lora, str) else None,
        extra_keys=tuple(_frozen(e) for e in extra) if extra is not None else None,
        group_idx=_group(fields), medium=_medium(fields),
    )


def _hashes(value: object) -> tuple[Hashable, ...]:
    if not isinstance(value, list) or not all(isinstance(h, bytes | int) for h in value):
        raise Malformed("block_hashes is not a list of bytes or integers")
    return tuple(value)


def _group(fields: dict[str, Any]) -> int | None:
    group = fields.get("group_idx")
    if group is not None and type(group) is not int:
        raise Malformed("group_idx is not an integer")
    return group


def _medium(fields: dict[str, Any]) -> str | None:
    medium = fields.get("medium")
    return medium if isinstance(medium, str) else None


def _frozen(value: object) -> Any:
    """msgpack arrays as tuples, so an extra key can be hashed."""
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        raise Malformed("an extra key is a map")
    return value
