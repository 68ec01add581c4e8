"""`--workers N`: N processes serving one port, so the router can use N cores.

Processes:
- the supervisor (the process `pd-proxy serve` started): it binds the listening socket
  (and `admin_listen`'s) once, makes a 0700 directory for the control sockets, and
  starts N workers (multiprocessing's spawn: fresh interpreters) that inherit the
  sockets. It serves nothing itself. It waits on the workers' sentinels, their
  readiness pipes and a signal wake-up fd, never on a timer alone:
  - start: every worker must be serving within `START_TIMEOUT_S`; one that exits or is
    late fails the start, and the supervisor stops the others and exits with
    uvicorn's STARTUP_FAILURE (3).
  - a worker that exits while the router runs is logged and started again (the same
    index) after `supervisor.restart_backoff` seconds, doubled for each of its exits
    within `supervisor.restart_window`, up to `restart_backoff_max`. A worker that exits
    more than `supervisor.max_restarts` times within the window is in a crash loop (a
    request that kills whichever worker takes it, say): the supervisor stops every
    worker and exits with `CRASH_LOOP` (4).
  - heartbeats: every `supervisor.heartbeat_interval` seconds it asks each serving
    worker for a heartbeat on its control socket, without blocking (the sockets are in
    its wait). A worker that answers none for `supervisor.heartbeat_timeout` seconds is
    alive but stuck (its event loop blocked): it is killed, and started again as above.
  - SIGHUP: it reads the config file again (what a worker falls back to when its own
    read fails, and the supervisor's own settings) and sends SIGHUP on to one serving
    worker, which applies the file's server lists for every worker (below).
  - SIGTERM / SIGINT: SIGTERM to every worker, which stops accepting and lets its
    requests finish (`shutdown_grace`); a worker still alive `shutdown_grace` +
    `STOP_MARGIN_S` later is killed. Exit 0 when every worker stopped cleanly. On every
    way out the directory goes.
- worker i (`run_worker`): the single-process router (`proxy.serve.run`) on the inherited
  sockets, plus its control listener (`proxy.api.control`) at `<dir>/worker-<i>.sock`.
  It re-reads `--config` when it starts and then takes the workers' servers from their
  state file in the directory (`WorkerGroup`), so admin API changes made before it
  started hold on it too, even when every worker died. Admin changes and config file
  changes are made by one worker for all, in one order (see `proxy.api.control`). It
  logs with "worker i" and has `PDPROXY_WORKER=i` in its environment. It stops by itself
  when the supervisor is gone (its sentinel closes).

The kernel hands each new connection to one of the workers waiting on the shared
socket; a connection stays with its worker.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection, wait
from multiprocessing.context import SpawnProcess
from pathlib import Path
from typing import Any

import msgspec
import uvicorn
from uvicorn.config import STARTUP_FAILURE

from proxy.api.control import WorkerGroup, heartbeat_frame, read_reply, socket_path
from proxy.config import ConfigSource, RouterConfig
from proxy.serve import READY, Worker, load_config, run, setup_logging

logger = logging.getLogger("pdproxy.workers")

WORKER_ENV = "PDPROXY_WORKER"  # the worker's index, in each worker's environment
START_TIMEOUT_S = 60.0  # a worker must serve this soon after it was started
STOP_MARGIN_S = 10.0  # beyond shutdown_grace, before a worker that has not exited is killed
CRASH_LOOP = 4  # the exit status when a worker exits more than supervisor.max_restarts times
IDLE_WAKE_S = 60.0  # the longest wait when nothing is due
_spawn = multiprocessing.get_context("spawn")


# --- in a worker ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """What a worker is started with (pickled to it: plain values only)."""

    index: int
    count: int
    directory: Path  # the control sockets' directory
    config: RouterConfig  # the supervisor's; used when the file no longer reads
    args: argparse.Namespace  # the command line, to re-read --config


def run_worker(spec: WorkerSpec, sock: socket.socket, admin_sock: socket.socket | None,
               ready: Connection) -> None:
    """A worker process's entry point (spawned by the supervisor)."""

    os.environ[WORKER_ENV] = str(spec.index)
    args = spec.args
    config = spec.config
    setup_logging(config, worker=spec.index)
    if args.config:
        try:
            config = load_config(args)  # the file as it is now (a restart may be late)
        except (OSError, ValueError) as exc:
            logger.error("config %s refused, starting with the supervisor's: %s", args.config, exc)
    source = ConfigSource(args.config, lambda: load_config(args)) if args.config else None
    group = WorkerGroup(spec.index, spec.count, spec.directory, timeout=config.timeouts.health)
    worker = Worker(group=group, listener=sock, admin_listener=admin_sock, ready=ready)
    if not run(config, source, worker=worker):
        sys.exit(STARTUP_FAILURE)


