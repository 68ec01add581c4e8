"""What P's and D's side channel threads share: one owned thread, its wake-up pipe, and the
engine's events for it.

The push side channel is ZMQ between D's scheduler and P's scheduler, one thread on each
(`connector.prefill.channel`, `connector.decode.channel`). Each thread owns its sockets
and its state; the engine thread reaches it only through typed events (frozen
dataclasses, one per kind, defined next to each side) put on a queue, followed by a
byte on a wake-up pipe that the thread's poll watches. Nothing is shared under a lock
but the caught-up counters (`wait_caught_up`).

Every wait is bounded: the thread wakes at the earliest deadline it holds, or at least
every `MAX_SLEEP_S`; `stop` joins it for at most `JOIN_TIMEOUT_S`.

A thread survives what it is handed. Each message and each engine event is handled under
a guard (`ChannelThread._guarded`), and so is each pass of the loop (`_pass`): an
exception is counted (`errors`), logged with what was being handled (at most `LOG_BURST`
lines a minute), and the thread goes on with the next one. A pass that fails waits a
little before the next (`FAILED_PASS_WAIT_S`, doubling up to `MAX_SLEEP_S`), so a broken
socket does not spin a core; after `MAX_FAILED_PASSES` failed passes in a row, or should
anything escape the guards, the thread ends and says why (`death`). Pushes then cannot
work on this server, and it must not look healthy: the engine calls `check_alive` every
step, which raises `ThreadDied`, and vLLM's engine stops with that error (its `/health`
answers 503, so the server is restarted) rather than serving on with pushes silently
broken. `Guard` is that bookkeeping, shared with the NIXL poller thread of the workers.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import zmq

logger = logging.getLogger("vllm.pd_connector.channel")

MAX_SLEEP_S = 1.0
JOIN_TIMEOUT_S = 5.0
# A guarded thread: after a failed pass it waits this long (doubling, up to MAX_SLEEP_S),
# and after this many failed passes in a row it gives up (the server turns unhealthy).
FAILED_PASS_WAIT_S = 0.01
MAX_FAILED_PASSES = 30
# What one thread logs about its errors: at most LOG_BURST lines per LOG_INTERVAL_S (the
# `errors` count has them all).
LOG_BURST = 10
LOG_INTERVAL_S = 60.0

T = TypeVar("T")
E = TypeVar("E")  # the engine's events for one side's thread


def describe(item: object) -> str:
    """A message or an event, for the log: its kind and its transfer (never its body,
    which may hold a million block ids)."""
    transfer = getattr(item, "transfer_id", None)
    return type(item).__name__ + (f" for transfer {transfer}" if transfer else "")


def drain(q: queue.SimpleQueue[T]) -> list[T]:
    """Everything in `q` now, without waiting."""
    items: list[T] = []
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items


class ThreadDied(RuntimeError):
    """A connector thread ended while it should run (raised on the engine's thread, so
    that vLLM stops the engine and its health check fails)."""


class LogLimit:
    """At most `burst` log lines per `interval` seconds; the next line after a quiet
    stretch says how many were left out."""

    def __init__(self, burst: int, interval: float) -> None:
        self._burst, self._interval = burst, interval
        self._window_start: float | None = None
        self._logged = 0  # in the current window
        self.left_out = 0  # since the last line logged

    def allow(self, now: float) -> bool:
        """Whether to log this one; if not, it is counted in `left_out`."""
        if self._window_start is None or now - self._window_start >= self._interval:
            self._window_start, self._logged = now, 0
        if self._logged >= self._burst:
            self.left_out += 1
            return False
        self._logged += 1
        return True

    def suffix(self) -> str:
        """For the line being logged: how many were left out before it (then reset)."""
        left_out, self.left_out = self.left_out, 0
        return f" ({left_out} more not logged)" if left_out else ""


class Guard:
    """One thread's errors: each exception it survives is counted and logged (at most
    LOG_BURST lines per LOG_INTERVAL_S) with what it was handling; failed passes in a row
    set how long to wait before the next, and how many are too many.

    Used by the guarded thread only; others read `errors` and `death` (single writer)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.errors = 0  # exceptions survived
        self.death: str | None = None  # why the thread ended, if it did while it should run
        self._failed_in_a_row = 0
        self._log = LogLimit(LOG_BURST, LOG_INTERVAL_S)

    def failed(self, what: str, exc: BaseException) -> None:
        """Handling `what` raised `exc`: count it, and log it (with its traceback)."""
        self.errors += 1
        if self._log.allow(time.monotonic()):
            logger.error("%s thread: %s failed: %s: %s (%d errors so far)%s", self.name, what,
                         type(exc).__name__, exc, self.errors, self._log.suffix(),
                         exc_info=exc)

    def pass_failed(self, exc: BaseException) -> float:
        """A whole pass failed: how long to wait before the next one. Raises ThreadDied
        after MAX_FAILED_PASSES in a row."""
        self.failed("a pass of its loop", exc)
        self._failed_in_a_row += 1
        if self._failed_in_a_row >= MAX_FAILED_PASSES:
            raise ThreadDied(f"{self.name} thread failed {self._failed_in_a_row} passes in a "
                             f"row, the last with {type(exc).__name__}: {exc}") from exc
        return float(min(MAX_SLEEP_S, FAILED_PASS_WAIT_S * 2 ** (self._failed_in_a_row - 1)))

    def pass_done(self) -> None:
        self._failed_in_a_row = 0

    def died(self, exc: BaseException) -> None:
        """The thread is ending on `exc`: say so, once, for `check`."""
        self.death = f"{type(exc).__name__}: {exc}"
        logger.critical("%s thread died (%s); pushes through this server cannot work, and "
                        "the engine stops at its next step", self.name, self.death,
                        exc_info=exc)

    def check(self, alive: bool) -> None:
        """Engine thread: raise ThreadDied if the thread ended while it should run (`alive`
        False, or a death recorded)."""
        if self.death is not None or not alive:
            raise ThreadDied(f"the connector's {self.name} thread died "
                             f"({self.death or 'no reason recorded'}); restart this server")


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
        self.guard = Guard(self.name)

    @property
    def errors(self) -> int:
        """Exceptions the thread survived (each logged with what it was handling)."""
        return self.guard.errors

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

    def check_alive(self) -> None:
        """Engine thread, every step: raise ThreadDied if the thread ended while it should
        run. (Before `start` and after `stop`, nothing to check.)"""
        thread = self._thread
        if thread is not None and not self._stop.is_set():
            self.guard.check(thread.is_alive())

    def _run_logged(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # whatever ends the thread is said, and seen by the engine
            self.guard.died(exc)

    def _run(self) -> None:
        """The thread: `_setup`, then `_pass` until stopped, each pass under the guard,
        then `_teardown` (which closes the sockets the thread owns)."""
        self._setup()
        try:
            while not self._stop.is_set():
                try:
                    self._pass()
                except Exception as exc:
                    self._stop.wait(self.guard.pass_failed(exc))  # raises after too many
                else:
                    self.guard.pass_done()
        finally:
            self._teardown()

    def _setup(self) -> None:
        """On the thread, before its first pass."""

    def _pass(self) -> None:
        """One pass of the thread: wait for its sockets, its wake-up pipe or its earliest
        deadline, then handle what came."""
        raise NotImplementedError

    def _teardown(self) -> None:
        """On the thread, as it ends: close what it owns."""

    def _guarded(self, what: str, call: Callable[..., object], *args: object) -> None:
        """`call(*args)`; an exception is counted and logged naming `what`, then dropped,
        so that one bad message or event costs itself only."""
        try:
            call(*args)
        except Exception as exc:
            self.guard.failed(what, exc)

    def _poll(self, poller: zmq.Poller, deadline: float | None) -> dict[Any, int]:
        sleep = MAX_SLEEP_S if deadline is None else deadline - time.monotonic()
        timeout_ms = int(max(0.0, min(MAX_SLEEP_S, sleep)) * 1000)
        ready = dict(poller.poll(timeout_ms))
        if self._wakeup.read_fd in ready:
            self._wakeup.clear()
        return ready

    def _drain_events(self) -> list[E]:
        return drain(self._events)

