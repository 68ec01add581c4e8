"""Which blocks of a prompt each server's prefix cache holds, kept from its KV events.

`KvIndex` holds one `SourceIndex` per event publisher (a server, or one data-parallel
rank of it). It is a pure state machine: the subscriber hands it each message's sequence
number and decoded batch, and `accept` answers with what to do next (`Applied`,
`Duplicate`, or `NeedReplay` from a sequence number); no I/O, no clock of its own.

A source's states:

- `UNKNOWN`: not yet replayed from the publisher's start, or a gap not yet replayed. Its entries are kept but not
  trusted: a scorer treats the server as unknown, never as empty.
- `SYNCED`: every batch since the first has been applied, in order.

What each event does, and the mistakes it guards against:

- a sequence number one past the last: applied.
- the same or an older number from a replay, or a live one that a replay already
  delivered: a duplicate, ignored.
- a number further ahead: a gap. The source turns `UNKNOWN` and the subscriber replays
  the missing batches from the publisher's replay socket; a replay that cannot cover
  the gap (the publisher's buffer moved on) wipes the source, which then counts only
  what it hears from there.
- any other live number that goes back: the publisher restarted, a new engine with an
  empty cache: wiped. (A restart first heard of at a number past the last one looks
  like a gap: the replay then fills it from the new publisher, and blocks of the old
  engine linger until evicted by name or wiped; they can only draw requests to it.)
- `AllBlocksCleared`: wiped.
- `BlockStored` / `BlockRemoved`: counted per vLLM block hash, because vLLM does not
  deduplicate: the same block may be stored twice (two physical copies) and removed
  twice. A block is gone when its count is back to 0. Only the accelerator's tier
  (`medium` GPU or unsaid) and the first KV cache group (hybrid models publish one per
  group) are routed to.
- a source that holds more blocks than its cap (the server's KV blocks, or the config's
  bound) is lying or misconfigured: wiped and counted. Memory is bounded per source
  whatever the events say, and a lie can only misroute requests to that server.
"""

from __future__ import annotations

import enum
import itertools
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from proxy.pool.kv.blocks import ROOT, HeldBy, Key, PromptBlocks, chain_key
from proxy.pool.kv.events import (
    ROUTED_MEDIA,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
)

REPLAY_WINDOW = 10_000  # vLLM's default replay buffer (buffer_steps): a replay's most batches
DEFAULT_MAX_BLOCKS = 1 << 20  # per source, when the server's own size is not known
MAX_CREDITS = 1 << 16  # per source: prompt blocks credited to it right after routing
MAX_LORA_NAMES = 1024  # per source: LoRA adapters its events named


class SourceState(str, enum.Enum):
    UNKNOWN = "unknown"
    SYNCED = "synced"


@dataclass(frozen=True, slots=True)
class Applied:
    """The batch was applied (`wiped`: the source was emptied first, with why)."""

    wiped: str | None = None


@dataclass(frozen=True, slots=True)
class Duplicate:
    """A batch already applied; nothing changed."""


@dataclass(frozen=True, slots=True)
class NeedReplay:
    """Batches are missing: replay from `start`, then hand this message in again."""

    start: int


Outcome = Applied | Duplicate | NeedReplay


@dataclass(slots=True)
class EventCounts:
    """What a source's events have done, for metrics (monotonic)."""

    batches: int = 0
    stored: int = 0
    removed: int = 0
    duplicates: int = 0  # stores of a block already held, removals of one held twice
    unknown_removals: int = 0  # removals of a block never heard of
    orphans: int = 0  # stores whose parent block is not held: their keys cannot be known
    ignored: int = 0  # other tiers, other KV groups, partial blocks
    gaps: int = 0
    wipes: dict[str, int] = field(default_factory=dict)  # why -> times