# --- the supervisor ----------------------------------------------------------------


@dataclasses.dataclass
class _Heartbeat:
    """One heartbeat asked of a worker: a non-blocking connection to its control socket,
    and the bytes of the answer so far."""

    sock: socket.socket
    received: bytes = b""

    def fileno(self) -> int:  # for `wait`
        return self.sock.fileno()


@dataclasses.dataclass
class _Slot:
    """One worker index and its current process (the supervisor's only)."""

    index: int
    process: SpawnProcess | None = None
    ready: Connection | None = None  # our end of its readiness pipe
    serving: bool = False  # it said it serves
    exits: collections.deque[float] = dataclasses.field(default_factory=collections.deque)
    restart_at: float | None = None  # monotonic time of its next start
    heartbeat: _Heartbeat | None = None  # the one asked and not answered yet
    next_heartbeat: float = 0.0  # monotonic time to ask the next one
    answered: float = 0.0  # monotonic time of its last heartbeat (or of saying it serves)
    killed: bool = False  # killed for answering no heartbeat; not reaped yet


def bind(host: str, port: int) -> socket.socket:
    """A listening address bound as uvicorn binds it (exits with STARTUP_FAILURE when it
    cannot be)."""
    return uvicorn.Config(app="", host=host, port=port).bind_socket()


