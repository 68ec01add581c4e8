"""D's workers wake D's scheduler when a push lands, so a pausing engine steps at once.

On a CPU server D's scheduler pauses each idle step while it only waits for pushes
(`push_wait_pause`). The WRITE's NIXL notification reaches D's workers, in other
processes; without a word from them the engine would notice the KV only after the pause.
So the scheduler waits on a ZMQ PULL socket (`WakeListener`) instead of sleeping, and
each worker's poller thread, on fetching notifications, sends an empty message to it
(`WakeSender`). Both ends live on this host: an IPC socket named after the engine.

Only the server's own user may connect to these sockets: each is a file in a directory of
its own, made private by the end that binds (`connector.shared.ipc`).

Each socket is used by one thread only: the listener by the engine's scheduler thread,
a sender by its worker's poller thread.
"""

from __future__ import annotations

import contextlib
import logging
import math

import zmq

from connector.shared.ipc import ipc_address, prepare_ipc_dir, remove_at_exit

logger = logging.getLogger("vllm.pd_connector.wake")


def wake_address(engine_id: str, dp_index: int) -> str:
    """The IPC address of one engine's wake-up socket."""
    return ipc_address("pd-wake", engine_id, dp_index)


class WakeListener:
    """D's scheduler: wait up to a timeout, or until a worker says a push landed."""

    def __init__(self, engine_id: str, dp_index: int = 0) -> None:
        self.address = wake_address(engine_id, dp_index)
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            prepare_ipc_dir(self.address)
            self._socket.bind(self.address)
        except (OSError, zmq.ZMQError):
            self._socket.close()
            self._context.term()
            raise
        self._remove = remove_at_exit(self, self.address)

    def wait(self, timeout_s: float) -> bool:
        """Block until woken or `timeout_s` passes; True when woken. Drains every
        wake-up already queued, so one landed push does not cut several pauses short."""
        woken = bool(self._socket.poll(timeout=math.ceil(timeout_s * 1000)))
        while self._socket.poll(timeout=0):
            self._socket.recv(zmq.NOBLOCK)
        return woken

    def close(self) -> None:
        self._socket.close()
        self._context.term()
        self._remove()


class WakeSender:
    """A D worker: tell the scheduler that notifications arrived. Never blocks, and never
    fails: with no socket (the address refused), wake-ups are simply not sent, and the
    scheduler sees a landed push at the end of its pause."""

    def __init__(self, engine_id: str, dp_index: int = 0) -> None:
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, 4)  # a few pending wake-ups say it all
        address = wake_address(engine_id, dp_index)
        try:
            self._socket.connect(address)
        except zmq.ZMQError as exc:
            logger.warning("no wake-up socket at %s (%s): a landed push is seen at the end "
                           "of the scheduler's pause", address, exc)

    def wake(self) -> None:
        with contextlib.suppress(zmq.Again):
            self._socket.send(b"", zmq.NOBLOCK)

    def close(self) -> None:
        self._socket.close()
        self._context.term()
