"""The push side channel's wire messages (msgpack over ZMQ), and their one codec.

Who sends what, for one transfer (`transfer_id`, chosen by the router, names it on both
sides; nothing else is matched):

    D -> P  RegisterBlocks  D allocated blocks for the prompt: write the KV here.
    P -> D  Ack             registered; here is P's layout. Or:
    P -> D  Nack            refused (reason code); D falls back to recompute.
    P -> D  PushDone        P wrote every block and freed its own.
    P -> D  PushFailed      P could not write (or never will); D falls back: it reads
                            the blocks P offers (`pull`), or computes the prompt.
    D -> P  Abort           D's request is gone; P frees the blocks it holds for it and
                            answers PushFailed(aborted) once nothing more will be written.
    D -> P  Ping            D still waits on this P; P answers Pong at once (liveness).
    R -> P  Abandon         the router's D leg failed before any D registered: P frees the
                            prompt's blocks now instead of after `unclaimed_ttl`. No answer.

The write lease: P WRITEs into D's blocks only while D lets it. Every Ack and Pong carries
a `LeaseToken` (P's instance, when P sent it, and P's terms: `lease_s`, `write_s`); D
echoes the latest one it has in a `Grant` on its registrations and pings. A transfer
becomes writable by a grant that names it: the grant on its own registration, or a
ping's `adds` (a registration sent before D had a token, named once its Ack came). Every
grant renews the lease of all that D's writable transfers: P may start WRITEs into their
blocks for `lease_s` from the token's `sent` (P's own clock: no clock is shared), and is
done with each WRITE (posted, or cancelled) `write_s` after the lease under which it
started ends. A grant names the transfers it does not cover (`withheld`: those D gave
up on, each also aborted); P aborts them first. So D, having given up on a push, knows
when P is surely done with its blocks without a word from P: `write_s` after `lease_s`
past the arrival of the latest token it had (`connector.decode.channel`; the design is
in docs/ARCHITECTURE.md, section 5).

Who may do what: a registered transfer is aborted only by the peer that registered it
(its CURVE public key when the side channel is authenticated, else its ZMQ routing
identity); for a transfer no D registered, knowing its `transfer_id` (128 random bits,
from the router) is the capability, for an Abort as for an Abandon.

PushFailed may follow RegisterBlocks at any time, with or without an Ack before it. D
learns that its KV arrived from the WRITE's own NIXL notification, not from PushDone.

Every message carries `version`; `decode` refuses any other version before it reads the
body, so a mixed deployment fails with a clear error instead of a misread field. Every
message is validated when it is built, here or by the decoder, so a bad value never gets
past this module. D's deadline travels as a lifetime (`ttl_s`), never as a clock reading:
P and D do not share a clock; the receiver rebases it on its own monotonic clock.
"""

from __future__ import annotations

import enum
import math
import threading
from typing import Annotated, NewType, TypeAlias, get_args

import msgspec

# Protocol versions. Bump on any change to a message's fields, tags or meaning.
#   1: RegisterBlocks, Ack, Nack, Abort, PushDone, PushFailed, Ping, Pong.
#   2: PushFailed.pull, P's offer to be read instead after a failed WRITE.
#   3: Abandon (router -> P); Nack reasons over_limit and too_many_blocks.
#   4: RegisterBlocks.tp_size may differ from P's: P accepts a D whose tp is a multiple
#      or a divisor of its own and its ranks WRITE D's ranks as `connector.shared.tp_plan` maps
#      them (version 3's P refused any other tp than its own).
#   5: the write lease: Ack.lease and Pong.lease (P's LeaseToken), RegisterBlocks.grant
#      and Ping.grant (D's Grant); FailReason lease_expired.
#   6: bounds that let P size its frames from its own layout: a transfer id has at most
#      MAX_TRANSFER_ID_CHARS characters, a grant names at most MAX_WITHHELD (256, was
#      4096) of each kind; block ids are checked >= 0 by the decoder itself.
PROTOCOL_VERSION = 6

TransferId = NewType("TransferId", str)
EngineId = NewType("EngineId", str)

