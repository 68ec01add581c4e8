"""`pd-proxy serve ...` (also `python -m proxy serve ...`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from proxy.config import ConfigSource, Mode, Policy
from proxy.serve import load_config, serve, setup_logging

DESCRIPTION = """\
An OpenAI-compatible router for vLLM prefill/decode disaggregation.

Clients call the router; for each request it picks a prefill server (P) and a decode
server (D) and hands the prompt's KV cache from P to D in one of two modes:
  pull  P computes the prompt first, then D reads P's KV blocks (vLLM's default).
  push  P and D get the request at the same time; P writes the KV into D's blocks.
  auto  push when the chosen P can push, else pull (the faster, once measured).
  local no P: D computes the prompt itself (auto may choose it with auto.local).
A request may pick its own mode with the header X-KV-Transfer-Mode: pull|push|auto
(local too where --client-modes allows it); every answer says the mode used in the
same header.
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
    serve.add_argument("--client-modes", type=_modes, metavar="MODE,...",
                       help="the modes a client may ask for with X-KV-Transfer-Mode, "
                            "comma-separated (default pull,push,auto; add local to let "
                            "clients skip P)")
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
                            "(docs/operating/workers.md)")
    policies = [p.value for p in Policy]
    serve.add_argument("--prefill-policy", choices=policies,
                       help="how a prefill server is picked (default least_outstanding; "
                            "prefix_affinity keeps prompts that start alike on one P, for "
                            "its prefix cache; load_aware reads each server's vLLM /metrics)")
    serve.add_argument("--decode-policy", choices=policies,
                       help="how a decode server is picked (default least_outstanding; "
                            "load_aware weighs each D's queue and KV cache usage)")
    return parser


def _modes(value: str) -> list[str]:
    """--client-modes: comma-separated mode names."""
    modes = [name.strip().lower() for name in value.split(",") if name.strip()]
    known = {m.value for m in Mode}
    unknown = [name for name in modes if name not in known]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown mode {unknown[0]!r} (modes: {', '.join(sorted(known))})")
    return modes


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
