"""`pd-proxy serve ...` (also `python -m proxy serve ...`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from proxy.config import Mode, Policy, RouterConfig, build_config, read_config_file
from proxy.router import ConfigSource

if TYPE_CHECKING:
    from proxy.workers import Worker

DESCRIPTION = """\
An OpenAI-compatible router for vLLM prefill/decode disaggregation.

Clients call the router; for each request it picks a prefill server (P) and a decode
server (D) and hands the prompt's KV cache from P to D in one of two modes:
  pull  P computes the prompt first, then D reads P's KV blocks (vLLM's default).
  push  P and D get the request at the same time; P writes the KV into D's blocks.
  auto  push when the chosen P can push, else pull (the faster, once measured).
  local no P: D computes the prompt itself (auto may choose it with auto.local).
A request may pick its own mode with the header X-KV-Transfer-Mode: pull|push|auto|local;
every answer says the mode used in the same header.
"""

EPILOG = """\
examples:
  pd-proxy serve --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200
  pd-proxy serve --config configs/1p1d-cpu.yaml --mode push
Flags given here win over the config file; see configs/example.yaml for every option.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pd-proxy", description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve", help="run the router", description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument("--config", type=Path, metavar="FILE",
                       help="YAML (.yaml/.yml) or TOML (.toml) config file")
    serve.add_argument("--prefill", action="append", metavar="URL",
                       help="a prefill vLLM server's base URL (repeat for several)")
    serve.add_argument("--decode", action="append", metavar="URL",
                       help="a decode vLLM server's base URL (repeat for several)")
    serve.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port to listen on (default 8000)")
    serve.add_argument("--mode", choices=[m.value for m in Mode],
                       help="KV hand-over mode when a request does not choose (default pull); "
                            "local: no P, D computes the prompt itself")
    serve.add_argument("--model", action="append", dest="models", metavar="NAME",
                       help="served model name (repeatable; default: ask the upstreams)")
    serve.add_argument("--missing-kv-params", choices=["error", "recompute"],
                       help="when P answers without kv_transfer_params: answer 502 (default) "
                            "or let D recompute the prompt (counted in metrics)")
    serve.add_argument("--health-interval", type=float, metavar="SECONDS",
                       help="seconds between active /health checks; 0 turns them off "
                            "(default 5)")
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"],
                       help="log level (default info)")
    serve.add_argument("--workers", type=int, metavar="N",
                       help="processes serving the one port, to use N cores (default 1). Each "
                            "keeps its own health checks, ejections, retry budget and auto "
                            "mode's learning; /metrics and the admin API cover them all "
                            "(README: Workers)")
    policies = [p.value for p in Policy]
    serve.add_argument("--prefill-policy", choices=policies,
                       help="how a prefill server is picked (default least_outstanding; "
                            "prefix_affinity keeps prompts that start alike on one P, for "
                            "its prefix cache; load_aware reads each server's vLLM /metrics)")
    serve.add_argument("--decode-policy", choices=policies,
                       help="how a decode server is picked (default least_outstanding; "
                            "load_aware weighs each D's queue and KV cache usage)")
    return parser


def load_config(args: argparse.Namespace) -> RouterConfig:
    file_values: dict[str, Any] = read_config_file(args.config) if args.config else {}
    overrides = {
        "prefill": args.prefill,
        "decode": args.decode,
        "host": args.host,
        "port": args.port,
        "mode": args.mode,
        "models": args.models,
        "missing_kv_params": args.missing_kv_params,
        "health.interval": args.health_interval,
        "log_level": args.log_level,
        "workers": args.workers,
        "balance.prefill": args.prefill_policy,
        "balance.decode": args.decode_policy,
    }
    return build_config(file_values, overrides)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = load_config(args)
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    if config.workers > 1:
        from proxy.workers import supervise

        setup_logging(config)
        return supervise(config, args)
    source = ConfigSource(args.config, lambda: load_config(args)) if args.config else None
    serve(config, source)
    return 0


def setup_logging(config: RouterConfig, *, worker: int | None = None) -> None:
    """Log lines to stderr; a worker's say which worker (`--workers N`)."""
    where = "" if worker is None else f"worker {worker} "
    logging.basicConfig(
        level=config.log_level.upper(),
        format=f"%(asctime)s %(levelname)s {where}%(name)s: %(message)s",
        stream=sys.stderr,
    )


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
    import uvicorn
    from uvicorn._compat import asyncio_run

    from proxy.app import create_app
    from proxy.listener import server_config

    kubernetes = config.discovery.kubernetes
    found = (f" + pods in namespace {kubernetes.namespace} ({kubernetes.prefill_selector} / "
             f"{kubernetes.decode_selector})" if kubernetes is not None else "")
    logging.getLogger("pdproxy").info(
        "pd-proxy on http://%s:%d, mode %s, prefill %s, decode %s%s",
        config.host, config.port, config.mode.value,
        ", ".join(e.url for e in config.prefill) or "-",
        ", ".join(e.url for e in config.decode) or "-", found,
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

    async def serve_all() -> None:
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

