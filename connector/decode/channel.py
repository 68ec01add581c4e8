"""D's side of the push side channel: one DEALER socket per P, and the thread that sends
D's registrations, aborts and pings and watches the answers and the deadlines.

Each DEALER's identity is D's engine id, so P's answers find their way back. D's engine
hands the thread typed events (`RegisterPush`, `AbortPush`, `ForgetPush`; see
`connector.shared.channel_thread`) and learns which pushes failed from `take_failures` (it then
reads P's blocks where P offers them, recomputes the other prompts, or frees the blocks
of an aborted request); a push that succeeds is known to D's workers from the WRITE's
own NIXL notification, and D's engine then calls `forget`.

With CURVE keys (`connector.shared.keys`), each DEALER is a CURVE client that checks P by P's
public key. The sockets are used only by the channel's thread, which closes them.

P servers come and go (pods, times their data-parallel ranks), so D's sockets are
bounded: an LRU of at most `max_peers`, where a socket with no push in flight is closed
once its P proved unreachable (its pushes failed for silence or no Ack), or after
`PEER_IDLE_S` unused, or when a new P needs its place. A P that cannot be reached is
retried with a growing interval (`RECONNECT_IVL_MS` up to `RECONNECT_IVL_MAX_MS`), not
every 100 ms for ever. A registration for which no socket can be had (every one busy, or
ZMQ refusing another) fails at once, and D computes that prompt itself. Each engine event
and each message is handled under the thread's guard (`connector.shared.channel_thread`).

The write lease (protocol 5, `connector.protocol.side_channel`; the why is in docs/ARCHITECTURE.md,
section 5). D keeps the latest lease token each P sent (on every Ack and Pong) and grants
with it: on each registration, and on each ping (every `ping_interval`, or a third of
P's lease when that is shorter), naming the registrations it sent before it had a token
once their Ack came, and withholding the pushes it gave up on. When D gives up on a push
without P's word (no Ack, the registration's deadline, P silent, or D's request ended),
it tells P (Abort) and frees the blocks only when P says nothing more will be written
(PushFailed, Nack, PushDone), or once P is surely done with them: P's lease and write
time after the arrival of the latest token D had, plus a margin (`_give_up`). A push no
grant named is freed at once: P cannot write it.
"""

from __future__ import annotations

