"""Pushes between tensor-parallel sizes: which of P's ranks WRITE into which of D's, which
KV heads each WRITE carries, and which size pairs a push supports.

The WRITEs themselves are vLLM's push worker code (`_xfer_blocks_for_req`, reused by
`connector.worker`), which maps ranks from the NIXL handshake. This module states that
same mapping in plain terms, with no vLLM in it, for three readers: P's registry, which
refuses a registration the mapping cannot serve (`refusal`, answered `NACK tp_mismatch`)
instead of failing later at the handshake; D's worker, which completes a push once every
WRITE into its rank has notified it (`writers_per_decode_rank`); and the tests, which
check where the bytes land (a unit test holds it to vLLM's own mapping).

Each side splits the model's KV heads evenly over its ranks: with `heads` KV heads and
TP `t`, rank x holds heads x*heads//t onwards, max(1, heads//t) of them (one head, shared
with other ranks, once t exceeds `heads`: the KV is replicated). An MLA model's latent
KV is one "head" every rank holds whole. A P rank WRITEs, into each D rank it maps to,
the heads both hold:

- equal sizes: P's rank r writes D's rank r, whole blocks. One notification per D rank.
- P tp = k * D tp: P's ranks d*k .. d*k+k-1 each write their heads into D's rank d, at
  their own place among D's heads. D's rank d waits for k notifications.
- D tp = k * P tp: P's rank r writes D's ranks r*k .. r*k+k-1, each the share of its
  heads that rank holds (k WRITEs from one rank). One notification per D rank.

Refused: sizes of which neither divides the other (vLLM's transfer topology has no
mapping for them); except for MLA, a D tp larger than both P's tp and the model's KV
heads: D's ranks would then hold replicated heads that vLLM's push worker writes to one
rank only (it dedups by head), so the other ranks would never be written; and, for a
model with Mamba (or other recurrent) state besides its KV, any two different sizes: the
state is sharded by rank and written as whole pages, which this plan (heads only) does
not map, so such a push is refused before any WRITE and D computes the prompt (pull
reads what vLLM's own pull can).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class HeadWrite:
    """One P rank's WRITE into one D rank: `count` heads from head `prefill_offset` of
    the P rank's block (in its own heads), to head `decode_offset` of the D rank's."""

    decode_rank: int
    prefill_offset: int
    decode_offset: int
    count: int


def refusal(prefill_tp: int, decode_tp: int, *, kv_heads: int | None = None,
            mla: bool = False, mamba: bool = False) -> str | None:
    """Why a push from P (`prefill_tp`) to D (`decode_tp`) cannot be done; None: it can.
    `kv_heads`: the model's KV heads, None when unknown (that check is then skipped);
    `mamba`: the model keeps Mamba (or other recurrent) state besides its KV."""
    if prefill_tp < 1 or decode_tp < 1:
        raise ValueError(f"tp sizes must be >= 1, got prefill {prefill_tp}, decode {decode_tp}")
    if mamba and prefill_tp != decode_tp:
        return (f"the model keeps Mamba state, which push moves only between equal tp sizes; "
                f"decode tp {decode_tp}, prefill tp {prefill_tp}")
    if prefill_tp % decode_tp and decode_tp % prefill_tp:
        return (f"push maps ranks only when one tp size is a multiple of the other; decode "
                f"tp {decode_tp}, prefill tp {prefill_tp}")
    if not mla and kv_heads is not None and decode_tp > prefill_tp and decode_tp > kv_heads:
        return (f"decode tp {decode_tp} exceeds the model's {kv_heads} KV heads and prefill "
                f"tp {prefill_tp}: D's ranks replicate heads, which push writes to one rank "
                "only; run D with tp <= max(prefill tp, KV heads)")
    return None


def keeps_state(model_config: Any) -> bool:
    """Whether a model (vLLM's `ModelConfig`) keeps Mamba (or other recurrent) state
    besides its KV: a hybrid (Jamba, Bamba, Granite 4 hybrid ...) or an attention-free
    Mamba. Such state moves only between equal tp sizes (`refusal`)."""
    return bool(model_config.is_hybrid or model_config.has_inner_state)


def decode_targets(prefill_tp: int, decode_tp: int, prefill_rank: int) -> tuple[int, ...]:
    """D's ranks that P's rank `prefill_rank` WRITEs into (a supported pair only)."""
    _require_supported(prefill_tp, decode_tp, prefill_rank)
    if prefill_tp >= decode_tp:
        return (prefill_rank * decode_tp // prefill_tp,)
    ratio = decode_tp // prefill_tp
    return tuple(range(prefill_rank * ratio, (prefill_rank + 1) * ratio))


def writers_per_decode_rank(prefill_tp: int, decode_tp: int) -> int:
    """How many of P's ranks WRITE into each of D's ranks, each with its own notification:
    D's rank holds the push complete once that many came (per pipeline stage)."""
    return max(1, prefill_tp // decode_tp)


def head_writes(prefill_tp: int, decode_tp: int, prefill_rank: int, *,
                kv_heads: int) -> tuple[HeadWrite, ...]:
    """P's rank `prefill_rank`'s WRITEs, one per D rank it writes, with the heads of each
    (`kv_heads`: the model's KV heads; 1 for MLA's latent)."""
    first, count = _heads_of(prefill_rank, prefill_tp, kv_heads)
    writes = []
    for decode_rank in decode_targets(prefill_tp, decode_tp, prefill_rank):
        d_first, d_count = _heads_of(decode_rank, decode_tp, kv_heads)
        start, end = max(first, d_first), min(first + count, d_first + d_count)
        if start >= end:
            raise ValueError(f"P rank {prefill_rank} of {prefill_tp} shares no KV head with "
                             f"D rank {decode_rank} of {decode_tp} ({kv_heads} heads)")
        writes.append(HeadWrite(decode_rank, start - first, start - d_first, end - start))
    return tuple(writes)


def heads_per_rank(tp: int, kv_heads: int) -> int:
    """The KV heads one rank of a `tp`-way engine holds (1 when replicated)."""
    return max(1, kv_heads // tp)


def _heads_of(rank: int, tp: int, kv_heads: int) -> tuple[int, int]:
    """(first head, head count) of `rank` of a `tp`-way engine."""
    if kv_heads < 1:
        raise ValueError(f"kv_heads must be >= 1, got {kv_heads}")
    return rank * kv_heads // tp, heads_per_rank(tp, kv_heads)


def _require_supported(prefill_tp: int, decode_tp: int, prefill_rank: int) -> None:
    why = refusal(prefill_tp, decode_tp)
    if why is not None:
        raise ValueError(why)
    if not 0 <= prefill_rank < prefill_tp:
        raise ValueError(f"prefill rank must be in [0, {prefill_tp}), got {prefill_rank}")