class Supervisor:
    def __init__(self, config: RouterConfig, args: argparse.Namespace,
                 sock: socket.socket, admin_sock: socket.socket | None, directory: Path) -> None:
        self._config = config
        self._args = args
        self._socket = sock
        self._admin_socket = admin_sock
        self._directory = directory
        self._slots = [_Slot(i) for i in range(config.workers)]
        self._stop_signal: int | None = None
        self._hangups = 0  # SIGHUPs not handled yet
        self._crash_loop = False
        self._wake_r, self._wake_w = socket.socketpair()  # signals wake our waits

    # signals

    @contextlib.contextmanager
    def _signals(self) -> Iterator[None]:
        def on_signal(number: int, frame: Any) -> None:
            if number == signal.SIGHUP:
                self._hangups += 1
            else:
                self._stop_signal = number

        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        previous_fd = signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        previous = {s: signal.signal(s, on_signal)
                    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        try:
            yield
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)
            signal.set_wakeup_fd(previous_fd)
            self._wake_r.close()
            self._wake_w.close()

    def _reload(self) -> None:
        """SIGHUP: read the config file again; one serving worker applies it for all."""
        self._hangups = 0
        if self._args.config is None:
            logger.warning("SIGHUP: no config file to read again (started without --config)")
            return
        try:
            config = load_config(self._args)
        except (OSError, ValueError) as exc:
            logger.error("SIGHUP: config %s refused, the running config stays: %s",
                         self._args.config, exc)
            return
        for name in ("workers", "host", "port", "admin_listen"):  # bound or spawned once
            if getattr(config, name) != getattr(self._config, name):
                logger.warning("SIGHUP: %s changed; it takes effect at the next start", name)
        self._config = config
        slot = next((s for s in self._slots if s.serving and s.process is not None
                     and s.process.pid is not None and not s.killed), None)
        if slot is None or slot.process is None or slot.process.pid is None:
            logger.warning("SIGHUP: no worker serves now; each takes the file as it starts")
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(slot.process.pid, signal.SIGHUP)
        logger.info("SIGHUP: config %s read again; worker %d applies its servers for every "
                    "worker", self._args.config, slot.index)

    # workers

    def _start(self, slot: _Slot) -> None:
        ours, theirs = _spawn.Pipe(duplex=False)
        spec = WorkerSpec(slot.index, len(self._slots), self._directory, self._config, self._args)
        process = _spawn.Process(target=run_worker, name=f"pd-proxy-worker-{slot.index}",
                                 args=(spec, self._socket, self._admin_socket, theirs))
        process.start()
        theirs.close()
        slot.process, slot.ready, slot.serving, slot.restart_at = process, ours, False, None
        slot.killed = False
        logger.info("worker %d started (pid %s)", slot.index, process.pid)

    def _wait(self, timeout: float | None) -> None:
        waitables: list[Any] = [self._wake_r]
        for slot in self._slots:
            if slot.process is not None:
                waitables.append(slot.process.sentinel)
                if slot.ready is not None and not slot.serving:
                    waitables.append(slot.ready)
            if slot.heartbeat is not None:
                waitables.append(slot.heartbeat)
        wait(waitables, timeout)
        with contextlib.suppress(BlockingIOError, InterruptedError):
            self._wake_r.recv(4096)  # drain the wake-ups; the handler recorded the signal

    def _note_ready(self, slot: _Slot) -> None:
        if slot.serving or slot.ready is None:
            return
        with contextlib.suppress(EOFError, OSError):
            if slot.ready.poll() and slot.ready.recv_bytes() == READY:
                slot.serving = True
                slot.answered = slot.next_heartbeat = time.monotonic()
                logger.info("worker %d serves", slot.index)

    def _reap(self, slot: _Slot) -> bool:
        """Clear a worker that exited; True when it had."""
        process = slot.process
        if process is None or process.is_alive():
            return False
        process.join()
        self._note_ready(slot)  # it may have said so just before it exited
        if slot.ready is not None:
            slot.ready.close()
        self._end_heartbeat(slot)
        slot.process = slot.ready = None
        return True

    def _await_start(self) -> bool:
        deadline = time.monotonic() + START_TIMEOUT_S
        while self._stop_signal is None:
            for slot in self._slots:
                self._note_ready(slot)
                if slot.process is not None and not slot.process.is_alive() and not slot.serving:
                    logger.error("worker %d failed to start (exit code %s)", slot.index,
                                 slot.process.exitcode)
                    return False
            if all(slot.serving for slot in self._slots):
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                late = [s.index for s in self._slots if not s.serving]
                logger.error("worker(s) %s not serving within %g s", late, START_TIMEOUT_S)
                return False
            self._wait(left)
        return True  # asked to stop while starting: stop cleanly

    def _keep_alive(self) -> None:
        now = time.monotonic()
        settings = self._config.supervisor
        for slot in self._slots:
            self._note_ready(slot)
            self._heartbeat(slot, now)
            if slot.process is not None:
                process = slot.process
                served = slot.serving
                if not self._reap(slot):
                    continue
                slot.exits.append(now)
                while now - slot.exits[0] > settings.restart_window:
                    slot.exits.popleft()
                if len(slot.exits) > settings.max_restarts:
                    logger.error("worker %d (pid %s) exited (exit code %s), %d times within "
                                 "%g s (supervisor.max_restarts %d): a crash loop, stopping",
                                 slot.index, process.pid, process.exitcode, len(slot.exits),
                                 settings.restart_window, settings.max_restarts)
                    self._crash_loop = True
                    return
                backoff = min(settings.restart_backoff * 2 ** (len(slot.exits) - 1),
                              settings.restart_backoff_max)
                logger.log(logging.WARNING if served else logging.ERROR,
                           "worker %d (pid %s) exited %s(exit code %s): starting it again in "
                           "%g s", slot.index, process.pid, "" if served else "before serving ",
                           process.exitcode, backoff)
                slot.restart_at = now + backoff
            if slot.restart_at is not None and slot.restart_at <= now:
                self._start(slot)

    # heartbeats

    def _heartbeat(self, slot: _Slot, now: float) -> None:
        """Read the answer to the heartbeat asked, ask the next when due, and kill a
        worker that answered none for heartbeat_timeout."""
        settings = self._config.supervisor
        process = slot.process
        if settings.heartbeat_interval <= 0 or not slot.serving or process is None or slot.killed:
            return
        if slot.heartbeat is not None:
            self._read_heartbeat(slot, now)
        if now - slot.answered > settings.heartbeat_timeout:
            logger.error("worker %d (pid %s) answered no heartbeat for %g s "
                         "(supervisor.heartbeat_timeout): killed", slot.index, process.pid,
                         now - slot.answered)
            self._end_heartbeat(slot)
            process.kill()
            slot.killed = True
            return
        if slot.heartbeat is None and now >= slot.next_heartbeat:
            slot.next_heartbeat = now + settings.heartbeat_interval
            slot.heartbeat = self._ask_heartbeat(slot)

    def _ask_heartbeat(self, slot: _Slot) -> _Heartbeat | None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            # A unix socket connects at once (or is refused); the request fits its buffer.
            sock.connect(os.fspath(socket_path(self._directory, slot.index)))
            sock.send(heartbeat_frame())
        except OSError as exc:
            logger.debug("worker %d: heartbeat not sent: %s", slot.index, exc)
            sock.close()
            return None
        return _Heartbeat(sock)

    def _read_heartbeat(self, slot: _Slot, now: float) -> None:
        heartbeat = slot.heartbeat
        assert heartbeat is not None
        try:
            data = heartbeat.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return  # nothing yet
        except OSError:
            data = b""
        if not data:  # closed without an answer: ask again when due
            self._end_heartbeat(slot)
            return
        heartbeat.received += data
        try:
            reply = read_reply(heartbeat.received)
        except (ValueError, msgspec.DecodeError):
            reply = None
            self._end_heartbeat(slot)
        if reply is not None:
            self._end_heartbeat(slot)
            if reply.status == 200:
                slot.answered = now

    @staticmethod
    def _end_heartbeat(slot: _Slot) -> None:
        if slot.heartbeat is not None:
            slot.heartbeat.sock.close()
            slot.heartbeat = None

    def _next_wake(self) -> float:
        now = time.monotonic()
        settings = self._config.supervisor
        due = [s.restart_at for s in self._slots if s.restart_at is not None]
        if settings.heartbeat_interval > 0:
            for slot in self._slots:
                if slot.serving and slot.process is not None and not slot.killed:
                    due.append(slot.answered + settings.heartbeat_timeout)
                    if slot.heartbeat is None:
                        due.append(slot.next_heartbeat)
        return max(0.0, min(due) - now) if due else IDLE_WAKE_S

    def _stop_all(self) -> bool:
        """SIGTERM every worker, wait for them (bounded), kill the rest; True when all
        stopped by themselves."""
        for slot in self._slots:
            self._end_heartbeat(slot)
            if slot.process is not None and slot.process.pid is not None and slot.process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(slot.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + self._config.shutdown_grace + STOP_MARGIN_S
        clean = True
        for slot in self._slots:
            process = slot.process
            if process is None:
                continue
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                logger.error("worker %d (pid %s) still running after %g s: killed", slot.index,
                             process.pid, self._config.shutdown_grace + STOP_MARGIN_S)
                process.kill()
                process.join(STOP_MARGIN_S)
                clean = False
            elif process.exitcode not in (0, -signal.SIGTERM, -signal.SIGINT):
                logger.error("worker %d exited with code %s", slot.index, process.exitcode)
                clean = False
            if slot.ready is not None:
                slot.ready.close()
        return clean

    def run(self) -> int:
        with self._signals():
            for slot in self._slots:
                self._start(slot)
            started = self._await_start()
            if started and self._stop_signal is None:
                logger.info("%d workers serving http://%s:%d", len(self._slots),
                            self._config.host, self._config.port)
            while started and self._stop_signal is None and not self._crash_loop:
                self._wait(self._next_wake())
                if self._hangups:
                    self._reload()
                if self._stop_signal is None:
                    self._keep_alive()
            if self._stop_signal is not None:
                logger.info("%s: stopping the workers (shutdown_grace %d s)",
                            signal.Signals(self._stop_signal).name, self._config.shutdown_grace)
            clean = self._stop_all()
        if not started:
            return STARTUP_FAILURE
        if self._crash_loop:
            return CRASH_LOOP
        return 0 if clean else 1


def supervise(config: RouterConfig, args: argparse.Namespace) -> int:
    """Run `config.workers` workers on one port until SIGTERM/SIGINT; the exit status."""
    sock = bind(config.host, config.port)
    admin_sock = None
    if config.admin_listen is not None:
        host, _, port = config.admin_listen.rpartition(":")
        admin_sock = bind(host.strip("[]"), int(port))
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    directory = Path(tempfile.mkdtemp(prefix="pd-proxy-",
                                      dir=runtime if runtime and os.path.isdir(runtime) else None))
    logger.info("pd-proxy: %d workers on http://%s:%d", config.workers, config.host, config.port)
    try:
        return Supervisor(config, args, sock, admin_sock, directory).run()
    finally:
        sock.close()
        if admin_sock is not None:
            admin_sock.close()
        shutil.rmtree(directory, ignore_errors=True)
