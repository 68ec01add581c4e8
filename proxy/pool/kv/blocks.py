"""The router's own keys for a prompt's blocks of tokens.

vLLM names a cached block by a hash of its tokens chained to its parent's hash, with an
algorithm and seed that depend on its configuration (and, for Python's own hash, on
PYTHONHASHSEED). The router does not copy that: it keys a block by blake2b over its
parent's key, its token ids and its extra keys, computed the same way for a prompt and
for the tokens a `BlockStored` event carries. Equal keys mean equal tokens from the
prompt's start, whatever vLLM's hashing; `KvIndex` maps vLLM's hashes to these keys only
to apply removals.

Extra keys are what makes equal tokens different blocks in vLLM: the LoRA adapter's name
(every block), the cache salt (the first block), multimodal inputs (never computed for a
prompt here: a request with images is not scored). Events publish them untagged, in
that order, and `request_extra` builds a prompt's the same way.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import Any

ROOT = 0  # the parent key of a prompt's first block
_KEY_BYTES = 8


def chain_key(parent: int, tokens: Sequence[int], extra: tuple[Any, ...] | None) -> int:
    """One block's key: blake2b of its parent's key, its token ids and its extra keys."""
    digest = hashlib.blake2b(parent.to_bytes(_KEY_BYTES, "big"), digest_size=_KEY_BYTES)
    digest.update(array("q", tokens).tobytes())
    if extra:
        digest.update(repr(extra).encode())
    return int.from_bytes(digest.digest(), "big")


def request_extra(index: int, *, lora: str | None, cache_salt: str | None) -> tuple[Any, ...] | None:
    """The extra keys vLLM gives block `index` of a text prompt, untagged as in events."""
    extra: list[Any] = []
    if lora:
        extra.append(lora)
    if cache_salt and index == 0:
        extra.append(cache_salt)
    return tuple(extra) or None


def prompt_keys(
    tokens: Sequence[int], block_size: int, *, lora: str | None = None,
    cache_salt: str | None = None,
) -> list[int]:
    """The keys of every full block of a prompt, first to last (a partial last block is
    never cached, so it has none)."""
    keys: list[int] = []
    parent = ROOT
    for start in range(0, len(tokens) - block_size + 1, block_size):
        extra = request_extra(len(keys), lora=lora, cache_salt=cache_salt)
        parent = chain_key(parent, tokens[start:start + block_size], extra)
        keys.append(parent)
    return keys


class PromptBlocks:
    """One prompt's token ids and their block keys, computed once per block size."""

    __slots__ = ("tokens", "lora", "cache_salt", "predicted", "_keys")

    def __init__(self, tokens: Sequence[int], *, lora: str | None = None,
                 cache_salt: str | None = None) -> None:
        self.tokens = tokens
        self.lora = lora
        self.cache_salt = cache_salt
        # cluster -> the prompt tokens the chosen server held, by the index (None: unknown)
        self.predicted: dict[str, int | None] = {}
        self._keys: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def keys(self, block_size: int) -> list[int]:
        found = self._keys.get(block_size)
        if found is None:
            found = self._keys[block_size] = prompt_keys(
                self.tokens, block_size, lora=self.lora, cache_salt=self.cache_salt)
        return found
