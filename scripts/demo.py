"""The demo: real vLLM on CPU, a 1P1D pair with the router in front, one request per mode.

    .venv/bin/python -m scripts.demo

Steps (each printed as it happens):
1. build the tiny model (once, into .cache/tiny-model; no download);
2. start a P and a D with our `NixlDualConnector`, and the router in front (push by
   default); send a completion and a streamed chat completion in each mode, the mode
   chosen per request by the `X-KV-Transfer-Mode` header, all on the same pair;
3. every answer is checked against the same request served whole by one server
   (greedy tokens must be equal), and D's /metrics must show the prompt's KV came over
   NIXL (not recomputed).
About 1-2 minutes on a 2-core machine; servers log to .cache/vllm-logs/.

`--stock` runs the same checks with vLLM's own connectors instead, which fix the mode per
deployment: a `NixlConnector` pair (pull; a push request falls back to pull, and the
answer says so in X-KV-Transfer-Mode), then a `NixlPushConnector` pair (push).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from testbed import tiny_model
from testbed.pd_protocol import EXTERNAL_KV_TOKENS, metric, parse_metrics
from testbed.vllm_cpu import DEFAULT_MODEL_DIR, DUAL_CONNECTOR, REPO_ROOT, free_port, pair

PROMPT = "The router hands the prompt's cache from prefill to decode, and the decode server"
MAX_TOKENS = 16


def say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


@contextlib.contextmanager
def router(prefill_url: str, decode_url: str, mode: str, config: Path | None = None) -> Iterator[str]:
    """`pd-proxy serve` in front of one P and one D (`config`: a config file beside the
    flags, which win over it); yields its URL once healthy."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy", "serve", "--prefill", prefill_url, "--decode", decode_url,
         "--port", str(port), "--mode", mode, "--client-modes", "pull,push,auto,local",
         *(["--config", str(config)] if config is not None else [])],
        cwd=REPO_ROOT, process_group=0,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the router exited with {proc.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("the router did not become healthy in 30 s")
            time.sleep(0.2)
        say(f"router on {url} (mode {mode}) in front of P {prefill_url} and D {decode_url}")
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            say("the router did not exit 15 s after SIGTERM; killing it")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def external_kv_tokens(decode_url: str) -> float:
    """D's count of prompt tokens that came over KV transfer (not computed by D)."""
    samples = parse_metrics(httpx.get(f"{decode_url}/metrics", timeout=10).text)
    return metric(samples, EXTERNAL_KV_TOKENS, source="external_kv_transfer")


def ask(url: str, path: str, body: dict[str, Any], mode: str) -> tuple[str, str, float]:
    """Send one request through the router; return (text, mode used, seconds)."""
    started = time.perf_counter()
    headers = {"X-KV-Transfer-Mode": mode, "X-Request-Id": f"demo-{uuid.uuid4().hex[:12]}"}
    if body.get("stream"):
        text = ""
        with httpx.stream("POST", f"{url}{path}", json=body, headers=headers, timeout=120) as r:
            r.raise_for_status()
            used = r.headers["x-kv-transfer-mode"]
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = httpx.Response(200, content=line[6:]).json()["choices"][0]
                    text += choice.get("text") or choice.get("delta", {}).get("content") or ""
    else:
        r = httpx.post(f"{url}{path}", json=body, headers=headers, timeout=120)
        r.raise_for_status()
        used = r.headers["x-kv-transfer-mode"]
        choice = r.json()["choices"][0]
        text = choice.get("text") or choice.get("message", {}).get("content") or ""
    return text, used, time.perf_counter() - started


def reference(server_url: str, path: str, body: dict[str, Any]) -> str:
    """The same request served whole by one server (a fresh cache_salt: no cache hits)."""
    whole = {**body, "stream": False, "cache_salt": uuid.uuid4().hex}
    choice = httpx.post(f"{server_url}{path}", json=whole, timeout=120).json()["choices"][0]
    return str(choice.get("text") or choice.get("message", {}).get("content") or "")


def check(label: str, url: str, decode_url: str, path: str, body: dict[str, Any], mode: str,
          expect_mode: str) -> bool:
    before = external_kv_tokens(decode_url)
    text, used, seconds = ask(url, path, body, mode)
    via_kv = external_kv_tokens(decode_url) - before
    same = text == reference(decode_url, path, body)
    ok = same and used == expect_mode and via_kv > 0
    say(f"{label}: asked {mode}, used {used}, {seconds * 1000:.0f} ms, "
        f"{via_kv:.0f} prompt tokens over KV transfer, tokens equal one server's: {same}"
        f"  {'OK' if ok else 'FAILED'}")
    say(f"    {text!r}")
    return ok


COMPLETION = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS,
        "temperature": 0, "stream": True}


def dual_demo() -> list[bool]:
    """Our connector: one pair, both modes, chosen per request."""
    completion, chat = COMPLETION, CHAT
    results = []
    say(f"starting a P/D pair with our {DUAL_CONNECTOR} ... (20-60 s)")
    with pair(DUAL_CONNECTOR) as p, router(p.prefill_url, p.decode_url, "push") as url:
        for mode in ("push", "pull"):
            results.append(check(f"{mode} completion", url, p.decode_url, "/v1/completions",
                                 completion, mode, mode))
            results.append(check(f"{mode} streamed chat", url, p.decode_url, "/v1/chat/completions",
                                 chat, mode, mode))
    return results


def stock_demo() -> list[bool]:
    """vLLM's connectors: one pair per mode."""
    completion, chat = COMPLETION, CHAT
    results = []
    say("starting a P/D pair with stock NixlConnector (pull) ... (20-60 s)")
    with pair("NixlConnector") as p, router(p.prefill_url, p.decode_url, "pull") as url:
        results.append(check("pull completion", url, p.decode_url, "/v1/completions", completion, "pull", "pull"))
        results.append(check("push asked of a pull-only pair", url, p.decode_url, "/v1/completions",
                             completion, "push", "pull"))

    say("starting a P/D pair with stock NixlPushConnector (push) ... (20-60 s)")
    with pair("NixlPushConnector") as p, router(p.prefill_url, p.decode_url, "push") as url:
        results.append(check("push completion", url, p.decode_url, "/v1/completions", completion, "push", "push"))
        results.append(check("push streamed chat", url, p.decode_url, "/v1/chat/completions", chat, "push", "push"))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stock", action="store_true",
                        help="use vLLM's own NixlConnector and NixlPushConnector (two pairs)")
    args = parser.parse_args()
    say("building the tiny model (once)")
    tiny_model.build(DEFAULT_MODEL_DIR)
    results = stock_demo() if args.stock else dual_demo()
    say(f"{sum(results)} of {len(results)} checks passed")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