MAX_PORT = 65535
# More KV-cache groups than a model has (vLLM's hybrid models have a few). The decoder
# refuses a message naming more before it builds a single group: a million empty groups
# fit in one frame, and would keep P's side channel thread decoding for most of a second.
MAX_KV_GROUPS = 1024
# Checked by msgspec as it decodes (no Python loop over a registration's ids: a flood of
# large registrations spent a third of P's channel thread in that loop).
BlockIds: TypeAlias = Annotated[list[list[Annotated[int, msgspec.Meta(ge=0)]]],
                                msgspec.Meta(max_length=MAX_KV_GROUPS)]
# A transfer id is the router's 32 hex digits; any id on the wire has at most this many
# characters, so that P can bound a legitimate frame (`connector.prefill.channel`).
MAX_TRANSFER_ID_CHARS = 64
# A grant names at most this many transfers of each kind (`adds`, `withheld`: D's
# give-ups at that P that P has not answered yet, normally a handful). Past it, D sends
# no grant and P's lease lapses (P lets go; D computes). Small, because every frame P
# reads may be this large: with 4096 a ping could be 280 KB, and P could not refuse a
# 150 KB flood of degenerate registrations before reading them (scripts/drill_flood).
MAX_WITHHELD = 256


class ProtocolError(ValueError):
    """Bytes that are not a valid message of our protocol version, or a bad field value."""


class NackReason(str, enum.Enum):
    """Why P refused a registration (sent in `Nack`)."""

    DUPLICATE = "duplicate"  # this transfer_id is already registered
    BLOCK_SIZE_MISMATCH = "block_size_mismatch"
    TP_MISMATCH = "tp_mismatch"  # a tp pair push cannot map (tp_plan), or tp_rank not 0
    PREFILL_ABORTED = "prefill_aborted"  # P's request for it already ended without KV
    SHUTTING_DOWN = "shutting_down"
    OVER_LIMIT = "over_limit"  # this peer holds too many pending registrations already
    TOO_MANY_BLOCKS = "too_many_blocks"  # more block ids than P has blocks in all
    # P takes no push: its vLLM's push code fails the prefix-hit check at start
    # (`vllm_compat.push_trims_to_decode_tail`)
    PUSH_UNSUPPORTED = "push_unsupported"


class FailReason(str, enum.Enum):
    """Why P will not complete an accepted push (sent in `PushFailed`)."""

    WRITE_ERROR = "write_error"
    HANDSHAKE_ERROR = "handshake_error"  # P could not reach D's agent
    LAYOUT_MISMATCH = "layout_mismatch"  # P and D hold a different number of KV groups
    EXPIRED = "expired"  # the other side did not show up before the deadline
    ABORTED = "aborted"  # D aborted; nothing more will be written into its blocks
    PREFILL_ABORTED = "prefill_aborted"  # P's request ended without its KV (cancelled)
    SHUTTING_DOWN = "shutting_down"
    LEASE_EXPIRED = "lease_expired"  # D stopped granting (gone, or cut off): P let go


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ProtocolError(message)


def _require_id(value: str, field: str) -> None:
    _require(bool(value), f"{field} must be a non-empty string")


def _require_transfer_id(value: str, field: str) -> None:
    _require_id(value, field)
    _require(len(value) <= MAX_TRANSFER_ID_CHARS,
             f"{field} must have at most {MAX_TRANSFER_ID_CHARS} characters, got {len(value)}")


def _require_block_ids(block_ids: BlockIds) -> None:
    """Block ids >= 0. The decoder checks that as it reads them (`BlockIds`); this loop,
    over every id in Python, is for a message built here only."""
    if getattr(_decoding, "active", False):
        return
    for group in block_ids:
        bad = [block for block in group if block < 0]
        _require(not bad, f"block_ids must hold ids >= 0, got {bad}")


class _Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    version: int = PROTOCOL_VERSION


class _TransferMessage(_Message, frozen=True, kw_only=True):
    transfer_id: TransferId

    def __post_init__(self) -> None:
        _require_transfer_id(self.transfer_id, "transfer_id")