import enum
import logging
import queue
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from connector.protocol.side_channel import (
    MAX_WITHHELD,
    Abort,
    Ack,
    EngineId,
    Grant,
    LeaseToken,
    Message,
    Nack,
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
from connector.shared.channel_thread import ChannelThread, describe, drain
from connector.shared.keys import ClientKeys

logger = logging.getLogger("vllm.pd_connector.channel")

# A socket to a P with no push in flight is closed after this long unused.
PEER_IDLE_S = 60.0
# ZMQ's reconnection to a P that is not there: the first retry after RECONNECT_IVL_MS,
# each next one twice as late, up to RECONNECT_IVL_MAX_MS.
RECONNECT_IVL_MS = 100
RECONNECT_IVL_MAX_MS = 5000
# When D gave up on a push without P's word, it frees the blocks once P is surely done
# with them: P's lease and write time past the arrival of the latest token D had, times
# 1 + CLOCK_RATE_SLACK (P's and D's clocks may tick at slightly different rates: NTP
# slews a clock by at most 0.05 %), plus RELEASE_MARGIN_S (the step from P's scheduler
# to its workers, and the last bytes of a WRITE that P cancelled at its deadline).
CLOCK_RATE_SLACK = 1e-3
RELEASE_MARGIN_S = 1.0


# --- the engine's events for D's channel thread ----------------------------------------


@dataclass(frozen=True, slots=True)
class RegisterPush:
    """Register D's blocks with the P whose push side channel is `peer` (tcp://host:port)."""

    peer: str
    registration: RegisterBlocks


@dataclass(frozen=True, slots=True)
class AbortPush:
    """D's request is gone (see `DecodeChannel.abort`)."""

    transfer_id: TransferId
    peer: str | None


@dataclass(frozen=True, slots=True)
class ForgetPush:
    """The push arrived."""

    transfer_id: TransferId


DecodeEvent = RegisterPush | AbortPush | ForgetPush


# --- what D's engine is told, and the thread's own records ---------------------------------


@dataclass(frozen=True, slots=True)
class PushFailure:
    """D's engine: the push for D's `request_id` will not arrive (`why`)."""

    request_id: str
    transfer_id: TransferId
    why: str
    pull: PullOffer | None = None  # P kept the blocks: READ them instead


class _Wait(enum.Enum):
    """What D waits for, for one push, until its `deadline`."""

    ACK = "ack"  # registered: P's Ack
    WRITE = "write"  # acknowledged: the WRITE (its notification reaches D's workers)
    RELEASE = "release"  # given up on: P's word that it will not write, or P surely done


@dataclass(slots=True)
class _Pending:
    """One push D waits for.

        ACK --(Ack)--> WRITE --(the push arrived: `forget`)--> gone
        ACK, WRITE --(Nack, PushFailed)--> gone, reported failed
        ACK, WRITE --(D gives up: no Ack, the deadline, P silent; or D's request ended)-->
            RELEASE, Abort sent, withheld from every grant; or gone at once, reported,
            when no grant ever named it (P cannot write into its blocks)
        RELEASE --(P's word: PushFailed, Nack, PushDone; or its deadline: P is surely
            done with the blocks)--> gone, reported"""

    registration: RegisterBlocks
    peer: str  # P's push side channel, tcp://host:port
    deadline: float  # what `wait` waits for must come by then
    wait: _Wait = _Wait.ACK
    granted: bool = False  # a grant naming it went to P: P may write into its blocks
    aborted: bool = False  # D's request is gone (not a give-up): P's offer is not taken
    why: str = ""  # RELEASE: what D reports at the end, unless P says more


@dataclass(slots=True)
class _Peer:
    socket: zmq.Socket[Any]
    last_heard: float
    last_used: float  # the last registration or abort for it: the LRU's order
    last_ping: float = 0.0
    transfers: set[TransferId] = field(default_factory=set)
    unreachable: bool = False  # pushes failed for its silence: closed once it has none
    token: LeaseToken | None = None  # the latest of P's lease tokens, for D's grants
    token_at: float = 0.0  # when it arrived
    withheld: set[TransferId] = field(default_factory=set)  # granted, then given up on


class _NoSocket(Exception):
    """No socket to that P could be had (the reason is the message)."""


class DecodeChannel(ChannelThread[DecodeEvent]):
    """D's side channel: a socket per P, the pushes D waits for, and their deadlines."""

    name = "pd-push-decode"

    def __init__(self, engine_id: EngineId, *, ack_timeout: float, ping_interval: float,
                 peer_timeout: float, registration_ttl: float, max_peers: int = 256,
                 curve: ClientKeys | None = None) -> None:
        """`curve`: connect to P's as a CURVE client with these keys (None: in the clear).
        `max_peers`: at most this many sockets to P servers at once."""
        super().__init__()
        self.engine_id = engine_id
        self._curve = curve
        self.ack_timeout = ack_timeout
        self.ping_interval = ping_interval
        self.peer_timeout = peer_timeout
        self.registration_ttl = registration_ttl
        self.max_peers = max_peers
        self._failures: queue.SimpleQueue[PushFailure] = queue.SimpleQueue()
        # Owned by the channel thread:
        self._pending: dict[TransferId, _Pending] = {}
        self._peers: OrderedDict[str, _Peer] = OrderedDict()  # least recently used first
        self._poller = zmq.Poller()
        # Written by the channel thread, read by the engine thread (has_pending_work, the
        # stats log).
        self.waiting = 0
        self.open_peers = 0  # sockets to P servers now
        self.peers_closed = 0  # sockets to P closed: idle, unreachable, or for room
        self.no_socket = 0  # registrations failed at once: no socket to their P

    # --- engine thread -----------------------------------------------------------------

    def register(self, peer: str, registration: RegisterBlocks) -> None:
        self._post(RegisterPush(peer, registration))

    def abort(self, transfer_id: TransferId, peer: str | None = None) -> None:
        """D's request is gone: tell P, and report the push failed (so D frees its
        blocks) once P says nothing more will be written, or P cannot be reached.

        With `peer`, for a transfer D never registered: only tell that P (so it frees
        what it holds at once), and wait for nothing."""
        self._post(AbortPush(transfer_id, peer))

    def forget(self, transfer_id: TransferId) -> None:
        """The push arrived (D's workers saw the WRITE's notification)."""
        self._post(ForgetPush(transfer_id))

    def take_failures(self) -> list[PushFailure]:
        return drain(self._failures)

    def has_pending_work(self) -> bool:
        return self._events_pending() or self.waiting > 0 or not self._failures.empty()

    # --- channel thread ----------------------------------------------------------------

    def _setup(self) -> None:
        self._poller.register(self._wakeup.read_fd, zmq.POLLIN)

    def _pass(self) -> None:
        ready = self._poll(self._poller, self._next_deadline())
        events: list[DecodeEvent] = []
        try:
            events = self._drain_events()
            for event in events:
                self._guarded(describe(event), self._on_engine_event, event)
            for address, peer in list(self._peers.items()):
                if peer.socket in ready:
                    self._read_peer(address, peer)
            now = time.monotonic()
            self._check_time(now)
            self._close_unused(now)
        finally:
            self.waiting = len(self._pending)
            self.open_peers = len(self._peers)
            self._mark_handled(len(events))

    def _teardown(self) -> None:
        for peer in self._peers.values():
            peer.socket.close()

    def _on_engine_event(self, event: DecodeEvent) -> None:
        now = time.monotonic()
        match event:
            case RegisterPush(address, registration):
                tid = registration.transfer_id
                waits = _Pending(registration, address, now + self.ack_timeout)
                try:
                    peer = self._peer(address, now)
                except _NoSocket as exc:
                    self.no_socket += 1
                    self._fail(waits, str(exc))  # P never saw it: nothing to wait for
                    return
                self._pending[tid] = waits
                peer.transfers.add(tid)
                grant = self._grant(peer)  # None before D has a token: named after its Ack
                waits.granted = grant is not None
                self._send(peer, msgspec.structs.replace(registration, grant=grant))
            case AbortPush(tid, address):
                pending = self._pending.get(tid)
                if pending is None and address is not None:
                    try:
                        self._send(self._peer(address, now), Abort(transfer_id=tid))
                    except _NoSocket as exc:
                        logger.info("push %s: could not tell P at %s that D will not take "
                                    "it (%s); P frees it at its deadline", tid, address, exc)
                    return
                if pending is None:
                    return
                # D keeps the blocks until P says nothing more will be written (a WRITE
                # in flight finishes first), or P is surely done with them: freeing them
                # under a running WRITE would corrupt another request's KV.
                pending.aborted = True
                if pending.wait is not _Wait.RELEASE:
                    self._give_up(pending, "D's request ended", now)
            case ForgetPush(tid):
                self._drop(tid)

    def _peer(self, address: str, now: float) -> _Peer:
        """The socket to P at `address`, made if need be (the least recently used idle
        one closed to make room). Raises _NoSocket when none can be had."""
        peer = self._peers.get(address)
        if peer is None:
            if len(self._peers) >= self.max_peers and not self._close_least_used():
                raise _NoSocket(f"D has pushes in flight with {len(self._peers)} P servers, "
                                f"its limit (max_peers)")
            try:
                sock = self._connect(address)
            except zmq.ZMQError as exc:
                raise _NoSocket(f"no socket to P at {address}: {exc}") from exc
            peer = _Peer(sock, last_heard=now, last_used=now)
            self._peers[address] = peer
        else:
            self._peers.move_to_end(address)
            if not peer.transfers:
                peer.last_heard = now  # idle until now: its silence so far means nothing
            peer.last_used = now
        return peer

    def _connect(self, address: str) -> zmq.Socket[Any]:
        sock = self._context.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, self.engine_id.encode())
            sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
            if self._curve is not None:
                sock.setsockopt(zmq.CURVE_SECRETKEY, self._curve.pair.secret)
                sock.setsockopt(zmq.CURVE_PUBLICKEY, self._curve.pair.public)
                sock.setsockopt(zmq.CURVE_SERVERKEY, self._curve.server_public)
            sock.connect(address)
            self._poller.register(sock, zmq.POLLIN)
        except BaseException:
            sock.close()
            raise
        return sock

    def _close_least_used(self) -> bool:
        """Close the least recently used socket with no push in flight; False if none."""
        for address, peer in self._peers.items():
            if not peer.transfers:
                self._close_peer(address, peer, "to make room for another P")
                return True
        return False

    def _close_unused(self, now: float) -> None:
        """Close the sockets with no push in flight whose P proved unreachable, or that
        were not used for PEER_IDLE_S."""
        for address, peer in list(self._peers.items()):
            if peer.transfers:
                continue
            if peer.unreachable:
                self._close_peer(address, peer, "its P was unreachable")
            elif now - peer.last_used >= PEER_IDLE_S:
                self._close_peer(address, peer, f"unused for {PEER_IDLE_S:g} s")

    def _close_peer(self, address: str, peer: _Peer, why: str) -> None:
        del self._peers[address]
        self._poller.unregister(peer.socket)
        peer.socket.close()
        self.peers_closed += 1
        logger.debug("push side channel: closed the socket to P at %s: %s", address, why)

    def _read_peer(self, address: str, peer: _Peer) -> None:
        while True:
            try:
                payload = peer.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            peer.last_heard = time.monotonic()
            peer.unreachable = False
            try:
                message = decode(payload)
            except ProtocolError as exc:
                logger.warning("push side channel: refused a message from %s: %s", address, exc)
                continue
            self._guarded(f"{describe(message)} from {address}", self._on_message, message,
                          peer)

    def _on_message(self, message: Message, peer: _Peer) -> None:
        if isinstance(message, (Ack, Pong)) and message.lease is not None:
            self._take_token(peer, message.lease)
        if not isinstance(message, (Ack, Nack, PushFailed, PushDone)):
            return  # a Pong (liveness: heard; a token), or nothing P sends
        pending = self._pending.get(message.transfer_id)
        if pending is None:
            return  # already over here (done, failed or timed out)
        if isinstance(message, Ack):
            if pending.wait is not _Wait.ACK:
                return  # late: D gave up on it meanwhile
            # From now on P is known to hold the registration: wait for the WRITE up to
            # the registration's own deadline; a dead P is caught sooner by its silence
            # (peer_timeout). One sent before D had a token is named in a grant now.
            pending.wait = _Wait.WRITE
            pending.deadline = time.monotonic() + min(
                self.registration_ttl, pending.registration.ttl_s)
            if not message.granted:  # sent before D had a token, or with an expired one
                pending.granted = False
                self._ping(peer, time.monotonic(), adds=[message.transfer_id])
        elif isinstance(message, Nack):
            self._fail(pending, f"P refused the registration: {message.reason.value}: "
                                f"{message.message}")
        elif isinstance(message, PushFailed):
            self._fail(pending, f"P will not write: {message.reason.value}"
                                f"{': ' + message.message if message.message else ''}",
                       pull=None if pending.aborted else message.pull)
        elif isinstance(message, PushDone) and pending.wait is _Wait.RELEASE:
            self._fail(pending, pending.why)  # written, so nothing more will be
        # A PushDone otherwise: D's workers learn it from the WRITE's notification, then
        # `forget`.

    def _take_token(self, peer: _Peer, token: LeaseToken) -> None:
        """Keep P's latest token (a newer one, or the first of a P that restarted)."""
        if peer.token is None or token.instance != peer.token.instance \
                or token.sent > peer.token.sent:
            peer.token, peer.token_at = token, time.monotonic()

    def _grant(self, peer: _Peer, adds: list[TransferId] | None = None) -> Grant | None:
        """D's grant for `peer`'s P, with its latest token: naming `adds`, and withholding
        what D gave up on. None without a token, or with too many to withhold to say (P's
        lease then lapses, and P lets go of every push of D's: D computes them)."""
        if peer.token is None:
            return None
        if len(peer.withheld) > MAX_WITHHELD:
            logger.warning("push side channel: %d pushes given up on at one P, more than a "
                           "grant can name; no grant sent", len(peer.withheld))
            return None
        return Grant(token=peer.token, adds=adds or [], withheld=sorted(peer.withheld))

    def _ping(self, peer: _Peer, now: float, adds: list[TransferId] | None = None) -> None:
        """Ping `peer`'s P, with D's grant (if it has one to give)."""
        peer.last_ping = now
        grant = self._grant(peer, adds)
        if grant is not None:
            for tid in grant.adds:
                self._pending[tid].granted = True
        self._send(peer, Ping(grant=grant))

    def _ping_every(self, peer: _Peer) -> float:
        """Often enough to keep P's lease: a third of it, at the most ping_interval."""
        if peer.token is None:
            return self.ping_interval
        return min(self.ping_interval, peer.token.lease_s / 3)

    def _give_up(self, pending: _Pending, why: str, now: float) -> None:
        """D stops waiting for the push (`why`): P is told (Abort), and the blocks are
        freed once P says it will not write, or is surely done with them (RELEASE). At
        once if no grant ever named it: P cannot write into its blocks."""
        peer = self._peers[pending.peer]
        tid = pending.registration.transfer_id
        self._send(peer, Abort(transfer_id=tid))
        if not pending.granted:
            self._fail(pending, why)
            return
        assert peer.token is not None  # a grant needs one
        terms = peer.token.lease_s + peer.token.write_s
        pending.wait, pending.why = _Wait.RELEASE, why
        pending.deadline = peer.token_at + terms * (1 + CLOCK_RATE_SLACK) + RELEASE_MARGIN_S
        peer.withheld.add(tid)
        if pending.deadline <= now:
            self._fail(pending, why)
            return
        reg = pending.registration
        logger.info("push %s for request %s: %s; D frees its blocks when P says it will not "
                    "write, or in %.1f s, when P is surely done with them", tid,
                    reg.request_id, why, pending.deadline - now)

    def _check_time(self, now: float) -> None:
        for pending in [p for p in self._pending.values() if now >= p.deadline]:
            if pending.wait is _Wait.RELEASE:
                self._fail(pending, pending.why)  # P is surely done with the blocks
            elif pending.wait is _Wait.ACK:
                self._peers[pending.peer].unreachable = True
                self._give_up(pending, "P did not acknowledge the registration within "
                                       f"{self.ack_timeout:g} s", now)
            else:
                self._give_up(pending, "the push did not arrive before the registration's "
                                       "deadline", now)
        for address, peer in self._peers.items():
            if not peer.transfers:
                continue
            if now - peer.last_heard >= self.peer_timeout:
                peer.unreachable = True
                why = f"P at {address} silent for {now - peer.last_heard:.1f} s"
                for tid in list(peer.transfers):
                    waiting = self._pending.get(tid)
                    if waiting is not None and waiting.wait is not _Wait.RELEASE:
                        self._give_up(waiting, why, now)
            if peer.transfers and now - peer.last_ping >= self._ping_every(peer):
                self._ping(peer, now)

    def _next_deadline(self) -> float | None:
        deadlines = [p.deadline for p in self._pending.values()]
        deadlines.extend(peer.last_ping + self._ping_every(peer)
                         for peer in self._peers.values() if peer.transfers)
        return min(deadlines, default=None)

    def _fail(self, pending: _Pending, why: str, pull: PullOffer | None = None) -> None:
        """Report the push failed (released, for D's own abort): D frees or reuses its
        blocks now."""
        reg = pending.registration
        self._failures.put(PushFailure(reg.request_id, reg.transfer_id, why, pull))
        self._drop(reg.transfer_id)
        log = logger.info if pending.aborted else logger.warning
        log("push %s for request %s %s: %s%s", reg.transfer_id, reg.request_id,
            "released" if pending.aborted else "failed", why,
            "; P offers its blocks to read instead" if pull is not None else "")

    def _drop(self, tid: TransferId) -> None:
        pending = self._pending.pop(tid, None)
        if pending is not None:
            peer = self._peers.get(pending.peer)
            if peer is not None:
                peer.transfers.discard(tid)
                peer.withheld.discard(tid)

    def _send(self, peer: _Peer, message: Message) -> None:
        try:
            peer.socket.send(encode(message), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.warning("push side channel: could not send %s: %s",
                           type(message).__name__, exc)
