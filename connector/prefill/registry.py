"""P's push registry: matches D's block registrations with P's finished prefills.

Owned by one thread on P, the side channel's (`connector.prefill.channel`), so no lock:
it learns of D's registrations and aborts from the socket, of prefills and WRITE results
from the engine, and calls `expire` on every wake-up (`next_deadline`). It does no I/O;
each method returns what the caller must do (answer D, start a WRITE, free P's blocks).

Matching is exact on `transfer_id` and works in either order: D may register before P's
prefill finishes, or after. One registry serves one P engine (all its ranks); D's
scheduler registers for all of D's ranks at once (`tp_rank` 0), and every P rank WRITEs
its share (see `connector.shared.tp_plan`). P and D may run different tensor-parallel sizes when
one is a multiple of the other; any other pair, and a D whose tp would replicate the
model's KV heads beyond P's tp, is refused (TP_MISMATCH, with the reason).

An end that comes before its transfer is known leaves a tombstone for `unclaimed_ttl`:
D's abort before P's prefill finished (the prefill's blocks are then freed the moment it
finishes, not after a deadline), and P's request ending without KV before D registered
(D's registration is then refused at once, and D recomputes instead of waiting).

States of one transfer:

    register                         prefill_finished
  -----------> AWAITING_PREFILL -------------------------+
                 | deadline: EXPIRED                     |
                 | abort:    ABORTED                     v
  -----------> AWAITING_REGISTRATION --register--> READY --write_started--> WRITING
  prefill_       | deadline: EXPIRED               | abort: ABORTED         | write_done: DONE
  finished       | abort:    ABORTED               | write_failed: FAILED   | write_failed: FAILED
                                                                          | abort: ABORTED, once
                                                                          |   the WRITE ends
  A match whose KV-cache group counts differ goes straight to FAILED. A match (READY)
  needs a grant that named the registration (below): until one comes, the record is
  AWAITING_GRANT (grant: READY; none within lease_s: EXPIRED, reason LEASE_EXPIRED; abort:
  ABORTED). AWAITING_PREFILL also ends EXPIRED (LEASE_EXPIRED) when that grant does not
  come in time, or its lease lapses.

The write lease (protocol 5; docs/ARCHITECTURE.md, section 5, has the why). P may start a
WRITE into a registration's blocks only under a lease its registrant granted: each grant
(`grant`, from a registration's or a ping's `Grant`, its token's `sent` taken by the
caller from P's own token) holds `lease_s` from when P sent that token, per peer. A
registration is granted by a grant that names it (`adds`: the caller passes the
registration's own with its grant), within `lease_s` of being registered (`grant_by`),
else it ends. A match of a granted transfer is READY with `write_by`, the lease's end
plus `write_s`: P posts no WRITE into D's blocks after it, and cancels what is still in
flight then. A peer's lease that lapses (no grant for `lease_s`) ends that peer's
granted transfers that no WRITE has started for (LEASE_EXPIRED; an AWAITING_PREFILL one
leaves a D_ABORTED tombstone, so its prefill is freed the moment it finishes); a lapsed
lease is ended before a late grant could renew it, so a transfer it ended cannot come
back. The caller aborts a grant's `withheld` transfers before it applies it.

  prefill_completing (engine step `step`, being built, completes the prompt) matches an
  AWAITING_PREFILL registration early (READY with `early_step`: P WRITEs right after that
  step's forward pass; the prefill_finished that follows is taken as known). With no
  registration yet, the record is COMPLETING (not live: no deadline, not counted) until
  a registration matches it early or its prefill_finished comes. A record carries P's
  fault injection (`fail_on_purpose`) to its Ready.

  prefill_progress (engine step `step`, being built, computes a chunk of the prompt, not
  its last) answers, for a granted AWAITING_PREFILL registration, a Ready with `chunk`:
  WRITE P's blocks that the chunks so far made whole, and no earlier chunk covered, into
  D's matching blocks, without a notification. The transfer stays AWAITING_PREFILL; its
  final Ready (prefill_completing or prefill_finished) is for the whole prompt, and P's
  worker skips what chunks wrote (connector/prefill/layers.py, `ChunkCover`). The record
  keeps the latest progress: a registration not granted yet is answered by its grant,
  and with no registration yet the record is CHUNKING (not live, like COMPLETING), which
  a registration turns AWAITING_PREFILL, its grant answering that chunk. The router sends
  P and D their legs at once, so D's registration mostly comes while P computes the
  prompt's first chunk: answered then, P's workers write that chunk from the layer the
  pass has reached (their layers computed so far at once). An answer that reaches them
  after its step is dropped there, as the request's blocks may have been taken back
  since: the final WRITE carries those blocks.

Who may end a transfer: a registered one is aborted only by the peer that registered it
(`peer`: its CURVE public key, else its ZMQ routing identity); an abort from anyone else
is ignored and counted. A transfer no D registered yet may be aborted, or abandoned (the
router's word that its D leg failed), by anyone who names it: its 128-bit random id is
the capability. An abandon of a registered transfer is ignored and counted.

Limits, so that no peer, nor many peers together, can make P hold unbounded state.
A registration is checked against P's own layout before anything of it is kept: as many
KV-cache groups as P has (`num_groups`), and no more block ids in all than P has blocks
(`num_blocks`); else TOO_MANY_BLOCKS (the wire's reason for a registration P could not
hold), counted in `too_many_blocks`. Live registrations are capped per peer
(`max_pending_per_peer`) and for all peers together (`max_pending`, and
`max_pending_bytes` of what they hold, roughly: without CURVE every new ZMQ identity is a
new peer, so only the global caps bound a flood); over a cap, OVER_LIMIT. At most
`max_tombstones` tombstones are kept (the oldest go first, counted in
`tombstones_dropped`), each under a 16-byte digest of its id, whatever the id's length.

Deadlines live in a heap (`_deadlines`), with lazy deletion: an entry whose record or
tombstone is gone, or has another deadline now, is skipped when it comes up, and the heap
is rebuilt from the live ones when stale entries outnumber them. So `expire` and
`next_deadline` cost what is due, not a scan of every record and tombstone.

DONE, FAILED, EXPIRED and ABORTED are terminal: the record is removed in the call that
reaches them (nothing outlives its transfer) and a `Release` says to free P's blocks, if
P holds any, and to tell D, if D registered: PushDone, or PushFailed with the reason
(`aborted` answers D's own Abort, once nothing more will be written into its blocks).

Deadlines use the caller's monotonic clock (`now`, seconds). A registration waits at most
min(registration_ttl, D's ttl_s); a finished prefill waits for D at most unclaimed_ttl.
READY and WRITING have no deadline here: the writer bounds them (`write_by`) and reports
the result.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import heapq
import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeAlias

import msgspec

from connector.protocol.side_channel import (
    EngineId,
    FailReason,
    NackReason,
    RegisterBlocks,
    TransferId,
)
from connector.shared import tp_plan

RequestId: TypeAlias = str  # P's engine request id, which holds P's blocks
PeerId: TypeAlias = bytes  # who sent a message: CURVE public key, else ZMQ routing identity

DEFAULT_REGISTRATION_TTL_S = 120.0
DEFAULT_UNCLAIMED_TTL_S = 120.0
# The write lease's terms (the settings write_lease and write_timeout).
DEFAULT_LEASE_S = 3.0
DEFAULT_WRITE_S = 10.0
DEFAULT_MAX_PENDING_PER_PEER = 4096
# All peers together: four D servers at their per-peer limit. A flood from ever new
# identities (no CURVE) meets this one.
DEFAULT_MAX_PENDING = 16384
# What live registrations may hold in all (their `footprint`s): a registration's strings
# may fill most of a frame (up to 1 MiB), so a count alone would not bound P's memory.
DEFAULT_MAX_PENDING_BYTES = 1 << 30
# Tombstones outlive nothing but their deadline; this bounds them under a flood of aborts
# for ids P never saw. Evicting one early costs at most a late prefill held until its
# deadline, or a late registration waiting for its TTL.
DEFAULT_MAX_TOMBSTONES = 65536
# The deadline heap is rebuilt once its stale entries outnumber the live ones by this.
_HEAP_SLACK = 1024

BlockIds = list[list[int]]  # one list per KV-cache group


class TransferState(enum.Enum):
    COMPLETING = "completing"  # P's prompt completes in the step being built; not live
    CHUNKING = "chunking"  # P computes the prompt in chunks, no registration yet; not live
    AWAITING_PREFILL = "awaiting_prefill"
    AWAITING_REGISTRATION = "awaiting_registration"
    AWAITING_GRANT = "awaiting_grant"  # both halves here; no grant named it yet
    READY = "ready"
    WRITING = "writing"
    DONE = "done"
    FAILED = "failed"
    EXPIRED = "expired"
    ABORTED = "aborted"


LIVE_STATES = (TransferState.AWAITING_PREFILL, TransferState.AWAITING_REGISTRATION,
               TransferState.AWAITING_GRANT, TransferState.READY, TransferState.WRITING)


class InvalidTransition(RuntimeError):
    """The caller reported an event the transfer's state does not allow (a bug)."""


