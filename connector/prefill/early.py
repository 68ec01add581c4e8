"""P's channel thread hands an early WRITE straight to P's worker.

An early WRITE starts right after the forward pass that completes a push's prompt (see
`DualConfig.early_write`). D's registration for it may arrive while that forward pass
runs, after the step's metadata left the scheduler, so the match cannot travel with the
metadata. The channel thread, which makes the match, sends it to the worker directly:
a ZMQ PUSH socket (`EarlyOutbox`, bound by the channel thread) to the worker's PULL
socket (`EarlyInbox`, read by the worker's engine thread, without waiting, once the
forward pass is done and at the start of each step). Both ends live on this host: an IPC
socket named after the engine, its push port and the worker's rank (see
`connector.shared.ipc.ipc_address`), which no other server on the host can share, in a
directory only this user can enter.

Every rank (tensor-parallel worker) must WRITE its share of a push, so the outbox has one
socket per rank and sends each early WRITE to all of them; a rank it could not reach
gets the WRITE with the next step instead (`send` says which ranks). Servers with
pipeline stages make no early WRITEs (`DualConfig.writes_early`).

The payload is the channel's `StartWrite`, msgpack-encoded.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import zmq

from connector.shared.ipc import ipc_address, prepare_ipc_dir, remove_at_exit

logger = logging.getLogger("vllm.pd_connector.early")


def early_address(engine_id: str, dp_index: int, push_port: int, rank: int = 0) -> str:
    return ipc_address("pd-early", f"{engine_id}@{push_port}.{rank}", dp_index)


class EarlyOutbox:
    """P's channel thread: send early WRITEs to every rank's worker. Used by that thread
    only (but `connected`, see there)."""

    def __init__(self, context: zmq.Context[Any], engine_id: str, dp_index: int,
                 push_port: int, ranks: int = 1) -> None:
        self._ranks: list[_RankOutbox] = []
        try:
            for rank in range(ranks):
                self._ranks.append(_RankOutbox(context, early_address(
                    engine_id, dp_index, push_port, rank)))
        except (OSError, zmq.ZMQError):
            self.close()
            raise

    @property
    def ranks(self) -> int:
        return len(self._ranks)

    @property
    def addresses(self) -> list[str]:
        return [outbox.address for outbox in self._ranks]

    def connected(self, timeout: float = 0.0) -> bool:
        """Whether every rank's inbox is connected, waiting up to `timeout` seconds for
        each (`_RankOutbox.connected`)."""
        return all([outbox.connected(timeout) for outbox in self._ranks])

    def send(self, message: Any) -> list[int]:
        """Send `message` to every rank: the ranks it could not go to (none connected, or
        a full queue)."""
        payload = msgspec.msgpack.encode(message)
        return [rank for rank, outbox in enumerate(self._ranks) if not outbox.send(payload)]

    def close(self) -> None:
        for outbox in self._ranks:
            outbox.close()


class _RankOutbox:
    """One rank's socket of the outbox."""

    def __init__(self, context: zmq.Context[Any], address: str) -> None:
        self.address = address
        self._socket = context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 0)
        # What `connected` reads: attached before the bind, so it cannot miss a worker.
        self._monitor: zmq.Socket[Any] | None = self._socket.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self._connected = False
        try:
            prepare_ipc_dir(self.address)
            self._socket.bind(self.address)
        except (OSError, zmq.ZMQError):
            self._close_monitor()
            self._socket.close()
            raise
        self._remove = remove_at_exit(self, self.address)

    def connected(self, timeout: float = 0.0) -> bool:
        """Whether the worker's inbox is connected, so that `send` goes, waiting for it up
        to `timeout` seconds. (The inbox's own end learns of its connection sooner than
        this end can send on it.) It touches only the monitor's socket, never the PUSH
        socket, so one thread other than the channel's may ask."""
        if not self._connected and self._monitor is not None \
                and self._monitor.poll(int(timeout * 1000)):
            self._monitor.recv_multipart()  # the one event it watches: a handshake done
            self._connected = True
            self._monitor.close()  # later events are dropped; `close` ends the monitor
            self._monitor = None
        return self._connected

    def _close_monitor(self) -> None:
        if not self._socket.closed:  # a context's destroy may have closed it already
            self._socket.disable_monitor()
        if self._monitor is not None:
            self._monitor.close()
            self._monitor = None

    def send(self, payload: bytes) -> bool:
        """False when it could not go (no worker connected, or its queue is full)."""
        for _ in range(2):
            try:
                self._socket.send(payload, zmq.NOBLOCK)
                return True
            except zmq.Again:
                # libzmq's send may leave the socket's pending commands for later, among
                # them the one that attaches a worker which connected since the last
                # send: it then says EAGAIN with the worker there. A poll runs them;
                # measured, the first send after a connect failed this way 29 times in
                # 30 when an earlier send had found no worker.
                if not self._socket.poll(0, zmq.POLLOUT):
                    return False
            except zmq.ZMQError:
                return False
        return False

    def close(self) -> None:
        self._close_monitor()
        self._socket.close()
        self._remove()


class EarlyInbox:
    """P's worker: the early WRITEs sent so far, decoded as `kind`. Never blocks. With no
    socket (the address refused), it takes nothing: P's channel then cannot hand the
    WRITE over, and the engine starts it with the next step instead."""

    def __init__(self, kind: type[Any], engine_id: str, dp_index: int, push_port: int,
                 rank: int = 0) -> None:
        self._decoder = msgspec.msgpack.Decoder(kind)
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        address = early_address(engine_id, dp_index, push_port, rank)
        try:
            self._socket.connect(address)
        except zmq.ZMQError as exc:
            logger.warning("no socket for early WRITEs at %s (%s): pushes are written at "
                           "the step after their prompt's", address, exc)

    def take(self) -> list[Any]:
        taken: list[Any] = []
        while True:
            try:
                payload = self._socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return taken
            taken.append(self._decoder.decode(payload))

    def close(self) -> None:
        self._socket.close()
        self._context.term()
