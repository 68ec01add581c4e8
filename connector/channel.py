"""The push side channel: ZMQ between D's scheduler and P's scheduler, one thread each.

P runs a `PrefillChannel`: a ROUTER socket on its push port and a thread that owns P's
`PushRegistry`. D's registrations, aborts and pings arrive on the socket; P's engine
reports finished prefills and WRITE results through `PrefillChannel`'s methods (a queue
and a wake-up pipe, never a lock). What the engine must do next, start a WRITE or free a
prefill's blocks, comes back from `take_actions`, which the engine calls every step.

D runs a `DecodeChannel`: one DEALER socket per P (identity: D's engine id, so P's
answers find their way back) and a thread that sends registrations, aborts and pings and
watches the answers and the deadlines. D's engine learns which pushes failed from
`take_failures` (it then reads P's blocks where P offers them, recomputes the other
prompts, or frees the blocks of an aborted request); a push that succeeds is known to
D's workers from the WRITE's own NIXL notification, and D's engine then calls `forget`.

With CURVE keys (`connector.keys`), P's ROUTER is a CURVE server that admits only the
peers whose public keys it holds (ZMQ's ZAP handshake, answered by pyzmq's authenticator
thread); a refused handshake is counted (`refused_handshakes`) and nothing of that peer
reaches the registry. D's DEALERs are CURVE clients. Each message's sender (`PeerId`) is
its CURVE public key, else its routing identity: the registry lets only a transfer's
registrant abort it. Without keys, anyone who reaches the push port is trusted, and P
logs so once at start.

ZMQ sockets are used only by the channel's thread. Every wait is bounded: the thread
wakes at the earliest deadline it holds, or at least every `_MAX_SLEEP_S`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from connector.early import EarlyOutbox
from connector.keys import ClientKeys, ServerKeys
from connector.messages import (
    Abandon,
    Abort,
    Ack,
    EngineId,
    FailReason,
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
from connector.registry import (
    BlockIds,
    Ignored,
    PeerId,
    PushRegistry,
    Ready,
    Rejected,
    Release,
    RequestId,
    TransferState,
    Waiting,
)

logger = logging.getLogger("vllm.pd_connector.channel")

_MAX_SLEEP_S = 1.0
_JOIN_TIMEOUT_S = 5.0
# A refused peer retries its handshake every 100 ms: log the first refusal, then at most
# this often (the count is in `push stats:`).
_REFUSAL_LOG_INTERVAL_S = 60.0
# Handshake failures: a peer without a key (mechanism mismatch), with an unknown key
# (the authenticator said no), or speaking garbage.
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
# A registration's frame, beyond its block ids (ids, host names and request ids included):
# frames longer than this plus 10 bytes per P block end their connection unread.
_FRAME_ALLOWANCE = 1 << 20


def _drain(q: queue.SimpleQueue[Any]) -> list[Any]:
    """Everything in `q` now, without waiting."""
    items = []
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items


class _Wakeup:
    """A pipe any thread may write a byte to, to wake the channel thread's poll."""

    def __init__(self) -> None:
        self.read_fd, self._write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self._write_fd, False)

    def set(self) -> None:
        try:
            os.write(self._write_fd, b"x")
        except BlockingIOError:
            pass  # the pipe is full: a wake-up is already pending

    def clear(self) -> None:
        try:
            while os.read(self.read_fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        os.close(self.read_fd)
        os.close(self._write_fd)


class _ChannelThread:
    """Start/stop of one owned thread that polls its sockets and the wake-up pipe."""

    name = "pd-push-channel"

    def __init__(self) -> None:
        self._wakeup = _Wakeup()
        self._events: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._context = zmq.Context()
        # Events posted (by the engine thread) and handled (by the channel thread): each
        # counter has one writer, so unequal counts safely mean "work not yet seen".
        self._posted = 0
        self._handled = 0
        self._caught_up = threading.Condition()  # notified when events were handled

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run_logged, name=self.name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and close everything; safe to call twice, or without start."""
        if self._stopped:
            return
        self._stopped = True
        self._stop.set()
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(_JOIN_TIMEOUT_S)
            if self._thread.is_alive():
                logger.warning("%s thread did not stop within %.0f s", self.name, _JOIN_TIMEOUT_S)
            self._thread = None
        self._close_sockets()  # the thread closed its own; these were never handed to one
        self._context.term()
        self._wakeup.close()

    def _close_sockets(self) -> None:
        """Close the sockets made before the thread started (if it never did)."""

    def _post(self, *event: Any) -> None:
        """From any thread: hand the channel thread an event and wake it."""
        self._posted += 1
        self._events.put(event)
        self._wakeup.set()

    def _events_pending(self) -> bool:
        return self._posted != self._handled

    def wait_caught_up(self, timeout: float) -> None:
        """Engine thread: give the channel thread up to `timeout` seconds to handle what
        was posted, so that an action it causes (a WRITE) is taken this step, not the
        next one (a whole forward pass later)."""
        if self._events_pending():
            with self._caught_up:
                self._caught_up.wait_for(lambda: not self._events_pending(), timeout)

    def _mark_handled(self, count: int) -> None:
        if count:
            with self._caught_up:
                self._handled += count
                self._caught_up.notify_all()

    def _run_logged(self) -> None:
        try:
            self._run()
        except Exception:
            logger.exception("%s thread died; pushes through this server now fail", self.name)

    def _run(self) -> None:
        raise NotImplementedError

    def _poll(self, poller: zmq.Poller, deadline: float | None) -> dict[Any, int]:
        sleep = _MAX_SLEEP_S if deadline is None else deadline - time.monotonic()
        timeout_ms = int(max(0.0, min(_MAX_SLEEP_S, sleep)) * 1000)
        ready = dict(poller.poll(timeout_ms))
        if self._wakeup.read_fd in ready:
            self._wakeup.clear()
        return ready

    def _drain_events(self) -> list[tuple[Any, ...]]:
        return _drain(self._events)


# --- P -------------------------------------------------------------------------------------


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
    fail_on_purpose: bool = False  # fault injection (`fail_write`): fail, do not WRITE


@dataclass(frozen=True, slots=True)
class FreeBlocks:
    """P's engine: free the blocks P's `request_id` holds; no WRITE will read them."""

    transfer_id: TransferId
    request_id: RequestId
    why: str


PrefillAction = StartWrite | FreeBlocks


class _AllowedKeys:
    """The authenticator's question, on its own thread: may this CURVE public key (Z85)
    connect? Frozen set lookups only, so no lock is needed."""

    def __init__(self, allowed: frozenset[bytes]) -> None:
        self._allowed = allowed

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self._allowed


class PrefillChannel(_ChannelThread):
    """P's side channel: the ROUTER socket, the registry, and the engine's two queues."""

    name = "pd-push-prefill"

    def __init__(self, registry: PushRegistry, bind_host: str, port: int, *,
                 early_to: tuple[str, int] | None = None,
                 curve: ServerKeys | None = None) -> None:
        """`early_to`: the engine id and data-parallel index of P's one worker, to send
        early WRITEs to (None: no early WRITEs). `curve`: admit only peers with these
        keys (None: anyone, with a warning)."""
        super().__init__()
        self.registry = registry
        self._early: EarlyOutbox | None = None
        self._auth: ThreadAuthenticator | None = None
        self._monitor: zmq.Socket[Any] | None = None
        self.authenticated = curve is not None
        self.address = f"tcp://{bind_host}:{port}"
        self._actions: queue.SimpleQueue[PrefillAction] = queue.SimpleQueue()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        # A reply to a D whose connection is gone fails instead of vanishing: P then
        # knows that blocks it kept for that D's READ can go at once.
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if registry.config.num_blocks is not None:
            self._socket.setsockopt(
                zmq.MAXMSGSIZE, _FRAME_ALLOWANCE + 10 * registry.config.num_blocks)
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
                self._early = EarlyOutbox(self._context, *early_to, port)
            except (OSError, zmq.ZMQError) as exc:
                logger.warning("no socket for early WRITEs (%s): pushes are written at the "
                               "step after their prompt's", exc)
        # Prefills whose last step runs now: that step's number, for an early WRITE.
        self._completing: dict[TransferId, int] = {}
        # Transfers whose WRITE is to fail on purpose (fault injection), until it starts.
        self._fail_on_purpose: set[TransferId] = set()
        # Written by the channel thread, read by the engine thread (has_pending_work, the
        # stats log).
        self.live_transfers = 0
        self.counters = registry.counters()
        self.refused_handshakes = 0  # peers refused by CURVE (no key, or an unknown one)
        self.unidentified = 0  # messages dropped: authenticated, yet no key on them
        self._refusal_logged_at: float | None = None

    # --- engine thread -----------------------------------------------------------------

    def prefill_finished(self, transfer_id: TransferId, request_id: RequestId,
                         block_ids: BlockIds, *, fail_on_purpose: bool = False) -> None:
        self._post("finished", transfer_id, request_id, block_ids, fail_on_purpose)

    def prefill_completing(self, transfer_id: TransferId, request_id: RequestId,
                           block_ids: BlockIds, step: int, *,
                           fail_on_purpose: bool = False) -> None:
        """Engine step `step`, being built, completes this push's prompt. If D has
        registered, or registers before the prefill is finished, its StartWrite
        (`early_step`) goes straight to P's worker, which WRITEs right after the step's
        forward pass."""
        self._post("completing", transfer_id, request_id, block_ids, step, fail_on_purpose)

    def prefill_aborted(self, transfer_id: TransferId) -> None:
        self._post("aborted", transfer_id)

    def write_ended(self, transfer_id: TransferId, error: str | None, *,
                    pull_ttl: float | None = None) -> None:
        """The WRITE is over on every rank. `pull_ttl`: it failed, and P's workers keep
        the blocks that long for D to READ instead (offered to D, or freed at once when
        D no longer wants them)."""
        self._post("written", transfer_id, error, pull_ttl)

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
        return _drain(self._actions)

    def has_pending_work(self) -> bool:
        """True while a transfer is alive or an event is unhandled: P's engine must keep
        stepping, or it would sleep through the action that ends the transfer."""
        return self._events_pending() or self.live_transfers > 0 or not self._actions.empty()

    # --- channel thread ----------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._wakeup.read_fd, zmq.POLLIN)
        if self._monitor is not None:
            poller.register(self._monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = self._poll(poller, self.registry.next_deadline())
                if self._monitor is not None and self._monitor in ready:
                    self._read_monitor(self._monitor)
                if self._socket in ready:
                    self._read_socket()
                events = self._drain_events()
                for event in events:
                    self._on_engine_event(*event)
                for release in self.registry.expire(time.monotonic()):
                    self._released(release)
                self.live_transfers = len(self.registry)
                self.counters = self.registry.counters()  # a copy, for the stats log
                self._mark_handled(len(events))  # after live_transfers: see has_pending_work
        finally:
            self._close_owned()

    def _read_monitor(self, monitor: zmq.Socket[Any]) -> None:
        """Count the peers CURVE refused (their messages never reach us), and say so in
        the log: at once the first time, then at most every _REFUSAL_LOG_INTERVAL_S."""
        while monitor.poll(0):
            event = recv_monitor_message(monitor, zmq.NOBLOCK)
            if not event["event"] & _HANDSHAKE_FAILED:
                continue
            self.refused_handshakes += 1
            now = time.monotonic()
            last = self._refusal_logged_at
            if last is None or now - last >= _REFUSAL_LOG_INTERVAL_S:
                self._refusal_logged_at = now
                logger.warning("push side channel: refused a peer without an allowed CURVE "
                               "key (%d refusals so far)", self.refused_handshakes)

    def _read_socket(self) -> None:
        while True:
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) != 2:
                continue  # not [identity, payload]: not one of ours
            identity, payload = frames[0].bytes, frames[1]
            peer = self._peer_of(identity, payload)
            if peer is None:
                continue
            try:
                message = decode(payload.bytes)
            except ProtocolError as exc:
                logger.warning("push side channel: refused a message from %r: %s",
                               identity, exc)
                continue
            self._on_message(identity, message, peer)

    def _peer_of(self, identity: bytes, payload: zmq.Frame) -> PeerId | None:
        """Who sent `payload`: its CURVE public key (Z85, as the authenticator named the
        user), else its routing identity. None: authenticated, but no key on it (drop)."""
        if not self.authenticated:
            return identity
        try:
            user = payload.get("User-Id")
        except zmq.ZMQError:
            user = None
        if not isinstance(user, str) or not user:
            self.unidentified += 1
            return None
        return user.encode()

    def _on_message(self, identity: bytes, message: Message, peer: PeerId) -> None:
        now = time.monotonic()
        if isinstance(message, Ping):
            self._send(identity, Pong())
        elif isinstance(message, RegisterBlocks):
            self._on_outcome(self.registry.register(message, now=now, peer=peer),
                             registration=message)
        elif isinstance(message, Abort):
            tid = message.transfer_id
            outcome = self.registry.abort(tid, now=now, peer=peer)
            if isinstance(outcome, Ignored):
                logger.debug("push %s: abort ignored: %s", tid, outcome.why)
                return
            if outcome is not None:
                self._released(outcome)
            elif self.registry.state_of(tid) is None:
                # Nothing here (yet) for this transfer: nothing will be written into D's
                # blocks, so D may free them now.
                self._send(identity, PushFailed(transfer_id=tid, reason=FailReason.ABORTED))
            logger.info("push %s: D aborted", tid)
        elif isinstance(message, Abandon):
            tid = message.transfer_id
            outcome = self.registry.abandon(tid, now=now)
            if isinstance(outcome, Ignored):
                logger.debug("push %s: abandon ignored: %s", tid, outcome.why)
                return
            if outcome is not None:
                self._released(outcome)
            logger.info("push %s: abandoned by the router (its D leg failed)", tid)
        else:
            logger.warning("push side channel: unexpected %s from %r",
                           type(message).__name__, identity)

    def _on_engine_event(self, kind: str, transfer_id: TransferId, *args: Any) -> None:
        now = time.monotonic()
        if kind == "finished":
            request_id, block_ids, fail_on_purpose = args
            self._completing.pop(transfer_id, None)
            if fail_on_purpose:
                self._fail_on_purpose.add(transfer_id)
            outcome = self.registry.prefill_finished(
                transfer_id, block_ids, request_id=request_id, now=now)
            self._on_outcome(outcome, registration=None)
        elif kind == "completing":
            request_id, block_ids, step, fail_on_purpose = args
            self._completing[transfer_id] = step  # until the prefill is finished
            if fail_on_purpose:
                self._fail_on_purpose.add(transfer_id)
            ready = self.registry.prefill_completing(transfer_id, block_ids,
                                                     request_id=request_id)
            if ready is not None:
                self._on_outcome(ready, registration=None)
        elif kind == "aborted":
            self._completing.pop(transfer_id, None)
            self._fail_on_purpose.discard(transfer_id)
            release = self.registry.prefill_aborted(transfer_id, now=now)
            if release is not None:
                self._released(release)
        elif kind == "written":
            error, pull_ttl = args
            if self.registry.state_of(transfer_id) is not TransferState.WRITING:
                return  # gone already (cannot happen: a WRITING transfer has no deadline)
            if error is None:
                self._released(self.registry.write_done(transfer_id), freed_by_engine=True)
                return
            release = self.registry.write_failed(transfer_id, FailReason.WRITE_ERROR)
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

    def _on_outcome(self, outcome: Any, registration: RegisterBlocks | None) -> None:
        """Act on what the registry said about a registration or a finished prefill."""
        if registration is not None and isinstance(outcome, (Waiting, Ready)):
            config = self.registry.config
            self._send(registration.engine_id.encode(), Ack(
                transfer_id=registration.transfer_id, engine_id=config.engine_id,
                block_size=config.block_size, tp_size=config.tp_size))
        if isinstance(outcome, Ready):
            self.registry.write_started(outcome.transfer_id)
            tid = outcome.transfer_id
            write = StartWrite(tid, outcome.request_id, outcome.block_ids, outcome.registration,
                               fail_on_purpose=tid in self._fail_on_purpose)
            self._fail_on_purpose.discard(tid)
            if outcome.early:
                self._start_early(write)
            else:
                self._actions.put(write)
            logger.debug("push %s: matched, WRITE requested%s", outcome.transfer_id,
                         " right after the prompt's last forward pass" if outcome.early else "")
        elif isinstance(outcome, Rejected):
            # A peer over its limit may be flooding: the stats line counts those.
            level = logging.DEBUG if outcome.reason is NackReason.OVER_LIMIT \
                else logging.WARNING
            logger.log(level, "push %s refused: %s", outcome.transfer_id, outcome.message)
            if registration is not None:
                self._send(registration.engine_id.encode(), Nack(
                    transfer_id=outcome.transfer_id, reason=outcome.reason,
                    message=outcome.message))
            if outcome.request_id is not None:
                self._actions.put(FreeBlocks(outcome.transfer_id, outcome.request_id,
                                             outcome.reason.value))
            if self.registry.state_of(outcome.transfer_id) is None:
                self._fail_on_purpose.discard(outcome.transfer_id)
        elif isinstance(outcome, Release):
            self._released(outcome)

    def _start_early(self, write: StartWrite) -> None:
        """Send P's worker a WRITE to start right after the forward pass of the step that
        completes the prompt. Should that fail, the engine starts it with a later step,
        once that forward pass is done (`early_step` says which)."""
        write = dataclasses.replace(write, early_step=self._completing.pop(write.transfer_id))
        if self._early is None or not self._early.send(write):
            logger.warning("push %s: could not hand the WRITE to P's worker at once; it "
                           "starts with the next step", write.transfer_id)
            self._actions.put(write)

    def _released(self, release: Release, *, freed_by_engine: bool = False,
                  message: str = "", pull: PullOffer | None = None) -> None:
        """A transfer ended: free P's blocks (unless the engine's WRITE path did, or
        keeps them for D's READ: `pull`) and tell D, if D registered."""
        self._fail_on_purpose.discard(release.transfer_id)
        if release.request_id is not None and release.block_ids is not None \
                and not freed_by_engine:
            self._actions.put(FreeBlocks(release.transfer_id, release.request_id,
                                         release.state.value))
        if release.notify is not None:
            to = release.notify.engine_id.encode()
            if release.state is TransferState.DONE:
                self._send(to, PushDone(transfer_id=release.transfer_id))
            else:
                reason = release.reason or FailReason.WRITE_ERROR
                delivered = self._send(to, PushFailed(
                    transfer_id=release.transfer_id, reason=reason, message=message, pull=pull))
                if pull is not None and not delivered:  # D is gone: nobody will READ
                    self._actions.put(FreeBlocks(release.transfer_id, pull.request_id,
                                                 "decode_gone"))
        level = logging.DEBUG if release.state is TransferState.DONE else logging.INFO
        logger.log(level, "push %s ended: %s%s", release.transfer_id, release.state.value,
                   f" ({release.reason.value})" if release.reason else "")

    def _send(self, identity: bytes, message: Message) -> bool:
        """Send to D `identity`; False when it could not go (D not connected)."""
        try:
            self._socket.send_multipart([identity, encode(message)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.warning("push side channel: could not send %s to %r: %s",
                           type(message).__name__, identity, exc)
            return False
        return True


# --- D -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PushFailure:
    """D's engine: the push for D's `request_id` will not arrive (`why`)."""

    request_id: str
    transfer_id: TransferId
    why: str
    pull: PullOffer | None = None  # P kept the blocks: READ them instead


@dataclass(slots=True)
class _Pending:
    """One push D waits for."""

    registration: RegisterBlocks
    peer: str  # P's push side channel, tcp://host:port
    deadline: float  # no Ack by then (or no answer to our Abort): give up
    acked: bool = False
    aborting: bool = False


@dataclass(slots=True)
class _Peer:
    socket: zmq.Socket[Any]
    last_heard: float
    last_ping: float = 0.0
    transfers: set[TransferId] = field(default_factory=set)


class DecodeChannel(_ChannelThread):
    """D's side channel: a socket per P, the pushes D waits for, and their deadlines."""

    name = "pd-push-decode"

    def __init__(self, engine_id: EngineId, *, ack_timeout: float, ping_interval: float,
                 peer_timeout: float, registration_ttl: float,
                 curve: ClientKeys | None = None) -> None:
        """`curve`: connect to P's as a CURVE client with these keys (None: in the clear)."""
        super().__init__()
        self.engine_id = engine_id
        self._curve = curve
        self.ack_timeout = ack_timeout
        self.ping_interval = ping_interval
        self.peer_timeout = peer_timeout
        self.registration_ttl = registration_ttl
        self._failures: queue.SimpleQueue[PushFailure] = queue.SimpleQueue()
        # Owned by the channel thread:
        self._pending: dict[TransferId, _Pending] = {}
        self._peers: dict[str, _Peer] = {}
        self._poller = zmq.Poller()
        # Written by the channel thread, read by the engine thread (has_pending_work).
        self.waiting = 0

    # --- engine thread -----------------------------------------------------------------

    def register(self, peer: str, registration: RegisterBlocks) -> None:
        self._post("register", peer, registration)

    def abort(self, transfer_id: TransferId, peer: str | None = None) -> None:
        """D's request is gone: tell P, and report the push failed (so D frees its
        blocks) once P says nothing more will be written, or P cannot be reached.

        With `peer`, for a transfer D never registered: only tell that P (so it frees
        what it holds at once), and wait for nothing."""
        self._post("abort", transfer_id, peer)

    def forget(self, transfer_id: TransferId) -> None:
        """The push arrived (D's workers saw the WRITE's notification)."""
        self._post("forget", transfer_id)

    def take_failures(self) -> list[PushFailure]:
        return _drain(self._failures)

    def has_pending_work(self) -> bool:
        return self._events_pending() or self.waiting > 0 or not self._failures.empty()

    # --- channel thread ----------------------------------------------------------------

    def _run(self) -> None:
        self._poller.register(self._wakeup.read_fd, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = self._poll(self._poller, self._next_deadline())
                events = self._drain_events()
                for event in events:
                    self._on_engine_event(*event)
                for address, peer in list(self._peers.items()):
                    if peer.socket in ready:
                        self._read_peer(address, peer)
                self._check_time(time.monotonic())
                self.waiting = len(self._pending)
                self._mark_handled(len(events))
        finally:
            for peer in self._peers.values():
                peer.socket.close()

    def _on_engine_event(self, kind: str, *args: Any) -> None:
        now = time.monotonic()
        if kind == "register":
            address, registration = args
            peer = self._peer(address, now)
            tid = registration.transfer_id
            self._pending[tid] = _Pending(registration, address, now + self.ack_timeout)
            peer.transfers.add(tid)
            self._send(peer, registration)
        elif kind == "abort":
            tid, address = args
            pending = self._pending.get(tid)
            if pending is None and address is not None:
                self._send(self._peer(address, now), Abort(transfer_id=tid))
                return
            if pending is None or pending.aborting:
                return
            # P answers once nothing more will be written (a WRITE in flight finishes
            # first). Until then D keeps its blocks: freeing them under a running WRITE
            # would corrupt another request's KV. A dead P is caught by peer_timeout; the
            # deadline stays the registration's (or the Ack's, if none came).
            pending.aborting = True
            self._send(self._peers[pending.peer], Abort(transfer_id=tid))
        elif kind == "forget":
            (tid,) = args
            self._drop(tid)

    def _peer(self, address: str, now: float) -> _Peer:
        peer = self._peers.get(address)
        if peer is None:
            sock = self._context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, self.engine_id.encode())
            if self._curve is not None:
                sock.setsockopt(zmq.CURVE_SECRETKEY, self._curve.pair.secret)
                sock.setsockopt(zmq.CURVE_PUBLICKEY, self._curve.pair.public)
                sock.setsockopt(zmq.CURVE_SERVERKEY, self._curve.server_public)
            sock.connect(address)
            self._poller.register(sock, zmq.POLLIN)
            peer = _Peer(sock, last_heard=now)
            self._peers[address] = peer
        elif not peer.transfers:
            peer.last_heard = now  # idle until now: its silence so far means nothing
        return peer

    def _read_peer(self, address: str, peer: _Peer) -> None:
        while True:
            try:
                payload = peer.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            peer.last_heard = time.monotonic()
            try:
                message = decode(payload)
            except ProtocolError as exc:
                logger.warning("push side channel: refused a message from %s: %s", address, exc)
                continue
            self._on_message(message)

    def _on_message(self, message: Message) -> None:
        if isinstance(message, Pong):
            return
        tid = getattr(message, "transfer_id", None)
        pending = self._pending.get(tid) if tid is not None else None
        if pending is None:
            return  # already over here (done, failed or timed out)
        if isinstance(message, Ack):
            # From now on P is known to hold the registration: wait for its answer (the
            # WRITE, or the reply to an abort) up to the registration's own deadline; a
            # dead P is caught sooner by its silence (peer_timeout).
            pending.acked = True
            pending.deadline = time.monotonic() + min(
                self.registration_ttl, pending.registration.ttl_s)
        elif isinstance(message, Nack):
            self._fail(pending, f"P refused the registration: {message.reason.value}: "
                                f"{message.message}")
        elif isinstance(message, PushFailed):
            self._fail(pending, f"P will not write: {message.reason.value}"
                                f"{': ' + message.message if message.message else ''}",
                       pull=None if pending.aborting else message.pull)
        elif isinstance(message, PushDone) and not pending.aborting:
            pass  # D's workers learn it from the WRITE's notification, then `forget`

    def _check_time(self, now: float) -> None:
        for pending in [p for p in self._pending.values() if now >= p.deadline]:
            if pending.aborting:
                why = "P did not answer the abort in time"
            elif not pending.acked:
                why = f"P did not acknowledge the registration within {self.ack_timeout:g} s"
            else:
                why = "the push did not arrive before the registration's deadline"
            self._fail(pending, why)
        for address, peer in self._peers.items():
            if not peer.transfers:
                continue
            if now - peer.last_heard >= self.peer_timeout:
                for tid in list(peer.transfers):
                    self._fail(self._pending[tid],
                               f"P at {address} silent for {now - peer.last_heard:.1f} s")
            elif now - peer.last_ping >= self.ping_interval:
                peer.last_ping = now
                self._send(peer, Ping())

    def _next_deadline(self) -> float | None:
        deadlines = [p.deadline for p in self._pending.values()]
        deadlines.extend(peer.last_ping + self.ping_interval
                         for peer in self._peers.values() if peer.transfers)
        return min(deadlines, default=None)

    def _fail(self, pending: _Pending, why: str, pull: PullOffer | None = None) -> None:
        reg = pending.registration
        self._failures.put(PushFailure(reg.request_id, reg.transfer_id, why, pull))
        self._drop(reg.transfer_id)
        log = logger.info if pending.aborting else logger.warning
        log("push %s for request %s %s: %s%s", reg.transfer_id, reg.request_id,
            "released" if pending.aborting else "failed", why,
            "; P offers its blocks to read instead" if pull is not None else "")

    def _drop(self, tid: TransferId) -> None:
        pending = self._pending.pop(tid, None)
        if pending is not None:
            self._peers[pending.peer].transfers.discard(tid)

    def _send(self, peer: _Peer, message: Message) -> None:
        try:
            peer.socket.send(encode(message), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.warning("push side channel: could not send %s: %s",
                           type(message).__name__, exc)


__all__ = [
    "DecodeChannel",
    "FreeBlocks",
    "PrefillAction",
    "PrefillChannel",
    "PushFailure",
    "StartWrite",
]