class RegistryConfig(msgspec.Struct, frozen=True, kw_only=True):
    """P's layout, checked against each registration, and the two waiting deadlines."""

    engine_id: EngineId
    block_size: int
    tp_size: int = 1
    # The model's KV heads (None: unknown, not checked) and whether its KV is MLA's
    # latent: what decides whether D's tp can be pushed to (`tp_plan.refusal`).
    kv_heads: int | None = None
    mla: bool = False
    mamba: bool = False  # Mamba (or other recurrent) state besides the KV: equal tp only
    # False: every registration is refused (this vLLM's push would write a prefix hit's
    # blocks wrong: `vllm_compat.push_trims_to_decode_tail`).
    push_supported: bool = True
    registration_ttl: float = DEFAULT_REGISTRATION_TTL_S
    unclaimed_ttl: float = DEFAULT_UNCLAIMED_TTL_S
    # The write lease: a grant holds lease_s; P is done with a WRITE write_s after that.
    lease_s: float = DEFAULT_LEASE_S
    write_s: float = DEFAULT_WRITE_S
    # P's KV cache blocks in all: no registration may name more block ids (None: unknown).
    num_blocks: int | None = None
    # P's KV-cache groups: a registration must name as many (None: unknown, not checked).
    num_groups: int | None = None
    max_pending_per_peer: int = DEFAULT_MAX_PENDING_PER_PEER
    max_pending: int = DEFAULT_MAX_PENDING  # live registrations of all peers together
    max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES  # what they hold (`footprint`)
    max_tombstones: int = DEFAULT_MAX_TOMBSTONES

    def __post_init__(self) -> None:
        for name in ("num_blocks", "num_groups"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        for name in ("max_pending_per_peer", "max_pending", "max_pending_bytes",
                     "max_tombstones"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.engine_id:
            raise ValueError("engine_id must be a non-empty string")
        if self.block_size < 1 or self.tp_size < 1 or (
                self.kv_heads is not None and self.kv_heads < 1):
            raise ValueError(
                f"need block_size >= 1, tp_size >= 1, kv_heads >= 1 or None; got "
                f"block_size={self.block_size}, tp_size={self.tp_size}, kv_heads={self.kv_heads}"
            )
        for name, ttl in (("registration_ttl", self.registration_ttl),
                          ("unclaimed_ttl", self.unclaimed_ttl), ("lease_s", self.lease_s),
                          ("write_s", self.write_s)):
            if not (math.isfinite(ttl) and ttl > 0):
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {ttl}")


# --- What the caller must do (the results of transitions) -------------------------------

@dataclass(frozen=True, slots=True)
class Ready:
    """Both sides are known: start the WRITE of `block_ids` into the registration's."""

    transfer_id: TransferId
    registration: RegisterBlocks
    block_ids: BlockIds  # P's
    request_id: RequestId  # P's
    # Matched while engine step `early_step`, which completes the prompt, was built or
    # ran: WRITE right after its forward pass. None: matched after the prefill.
    early_step: int | None = None
    fail_on_purpose: bool = False  # fault injection (`fail_write`): fail, do not WRITE
    # The caller's clock: no WRITE into D's blocks is posted after this, and one still in
    # flight then is cancelled (the lease's end plus write_s).
    write_by: float = math.inf
    # A chunk's WRITE (`prefill_progress`): some of the prompt's blocks, no notification
    # to D, and the transfer stays as it was.
    chunk: bool = False


@dataclass(frozen=True, slots=True)
class Waiting:
    """Accepted; the other side has not shown up yet (`state` says which)."""

    transfer_id: TransferId
    state: TransferState


@dataclass(frozen=True, slots=True)
class Rejected:
    """Refused: answer a registration with a Nack; free `block_ids` if set (not kept)."""

    transfer_id: TransferId
    reason: NackReason
    message: str
    block_ids: BlockIds | None = None
    request_id: RequestId | None = None  # P's request holding `block_ids`


@dataclass(frozen=True, slots=True)
class Release:
    """A transfer ended in `state`. Free P's `block_ids` (if any) now, or keep them under
    the pull lease where D may READ them instead: the registry no longer holds them. If
    `notify` is set, tell that D: PushDone when DONE, else PushFailed with `reason`."""

    transfer_id: TransferId
    state: TransferState
    block_ids: BlockIds | None
    notify: RegisterBlocks | None = None
    reason: FailReason | None = None
    request_id: RequestId | None = None  # P's request holding `block_ids`
    # Tell D no sooner (the caller's clock): chunk WRITEs into D's blocks may be in
    # flight until then (`prefill_progress`), and D frees its blocks on P's word.
    notify_after: float | None = None


@dataclass(frozen=True, slots=True)
class Ignored:
    """An abort or abandon P does not honour (`why`); nothing to do, nobody to answer."""

    transfer_id: TransferId
    why: str


Outcome: TypeAlias = Ready | Waiting | Rejected | Release


@dataclass(slots=True)
class RegistryCounters:
    registered: int = 0  # registrations accepted
    prefills: int = 0  # finished prefills accepted
    matched: int = 0  # pairs that became READY
    early: int = 0  # of those, matched before the prefill's last forward pass (early WRITE)
    chunks: int = 0  # WRITEs of a prompt's chunk while its later chunks compute
    done: int = 0
    failed: int = 0
    aborted: int = 0
    expired_registrations: int = 0  # D registered, P never finished in time
    expired_unclaimed: int = 0  # P finished, D never registered in time
    duplicates: int = 0
    rejected: int = 0  # registrations refused: block size or an unsupported TP pair
    over_limit: int = 0  # registrations refused: the peer's or all peers' pending limit
    too_many_blocks: int = 0  # registrations refused: more block ids or other groups than P's
    tombstones_dropped: int = 0  # the oldest tombstones, evicted at max_tombstones
    foreign_aborts: int = 0  # aborts of a registered transfer from another peer: ignored
    abandoned: int = 0  # the router's abandons honoured
    abandons_ignored: int = 0  # abandons of a transfer a D registered: ignored
    lease_expired: int = 0  # transfers ended: their D's grant did not come, or lapsed
    stale_grants: int = 0  # grants whose lease had ended when they came: ignored


@dataclass(frozen=True, slots=True)
class RegistrySnapshot:
    by_state: dict[TransferState, int]  # live records only
    counters: RegistryCounters
    completing: int = 0  # prefills remembered by prefill_completing, not yet finished
    chunking: int = 0  # prompts in chunks remembered by prefill_progress, not registered

    @property
    def live(self) -> int:
        return sum(self.by_state.values())


@dataclass(slots=True)
class _Transfer:
    """One transfer's record; the registry's only per-transfer state."""

    transfer_id: TransferId
    state: TransferState
    deadline: float | None  # monotonic; set only while awaiting the other side
    registration: RegisterBlocks | None = None
    # P's, held from prefill_finished until released (COMPLETING: the step's, not held).
    block_ids: BlockIds | None = None
    request_id: RequestId | None = None  # P's request that holds block_ids
    abort_requested: bool = False  # D aborted during WRITING
    owner: PeerId | None = None  # the peer that registered it, once one has
    footprint: int = 0  # what its registration holds, once owned (`footprint`)
    early_step: int | None = None  # COMPLETING: the step that completes the prompt
    fail_on_purpose: bool = False  # P's fault injection, for its Ready
    granted: bool = False  # a grant of its registrant named it
    grant_by: float | None = None  # registered, not granted: the grant must come by then
    chunk_blocks: int = 0  # P's first blocks its chunk WRITEs covered (`prefill_progress`)
    chunk_write_by: float | None = None  # the last chunk WRITE's `write_by`
    progress: _Progress | None = None  # the latest `prefill_progress`, until completing

    def due(self) -> float | None:
        """When it ends unless something happens first (None: no deadline here)."""
        if self.grant_by is None:
            return self.deadline
        return self.grant_by if self.deadline is None else min(self.deadline, self.grant_by)


@dataclass(frozen=True, slots=True)
class _Progress:
    """A `prefill_progress`: P's first blocks (one KV-cache group) whose KV is whole after
    engine step `step`, of a prompt of `prompt_blocks` blocks."""

    block_ids: list[int]
    request_id: RequestId
    prompt_blocks: int
    step: int


_NOT_LIVE = (TransferState.COMPLETING, TransferState.CHUNKING)  # P's alone: no deadline


@dataclass(frozen=True, slots=True)
class _LeaseKey:
    """A peer's lease's entry in the deadline heap."""

    peer: PeerId


class _Tombstone(enum.Enum):
    """Why a transfer ended before the registry knew it (see the module docstring)."""

    D_ABORTED = "d_aborted"
    PREFILL_ABORTED = "prefill_aborted"


Grave: TypeAlias = bytes  # a tombstone's key: a digest of its transfer id (`_grave`)
DeadlineKey: TypeAlias = TransferId | Grave | _LeaseKey  # what a heap entry is the deadline of


def _grave(transfer_id: TransferId) -> Grave:
    """16 bytes, whatever the id's length: an id is a peer's string, up to a frame."""
    return hashlib.blake2b(transfer_id.encode(), digest_size=16).digest()


# A rough count of the bytes a kept registration holds: a Python int and its list slot
# per block id, a list per group, and the struct, its record and its strings.
_BYTES_PER_BLOCK_ID = 40
_BYTES_PER_GROUP = 64
_BYTES_PER_RECORD = 1024


def footprint(reg: RegisterBlocks) -> int:
    """What keeping `reg` costs P, roughly, in bytes (what `max_pending_bytes` sums)."""
    ids = sum(len(group) for group in reg.block_ids)
    strings = len(reg.transfer_id) + len(reg.engine_id) + len(reg.request_id) + len(reg.host)
    return (_BYTES_PER_RECORD + strings + _BYTES_PER_GROUP * len(reg.block_ids)
            + _BYTES_PER_BLOCK_ID * ids)


class PushRegistry:
    """Usage sketch, on P's owner thread:

        registry = PushRegistry(RegistryConfig(engine_id=eid, block_size=16))
        outcome = registry.register(reg, now=time.monotonic())  # from D
        outcome = registry.prefill_finished(tid, block_ids, request_id=rid, now=...)
        if isinstance(outcome, Ready) and registry.write_started(outcome.transfer_id):
            ...  # WRITE; later write_done(tid) or write_failed(tid, reason)
        for release in registry.expire(time.monotonic()): ...
    """

    def __init__(self, config: RegistryConfig) -> None:
        self.config = config
        self._transfers: dict[TransferId, _Transfer] = {}  # live and not live records
        self._not_live = 0  # records in COMPLETING or CHUNKING (`_NOT_LIVE`)
        # Cause and deadline, oldest first (what max_tombstones evicts).
        self._tombstones: dict[Grave, tuple[_Tombstone, float]] = {}
        self._owned: dict[PeerId, set[TransferId]] = {}  # live registrations per owner
        self._leases: dict[PeerId, float] = {}  # each owner's lease: its end
        self._pending = 0  # live registrations of all owners together
        self._pending_bytes = 0  # the footprints of the owned records
        # (deadline, sequence, key): a record's transfer id, a tombstone's Grave, or a
        # peer's lease. Lazy: an entry counts only while what it names has that deadline.
        self._deadlines: list[tuple[float, int, DeadlineKey]] = []
        self._sequence = itertools.count()  # orders equal deadlines; keys never compared
        self._counters = RegistryCounters()

    # --- events from D and the router (side channel) -------------------------------------

    def register(self, reg: RegisterBlocks, *, now: float, peer: PeerId = b"") -> Outcome:
        """D's registration, from `peer`. Ready or Waiting: send Ack. Rejected: send Nack."""
        tid = reg.transfer_id
        grave = _grave(tid)
        if self._tombstones.get(grave, (None,))[0] is _Tombstone.PREFILL_ABORTED:
            del self._tombstones[grave]
            self._counters.rejected += 1
            return Rejected(tid, NackReason.PREFILL_ABORTED,
                            f"P's request for transfer {tid!r} ended without its KV")
        record = self._transfers.get(tid)
        if record is not None and record.state is not TransferState.AWAITING_REGISTRATION \
                and record.state not in _NOT_LIVE:
            self._counters.duplicates += 1
            return Rejected(tid, NackReason.DUPLICATE, f"transfer {tid!r} is already registered")
        # Its size first, so that a degenerate one costs nothing more (not even a footprint).
        refusal = (self._check_size(reg) or self._check_limits(peer, footprint(reg))
                   or self._check_layout(reg))
        if refusal is not None:
            if refusal[0] is NackReason.OVER_LIMIT:
                self._counters.over_limit += 1
            elif refusal[0] is NackReason.TOO_MANY_BLOCKS:
                self._counters.too_many_blocks += 1
            else:
                self._counters.rejected += 1
            if record is None or record.state in _NOT_LIVE:
                return Rejected(tid, refusal[0], refusal[1])
            del self._transfers[tid]
            return Rejected(tid, refusal[0], refusal[1], record.block_ids, record.request_id)
        self._counters.registered += 1
        if record is not None and record.state is TransferState.COMPLETING:
            if len(record.block_ids or ()) == len(reg.block_ids):  # matches early
                self._not_live -= 1
                record.state = TransferState.AWAITING_PREFILL
                self._counters.early += 1
            else:  # its prefill_finished fails it, once P's blocks can be freed
                record = self._forget_not_live(record)
        if record is None or record.state is TransferState.CHUNKING:
            # P's prompt is still to come (in chunks so far: the grant asks for them).
            deadline = now + min(self.config.registration_ttl, reg.ttl_s)
            if record is None:
                record = self._transfers[tid] = _Transfer(tid, TransferState.AWAITING_PREFILL,
                                                          deadline)
            else:
                self._not_live -= 1
                record.state, record.deadline = TransferState.AWAITING_PREFILL, deadline
            record.registration = reg
            self._own(record, peer, reg, now)
            return Waiting(tid, TransferState.AWAITING_PREFILL)
        record.registration = reg
        self._own(record, peer, reg, now)
        return self._match(record, now)

    def abort(self, transfer_id: TransferId, *, now: float,
              peer: PeerId = b"") -> Release | Ignored | None:
        """D's request is gone (D is `peer`). None: nothing to do now (a WRITE is in flight
        and its end will release; or the id is unknown, and a tombstone frees a late
        prefill at once: the caller answers D itself). Ignored: another peer registered
        this transfer; only it may abort it."""
        record = self._forget_not_live(self._transfers.get(transfer_id))
        if record is None:  # its prefill_finished meets the tombstone
            self._bury(transfer_id, _Tombstone.D_ABORTED, now)
            return None
        if record.owner is not None and record.owner != peer:
            self._counters.foreign_aborts += 1
            return Ignored(transfer_id, "aborted by a peer that did not register it")
        if record.state is TransferState.WRITING:
            record.abort_requested = True
            return None
        if record.state is TransferState.AWAITING_PREFILL:  # its prefill may still finish
            self._bury(transfer_id, _Tombstone.D_ABORTED, now)
        return self._end(record, TransferState.ABORTED, FailReason.ABORTED)

    def abandon(self, transfer_id: TransferId, *, now: float) -> Release | Ignored | None:
        """The router's D leg for this transfer failed before any D registered: free P's
        blocks now (Release), or as soon as the prefill finishes (None: a tombstone, as for
        an abort of an unknown id). Ignored once a D has registered it: that D ends it."""
        record = self._transfers.get(transfer_id)
        if record is not None and record.registration is not None:
            self._counters.abandons_ignored += 1
            return Ignored(transfer_id, "a D has registered it")
        self._counters.abandoned += 1
        record = self._forget_not_live(record)
        if record is None:  # its prefill_finished meets the tombstone
            self._bury(transfer_id, _Tombstone.D_ABORTED, now)
            return None
        return self._end(record, TransferState.ABORTED, FailReason.ABORTED)

    def grant(self, peer: PeerId, *, sent: float, now: float,
              adds: Iterable[TransferId] = ()) -> list[Ready | Release]:
        """`peer` grants its lease, from P's token sent at `sent` (the caller checked that
        it is P's own, and not from the future): P may start WRITEs into the blocks of its
        granted transfers until `sent + lease_s`. Its registrations named in `adds` are
        granted from now: those whose prefill is here become Ready, and those whose prompt
        P computes in chunks give a chunk's Ready (`chunk`, see `prefill_progress`: not
        for `write_started`) for the chunks computed so far. A lease that had lapsed ends
        its transfers first (Release each), and is not taken back by this one."""
        until = sent + self.config.lease_s
        if until <= now:
            self._counters.stale_grants += 1
            return []
        if peer not in self._owned:
            return []  # nothing of its to write into: no lease to keep
        outcomes: list[Ready | Release] = []
        lapsed = self._leases.get(peer)
        if lapsed is not None and lapsed <= now:
            outcomes.extend(self._lapse(peer, now))
            if peer not in self._owned:
                return outcomes
        if until > self._leases.get(peer, -math.inf):
            self._leases[peer] = until
            self._schedule(_LeaseKey(peer), until)
        for tid in adds:
            record = self._transfers.get(tid)
            if record is None or record.owner != peer or record.granted:
                continue  # gone already, or not this peer's to grant
            record.granted, record.grant_by = True, None
            completing = record.state is TransferState.AWAITING_PREFILL \
                and record.early_step is not None  # its prompt's last step is under way
            if record.state is TransferState.AWAITING_GRANT or completing:
                self._counters.early += completing
                match = self._match(record, now)
                assert not isinstance(match, Waiting)
                outcomes.append(match)
                continue
            if (due := record.due()) is not None:
                self._schedule(tid, due)
            if (chunk := self._chunk(record, now)) is not None:
                outcomes.append(chunk)  # a chunk of its prompt computed since it registered
        return outcomes

    # --- events from P's engine ----------------------------------------------------------

    def prefill_finished(
        self, transfer_id: TransferId, block_ids: BlockIds, *, request_id: RequestId,
        now: float, fail_on_purpose: bool = False,
    ) -> Outcome:
        """P's request `request_id` computed the prompt and holds `block_ids` for it until
        a Release frees them. `fail_on_purpose`: its WRITE is to fail (fault injection)."""
        record = self._forget_not_live(self._transfers.get(transfer_id))
        if record is not None and record.request_id == request_id \
                and record.state in (TransferState.AWAITING_GRANT, TransferState.READY,
                                     TransferState.WRITING):
            self._counters.prefills += 1
            return Waiting(transfer_id, record.state)  # matched early: its WRITE is under way
        if record is not None and record.state is not TransferState.AWAITING_PREFILL:
            self._counters.duplicates += 1
            return Rejected(
                transfer_id, NackReason.DUPLICATE,
                f"prefill for transfer {transfer_id!r} already finished; these blocks are "
                "not kept", block_ids, request_id,
            )
        self._counters.prefills += 1
        if record is None:
            record = _Transfer(
                transfer_id, TransferState.AWAITING_REGISTRATION,
                now + self.config.unclaimed_ttl, block_ids=block_ids, request_id=request_id,
                fail_on_purpose=fail_on_purpose,
            )
            self._transfers[transfer_id] = record
            if self._tombstones.pop(_grave(transfer_id), (None,))[0] is _Tombstone.D_ABORTED:
                return self._end(record, TransferState.ABORTED)
            assert record.deadline is not None
            self._schedule(transfer_id, record.deadline)
            return Waiting(transfer_id, TransferState.AWAITING_REGISTRATION)
        record.block_ids = block_ids
        record.request_id = request_id
        record.fail_on_purpose = fail_on_purpose
        return self._match(record, now)

    def prefill_completing(
        self, transfer_id: TransferId, block_ids: BlockIds, *, request_id: RequestId,
        step: int, now: float, fail_on_purpose: bool = False,
    ) -> Ready | None:
        """P's request `request_id` completes its prompt, into `block_ids`, in engine step
        `step`, being built. Ready: D had registered, and granted; WRITE right after that
        step's forward pass. None: not now (with no registration yet, the record is
        COMPLETING, for one that comes before `prefill_finished`, which follows the step;
        with no grant yet, the record waits for one, or for `prefill_finished`)."""
        record = self._transfers.get(transfer_id) \
            or self._remember(transfer_id, TransferState.COMPLETING)
        if record is None or record.state not in (TransferState.COMPLETING,
                                                  TransferState.CHUNKING,
                                                  TransferState.AWAITING_PREFILL):
            return None
        record.progress = None  # the final WRITE covers the rest of the prompt
        if record.state is TransferState.CHUNKING:
            record.state = TransferState.COMPLETING
        if record.state is TransferState.AWAITING_PREFILL:
            assert record.registration is not None
            if len(block_ids) != len(record.registration.block_ids):
                return None  # prefill_finished fails it, once P's blocks can be freed
        record.block_ids = block_ids
        record.request_id = request_id
        record.early_step = step
        record.fail_on_purpose = fail_on_purpose
        if record.state is TransferState.COMPLETING or not self._writable(record, now):
            return None
        self._counters.early += 1
        match = self._match(record, now)
        assert isinstance(match, Ready)
        return match

    def prefill_progress(
        self, transfer_id: TransferId, block_ids: BlockIds, *, request_id: RequestId,
        prompt_blocks: int, step: int, now: float,
    ) -> Ready | None:
        """P computes its prompt in chunks: after engine step `step`, being built, P's
        first blocks `block_ids` (one KV-cache group) hold the prompt's KV, of a prompt of
        `prompt_blocks` blocks. Ready (`chunk`): D registered and granted; WRITE, right
        after that step's forward pass (or layer by layer during it), those of them no
        chunk covered yet, into D's matching blocks, without a notification; the transfer
        stays AWAITING_PREFILL, its final WRITE (which skips what chunks wrote) to come.
        None: nothing to write now; the record keeps this progress (with no record yet, a
        CHUNKING one), and the grant of a registration that comes later asks for it. D
        holds blocks for the prompt's last blocks only (a prefix hit on D:
        `prompt_blocks` - its count), so P's block i goes to D's block i - that hit, as
        vLLM's push code pairs them for the whole prompt."""
        if len(block_ids) != 1:
            return None  # several KV-cache groups: written whole at the end
        record = self._transfers.get(transfer_id) \
            or self._remember(transfer_id, TransferState.CHUNKING)
        if record is None or record.state not in (TransferState.CHUNKING,
                                                  TransferState.AWAITING_PREFILL):
            return None
        record.progress = _Progress(list(block_ids[0]), request_id, prompt_blocks, step)
        return self._chunk(record, now)

    def prefill_aborted(self, transfer_id: TransferId, *, now: float) -> Release | None:
        """P's request ended without its KV (cancelled, or failed). A waiting D is told at
        once; one that registers later is refused (see the tombstones)."""
        record = self._forget_not_live(self._transfers.get(transfer_id))
        if record is None:
            self._bury(transfer_id, _Tombstone.PREFILL_ABORTED, now)
            return None
        if record.state is not TransferState.AWAITING_PREFILL:
            return None  # its prefill already finished: the KV is held and may be written
        return self._end(record, TransferState.FAILED, FailReason.PREFILL_ABORTED)

    def write_started(self, transfer_id: TransferId) -> bool:
        """False: the transfer is gone (aborted): do not start the WRITE."""
        record = self._transfers.get(transfer_id)
        if record is None:
            return False
        self._require(record, TransferState.READY, event="write_started")
        record.state = TransferState.WRITING
        return True

    def write_done(self, transfer_id: TransferId) -> Release:
        record = self._transfers.get(transfer_id)
        if record is None:
            raise InvalidTransition(f"write_done for unknown transfer {transfer_id!r}")
        self._require(record, TransferState.WRITING, event="write_done")
        return self._end(record, TransferState.DONE)

    def write_failed(self, transfer_id: TransferId, reason: FailReason) -> Release | None:
        """The WRITE failed, or could not start (from READY). None: already gone."""
        record = self._transfers.get(transfer_id)
        if record is None:
            return None
        self._require(record, TransferState.READY, TransferState.WRITING, event="write_failed")
        return self._end(record, TransferState.FAILED, reason)

    # --- time ----------------------------------------------------------------------------

    def expire(self, now: float) -> list[Release]:
        """End every waiting transfer whose deadline is <= `now`, and drop every tombstone
        whose deadline is; in the order of their deadlines."""
        releases = []
        while self._deadlines and self._deadlines[0][0] <= now:
            entry = heapq.heappop(self._deadlines)
            key = entry[2]
            if not self._holds(*entry):
                continue
            if isinstance(key, _LeaseKey):
                releases.extend(self._lapse(key.peer, now))
            elif isinstance(key, bytes):
                del self._tombstones[key]
            else:
                record = self._transfers[key]
                if record.grant_by is not None and record.grant_by <= now:
                    releases.append(self._lease_ended(record, now))
                else:
                    releases.append(self._end(record, TransferState.EXPIRED,
                                              FailReason.EXPIRED))
        return releases

    def next_deadline(self) -> float | None:
        """The earliest deadline, for the owner's wake-up timer; None when none is set."""
        while self._deadlines and not self._holds(*self._deadlines[0]):
            heapq.heappop(self._deadlines)  # stale: drop it, the answer is unchanged
        return self._deadlines[0][0] if self._deadlines else None

    # --- inspection ----------------------------------------------------------------------

    def state_of(self, transfer_id: TransferId) -> TransferState | None:
        record = self._transfers.get(transfer_id)
        return None if record is None else record.state

    def __len__(self) -> int:
        return len(self._transfers) - self._not_live  # live ones: not COMPLETING, CHUNKING

    def pending_of(self, peer: PeerId) -> int:
        """Live registrations `peer` made (what max_pending_per_peer limits)."""
        return len(self._owned.get(peer, ()))

    def granted(self, transfer_id: TransferId) -> bool:
        """Whether a grant named this transfer (P may write into its blocks, under the
        lease)."""
        record = self._transfers.get(transfer_id)
        return record is not None and record.granted

    def lease_of(self, peer: PeerId) -> float | None:
        """When `peer`'s lease ends (None: it holds none)."""
        return self._leases.get(peer)

    def tombstones(self) -> int:
        return len(self._tombstones)

    def pending(self) -> tuple[int, int]:
        """Live registrations of all peers, and their footprints' sum (the global caps)."""
        return self._pending, self._pending_bytes

    def deadlines_held(self) -> int:
        """Entries in the deadline heap, stale ones included (bounded: see `_schedule`)."""
        return len(self._deadlines)

    def counters(self) -> RegistryCounters:
        """A copy of the counts so far (cheap: no walk over the live transfers)."""
        return dataclasses.replace(self._counters)

    def snapshot(self) -> RegistrySnapshot:
        by_state = dict.fromkeys((*LIVE_STATES, *_NOT_LIVE), 0)
        for record in self._transfers.values():
            by_state[record.state] += 1
        completing = by_state.pop(TransferState.COMPLETING)
        chunking = by_state.pop(TransferState.CHUNKING)
        return RegistrySnapshot(by_state, self.counters(), completing, chunking)

    # --- internals -----------------------------------------------------------------------

    def _check_size(self, reg: RegisterBlocks) -> tuple[NackReason, str] | None:
        """Could P hold what `reg` names: its KV-cache groups, and as many block ids?"""
        local = self.config
        groups = len(reg.block_ids)
        if local.num_groups is not None and groups != local.num_groups:
            return NackReason.TOO_MANY_BLOCKS, (
                f"{groups} KV-cache groups in one registration; this P has "
                f"{local.num_groups}: serve the same model on P and D")
        count = sum(len(group) for group in reg.block_ids)
        if local.num_blocks is not None and count > local.num_blocks:
            return NackReason.TOO_MANY_BLOCKS, (
                f"{count} block ids in one registration; this P has {local.num_blocks} "
                "blocks in all")
        return None

    def _check_limits(self, peer: PeerId, size: int) -> tuple[NackReason, str] | None:
        """May `peer` hold one more live registration, of `size` bytes?"""
        local = self.config
        if self.pending_of(peer) >= local.max_pending_per_peer:
            return NackReason.OVER_LIMIT, (
                f"this peer already holds {local.max_pending_per_peer} pending registrations "
                "on this P (kv_connector_extra_config.max_pending_per_peer)")
        count, held = self.pending()
        if count >= local.max_pending:
            return NackReason.OVER_LIMIT, (
                f"all peers together hold {local.max_pending} pending registrations on this "
                "P already (kv_connector_extra_config.max_pending)")
        if held + size > local.max_pending_bytes:
            return NackReason.OVER_LIMIT, (
                f"pending registrations hold {held} bytes on this P; this one's {size} "
                f"would pass the limit of {local.max_pending_bytes}")
        return None

    def _own(self, record: _Transfer, peer: PeerId, reg: RegisterBlocks, now: float) -> None:
        """`peer` registered `record`: only it may abort it; it counts to the limits; its
        grant must come within lease_s."""
        record.owner = peer
        record.footprint = footprint(reg)
        self._owned.setdefault(peer, set()).add(record.transfer_id)
        record.grant_by = now + self.config.lease_s
        self._pending += 1
        self._pending_bytes += record.footprint
        due = record.due()
        assert due is not None
        self._schedule(record.transfer_id, due)

    def _bury(self, transfer_id: TransferId, cause: _Tombstone, now: float) -> None:
        """Leave a tombstone until `unclaimed_ttl`; past max_tombstones, the oldest goes."""
        grave, deadline = _grave(transfer_id), now + self.config.unclaimed_ttl
        if self._tombstones.pop(grave, None) is None \
                and len(self._tombstones) >= self.config.max_tombstones:
            del self._tombstones[next(iter(self._tombstones))]  # its heap entry goes stale
            self._counters.tombstones_dropped += 1
        self._tombstones[grave] = (cause, deadline)  # the newest, last
        self._schedule(grave, deadline)

    def _schedule(self, key: DeadlineKey, deadline: float) -> None:
        """Put `key`'s deadline in the heap. Entries for records and tombstones that are
        gone, or have another deadline now, stay until they come up (`_holds`), unless
        they outnumber the live ones: then the heap is rebuilt, so it holds at most twice
        the live records and tombstones (plus _HEAP_SLACK), whatever a peer sends."""
        heapq.heappush(self._deadlines, (deadline, next(self._sequence), key))
        live = len(self._transfers) + len(self._tombstones) + len(self._leases)
        if len(self._deadlines) > 2 * live + _HEAP_SLACK:
            self._deadlines = [entry for entry in self._deadlines if self._holds(*entry)]
            heapq.heapify(self._deadlines)

    def _holds(self, deadline: float, _sequence: int, key: DeadlineKey) -> bool:
        """Whether this heap entry is still its record's, its tombstone's or its lease's
        deadline."""
        if isinstance(key, _LeaseKey):
            return self._leases.get(key.peer) == deadline
        if isinstance(key, bytes):
            return self._tombstones.get(key, (None, None))[1] == deadline
        record = self._transfers.get(key)
        return record is not None and record.due() == deadline

    def _check_layout(self, reg: RegisterBlocks) -> tuple[NackReason, str] | None:
        local = self.config
        if not local.push_supported:
            return NackReason.PUSH_UNSUPPORTED, (
                "this P takes no push: its vLLM's push code failed the prefix-hit check at "
                "start (it would not write only the blocks D lacks); D reads by pull")
        if reg.block_size != local.block_size:
            return NackReason.BLOCK_SIZE_MISMATCH, (
                f"block size mismatch: decode {reg.block_size}, prefill {local.block_size}; "
                "start P and D with the same --block-size"
            )
        if reg.tp_rank != 0:
            return NackReason.TP_MISMATCH, (
                f"tensor-parallel mismatch: a registration speaks for all of D's ranks "
                f"(tp_rank 0), this one for rank {reg.tp_rank} of decode tp {reg.tp_size}")
        why = tp_plan.refusal(local.tp_size, reg.tp_size, kv_heads=local.kv_heads,
                              mla=local.mla, mamba=local.mamba)
        if why is not None:
            return NackReason.TP_MISMATCH, (
                f"tensor-parallel mismatch: {why} (D reads the KV by pull where vLLM can, "
                "else computes the prompt)")
        return None

    def _remember(self, transfer_id: TransferId, state: TransferState) -> _Transfer | None:
        """A new not-live record (`state`: COMPLETING or CHUNKING) of P's alone, unless the
        transfer ended before it was known (a tombstone): then None."""
        if _grave(transfer_id) in self._tombstones:
            return None
        record = self._transfers[transfer_id] = _Transfer(transfer_id, state, None)
        self._not_live += 1
        return record

    def _forget_not_live(self, record: _Transfer | None) -> _Transfer | None:
        """None for a COMPLETING or CHUNKING record (dropped: P's prefill ended, or D
        will not register), else `record`."""
        if record is None or record.state not in _NOT_LIVE:
            return record
        del self._transfers[record.transfer_id]
        self._not_live -= 1
        return None

    def _writable(self, record: _Transfer, now: float) -> bool:
        """Whether P may start a WRITE into `record`'s blocks now: granted, under a lease
        that has not ended."""
        return record.granted and self._leases.get(record.owner or b"", -math.inf) > now

    def _chunk(self, record: _Transfer, now: float) -> Ready | None:
        """The WRITE of `record`'s latest progress (`prefill_progress`) that no chunk
        covered yet, if P may write into its D's blocks now; None otherwise."""
        progress, registration = record.progress, record.registration
        if progress is None or registration is None \
                or record.state is not TransferState.AWAITING_PREFILL \
                or not self._writable(record, now):
            return None
        assert record.owner is not None
        if len(registration.block_ids) != 1:
            return None  # several KV-cache groups: written whole at the end
        decode = registration.block_ids[0]
        hit = progress.prompt_blocks - len(decode)
        start, end = max(hit, record.chunk_blocks), len(progress.block_ids)
        if hit < 0 or end > progress.prompt_blocks or end <= start:
            return None
        record.chunk_blocks = end
        record.chunk_write_by = self._leases[record.owner] + self.config.write_s
        self._counters.chunks += 1
        chunk = msgspec.structs.replace(registration,
                                        block_ids=[list(decode[start - hit:end - hit])])
        return Ready(record.transfer_id, chunk, [progress.block_ids[start:end]],
                     progress.request_id, progress.step, write_by=record.chunk_write_by,
                     chunk=True)

    def _match(self, record: _Transfer, now: float) -> Ready | Waiting | Release:
        """Both sides are known: READY (early if the record has `early_step`), under its
        registrant's lease; AWAITING_GRANT until it grants; LEASE_EXPIRED if that lease
        has ended."""
        assert record.registration is not None and record.block_ids is not None
        record.deadline = None
        if len(record.block_ids) != len(record.registration.block_ids):
            return self._end(record, TransferState.FAILED, FailReason.LAYOUT_MISMATCH)
        if not record.granted:
            record.state = TransferState.AWAITING_GRANT
            assert record.grant_by is not None
            self._schedule(record.transfer_id, record.grant_by)
            return Waiting(record.transfer_id, TransferState.AWAITING_GRANT)
        if not self._writable(record, now):
            return self._lease_ended(record, now)
        record.state = TransferState.READY
        self._counters.matched += 1
        assert record.request_id is not None and record.owner is not None
        return Ready(record.transfer_id, record.registration, record.block_ids, record.request_id,
                     record.early_step, record.fail_on_purpose,
                     write_by=self._leases[record.owner] + self.config.write_s)

    def _lapse(self, peer: PeerId, now: float) -> list[Release]:
        """`peer`'s lease ended: end its granted transfers that no WRITE has started for
        (one that has is bounded by its `write_by`), and forget the lease."""
        del self._leases[peer]
        releases = []
        for tid in list(self._owned.get(peer, ())):
            record = self._transfers[tid]
            if record.granted and record.state not in (TransferState.READY,
                                                       TransferState.WRITING):
                releases.append(self._lease_ended(record, now))
        return releases

    def _lease_ended(self, record: _Transfer, now: float) -> Release:
        """End `record`: its registrant's grant did not come in time, or lapsed. A prefill
        still to come is freed the moment it finishes (a tombstone, as for D's abort)."""
        self._counters.lease_expired += 1
        if record.state is TransferState.AWAITING_PREFILL:
            self._bury(record.transfer_id, _Tombstone.D_ABORTED, now)
        return self._end(record, TransferState.EXPIRED, FailReason.LEASE_EXPIRED)

    def _end(
        self, record: _Transfer, state: TransferState, reason: FailReason | None = None
    ) -> Release:
        """Remove the record and say what to release; the one exit of every transfer."""
        del self._transfers[record.transfer_id]  # its heap entry, if any, goes stale
        if record.owner is not None:
            self._pending -= 1
            self._pending_bytes -= record.footprint
            owned = self._owned[record.owner]
            owned.discard(record.transfer_id)
            if not owned:  # nothing of this peer's left to write into: its lease goes
                del self._owned[record.owner]
                self._leases.pop(record.owner, None)
        if record.abort_requested:
            state, reason = TransferState.ABORTED, FailReason.ABORTED
        if state is TransferState.EXPIRED and reason is FailReason.LEASE_EXPIRED:
            pass  # counted in lease_expired
        elif state is TransferState.EXPIRED:
            if record.state is TransferState.AWAITING_PREFILL:
                self._counters.expired_registrations += 1
            else:
                self._counters.expired_unclaimed += 1
        elif state is TransferState.DONE:
            self._counters.done += 1
        elif state is TransferState.FAILED:
            self._counters.failed += 1
        else:
            self._counters.aborted += 1
        # D hears of every end of a transfer it registered, its own abort included: D
        # frees its blocks only once P says nothing more will be written into them.
        # A transfer that ends before its final WRITE, after chunk WRITEs: D hears of it
        # once those can no longer be in flight (a final WRITE's end comes after all).
        notify_after = record.chunk_write_by \
            if record.state is TransferState.AWAITING_PREFILL else None
        return Release(record.transfer_id, state, record.block_ids, record.registration,
                       reason, record.request_id, notify_after)

    @staticmethod
    def _require(record: _Transfer, *allowed: TransferState, event: str) -> None:
        if record.state not in allowed:
            raise InvalidTransition(
                f"{event} for transfer {record.transfer_id!r} in state {record.state.name}; "
                f"allowed only in {', '.join(s.name for s in allowed)}"
            )