class LeaseToken(msgspec.Struct, frozen=True, kw_only=True):
    """P -> D, on every Ack and Pong, and back in D's grants: P's `instance` (a random
    number per P channel: a token of another P, or of this one's former life, grants
    nothing), when P sent it (`sent`, P's monotonic clock, read only by P), and P's terms:
    a grant holds `lease_s` from `sent`; P is done with a WRITE `write_s` after its lease
    ends."""

    instance: int
    sent: float
    lease_s: float
    write_s: float

    def __post_init__(self) -> None:
        _require(math.isfinite(self.sent), f"sent must be finite, got {self.sent}")
        for name in ("lease_s", "write_s"):
            value = getattr(self, name)
            _require(math.isfinite(value) and value > 0,
                     f"{name} must be a finite number > 0, got {value}")


class Grant(msgspec.Struct, frozen=True, kw_only=True):
    """D -> P, on a registration or a ping: P may WRITE into the blocks of this D's
    writable transfers for `token.lease_s` from `token.sent` (the latest token D had from
    this P). Writable are the transfers a grant named: its registration's own, and
    `adds` (registrations sent before D had a token). Not those `withheld`: D gave up on
    them; P aborts them before it takes the grant."""

    token: LeaseToken
    adds: Annotated[list[TransferId], msgspec.Meta(max_length=MAX_WITHHELD)] = []
    withheld: Annotated[list[TransferId], msgspec.Meta(max_length=MAX_WITHHELD)] = []

    def __post_init__(self) -> None:
        for transfer_id in (*self.adds, *self.withheld):
            _require_transfer_id(transfer_id, "a grant's transfer_id")


class RegisterBlocks(_TransferMessage, frozen=True, kw_only=True, tag="register_blocks"):
    """D -> P: D's blocks for this transfer, one list per KV-cache group.

    D's scheduler speaks for all of D's ranks (`tp_rank` 0 of `tp_size`); each of P's
    ranks writes the D ranks `connector.shared.tp_plan` maps it to (P's rank r to D's rank r
    when the sizes are equal). `request_id` is D's engine request id: the WRITE's NIXL
    notification names it. `host`/`port` are D's NIXL side channel (vLLM's handshake
    listener), where P's workers fetch D's agent metadata before they WRITE. Replies go
    back over the same ZMQ connection, addressed by D's `engine_id`."""

    engine_id: EngineId
    request_id: str
    tp_size: int
    tp_rank: int
    block_ids: BlockIds
    block_size: int
    host: str
    port: int
    ttl_s: float  # how long D keeps the blocks, from when it sent this
    grant: Grant | None = None  # None: D has no token from this P yet (it grants later)

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_id(self.engine_id, "engine_id")
        _require_id(self.request_id, "request_id")
        _require(self.tp_size >= 1, f"tp_size must be >= 1, got {self.tp_size}")
        _require(
            0 <= self.tp_rank < self.tp_size,
            f"tp_rank must be in [0, {self.tp_size}), got {self.tp_rank}",
        )
        _require(1 <= len(self.block_ids) <= MAX_KV_GROUPS,
                 f"block_ids must hold 1 to {MAX_KV_GROUPS} KV-cache groups, "
                 f"got {len(self.block_ids)}")
        _require_block_ids(self.block_ids)
        _require(self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}")
        _require_id(self.host, "host")
        _require(1 <= self.port <= MAX_PORT, f"port must be in 1..{MAX_PORT}, got {self.port}")
        _require(
            math.isfinite(self.ttl_s) and self.ttl_s > 0,
            f"ttl_s must be a finite number > 0, got {self.ttl_s}",
        )


class Ack(_TransferMessage, frozen=True, kw_only=True, tag="ack"):
    """P -> D: registration accepted; P's layout, for D's own checks and metrics, a lease
    token for D's grants, and whether the registration's own grant made it writable
    (False: none came with it, or its token had expired; D names it in a grant now)."""

    engine_id: EngineId
    block_size: int
    tp_size: int
    lease: LeaseToken | None = None
    granted: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_id(self.engine_id, "engine_id")
        _require(self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}")
        _require(self.tp_size >= 1, f"tp_size must be >= 1, got {self.tp_size}")


class Nack(_TransferMessage, frozen=True, kw_only=True, tag="nack"):
    """P -> D: registration refused. `message` says what differed and what to change."""

    reason: NackReason
    message: str = ""


