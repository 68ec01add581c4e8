"""D's workers wake D's scheduler when a push lands, so a pausing engine steps at once.

On a CPU server D's scheduler pauses each idle step while it only waits for pushes
(`push_wait_pause`). The WRITE's NIXL notification reaches D's workers, in other
processes; without a word from them the engine would notice the KV only after the pause.
So the scheduler waits on a ZMQ PULL socket (`WakeListener`) instead of sleeping, and
each worker's poller thread, on fetching notifications, sends an empty message to it
(`WakeSender`). Both ends live on this host: an IPC socket named after the engine, in
Linux's abstract namespace (no file to leave behind when a server is killed), or a file
in the temporary directory elsewhere.

Each socket is used by one thread only: the listener by the engine's scheduler thread,
a sender by its worker's poller thread.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import sys
import tempfile

import zmq


def ipc_address(prefix: str, engine_id: str, dp_index: int) -> str:
    """The IPC address of one of an engine's local sockets (a short, fixed-length name):
    in Linux's abstract namespace, or a file in the temporary directory elsewhere."""
    name = f"{prefix}-" + hashlib.sha256(f"{engine_id}/{dp_index}".encode()).hexdigest()[:16]
    if sys.platform == "linux":
        return f"ipc://@{name}"
    return f"ipc://{tempfile.gettempdir()}/{name}"


def remove_ipc_file(address: str) -> None:
    """After closing a socket bound at `address`: remove its file, if it has one (none in
    the abstract namespace)."""
    path = address.removeprefix("ipc://")
    if not path.startswith("@"):
        with contextlib.suppress(OSError):
            os.unlink(path)


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
        self._socket.bind(self.address)

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
        remove_ipc_file(self.address)


class WakeSender:
    """A D worker: tell the scheduler that notifications arrived. Never blocks."""

    def __init__(self, engine_id: str, dp_index: int = 0) -> None:
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, 4)  # a few pending wake-ups say it all
        self._socket.connect(wake_address(engine_id, dp_index))

    def wake(self) -> None:
        with contextlib.suppress(zmq.Again):
            self._socket.send(b"", zmq.NOBLOCK)

    def close(self) -> None:
        self._socket.close()
        self._context.term()
