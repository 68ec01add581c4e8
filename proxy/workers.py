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
    index), after a backoff that doubles while its restarts fail before serving.
  - SIGTERM / SIGINT: SIGTERM to every worker, which stops accepting and lets its
    requests finish (`shutdown_grace`); a worker still alive `shutdown_grace` +
    `STOP_MARGIN_S` later is killed. Exit 0 when every worker stopped cleanly.
- worker i (`run_worker`): the single-process router (`proxy.serve.run`) on the inherited
  sockets, plus its control listener (`proxy.api.control`) at `<dir>/worker-<i>.sock`.
  It re-reads `--config` when it starts, and a restarted worker then takes the servers
  of another worker (`WorkerGroup`), so admin API changes made before it started hold on
  it too. It watches the file itself, logs with "worker i", and has `PDPROXY_WORKER=i`
  in its environment. It stops by itself when the supervisor is gone (its sentinel
  closes).

The kernel hands each new connection to one of the workers waiting on the shared
socket; a connection stays with its worker.
"""

from __future__ import annotations

import argparse
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

import uvicorn
from uvicorn.config import STARTUP_FAILURE

from proxy.api.control import WorkerGroup
from proxy.config import ConfigSource, RouterConfig
from proxy.serve import READY, Worker, load_config, run, setup_logging

logger = logging.getLogger("pdproxy.workers")

WORKER_ENV = "PDPROXY_WORKER"  # the worker's index, in each worker's environment
START_TIMEOUT_S = 60.0  # a worker must serve this soon after it was started
STOP_MARGIN_S = 10.0  # beyond shutdown_grace, before a worker that has not exited is killed
RESTART_BACKOFF_MAX_S = 30.0  # the longest pause before restarting a failing worker
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
    restarted: bool = False  # an earlier process of this index ran: take the others' servers


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
    group = WorkerGroup(spec.index, spec.count, spec.directory, timeout=config.timeouts.health,
                        restarted=spec.restarted)
    worker = Worker(group=group, listener=sock, admin_listener=admin_sock, ready=ready)
    if not run(config, source, worker=worker):
        sys.exit(STARTUP_FAILURE)


# --- the supervisor ----------------------------------------------------------------


@dataclasses.dataclass
class _Slot:
    """One worker index and its current process (the supervisor's only)."""

    index: int
    process: SpawnProcess | None = None
    ready: Connection | None = None  # our end of its readiness pipe
    serving: bool = False  # it said it serves
    failures: int = 0  # restarts in a row that exited before serving
    restart_at: float | None = None  # monotonic time of its next start


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
        self._wake_r, self._wake_w = socket.socketpair()  # signals wake our waits

    # signals

    @contextlib.contextmanager
    def _signals(self) -> Iterator[None]:
        def on_signal(number: int, frame: Any) -> None:
            self._stop_signal = number

        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        previous_fd = signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)
            signal.set_wakeup_fd(previous_fd)
            self._wake_r.close()
            self._wake_w.close()

    # workers

    def _start(self, slot: _Slot) -> None:
        ours, theirs = _spawn.Pipe(duplex=False)
        spec = WorkerSpec(slot.index, len(self._slots), self._directory, self._config, self._args,
                          restarted=slot.restart_at is not None)
        process = _spawn.Process(target=run_worker, name=f"pd-proxy-worker-{slot.index}",
                                 args=(spec, self._socket, self._admin_socket, theirs))
        process.start()
        theirs.close()
        slot.process, slot.ready, slot.serving, slot.restart_at = process, ours, False, None
        logger.info("worker %d started (pid %s)", slot.index, process.pid)

    def _wait(self, timeout: float | None) -> None:
        waitables: list[Any] = [self._wake_r]
        for slot in self._slots:
            if slot.process is not None:
                waitables.append(slot.process.sentinel)
                if slot.ready is not None and not slot.serving:
                    waitables.append(slot.ready)
        wait(waitables, timeout)
        with contextlib.suppress(BlockingIOError, InterruptedError):
            self._wake_r.recv(4096)  # drain the wake-ups; the handler recorded the signal

    def _note_ready(self, slot: _Slot) -> None:
        if slot.serving or slot.ready is None:
            return
        with contextlib.suppress(EOFError, OSError):
            if slot.ready.poll() and slot.ready.recv_bytes() == READY:
                slot.serving, slot.failures = True, 0
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
        for slot in self._slots:
            self._note_ready(slot)
            if slot.process is not None:
                process = slot.process
                if not self._reap(slot):
                    continue
                if slot.serving:
                    slot.failures = 0
                    logger.warning("worker %d (pid %s) exited (exit code %s): starting it again",
                                   slot.index, process.pid, process.exitcode)
                else:
                    slot.failures += 1
                backoff = min(2.0 ** slot.failures - 1, RESTART_BACKOFF_MAX_S)
                if not slot.serving:
                    logger.error("worker %d (pid %s) exited before serving (exit code %s): "
                                 "next try in %g s", slot.index, process.pid, process.exitcode,
                                 backoff)
                slot.restart_at = now + backoff
            if slot.restart_at is not None and slot.restart_at <= now:
                self._start(slot)

    def _next_wake(self) -> float:
        pending = [s.restart_at for s in self._slots if s.restart_at is not None]
        return max(0.0, min(pending) - time.monotonic()) if pending else 60.0

    def _stop_all(self) -> bool:
        """SIGTERM every worker, wait for them (bounded), kill the rest; True when all
        stopped by themselves."""
        for slot in self._slots:
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
            while started and self._stop_signal is None:
                self._wait(self._next_wake())
                if self._stop_signal is None:
                    self._keep_alive()
            if self._stop_signal is not None:
                logger.info("%s: stopping the workers (shutdown_grace %d s)",
                            signal.Signals(self._stop_signal).name, self._config.shutdown_grace)
            clean = self._stop_all()
        if not started:
            return STARTUP_FAILURE
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