class SourceIndex:
    """One publisher's cached blocks, by the router's key and by vLLM's hash."""

    def __init__(self, url: str, rank: int, *, max_blocks: int = DEFAULT_MAX_BLOCKS,
                 all_lora_names: set[str] | None = None) -> None:
        self.url = url
        self.rank = rank
        self.max_blocks = max_blocks
        self.state = SourceState.UNKNOWN
        self.last_seq: int | None = None
        # After a replay: live batches up to here, queued while it ran, were replayed.
        self._replayed_to: int | None = None
        self.block_size: int | None = None  # from its events
        # Times a key left `_keys` (a removal, a wipe) or the block size changed: keys
        # are otherwise only added, so a prompt whose keys were all stored at one count
        # still is while it stays (`PromptBlocks.held_by`, read by `KvIndex`).
        self.removals = 0
        self.last_event_ts: float | None = None  # the publisher's clock, for event lag
        self.counts = EventCounts()
        self.lora_names: set[str] = set()  # adapters its events named (their blocks' key)
        # Every source's adapters, its index's (`KvIndex.lora_names`): added to here too.
        self._all_lora_names = all_lora_names
        self._by_hash: dict[Hashable, tuple[Key, int]] = {}  # vLLM hash -> (key, copies)
        self._keys: dict[Key, int] = {}  # key -> copies held under it
        self._credits: OrderedDict[Key, float] = OrderedDict()  # key -> until (monotonic)

    def __len__(self) -> int:
        return len(self._by_hash)

    # --- events ---------------------------------------------------------------------

    def accept(self, seq: int, batch: EventBatch, *, replayed: bool = False) -> Outcome:
        """Apply one batch (`replayed`: it came from the replay socket, not the live one)."""
        last = self.last_seq
        wiped = None
        if last is None:
            if seq > 0:  # joined mid-stream: what came before may still be in its buffer
                self.last_seq = -1
                self.state = SourceState.UNKNOWN
                return NeedReplay(0)
        elif seq <= last:
            if replayed:
                return Duplicate()
            if self._replayed_to is not None and seq <= self._replayed_to:
                if seq == self._replayed_to:  # the live stream caught up with the replay
                    self._replayed_to = None
                return Duplicate()
            # A live number that goes back: the publisher restarted, a new engine with a
            # new, empty cache (a live stream never repeats itself).
            wiped = self.wipe("restarted")
        elif seq > last + 1:
            self.state = SourceState.UNKNOWN
            self.counts.gaps += 1
            return NeedReplay(last + 1)
        self.last_seq = seq
        if replayed:
            self._replayed_to = seq
        elif self._replayed_to is not None and seq > self._replayed_to:
            self._replayed_to = None
        self.state = SourceState.SYNCED
        self.last_event_ts = batch.ts
        self.counts.batches += 1
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                self._removed(event)
            elif isinstance(event, AllBlocksCleared):
                self.wipe("cleared")
            if len(self._by_hash) > self.max_blocks:
                wiped = self.wipe("over_capacity")
        return Applied(wiped)

    def start_empty(self) -> None:
        """The publisher had nothing to replay when the router subscribed (nothing
        published yet, or no replay socket): in sync, and the next batch decides."""
        self.state = SourceState.SYNCED

    def lost(self, upto: int) -> None:
        """The batches before `upto` cannot be had (the publisher's replay buffer moved
        on, or it has no replay socket): go on from `upto`. A source that had entries
        is wiped, since what the lost batches did is unknown; one that just joined was
        empty anyway, and counts only what it hears from here (blocks the server stored
        earlier stay unknown to it until they are stored again)."""
        if self.last_seq is not None and self.last_seq >= 0:
            self.wipe("replay_incomplete")
        else:
            self.counts.wipes["joined_late"] = self.counts.wipes.get("joined_late", 0) + 1
        self.last_seq = upto - 1

    def wipe(self, why: str) -> str:
        self.release()
        self.counts.wipes[why] = self.counts.wipes.get(why, 0) + 1
        return why

    def release(self) -> None:
        """Empty it, uncounted (also when its server leaves: a cached prompt's
        `held_by` may keep the object, never its entries)."""
        self._by_hash.clear()
        self._keys.clear()
        self._credits.clear()
        self.removals += 1

    def _routed(self, group: int | None, medium: str | None) -> bool:
        return (group is None or group == 0) and medium in ROUTED_MEDIA

    def _stored(self, event: BlockStored) -> None:
        if not self._routed(event.group_idx, event.medium):
            self.counts.ignored += len(event.block_hashes)
            return
        size = event.block_size
        parent = ROOT
        if event.parent_block_hash is not None:
            held = self._by_hash.get(event.parent_block_hash)
            if held is None:
                self.counts.orphans += len(event.block_hashes)
                return
            parent = held[0]
        tokens = event.token_ids
        if len(tokens) < size * len(event.block_hashes):  # partial blocks: not routed to
            self.counts.ignored += len(event.block_hashes)
            return
        if size != self.block_size:
            self.block_size = size
            self.removals += 1
        if event.lora_name and len(self.lora_names) < MAX_LORA_NAMES:
            self.lora_names.add(event.lora_name)
            if self._all_lora_names is not None:
                self._all_lora_names.add(event.lora_name)
        extra = event.extra_keys
        for i, vllm_hash in enumerate(event.block_hashes):
            key = chain_key(parent, tokens[i * size:(i + 1) * size], extra[i] if extra else None)
            held = self._by_hash.get(vllm_hash)
            if held is not None:
                self.counts.duplicates += 1
                key = held[0]  # the same hash is the same block: keep its first key
                self._by_hash[vllm_hash] = (key, held[1] + 1)
            else:
                self._by_hash[vllm_hash] = (key, 1)
            self._keys[key] = self._keys.get(key, 0) + 1
            self.counts.stored += 1
            parent = key

    def _removed(self, event: BlockRemoved) -> None:
        if not self._routed(event.group_idx, event.medium):
            self.counts.ignored += len(event.block_hashes)
            return
        for vllm_hash in event.block_hashes:
            held = self._by_hash.get(vllm_hash)
            if held is None:
                self.counts.unknown_removals += 1
                continue
            key, copies = held
            if copies > 1:
                self.counts.duplicates += 1
                self._by_hash[vllm_hash] = (key, copies - 1)
            else:
                del self._by_hash[vllm_hash]
            left = self._keys[key] - 1
            if left:
                self._keys[key] = left
            else:
                del self._keys[key]
                self.removals += 1
            self.counts.removed += 1

    # --- queries ----------------------------------------------------------------------

    def snapshot(self) -> dict[str, object]:
        """For `/admin/kv`: where this source stands and what its events did."""
        counts = self.counts
        return {"url": self.url, "rank": self.rank, "state": self.state.value,
                "blocks": len(self), "block_size": self.block_size, "last_seq": self.last_seq,
                "credits": len(self._credits), "lora_names": sorted(self.lora_names),
                "events": {"batches": counts.batches, "stored": counts.stored,
                           "removed": counts.removed, "duplicates": counts.duplicates,
                           "unknown_removals": counts.unknown_removals,
                           "orphans": counts.orphans, "ignored": counts.ignored,
                           "gaps": counts.gaps, "wipes": dict(counts.wipes)}}

    def credit(self, keys: Sequence[Key], until: float) -> None:
        """Count `keys` as held until `until`: a request was just routed here with them,
        and its events have not arrived yet. Bounded: the oldest credits go first."""
        credits, held = self._credits, self._keys
        # The keys not stored yet, found in C (a prompt sent again: none): a Python loop
        # over every key was 1% of kv_aware's CPU per request (the profile scenario).
        for key in itertools.filterfalse(held.__contains__, keys):
            credits[key] = until
            credits.move_to_end(key)
        while len(credits) > MAX_CREDITS:
            credits.popitem(last=False)

    def hits(self, keys: Sequence[Key], now: float, *,
             held_by: HeldBy | None = None) -> int:
        """How many of `keys`, from the first, this source holds (or was credited).

        `held_by` (`PromptBlocks.held_by`, keys of this source's block size): when every
        key is stored, this source is remembered there for its server, with its
        `removals` count and the tokens held, so that the next request of the same
        prompt is not walked again (`KvIndex.hit_tokens_each`)."""
        held, credits = self._keys, self._credits
        if not held and not credits:
            return 0  # nothing stored or credited: nothing to walk (a server none of the
            # prompt's requests went to, scored on every pick of it)
        # The leading keys stored, counted in C (a prompt sent again: all of them); a
        # Python loop over every key was 3.5% of kv_aware's CPU per request, 1k-token
        # prompts (the profile scenario). Credits are looked up from the first one not.
        count = len(list(itertools.takewhile(held.__contains__, keys)))
        if count == len(keys):
            if held_by is not None and count and self.block_size:
                held_by[self.url] = (self, self.removals, count * self.block_size)
            return count
        for key in itertools.islice(keys, count, None):
            if key not in held:
                until = credits.get(key)
                if until is None or until < now:
                    break
            count += 1
        return count


