"""P's push registry: matches D's block registrations with P's finished prefills.

Owned by one thread on P, the side channel's (`connector.prefill_channel`), so no lock:
it learns of D's registrations and aborts from the socket, of prefills and WRITE results
from the engine, and calls `expire` on every wake-up (`next_deadline`). It does no I/O;
each method returns what the caller must do (answer D, start a WRITE, free P's blocks).

Matching is exact on `transfer_id` and works in either order: D may register before P's
prefill finishes, or after. One registry serves one P engine (all its ranks); D's
scheduler registers for all of D's ranks at once (`tp_rank` 0), and every P rank WRITEs
its share (see `connector.tp_plan`). P and D may run different tensor-parallel sizes when
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
  A match whose KV-cache group counts differ goes straight to FAILED.

  prefill_completing (engine step `step`, being built, completes the prompt) matches an
  AWAITING_PREFILL registration early (READY with `early_step`: P WRITEs right after that
  step's forward pass; the prefill_finished that follows is taken as known). With no
  registration yet, the record is COMPLETING (not live: no deadline, not counted) until
  a registration matches it early or its prefill_finished comes. A record carries P's
  fault injection (`fail_on_purpose`) to its Ready.

Who may end a transfer: a registered one is aborted only by the peer that registered it
(`peer`: its CURVE public key, else its ZMQ routing identity); an abort from anyone else
is ignored and counted. A transfer no D registered yet may be aborted, or abandoned (the
router's word that its D leg failed), by anyone who names it: its 128-bit random id is
the capability. An abandon of a registered transfer is ignored and counted.

Limits, so that no peer can make P hold unbounded state: at most `max_pending_per_peer`
live registrations per peer (more are refused, OVER_LIMIT), no more block ids in one
registration than P has blocks (`num_blocks`; TOO_MANY_BLOCKS), and at most
`MAX_TOMBSTONES` tombstones (the oldest go first).

DONE, FAILED, EXPIRED and ABORTED are terminal: the record is removed in the call that
reaches them (nothing outlives its transfer) and a `Release` says to free P's blocks, if
P holds any, and to tell D, if D registered: PushDone, or PushFailed with the reason
(`aborted` answers D's own Abort, once nothing more will be written into its blocks).

Deadlines use the caller's monotonic clock (`now`, seconds). A registration waits at most
min(registration_ttl, D's ttl_s); a finished prefill waits for D at most unclaimed_ttl.
READY and WRITING have no deadline here: the writer bounds them and reports the result.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import TypeAlias

import msgspec

from connector import tp_plan
from connector.messages import EngineId, FailReason, NackReason, RegisterBlocks, TransferId

RequestId: TypeAlias = str  # P's engine request id, which holds P's blocks
PeerId: TypeAlias = bytes  # who sent a message: CURVE public key, else ZMQ routing identity

DEFAULT_REGISTRATION_TTL_S = 120.0
DEFAULT_UNCLAIMED_TTL_S = 120.0
DEFAULT_MAX_PENDING_PER_PEER = 4096
# Tombstones outlive nothing but their deadline; this bounds them under a flood of aborts
# for ids P never saw. Evicting one early costs at most a late prefill held until its
# deadline, or a late registration waiting for its TTL.
MAX_TOMBSTONES = 65536

BlockIds = list[list[int]]  # one list per KV-cache group


class TransferState(enum.Enum):
    COMPLETING = "completing"  # P's prompt completes in the step being built; not live
    AWAITING_PREFILL = "awaiting_prefill"
    AWAITING_REGISTRATION = "awaiting_registration"
    READY = "ready"
    WRITING = "writing"
    DONE = "done"
    FAILED = "failed"
    EXPIRED = "expired"
    ABORTED = "aborted"


LIVE_STATES = (TransferState.AWAITING_PREFILL, TransferState.AWAITING_REGISTRATION,
               TransferState.READY, TransferState.WRITING)


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
    registration_ttl: float = DEFAULT_REGISTRATION_TTL_S
    unclaimed_ttl: float = DEFAULT_UNCLAIMED_TTL_S
    # P's KV cache blocks in all: no registration may name more block ids (None: unknown).
    num_blocks: int | None = None
    max_pending_per_peer: int = DEFAULT_MAX_PENDING_PER_PEER

    def __post_init__(self) -> None:
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.max_pending_per_peer < 1:
            raise ValueError(f"max_pending_per_peer must be >= 1, got {self.max_pending_per_peer}")
        if not self.engine_id:
            raise ValueError("engine_id must be a non-empty string")
        if self.block_size < 1 or self.tp_size < 1 or (
                self.kv_heads is not None and self.kv_heads < 1):
            raise ValueError(
                f"need block_size >= 1, tp_size >= 1, kv_heads >= 1 or None; got "
                f"block_size={self.block_size}, tp_size={self.tp_size}, kv_heads={self.kv_heads}"
            )
        for name, ttl in (("registration_ttl", self.registration_ttl),
                          ("unclaimed_ttl", self.unclaimed_ttl)):
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
    done: int = 0
    failed: int = 0
    aborted: int = 0
    expired_registrations: int = 0  # D registered, P never finished in time
    expired_unclaimed: int = 0  # P finished, D never registered in time
    duplicates: int = 0
    rejected: int = 0  # registrations refused: block size or an unsupported TP pair
    over_limit: int = 0  # registrations refused: the peer's pending limit
    too_many_blocks: int = 0  # registrations refused: more block ids than P's blocks
    foreign_aborts: int = 0  # aborts of a registered transfer from another peer: ignored
    abandoned: int = 0  # the router's abandons honoured
    abandons_ignored: int = 0  # abandons of a transfer a D registered: ignored


@dataclass(frozen=True, slots=True)
class RegistrySnapshot:
    by_state: dict[TransferState, int]  # live records only
    counters: RegistryCounters
    completing: int = 0  # prefills remembered by prefill_completing, not yet finished

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
    early_step: int | None = None  # COMPLETING: the step that completes the prompt
    fail_on_purpose: bool = False  # P's fault injection, for its Ready


class _Tombstone(enum.Enum):
    """Why a transfer ended before the registry knew it (see the module docstring)."""

    D_ABORTED = "d_aborted"
    PREFILL_ABORTED = "prefill_aborted"


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
        self._transfers: dict[TransferId, _Transfer] = {}  # live and COMPLETING records
        self._completing = 0  # records in COMPLETING (not live)
        self._tombstones: dict[TransferId, tuple[_Tombstone, float]] = {}  # cause, deadline
        self._pending_by_peer: dict[PeerId, int] = {}  # live registrations per owner
        self._counters = RegistryCounters()

    # --- events from D and the router (side channel) -------------------------------------

    def register(self, reg: RegisterBlocks, *, now: float, peer: PeerId = b"") -> Outcome:
        """D's registration, from `peer`. Ready or Waiting: send Ack. Rejected: send Nack."""
        tid = reg.transfer_id
        if self._tombstones.get(tid, (None,))[0] is _Tombstone.PREFILL_ABORTED:
            del self._tombstones[tid]
            self._counters.rejected += 1
            return Rejected(tid, NackReason.PREFILL_ABORTED,
                            f"P's request for transfer {tid!r} ended without its KV")
        record = self._transfers.get(tid)
        if record is not None and record.state not in (TransferState.AWAITING_REGISTRATION,
                                                       TransferState.COMPLETING):
            self._counters.duplicates += 1
            return Rejected(tid, NackReason.DUPLICATE, f"transfer {tid!r} is already registered")
        refusal = self._check_limits(reg, peer) or self._check_layout(reg)
        if refusal is not None:
            if refusal[0] is NackReason.OVER_LIMIT:
                self._counters.over_limit += 1
            elif refusal[0] is NackReason.TOO_MANY_BLOCKS:
                self._counters.too_many_blocks += 1
            else:
                self._counters.rejected += 1
            if record is None or record.state is TransferState.COMPLETING:
                return Rejected(tid, refusal[0], refusal[1])
            del self._transfers[tid]
            return Rejected(tid, refusal[0], refusal[1], record.block_ids, record.request_id)
        self._counters.registered += 1
        if record is not None and record.state is TransferState.COMPLETING:
            if len(record.block_ids or ()) == len(reg.block_ids):  # matches early
                self._completing -= 1
                record.state = TransferState.AWAITING_PREFILL
                self._counters.early += 1
            else:  # its prefill_finished fails it, once P's blocks can be freed
                record = self._forget_completing(record)
        if record is None:
            deadline = now + min(self.config.registration_ttl, reg.ttl_s)
            record = _Transfer(tid, TransferState.AWAITING_PREFILL, deadline, registration=reg)
            self._transfers[tid] = record
            self._own(record, peer)
            return Waiting(tid, TransferState.AWAITING_PREFILL)
        record.registration = reg
        self._own(record, peer)
        return self._match(record)

    def abort(self, transfer_id: TransferId, *, now: float,
              peer: PeerId = b"") -> Release | Ignored | None:
        """D's request is gone (D is `peer`). None: nothing to do now (a WRITE is in flight
        and its end will release; or the id is unknown, and a tombstone frees a late
        prefill at once: the caller answers D itself). Ignored: another peer registered
        this transfer; only it may abort it."""
        record = self._forget_completing(self._transfers.get(transfer_id))
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
        record = self._forget_completing(record)
        if record is None:  # its prefill_finished meets the tombstone
            self._bury(transfer_id, _Tombstone.D_ABORTED, now)
            return None
        return self._end(record, TransferState.ABORTED, FailReason.ABORTED)

    # --- events from P's engine ----------------------------------------------------------

    def prefill_finished(
        self, transfer_id: TransferId, block_ids: BlockIds, *, request_id: RequestId,
        now: float, fail_on_purpose: bool = False,
    ) -> Outcome:
        """P's request `request_id` computed the prompt and holds `block_ids` for it until
        a Release frees them. `fail_on_purpose`: its WRITE is to fail (fault injection)."""
        record = self._forget_completing(self._transfers.get(transfer_id))
        if record is not None and record.request_id == request_id \
                and record.state in (TransferState.READY, TransferState.WRITING):
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
            if self._tombstones.pop(transfer_id, (None,))[0] is _Tombstone.D_ABORTED:
                return self._end(record, TransferState.ABORTED)
            return Waiting(transfer_id, TransferState.AWAITING_REGISTRATION)
        record.block_ids = block_ids
        record.request_id = request_id
        record.fail_on_purpose = fail_on_purpose
        return self._match(record)

    def prefill_completing(
        self, transfer_id: TransferId, block_ids: BlockIds, *, request_id: RequestId,
        step: int, fail_on_purpose: bool = False,
    ) -> Ready | None:
        """P's request `request_id` completes its prompt, into `block_ids`, in engine step
        `step`, being built. Ready: D had registered; WRITE right after that step's forward
        pass. None: not now (with no registration yet, the record is COMPLETING, for one
        that comes before `prefill_finished`, which follows the step)."""
        record = self._transfers.get(transfer_id)
        if record is None and transfer_id not in self._tombstones:
            record = self._transfers[transfer_id] = _Transfer(transfer_id,
                                                              TransferState.COMPLETING, None)
            self._completing += 1
        if record is None or record.state not in (TransferState.COMPLETING,
                                                  TransferState.AWAITING_PREFILL):
            return None
        if record.state is TransferState.AWAITING_PREFILL:
            assert record.registration is not None
            if len(block_ids) != len(record.registration.block_ids):
                return None  # prefill_finished fails it, once P's blocks can be freed
        record.block_ids = block_ids
        record.request_id = request_id
        record.early_step = step
        record.fail_on_purpose = fail_on_purpose
        if record.state is TransferState.COMPLETING:
            return None
        self._counters.early += 1
        match = self._match(record)
        assert isinstance(match, Ready)
        return match

    def prefill_aborted(self, transfer_id: TransferId, *, now: float) -> Release | None:
        """P's request ended without its KV (cancelled, or failed). A waiting D is told at
        once; one that registers later is refused (see the tombstones)."""
        record = self._forget_completing(self._transfers.get(transfer_id))
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
        """End every waiting transfer whose deadline is <= `now`."""
        for tid in [t for t, (_, deadline) in self._tombstones.items() if now >= deadline]:
            del self._tombstones[tid]
        due = [r for r in self._transfers.values() if r.deadline is not None and now >= r.deadline]
        return [self._end(record, TransferState.EXPIRED, FailReason.EXPIRED) for record in due]

    def next_deadline(self) -> float | None:
        """The earliest deadline, for the owner's wake-up timer; None when none is set."""
        deadlines = [r.deadline for r in self._transfers.values() if r.deadline is not None]
        deadlines.extend(deadline for _, deadline in self._tombstones.values())
        return min(deadlines, default=None)

    # --- inspection ----------------------------------------------------------------------

    def state_of(self, transfer_id: TransferId) -> TransferState | None:
        record = self._transfers.get(transfer_id)
        return None if record is None else record.state

    def __len__(self) -> int:
        return len(self._transfers) - self._completing  # live ones: not COMPLETING

    def pending_of(self, peer: PeerId) -> int:
        """Live registrations `peer` made (what max_pending_per_peer limits)."""
        return self._pending_by_peer.get(peer, 0)

    def tombstones(self) -> int:
        return len(self._tombstones)

    def counters(self) -> RegistryCounters:
        """A copy of the counts so far (cheap: no walk over the live transfers)."""
        return dataclasses.replace(self._counters)

    def snapshot(self) -> RegistrySnapshot:
        by_state = dict.fromkeys(LIVE_STATES, 0)
        for record in self._transfers.values():
            if record.state is not TransferState.COMPLETING:
                by_state[record.state] += 1
        return RegistrySnapshot(by_state, self.counters(), self._completing)

    # --- internals -----------------------------------------------------------------------

    def _check_limits(self, reg: RegisterBlocks, peer: PeerId) -> tuple[NackReason, str] | None:
        limit = self.config.max_pending_per_peer
        if self._pending_by_peer.get(peer, 0) >= limit:
            return NackReason.OVER_LIMIT, (
                f"this peer already holds {limit} pending registrations on this P "
                "(kv_connector_extra_config.max_pending_per_peer)")
        count, most = sum(len(group) for group in reg.block_ids), self.config.num_blocks
        if most is not None and count > most:
            return NackReason.TOO_MANY_BLOCKS, (
                f"{count} block ids in one registration; this P has {most} blocks in all")
        return None

    def _own(self, record: _Transfer, peer: PeerId) -> None:
        """`peer` registered `record`: only it may abort it; it counts to its limit."""
        record.owner = peer
        self._pending_by_peer[peer] = self._pending_by_peer.get(peer, 0) + 1

    def _bury(self, transfer_id: TransferId, cause: _Tombstone, now: float) -> None:
        """Leave a tombstone until `unclaimed_ttl`; past MAX_TOMBSTONES, the oldest goes."""
        if transfer_id not in self._tombstones and len(self._tombstones) >= MAX_TOMBSTONES:
            del self._tombstones[next(iter(self._tombstones))]
        self._tombstones[transfer_id] = (cause, now + self.config.unclaimed_ttl)

    def _check_layout(self, reg: RegisterBlocks) -> tuple[NackReason, str] | None:
        local = self.config
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
                              mla=local.mla)
        if why is not None:
            return NackReason.TP_MISMATCH, (
                f"tensor-parallel mismatch: {why} (pull serves any tp pair vLLM reads)")
        return None

    def _forget_completing(self, record: _Transfer | None) -> _Transfer | None:
        """None for a COMPLETING record (dropped: it will not match early), else `record`."""
        if record is None or record.state is not TransferState.COMPLETING:
            return record
        del self._transfers[record.transfer_id]
        self._completing -= 1
        return None

    def _match(self, record: _Transfer) -> Ready | Release:
        """Both sides are known: READY (early if the record has `early_step`)."""
        assert record.registration is not None and record.block_ids is not None
        record.deadline = None
        if len(record.block_ids) != len(record.registration.block_ids):
            return self._end(record, TransferState.FAILED, FailReason.LAYOUT_MISMATCH)
        record.state = TransferState.READY
        self._counters.matched += 1
        assert record.request_id is not None
        return Ready(record.transfer_id, record.registration, record.block_ids, record.request_id,
                     record.early_step, record.fail_on_purpose)

    def _end(
        self, record: _Transfer, state: TransferState, reason: FailReason | None = None
    ) -> Release:
        """Remove the record and say what to release; the one exit of every transfer."""
        del self._transfers[record.transfer_id]
        if record.owner is not None:
            left = self._pending_by_peer[record.owner] - 1
            if left:
                self._pending_by_peer[record.owner] = left
            else:
                del self._pending_by_peer[record.owner]
        if record.abort_requested:
            state, reason = TransferState.ABORTED, FailReason.ABORTED
        if state is TransferState.EXPIRED:
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
        return Release(record.transfer_id, state, record.block_ids, record.registration,
                       reason, record.request_id)

    @staticmethod
    def _require(record: _Transfer, *allowed: TransferState, event: str) -> None:
        if record.state not in allowed:
            raise InvalidTransition(
                f"{event} for transfer {record.transfer_id!r} in state {record.state.name}; "
                f"allowed only in {', '.join(s.name for s in allowed)}"
            )
