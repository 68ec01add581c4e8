"""One router process: `run` serves the app (and the admin listener, with
`admin_listen`) until SIGTERM/SIGINT, alone (`pd-proxy serve`) or as one worker of
`--workers N` (`proxy.workers`), with the sockets the supervisor bound. SIGHUP reads the
config file again and applies its server lists (`ConfigWatcher.reload`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import logging
import multiprocessing
import signal
import socket
import sys
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import uvicorn

from proxy.config import ConfigSource, RouterConfig, build_config, read_config_file

if TYPE_CHECKING:
    from proxy.api.control import WorkerGroup

logger = logging.getLogger("pdproxy.workers")

READY = b"ready"  # a worker sends it to the supervisor once it serves


def load_config(args: argparse.Namespace) -> RouterConfig:
    file_values: dict[str, Any] = read_config_file(args.config) if args.config else {}
    overrides = {
        "prefill": args.prefill,
        "decode": args.decode,
        "host": args.host,
        "port": args.port,
        "mode": args.mode,
        "client_modes": args.client_modes,
        "models": args.models,
        "missing_kv_params": args.missing_kv_params,
        "health.interval": args.health_interval,
        "log_level": args.log_level,
        "workers": args.workers,
        "balance.prefill": args.prefill_policy,
        "balance.decode": args.decode_policy,
    }
    return build_config(file_values, overrides)


@dataclasses.dataclass
class Worker:
    """A worker's part in `run`: the sockets it serves, its control group, and how
    it tells the supervisor it serves."""

    group: WorkerGroup
    listener: socket.socket  # the router's port, bound by the supervisor
    admin_listener: socket.socket | None  # admin_listen's, when set
    ready: Connection  # the supervisor reads READY once this worker serves

    @property
    def server_class(self) -> type[uvicorn.Server]:
        ready = self.ready

        class WorkerServer(uvicorn.Server):
            async def startup(self, sockets: list[socket.socket] | None = None) -> None:
                await super().startup(sockets)
                if self.started:
                    with contextlib.suppress(OSError):
                        ready.send_bytes(READY)

        return WorkerServer

    def watch_parent(self, server: uvicorn.Server) -> None:
        """Stop serving (gracefully) when the supervisor is gone."""
        parent = multiprocessing.parent_process()
        if parent is None:
            return
        loop = asyncio.get_running_loop()
        sentinel = parent.sentinel

        def gone() -> None:
            loop.remove_reader(sentinel)
            logger.warning("the supervisor is gone: stopping")
            server.should_exit = True

        loop.add_reader(sentinel, gone)


def setup_logging(config: RouterConfig, *, worker: int | None = None) -> None:
    """Log lines to stderr; a worker's say which worker (`--workers N`)."""
    where = "" if worker is None else f"worker {worker} "
    logging.basicConfig(
        level=config.log_level.upper(),
        format=f"%(asctime)s %(levelname)s {where}%(name)s: %(message)s",
        stream=sys.stderr,
    )


def request_path_build() -> str:
    """How the request path runs: "compiled" (its modules built by mypyc, setup.py) or
    "pure Python" (PDPROXY_COMPILE=0, or a build that found no C compiler)."""
    from proxy.flow import exchange

    return "pure Python" if str(getattr(exchange, "__file__", "")).endswith(".py") else "compiled"


def serve(config: RouterConfig, source: ConfigSource | None = None) -> None:
    """Run the router (and its admin listener, with `admin_listen`) until SIGTERM/SIGINT."""
    from uvicorn.config import STARTUP_FAILURE

    setup_logging(config)
    if not run(config, source):
        sys.exit(STARTUP_FAILURE)


def run(
    config: RouterConfig,
    source: ConfigSource | None = None,
    *,
    worker: Worker | None = None,
) -> bool:
    """Serve until SIGTERM/SIGINT; False when the start failed. Alone, it binds its own
    addresses; as a worker of `--workers N` (`worker`), it serves the sockets the
    supervisor bound and answers the other workers on its control socket."""
    from uvicorn._compat import asyncio_run

    from proxy.api.app import create_app  # FastAPI loads only when a router runs
    from proxy.api.listener import server_config

    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until the loop handles it (serve_all)
    kubernetes = config.discovery.kubernetes
    found = (f" + pods in namespace {kubernetes.namespace} ({kubernetes.prefill_selector} / "
             f"{kubernetes.decode_selector})" if kubernetes is not None else "")
    logging.getLogger("pdproxy").info(
        "pd-proxy on http://%s:%d, mode %s, prefill %s, decode %s%s; request path %s",
        config.host, config.port, config.mode.value,
        ", ".join(e.url for e in config.prefill) or "-",
        ", ".join(e.url for e in config.decode) or "-", found, request_path_build(),
    )
    app = create_app(config, source, workers=worker.group if worker else None)
    # Fewer, later garbage collections: the request path makes many short-lived objects
    # and almost no cycles; with the default threshold (700) the collector ran every
    # few requests and showed in the p99.
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)
    # The listener cuts clients that stall or send their request too slowly (see there).
    server = (worker.server_class if worker else uvicorn.Server)(server_config(app, config))
    class AdminServer(uvicorn.Server):
        """The admin listener: it leaves signals to the main server (two servers that
        both capture them would each see only their own), which stops it."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    admin = None
    if app.admin_api is not None and config.admin_listen is not None:
        host, _, port = config.admin_listen.rpartition(":")
        admin = AdminServer(server_config(app.admin_api, config, host=host.strip("[]"),
                                            port=int(port), lifespan="off"))
        logging.getLogger("pdproxy").info("admin API on http://%s", config.admin_listen)
    sockets = [worker.listener] if worker else None
    admin_sockets = [worker.admin_listener] if worker and worker.admin_listener else None

    def reload() -> None:
        router = getattr(app.state, "router", None)  # set once the app started
        watcher = router.watcher if router is not None else None
        if watcher is None:
            logging.getLogger("pdproxy").warning(
                "SIGHUP: no config file to read again (%s)",
                "not serving yet" if router is None else "started without --config")
            return
        watcher.reload()

    async def serve_all() -> None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload)
        if worker is not None:
            worker.watch_parent(server)
        if admin is None:
            await server.serve(sockets)
            return
        admin_task = asyncio.create_task(admin.serve(admin_sockets), name="admin-listener")
        try:
            await server.serve(sockets)  # until a signal, or a failed start
        finally:
            admin.should_exit = True
            await admin_task
        if not admin.started:
            server.started = False  # the admin address could not be bound: a failed start

    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C: uvicorn has already shut down
        asyncio_run(serve_all(), loop_factory=server.config.get_loop_factory())
    return bool(server.started)

