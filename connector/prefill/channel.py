"""P's side of the push side channel: a ROUTER socket on P's push port, and the thread
that owns P's `PushRegistry`.

D's registrations, aborts and pings (and the router's abandons) arrive on the socket;
P's engine reports finished prefills and WRITE results through `PrefillChannel`'s
methods, each a typed event (`PrefillFinished`, `PrefillCompleting`, `PrefillAborted`,
`WriteEnded`) on the thread's queue (see `connector.shared.channel_thread`), never a lock.
What the engine must do next, start a WRITE or free a prefill's blocks, comes back from
`take_actions` (`StartWrite`, `FreeBlocks`), which the engine calls every step; an early
WRITE goes straight to P's worker instead (`connector.prefill.early`).

With CURVE keys (`connector.shared.keys`), the ROUTER is a CURVE server that admits only the
peers whose public keys it holds (ZMQ's ZAP handshake, answered by pyzmq's authenticator
thread); a refused handshake is counted (`refused_handshakes`) and nothing of that peer
reaches the registry. Each message's sender (`PeerId`) is its CURVE public key, else its
routing identity: the registry lets only a transfer's registrant abort it. Without keys,
anyone who reaches the push port is trusted, and P logs so once at start.

The ROUTER socket is used only by the channel's thread (and closed by `stop` if that
thread never ran). Each wake-up of that thread reads at most a batch of messages
(`_BATCH_MESSAGES`, `_BATCH_BYTES`), then handles the engine's events and the registry's
deadlines, and only then goes back to the socket: a peer that floods the push port slows
its own messages, not the engine's (a WRITE still starts, a prefill still expires).
Handling messages (decoding, checking, answering) takes at most a share of the thread's
time (`_HANDLING_SHARE`), and so of the GIL and the core it shares with P's engine; past
it, the messages of peers P does not know (none of whose registrations it accepted
lately) are read and dropped unhandled (`shed`), at a few microseconds each, while known
peers (the D servers at work) are still served. Reading on is what bounds P's memory: a
message left unread stays in ZMQ, also once its connection is gone. What ZMQ holds is
bounded per connection: at most `_RECEIVE_HWM` messages, none longer than P's layout
allows (`max_frame_bytes`; a longer frame ends its connection in ZMQ, unread).
Messages that are not ours are counted (`bad_messages`) and logged at most
`LOG_BURST` times a minute, as are refused registrations. Each message and engine event
is handled under the thread's guard (see `connector.shared.channel_thread`): one that raises is
counted and logged, and the thread goes on.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import math
import queue
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from connector.prefill.early import EarlyOutbox
from connector.prefill.registry import (
    BlockIds,
    Ignored,
    Outcome,
    PeerId,
    PushRegistry,
    Ready,
    Rejected,
    Release,
    RequestId,
    TransferState,
    Waiting,
)
from connector.protocol.side_channel import (
    MAX_KV_GROUPS,
    MAX_TRANSFER_ID_CHARS,
    MAX_WITHHELD,
    Abandon,
    Abort,
    Ack,
    FailReason,
    Grant,
    LeaseToken,
    Message,
    Nack,
    NackReason,
    Ping,
    Pong,
    ProtocolError,
    PullOffer,
    PushDone,
    PushFailed,
    RegisterBlocks,
    TransferId,
    decode,
    encode,
)
from connector.shared.channel_thread import LOG_BURST, ChannelThread, LogLimit, describe, drain
from connector.shared.keys import ServerKeys

logger = logging.getLogger("vllm.pd_connector.channel")

# A refused peer retries its handshake every 100 ms: log the first refusal, then at most
# this often (the count is in `push stats:`).
_REFUSAL_LOG_INTERVAL_S = 60.0
# One wake-up of the channel thread reads at most this many messages, or this many bytes
# (the message that passes it included), off each socket, then handles the engine's events
# and the deadlines. Enough that a burst of honest registrations is read in a pass or two;
# few enough that a flood of them, or of garbage, delays a WRITE or an expiry by a batch's
# work (well under a millisecond a message, a few for the largest), not by the flood's.
_BATCH_MESSAGES = 128
_BATCH_BYTES = 4 << 20
# Handling messages may take this share of the channel thread's time, in bursts of up to
# _HANDLING_BURST_S; past it, messages of peers not known are shed (read, dropped). Not
# reading instead would not do: a connection's unread messages stay in ZMQ after it
# closes, so a flooder that takes a new connection every 1000 messages (the drill's)
# piles them up. Measured with the drill's flooder sending pings, aborts and garbage
# only: letting the socket rest (not read) three quarters of the time grew P by 690 MiB
# in 8 s and left a backlog that delayed pushes by 3 s after the flood; handling every
# message kept P's memory flat but slowed pushes 2.3x.
_HANDLING_SHARE = 0.25
_HANDLING_BURST_S = 0.05
# Peers whose messages are handled even past the share: the last this many whose
# registrations P accepted (the D servers at work), most recently heard from last.
_KNOWN_PEERS = 4096
# Past the share, a peer not known still has its first this many messages handled (a
# new D's first registration, which makes it known), remembered for the last
# _STRANGERS peers: a flooder's new connection gets as much, and pays a connection for it.
_STRANGER_MESSAGES = 2
_STRANGERS = 65536
# Handshake failures: a peer without a key (mechanism mismatch), with an unknown key
# (the authenticator said no), or speaking garbage.
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
# What a frame of ours holds beyond its block ids and its grant's transfer ids: field
# names, numbers, D's engine id, request id and host name (each well under a KiB).
_FRAME_ALLOWANCE = 16 << 10
# Messages each peer connection may queue on P's ROUTER before ZMQ stops reading that
# connection (ZMQ's default is 1000). Measured with scripts/drill_flood's flooder, which
# takes a new connection every 1000 messages, against a reader slower than the flood: a
# connection that closes keeps what it queued until P reads it, so at 1000 per
# connection P grew by 3 GiB in 8 s; at 64, by 0.25 GiB. D sends a few messages per push,
# and what P's queue cannot take waits in D's.
_RECEIVE_HWM = 64


def max_frame_bytes(num_blocks: int, num_groups: int) -> int:
    """The longest frame a peer may send a P with `num_blocks` KV cache blocks in
    `num_groups` groups: a registration of every block, with a grant of the most
    transfer ids it may name. Longer frames end their connection in ZMQ, unread (a
    degenerate registration costs P no decoding: scripts/drill_flood's 50,000-block
    registrations took a third of P's channel thread)."""
    ids = 5 * (num_blocks + num_groups)  # a msgpack int up to 2**32 and a group's header
    grant = 2 * MAX_WITHHELD * (MAX_TRANSFER_ID_CHARS + 2)  # adds and withheld
    return _FRAME_ALLOWANCE + ids + grant


# --- what P's engine is told to do --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StartWrite:
    """P's engine: WRITE `block_ids` (P's, held by P's `request_id`) into D's blocks."""

    transfer_id: TransferId
    request_id: RequestId
    block_ids: BlockIds
    registration: RegisterBlocks
    # Matched while engine step `early_step`, the one whose forward pass completes the
    # prompt, was built or ran: WRITE right after that forward pass, not before it.
    # None: matched after the prefill.
    early_step: int | None = None
    # The ranks (P's workers) that start this WRITE; None: all. An early WRITE that
    # reached some ranks at once comes to the others with the next step.
    ranks: tuple[int, ...] | None = None
    # A chunk of the prompt (`PrefillProgress`), written during or right after step
    # `early_step` without a notification; the push's final WRITE skips it.
    chunk: bool = False
    fail_on_purpose: bool = False  # fault injection (`fail_write`): fail, do not WRITE
    # P's monotonic clock (this host's): no part of the WRITE is posted after it, and
    # what is still in flight then is cancelled (the write lease; `Ready.write_by`).
    write_by: float = math.inf


@dataclass(frozen=True, slots=True)
class FreeBlocks:
    """P's engine: free the blocks P's `request_id` holds; no WRITE will read them."""

    transfer_id: TransferId
    request_id: RequestId
    why: str


PrefillAction = StartWrite | FreeBlocks


# --- the engine's events for P's channel thread ----------------------------------------


@dataclass(frozen=True, slots=True)
class PrefillFinished:
    """P's push prefill finished: its blocks are the registry's now."""

    transfer_id: TransferId
    request_id: RequestId
    block_ids: BlockIds
    fail_on_purpose: bool


@dataclass(frozen=True, slots=True)
class PrefillCompleting:
    """Engine step `step`, being built, completes this push's prompt."""

    transfer_id: TransferId
    request_id: RequestId
    block_ids: BlockIds
    step: int
    fail_on_purpose: bool


@dataclass(frozen=True, slots=True)
class PrefillProgress:
    """Engine step `step`, being built, computes a chunk of this push's prompt (not its
    last): after it, P's first `block_ids` hold the prompt's KV."""

    transfer_id: TransferId
    request_id: RequestId
    block_ids: BlockIds
    prompt_blocks: int
    step: int


@dataclass(frozen=True, slots=True)
class PrefillAborted:
    """P's push request ended before its prefill finished."""

    transfer_id: TransferId


@dataclass(frozen=True, slots=True)
class WriteEnded:
    """The WRITE is over on every rank: `error` None when it succeeded; `pull_ttl`, when
    it failed and P's workers keep the blocks that long for D to READ."""

    transfer_id: TransferId
    error: str | None
    pull_ttl: float | None


def _start_write(ready: Ready) -> StartWrite:
    """The engine's order for the registry's `ready` (a push's WRITE, or a chunk's)."""
    return StartWrite(ready.transfer_id, ready.request_id, ready.block_ids,
                      ready.registration, early_step=ready.early_step, chunk=ready.chunk,
                      fail_on_purpose=ready.fail_on_purpose, write_by=ready.write_by)


PrefillEvent = (PrefillFinished | PrefillCompleting | PrefillProgress | PrefillAborted
                | WriteEnded)


class _AllowedKeys:
    """The authenticator's question, on its own thread: may this CURVE public key (Z85)
    connect? Frozen set lookups only, so no lock is needed."""

    def __init__(self, allowed: frozenset[bytes]) -> None:
        self._allowed = allowed

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self._allowed


class PrefillChannel(ChannelThread[PrefillEvent]):
    """P's side channel: the ROUTER socket, the registry, and the engine's two queues."""

    name = "pd-push-prefill"

    def __init__(self, registry: PushRegistry, bind_host: str, port: int, *,
                 early_to: tuple[str, int, int] | None = None,
                 curve: ServerKeys | None = None) -> None:
        """`early_to`: the engine id, data-parallel index and number of ranks (workers)
        of P's workers, to send early WRITEs to (None: no early WRITEs). `curve`: admit
        only peers with these keys (None: anyone, with a warning)."""
        super().__init__()
        self.registry = registry
        # Names this channel's lease tokens: a token of another P, or of this one's
        # former life, grants nothing.
        self._instance = secrets.randbits(62)
        self._early: EarlyOutbox | None = None
        self._auth: ThreadAuthenticator | None = None
        self._monitor: zmq.Socket[Any] | None = None
        self.authenticated = curve is not None
        self.address = f"tcp://{bind_host}:{port}"
        self._actions: queue.SimpleQueue[PrefillAction] = queue.SimpleQueue()
        # Ends D hears of later (`Release.notify_after`): (when, order, release, message,
        # pull offer), the channel thread's.
        self._deferred: list[tuple[float, int, Release, str, PullOffer | None]] = []
        self._deferred_order = itertools.count()
        self._deferred_ids: set[TransferId] = set()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        # A reply to a D whose connection is gone fails instead of vanishing: P then
        # knows that blocks it kept for that D's READ can go at once.
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A D that closed its socket to P (P was slow to answer) connects again with the
        # same identity, its engine's. Without handover the ROUTER refuses the new
        # connection while it has not yet seen the old one go, and what D sent on it is
        # lost: on a loaded machine a registration went unacknowledged that way.
        self._socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._socket.setsockopt(zmq.RCVHWM, _RECEIVE_HWM)
        if registry.config.num_blocks is not None:
            self._socket.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes(
                registry.config.num_blocks, registry.config.num_groups or MAX_KV_GROUPS))
        if curve is not None:
            # The authenticator answers ZMQ's handshake requests (ZAP) on its own thread,
            # in this channel's context; it must run before the first peer connects.
            self._auth = ThreadAuthenticator(self._context, log=logger)
            self._auth.start()
            self._auth.configure_curve_callback("*", _AllowedKeys(curve.allowed))
            self._socket.setsockopt(zmq.CURVE_SERVER, 1)
            self._socket.setsockopt(zmq.CURVE_SECRETKEY, curve.pair.secret)
            self._socket.setsockopt(zmq.CURVE_PUBLICKEY, curve.pair.public)
            self._monitor = self._socket.get_monitor_socket(_HANDSHAKE_FAILED)
        try:
            self._socket.bind(self.address)
        except zmq.ZMQError as exc:
            self.stop()
            raise OSError(
                f"cannot listen for push registrations on {self.address}: {exc}; choose "
                "another kv_connector_extra_config.push_port"
            ) from exc
        if curve is None:
            logger.warning(
                "push side channel on %s is not authenticated: any process that reaches "
                "this port can register transfers (have P write KV to an agent of its "
                "choosing) and abort them; set curve_secret_key_file, curve_allowed_keys "
                "and curve_server_key_file in kv_connector_extra_config", self.address)
        if early_to is not None:
            try:
                engine_id, dp_index, ranks = early_to
                self._early = EarlyOutbox(self._context, engine_id, dp_index, port, ranks)
            except (OSError, zmq.ZMQError) as exc:
                logger.warning("no socket for early WRITEs (%s): pushes are written at the "
                               "step after their prompt's", exc)
        # Written by the channel thread, read by the engine thread (has_pending_work, the
        # stats log).
        self.live_transfers = 0
        self.counters = registry.counters()
        self.refused_handshakes = 0  # peers refused by CURVE (no key, or an unknown one)
        self.unidentified = 0  # messages dropped: authenticated, yet no key on them
        self.bad_messages = 0  # messages dropped: not [identity, payload], or undecodable
        self.received = 0  # messages read off the socket, whatever they held
        self.unsent = 0  # answers that could not go (no such peer connected)
        self._refusal_log = LogLimit(1, _REFUSAL_LOG_INTERVAL_S)
        self._bad_message_log = LogLimit(LOG_BURST, _REFUSAL_LOG_INTERVAL_S)
        self._refused_registration_log = LogLimit(LOG_BURST, _REFUSAL_LOG_INTERVAL_S)
        self._unsent_log = LogLimit(LOG_BURST, _REFUSAL_LOG_INTERVAL_S)
        self._poller = zmq.Poller()
        # Seconds of handling left (see _HANDLING_SHARE), as of `_budget_at` (monotonic).
        self._budget, self._budget_at = _HANDLING_BURST_S, time.monotonic()
        self._known: OrderedDict[PeerId, None] = OrderedDict()  # see _KNOWN_PEERS
        self._strangers: OrderedDict[PeerId, int] = OrderedDict()  # see _STRANGERS
        self.shed = 0  # messages of peers not known, dropped unhandled past the share

    # --- engine thread -----------------------------------------------------------------

    def prefill_finished(self, transfer_id: TransferId, request_id: RequestId,
                         block_ids: BlockIds, *, fail_on_purpose: bool = False) -> None:
        self._post(PrefillFinished(transfer_id, request_id, block_ids, fail_on_purpose))

    def prefill_completing(self, transfer_id: TransferId, request_id: RequestId,
                           block_ids: BlockIds, step: int, *,
                           fail_on_purpose: bool = False) -> None:
        """Engine step `step`, being built, completes this push's prompt. If D has
        registered, or registers before the prefill is finished, its StartWrite
        (`early_step`) goes straight to P's worker, which WRITEs right after the step's
        forward pass."""
        self._post(PrefillCompleting(transfer_id, request_id, block_ids, step,
                                     fail_on_purpose))

    def prefill_progress(self, transfer_id: TransferId, request_id: RequestId,
                         block_ids: BlockIds, prompt_blocks: int, step: int) -> None:
        """Engine step `step`, being built, computes a chunk of this push's prompt (not
        its last), after which P's first `block_ids` hold its KV. If D has registered
        and granted, those blocks' WRITE (`StartWrite.chunk`) goes straight to P's
        workers, which write them layer by layer during that step's forward pass; if not
        yet, D's grant sends it when it comes (the workers drop it if the step is over)."""
        self._post(PrefillProgress(transfer_id, request_id, block_ids, prompt_blocks, step))

    def prefill_aborted(self, transfer_id: TransferId) -> None:
        self._post(PrefillAborted(transfer_id))

    def write_ended(self, transfer_id: TransferId, error: str | None, *,
                    pull_ttl: float | None = None) -> None:
        """The WRITE is over on every rank. `pull_ttl`: it failed, and P's workers keep
        the blocks that long for D to READ instead (offered to D, or freed at once when
        D no longer wants them)."""
        self._post(WriteEnded(transfer_id, error, pull_ttl))

    def _close_sockets(self) -> None:
        self._close_owned()  # each a no-op when the thread already closed it
        if self._auth is not None:
            self._auth.stop()  # its socket too must be closed before the context ends
            self._auth = None

    def _close_owned(self) -> None:
        if self._monitor is not None and not self._monitor.closed:
            if not self._socket.closed:
                self._socket.disable_monitor()
            self._monitor.close()
        self._socket.close()
        if self._early is not None:
            self._early.close()

    def take_actions(self) -> list[PrefillAction]:
        return drain(self._actions)

    def has_pending_work(self) -> bool:
        """True while a transfer is alive or an event is unhandled: P's engine must keep
        stepping, or it would sleep through the action that ends the transfer."""
        return self._events_pending() or self.live_transfers > 0 or not self._actions.empty()

    # --- channel thread ----------------------------------------------------------------

    def _setup(self) -> None:
        self._poller.register(self._socket, zmq.POLLIN)
        self._poller.register(self._wakeup.read_fd, zmq.POLLIN)
        if self._monitor is not None:
            self._poller.register(self._monitor, zmq.POLLIN)

    def _pass(self) -> None:
        deadline = self.registry.next_deadline()
        if self._deferred:
            first = self._deferred[0][0]
            deadline = first if deadline is None else min(deadline, first)
        self._wake(self._poll(self._poller, deadline))

    def _teardown(self) -> None:
        self._close_owned()

    def _wake(self, ready: dict[Any, int]) -> None:
        """One pass of the thread, for the sockets `ready` says are readable: a batch from
        each, then every engine event, then the deadlines. Whatever a batch left on a
        socket keeps it readable, so the next poll returns at once for the next pass."""
        events: list[PrefillEvent] = []
        try:
            if self._monitor is not None and self._monitor in ready:
                self._read_monitor(self._monitor)
            if self._socket in ready:
                self._read_socket()
            events = self._drain_events()
            for event in events:
                self._guarded(describe(event), self._on_engine_event, event)
            for release in self.registry.expire(time.monotonic()):
                self._guarded(f"the end of transfer {release.transfer_id}", self._released,
                              release)
            now = time.monotonic()
            while self._deferred and self._deferred[0][0] <= now:
                _, _, release, message, pull = heapq.heappop(self._deferred)
                self._deferred_ids.discard(release.transfer_id)
                self._guarded(f"telling D of the end of transfer {release.transfer_id}",
                              self._notify, release, message, pull)
        finally:
            self.live_transfers = len(self.registry)
            self.counters = self.registry.counters()  # a copy, for the stats log
            self._mark_handled(len(events))  # after live_transfers: see has_pending_work

    def _read_monitor(self, monitor: zmq.Socket[Any]) -> None:
        """Count the peers CURVE refused (their messages never reach us), and say so in
        the log: at once the first time, then at most every _REFUSAL_LOG_INTERVAL_S.
        At most a batch of events: handshakes are a peer's to flood too."""
        for _ in range(_BATCH_MESSAGES):
            if not monitor.poll(0):
                return
            event = recv_monitor_message(monitor, zmq.NOBLOCK)
            if not event["event"] & _HANDSHAKE_FAILED:
                continue
            self.refused_handshakes += 1
            if self._refusal_log.allow(time.monotonic()):  # the count says what it left out
                logger.warning("push side channel: refused a peer without an allowed CURVE "
                               "key (%d refusals so far)", self.refused_handshakes)

    def _read_socket(self) -> None:
        """Read at most a batch (_BATCH_MESSAGES, _BATCH_BYTES) of messages, and handle
        them within the share (_HANDLING_SHARE), or past it those of known peers."""
        now = time.monotonic()
        self._budget = min(_HANDLING_BURST_S,
                           self._budget + (now - self._budget_at) * _HANDLING_SHARE)
        self._budget_at = now
        size = 0
        for _ in range(_BATCH_MESSAGES):
            if size >= _BATCH_BYTES:
                return
            try:
                frames, user = self._receive()
            except zmq.Again:
                return
            self.received += 1
            size += sum(len(frame) for frame in frames)
            if len(frames) != 2:  # not [identity, payload]: not one of ours
                self._bad_message(frames[0], f"{len(frames) - 1} frames, not one")
                continue
            identity, payload = frames
            peer = self._peer_of(identity, user)
            if peer is None:
                continue
            if peer in self._known:
                self._known.move_to_end(peer)
            elif self._budget <= 0 and not self._stranger_allowed(peer):
                self.shed += 1
                continue
            started = time.perf_counter()
            try:
                message = decode(payload)
            except ProtocolError as exc:
                self._bad_message(identity, str(exc))
            else:
                self._guarded(f"{describe(message)} from {identity!r}", self._on_message,
                              identity, message, peer)
            self._budget -= time.perf_counter() - started

    def _stranger_allowed(self, peer: PeerId) -> bool:
        """Past the share: whether a peer not known may have one more message handled
        (its first _STRANGER_MESSAGES are)."""
        handled = self._strangers.get(peer, 0)
        if handled >= _STRANGER_MESSAGES:
            return False
        self._strangers[peer] = handled + 1
        if len(self._strangers) > _STRANGERS:
            self._strangers.popitem(last=False)
        return True

    def _know(self, peer: PeerId) -> None:
        """P accepted a registration of `peer`'s: handle its messages past the share."""
        self._known[peer] = None
        self._known.move_to_end(peer)
        if len(self._known) > _KNOWN_PEERS:
            self._known.popitem(last=False)

    def _bad_message(self, identity: bytes, why: str) -> None:
        """Count a message that is not ours, and log it (at most LOG_BURST a minute)."""
        self.bad_messages += 1
        if self._bad_message_log.allow(time.monotonic()):
            logger.warning("push side channel: refused a message from %r: %s%s", identity,
                           why, self._bad_message_log.suffix())

    def _receive(self) -> tuple[list[bytes], object]:
        """One message's frames, and with CURVE the user the authenticator named (its
        last frame's User-Id). Without CURVE, as bytes at once: ZMQ's frame objects cost
        more than a short message's copy (4.3 against 2.9 us a message, which counts
        when P reads a flood on to shed it). Raises zmq.Again when none is waiting."""
        if not self.authenticated:
            return self._socket.recv_multipart(zmq.NOBLOCK), None
        parts = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
        try:
            user = parts[-1].get("User-Id")
        except zmq.ZMQError:
            user = None
        return [part.bytes for part in parts], user

    def _peer_of(self, identity: bytes, user: object) -> PeerId | None:
        """Who sent a message: its CURVE public key (Z85, as the authenticator named the
        `user`), else its routing identity. None: authenticated, but no key on it (drop)."""
        if not self.authenticated:
            return identity
        if not isinstance(user, str) or not user:
            self.unidentified += 1
            return None
        return user.encode()

    def _on_message(self, identity: bytes, message: Message, peer: PeerId) -> None:
        now = time.monotonic()
        if isinstance(message, Ping):
            if message.grant is not None:
                for started in self._grant(identity, message.grant, peer, now):
                    self._on_outcome(started, registration=None)
            self._send(identity, Pong(lease=self._lease_token()))
        elif isinstance(message, RegisterBlocks):
            if message.grant is not None:
                self._withhold(identity, message.grant, peer, now)
            registered = self.registry.register(message, now=now, peer=peer)
            if isinstance(registered, (Waiting, Ready)):
                self._know(peer)
            granted = [] if message.grant is None else self._grant(
                identity, message.grant, peer, now, withheld_done=True,
                adds=(message.transfer_id,))
            self._on_outcome(registered, registration=message)  # its Ack says if granted
            for started in granted:
                self._on_outcome(started, registration=None)
        elif isinstance(message, Abort):
            self._abort(identity, message.transfer_id, peer, now)
        elif isinstance(message, Abandon):
            tid = message.transfer_id
            outcome = self.registry.abandon(tid, now=now)
            if isinstance(outcome, Ignored):
                logger.debug("push %s: abandon ignored: %s", tid, outcome.why)
                return
            # Logged only when it freed something: an abandon of an id P does not know
            # (yet) leaves a tombstone, which anyone can ask for (a flood does).
            if outcome is not None:
                self._released(outcome)
                logger.info("push %s: abandoned by the router (its D leg failed)", tid)
            else:
                logger.debug("push %s: abandoned by the router before its prefill ended", tid)
        else:
            logger.warning("push side channel: unexpected %s from %r",
                           type(message).__name__, identity)

    def _abort(self, identity: bytes, tid: TransferId, peer: PeerId, now: float, *,
               again: bool = False) -> None:
        """D gave up on `tid` (an Abort; `again`: a grant's `withheld`, said with every
        grant until P answers): end it, or once its WRITE ends, and tell D."""
        outcome = self.registry.abort(tid, now=now, peer=peer)
        if isinstance(outcome, Ignored):
            logger.debug("push %s: abort ignored: %s", tid, outcome.why)
            return
        known = True
        if outcome is not None:
            self._released(outcome)
        elif self.registry.state_of(tid) is None and tid not in self._deferred_ids:
            # Nothing here (yet) for this transfer: nothing will be written into D's
            # blocks, so D may free them now. (One whose end D hears of later, after its
            # chunk WRITEs, is answered then.)
            self._send(identity, PushFailed(transfer_id=tid, reason=FailReason.ABORTED))
            known = False  # at most a tombstone: not worth a line each (a flood's are not)
        logger.log(logging.INFO if known and not again else logging.DEBUG,
                   "push %s: D aborted", tid)

    def _withhold(self, identity: bytes, grant: Grant, peer: PeerId, now: float) -> None:
        """The transfers D's grant does not cover: aborted before the grant is taken."""
        for tid in grant.withheld:
            self._abort(identity, tid, peer, now, again=True)

    def _grant(self, identity: bytes, grant: Grant, peer: PeerId, now: float, *,
               withheld_done: bool = False,
               adds: tuple[TransferId, ...] = ()) -> list[Ready | Release]:
        """D's grant: its `withheld` transfers aborted first (unless done already), then,
        if its token is this channel's own and not from the future, its lease taken, with
        the transfers it names (its `adds`, and `adds`: a registration's own). What it
        starts or ends, for `_on_outcome`."""
        if not withheld_done:
            self._withhold(identity, grant, peer, now)
        token = grant.token
        if token.instance != self._instance or token.sent > now:
            logger.debug("push side channel: a grant from %r with a token that is not this "
                         "P's; ignored", identity)
            return []
        return self.registry.grant(peer, sent=token.sent, now=now, adds=(*adds, *grant.adds))

    def _lease_token(self) -> LeaseToken:
        """For an Ack or a Pong: D grants with the latest it has."""
        config = self.registry.config
        return LeaseToken(instance=self._instance, sent=time.monotonic(),
                          lease_s=config.lease_s, write_s=config.write_s)

    def _on_engine_event(self, event: PrefillEvent) -> None:
        now = time.monotonic()
        match event:
            case PrefillFinished(tid, request_id, block_ids, fail_on_purpose):
                outcome = self.registry.prefill_finished(
                    tid, block_ids, request_id=request_id, now=now,
                    fail_on_purpose=fail_on_purpose)
                self._on_outcome(outcome, registration=None)
            case PrefillCompleting(tid, request_id, block_ids, step, fail_on_purpose):
                ready = self.registry.prefill_completing(
                    tid, block_ids, request_id=request_id, step=step, now=now,
                    fail_on_purpose=fail_on_purpose)
                if ready is not None:
                    self._on_outcome(ready, registration=None)
            case PrefillProgress(tid, request_id, block_ids, prompt_blocks, step):
                chunk = self.registry.prefill_progress(
                    tid, block_ids, request_id=request_id, prompt_blocks=prompt_blocks,
                    step=step, now=now)
                if chunk is not None:
                    self._start_chunk(chunk)
            case PrefillAborted(tid):
                release = self.registry.prefill_aborted(tid, now=now)
                if release is not None:
                    self._released(release)
            case WriteEnded(tid, error, pull_ttl):
                self._write_ended(tid, error, pull_ttl)

    def _write_ended(self, tid: TransferId, error: str | None, pull_ttl: float | None) -> None:
        if self.registry.state_of(tid) is not TransferState.WRITING:
            return  # gone already (cannot happen: a WRITING transfer has no deadline)
        if error is None:
            self._released(self.registry.write_done(tid), freed_by_engine=True)
            return
        release = self.registry.write_failed(tid, FailReason.WRITE_ERROR)
        if release is None:
            return
        offer = None
        if pull_ttl is not None and release.state is TransferState.FAILED \
                and release.request_id is not None and release.block_ids is not None:
            offer = PullOffer(request_id=release.request_id, block_ids=release.block_ids,
                              ttl_s=pull_ttl)
        # Blocks kept for a READ that D will not do (it aborted) are freed at once.
        self._released(release, freed_by_engine=pull_ttl is None or offer is not None,
                       message=error, pull=offer)

    def _on_outcome(self, outcome: Outcome, registration: RegisterBlocks | None) -> None:
        """Act on what the registry said about a registration or a finished prefill."""
        if registration is not None and isinstance(outcome, (Waiting, Ready)):
            config = self.registry.config
            self._send(registration.engine_id.encode(), Ack(
                transfer_id=registration.transfer_id, engine_id=config.engine_id,
                block_size=config.block_size, tp_size=config.tp_size,
                lease=self._lease_token(),
                granted=self.registry.granted(registration.transfer_id)))
        if isinstance(outcome, Ready) and outcome.chunk:
            self._start_chunk(outcome)  # a grant's: the prompt's chunks computed so far
        elif isinstance(outcome, Ready):
            self.registry.write_started(outcome.transfer_id)
            write = _start_write(outcome)
            if write.early_step is not None:
                self._start_early(write)
            else:
                self._actions.put(write)
            logger.debug("push %s: matched, WRITE requested%s", outcome.transfer_id,
                         "" if write.early_step is None
                         else " right after the prompt's last forward pass")
        elif isinstance(outcome, Rejected):
            # A peer over its limit may be flooding: the stats line counts those. Other
            # refusals are logged, but no more than a peer's flood of them would earn.
            if outcome.reason is NackReason.OVER_LIMIT:
                logger.debug("push %s refused: %s", outcome.transfer_id, outcome.message)
            elif self._refused_registration_log.allow(time.monotonic()):
                logger.warning("push %s refused: %s%s", outcome.transfer_id, outcome.message,
                               self._refused_registration_log.suffix())
            if registration is not None:
                self._send(registration.engine_id.encode(), Nack(
                    transfer_id=outcome.transfer_id, reason=outcome.reason,
                    message=outcome.message))
            if outcome.request_id is not None:
                self._actions.put(FreeBlocks(outcome.transfer_id, outcome.request_id,
                                             outcome.reason.value))
        elif isinstance(outcome, Release):
            self._released(outcome)

    def early_connected(self, timeout: float = 0.0) -> bool:
        """Whether P's worker's early-WRITE inbox is connected (`EarlyOutbox.connected`),
        waiting up to `timeout` seconds; False when this P makes no early WRITEs."""
        return self._early is not None and self._early.connected(timeout)

    def _start_chunk(self, chunk: Ready) -> None:
        """Send P's workers a chunk's WRITE (best effort: a rank it cannot reach writes
        those blocks with the push's final WRITE instead)."""
        early = self._early
        missed = None if early is None else early.send(_start_write(chunk))
        if missed is None or missed:
            logger.debug("push %s: a chunk's WRITE did not reach P's worker%s; the final "
                         "WRITE carries its blocks", chunk.transfer_id,
                         "" if missed is None else f" ranks {missed}")

    def _start_early(self, write: StartWrite) -> None:
        """Send P's workers a WRITE to start right after the forward pass of the step that
        completes the prompt. The ranks it could not reach start it with a later step,
        once that forward pass is done (`early_step` says which)."""
        early = self._early
        missed = None if early is None else early.send(write)
        if early is None or missed is None or len(missed) == early.ranks:  # none took it
            logger.warning("push %s: could not hand the WRITE to P's worker at once; it "
                           "starts with the next step", write.transfer_id)
            self._actions.put(write)
        elif missed:
            logger.warning("push %s: could not hand the WRITE to P's workers of ranks %s at "
                           "once; they start it with the next step", write.transfer_id,
                           missed)
            self._actions.put(dataclasses.replace(write, ranks=tuple(missed)))

    def _released(self, release: Release, *, freed_by_engine: bool = False,
                  message: str = "", pull: PullOffer | None = None) -> None:
        """A transfer ended: free P's blocks (unless the engine's WRITE path did, or
        keeps them for D's READ: `pull`) and tell D, if D registered."""
        if release.request_id is not None and release.block_ids is not None \
                and not freed_by_engine:
            self._actions.put(FreeBlocks(release.transfer_id, release.request_id,
                                         release.state.value))
        if release.notify is not None and release.notify_after is not None \
                and release.notify_after > time.monotonic():
            # Chunk WRITEs into D's blocks may still be in flight: D frees them on P's
            # word, so that word waits until none can be.
            heapq.heappush(self._deferred, (release.notify_after, next(self._deferred_order),
                                            release, message, pull))
            self._deferred_ids.add(release.transfer_id)
        elif release.notify is not None:
            self._notify(release, message, pull)
        level = logging.DEBUG if release.state is TransferState.DONE else logging.INFO
        logger.log(level, "push %s ended: %s%s", release.transfer_id, release.state.value,
                   f" ({release.reason.value})" if release.reason else "")

    def _notify(self, release: Release, message: str = "", pull: PullOffer | None = None,
                ) -> None:
        """Tell the D that registered `release`'s transfer how it ended."""
        assert release.notify is not None
        to = release.notify.engine_id.encode()
        if release.state is TransferState.DONE:
            self._send(to, PushDone(transfer_id=release.transfer_id))
            return
        reason = release.reason or FailReason.WRITE_ERROR
        delivered = self._send(to, PushFailed(
            transfer_id=release.transfer_id, reason=reason, message=message, pull=pull))
        if pull is not None and not delivered:  # D is gone: nobody will READ
            self._actions.put(FreeBlocks(release.transfer_id, pull.request_id, "decode_gone"))

    def _send(self, identity: bytes, message: Message) -> bool:
        """Send to D `identity`; False when it could not go (D not connected)."""
        try:
            self._socket.send_multipart([identity, encode(message)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            # Counted, and logged at most LOG_BURST times a minute: a flood's registrations
            # name engine ids nobody connected as, and its aborts come from connections
            # gone by the time P answers (a warning for each took a tenth of P's channel
            # thread under scripts/drill_flood).
            self.unsent += 1
            if self._unsent_log.allow(time.monotonic()):
                logger.warning("push side channel: could not send %s to %r: %s%s",
                               type(message).__name__, identity, exc,
                               self._unsent_log.suffix())
            return False
        return True