_NO_SOURCES: Mapping[int, SourceIndex] = {}  # a server none of whose publishers is known


class KvIndex:
    """Every source of every server: `sources(url)` are a server's publishers (one per
    data-parallel rank)."""

    def __init__(self, *, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        self.max_blocks = max_blocks
        self._by_url: dict[str, dict[int, SourceIndex]] = {}
        # A source whose events gave its block size, lent to those whose events have
        # not yet (`_lent_block_size`): kept, not found by a walk over every source per
        # candidate (a server that has stored nothing is scored on every pick: the walk
        # and `hits`'s were a third of kv_aware's extra in the profile scenario).
        self._sized: SourceIndex | None = None
        # Every source's adapters, kept as their events name them (read per request:
        # building the union of every source's names each time was 1% of kv_aware's
        # CPU per request, the profile scenario).
        self._lora_names: set[str] = set()

    def source(self, url: str, rank: int) -> SourceIndex:
        ranks = self._by_url.setdefault(url, {})
        found = ranks.get(rank)
        if found is None:
            found = ranks[rank] = SourceIndex(url, rank, max_blocks=self.max_blocks,
                                              all_lora_names=self._lora_names)
        return found

    def sources(self, url: str) -> list[SourceIndex]:
        return list(self._by_url.get(url, {}).values())

    def all_sources(self) -> list[SourceIndex]:
        return [s for ranks in self._by_url.values() for s in ranks.values()]

    def forget(self, url: str) -> None:
        """A server left: its entries go with it."""
        for source in self._by_url.pop(url, {}).values():
            source.release()
            if source is self._sized:
                self._sized = None
        self._lora_names.clear()
        self._lora_names.update(name for s in self.all_sources() for name in s.lora_names)

    def lora_names(self) -> AbstractSet[str]:
        """The adapters any source's events named (live: not a copy)."""
        return self._lora_names

    def hit_tokens(self, url: str, prompt: PromptBlocks, now: float, *,
                   fallback_block_size: int) -> int | None:
        """The prompt's tokens, from its start, that the server holds on its best rank;
        None while none of its sources is in sync (unknown, not 0)."""
        return self.hit_tokens_each((url,), prompt, now, fallback_block_size=fallback_block_size)[0]

    def hit_tokens_each(self, urls: Iterable[str], prompt: PromptBlocks, now: float, *,
                        fallback_block_size: int) -> list[int | None]:
        """`hit_tokens` of each server, in one pass (a scorer asks for every candidate:
        one call per candidate was a fifth of kv_aware's pick, measured on a 2-core
        machine with a 1k-token prompt held by both of two servers).

        A server remembered in the prompt's `held_by` is not walked: the source that
        stored every key still does while it is in sync and its `removals` count has not
        moved (a prompt sent again, the usual case: walking each candidate's sources
        was a fifth of kv_aware's own bytecodes per request, `scripts.bench_path
        --target kv --bytecodes`)."""
        held_by, synced = prompt.held_by, SourceState.SYNCED
        found: list[int | None] = []
        for url in urls:
            whole = held_by.get(url)
            if whole is not None and whole[0].removals == whole[1] and whole[0].state is synced:
                found.append(whole[2])
            else:
                found.append(self._walk(url, prompt, now, fallback_block_size))
        return found

    def _walk(self, url: str, prompt: PromptBlocks, now: float,
              fallback_block_size: int) -> int | None:
        """The prompt's tokens the server holds on its best rank, walked through each
        source in sync; None while none is."""
        best = -1
        for source in self._by_url.get(url, _NO_SOURCES).values():
            if source.state is SourceState.SYNCED:
                size = source.block_size or self._lent_block_size(fallback_block_size)
                held = source.hits(prompt.keys(size), now, held_by=prompt.held_by) * size
                if held > best:
                    best = held
        return None if best < 0 else best  # full blocks: never past the prompt

    def credit(self, url: str, prompt: PromptBlocks, until: float, *,
               fallback_block_size: int) -> None:
        """Count the prompt's blocks as held by every source of the server until `until`
        (none for a server whose events stored them all: a prompt sent again)."""
        whole = prompt.held_by.get(url)
        if whole is not None and whole[0].removals == whole[1]:
            return
        for source in self._by_url.get(url, _NO_SOURCES).values():
            size = source.block_size or self._lent_block_size(fallback_block_size)
            source.credit(prompt.keys(size), until)

    def _lent_block_size(self, fallback: int) -> int:
        """The block size for a source whose events have stored nothing yet (so a burst's
        credit counts before its first events): another server's, else `fallback`. The
        first lender found lends until its server leaves (servers of one index may differ
        in block size: P and D)."""
        sized = self._sized
        if sized is None:
            sized = self._sized = next((s for s in self.all_sources() if s.block_size), None)
        return (sized.block_size if sized is not None else None) or fallback
