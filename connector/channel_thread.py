"""What P's and D's side channel threads share: one owned thread, its wake-up pipe, and the
engine's events for it.

The push side channel is ZMQ between D's scheduler and P's scheduler, one thread on each
(`connector.prefill_channel`, `connector.decode_channel`). Each thread owns its sockets
and its state; the engine thread reaches it only through typed events (frozen
dataclasses, one per kind, defined next to each side) put on a queue, followed by a
byte on a wake-up pipe that the thread's poll watches. Nothing is shared under a lock
but the caught-up counters (`wait_caught_up`).

Every wait is bounded: the thread wakes at the earliest deadline it holds, or at least
every `MAX_SLEEP_S`; `stop` joins it for at most `JOIN_TIMEOUT_S`.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Any, Generic, TypeVar

import zmq

logger = logging.getLogger("vllm.pd_connector.channel")

MAX_SLEEP_S = 1.0
JOIN_TIMEOUT_S = 5.0

T = TypeVar("T")
E = TypeVar("E")  # the engine's events for one side's thread


def drain(q: queue.SimpleQueue[T]) -> list[T]:
    """Everything in `q` now, without waiting."""
    items: list[T] = []
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


class ChannelThread(Generic[E]):
    """Start/stop of one owned thread that polls its sockets and the wake-up pipe, and
    the engine's events (`E`) for it."""

    name = "pd-push-channel"

    def __init__(self) -> None:
        self._wakeup = _Wakeup()
        self._events: queue.SimpleQueue[E] = queue.SimpleQueue()
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
            self._thread.join(JOIN_TIMEOUT_S)
            if self._thread.is_alive():
                logger.warning("%s thread did not stop within %.0f s", self.name, JOIN_TIMEOUT_S)
            self._thread = None
        self._close_sockets()  # the thread closed its own; these were never handed to one
        self._context.term()
        self._wakeup.close()

    def _close_sockets(self) -> None:
        """Close the sockets made before the thread started (if it never did)."""

    def _post(self, event: E) -> None:
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
        sleep = MAX_SLEEP_S if deadline is None else deadline - time.monotonic()
        timeout_ms = int(max(0.0, min(MAX_SLEEP_S, sleep)) * 1000)
        ready = dict(poller.poll(timeout_ms))
        if self._wakeup.read_fd in ready:
            self._wakeup.clear()
        return ready

    def _drain_events(self) -> list[E]:
        return drain(self._events)