class Abort(_TransferMessage, frozen=True, kw_only=True, tag="abort"):
    """D -> P: D's request is gone; free whatever is held for this transfer."""


class PushDone(_TransferMessage, frozen=True, kw_only=True, tag="push_done"):
    """P -> D: every block is written and P freed its own; D's KV is complete."""


class PullOffer(msgspec.Struct, frozen=True, kw_only=True):
    """P still holds the prompt's KV after a failed WRITE: D may READ it, like a pull.

    `request_id` is P's (D's READ notification names it), `block_ids` P's blocks, one
    list per KV-cache group; P keeps them `ttl_s` from when it sent this."""

    request_id: str
    block_ids: BlockIds
    ttl_s: float

    def __post_init__(self) -> None:
        _require_id(self.request_id, "request_id")
        _require(1 <= len(self.block_ids) <= MAX_KV_GROUPS,
                 f"block_ids must hold 1 to {MAX_KV_GROUPS} KV-cache groups, "
                 f"got {len(self.block_ids)}")
        _require_block_ids(self.block_ids)
        _require(math.isfinite(self.ttl_s) and self.ttl_s > 0,
                 f"ttl_s must be a finite number > 0, got {self.ttl_s}")


class PushFailed(_TransferMessage, frozen=True, kw_only=True, tag="push_failed"):
    """P -> D: P will not write this transfer. D reads P's blocks instead when P offers
    them (`pull`), and computes the prompt itself otherwise."""

    reason: FailReason
    message: str = ""
    pull: PullOffer | None = None


class Abandon(_TransferMessage, frozen=True, kw_only=True, tag="abandon"):
    """Router -> P: this push's D leg failed (D refused, crashed, or answered an error)
    and no D will claim the prompt: free its blocks now rather than after
    `unclaimed_ttl`. P honours it only while no D has registered the transfer; a
    registered transfer is ended by its registrant (Abort) or its WRITE. Not answered."""


class Ping(_Message, frozen=True, kw_only=True, tag="ping"):
    """D -> P: are you there? Sent while D waits on this P, with D's grant (the router's
    pings, and a D's with no token yet, carry none)."""

    grant: Grant | None = None


class Pong(_Message, frozen=True, kw_only=True, tag="pong"):
    """P -> D: yes (answered by P's side-channel thread, whatever its engine is doing),
    with a fresh lease token."""

    lease: LeaseToken | None = None


Message: TypeAlias = (
    RegisterBlocks | Ack | Nack | Abort | PushDone | PushFailed | Abandon | Ping | Pong
)

MESSAGE_TYPES: frozenset[str] = frozenset(
    str(cls.__struct_config__.tag) for cls in get_args(Message)
)


class _Header(msgspec.Struct):
    """What `decode` reads first: enough to refuse another version or an unknown type."""

    type: str
    version: int


# Set while this thread decodes: the decoder has checked what `__post_init__` would again.
_decoding = threading.local()
_ENCODER = msgspec.msgpack.Encoder()
_HEADER_DECODER = msgspec.msgpack.Decoder(_Header)
_DECODER: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    """Encode a message for the side channel: `decode(encode(m)) == m`."""
    return _ENCODER.encode(message)


def decode(data: bytes) -> Message:
    """Decode and validate one message; raise `ProtocolError` for anything else.

    Refused, in this order: bytes that are not a msgpack map with `type` and `version`,
    another protocol version, an unknown type, then missing, mistyped or invalid fields.
    """
    try:
        header = _HEADER_DECODER.decode(data)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed side-channel message: {exc}") from exc
    if header.version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version mismatch: received a {header.type!r} message of version "
            f"{header.version}, this side speaks version {PROTOCOL_VERSION}; run the same "
            "connector release on P and D"
        )
    if header.type not in MESSAGE_TYPES:
        raise ProtocolError(
            f"unknown message type {header.type!r}; known: {sorted(MESSAGE_TYPES)}"
        )
    _decoding.active = True
    try:
        return _DECODER.decode(data)
    except msgspec.DecodeError as exc:  # ValidationError included, from __post_init__ too
        raise ProtocolError(f"invalid {header.type!r} message: {exc}") from exc
    finally:
        _decoding.active = False
