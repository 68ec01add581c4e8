"""What the benchmarks share: ports, server processes, the canned fast fake P and D,
load generators, time to first token, a process's CPU and memory, JSON output and plots.

Every scenario of `python -m scripts.bench` (and each script's own module command) takes
these from here, not from one another, so a scenario's script holds only what it
measures. Nothing here measures anything on import.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

if TYPE_CHECKING:
    import httpx

REPO = Path(__file__).resolve().parents[1]
PERCENTILES = (1, 5, 10, 25, 50, 75, 90, 95, 99, 99.9)


# --- ports and server processes ------------------------------------------------------


@contextlib.contextmanager
def process(args: list[str], ready_url: str, name: str,
            log_path: Path | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """Start a server process (own process group) and wait until `ready_url` answers.
    With `log_path` its output goes there (a long run never fills a pipe), else stderr is
    kept for the error of a failed start. The process group is stopped when the block
    ends, however it ends: a SIGTERM to this process included (`_stop_on_sigterm`)."""
    _stop_on_sigterm()
    if log_path is None:
        proc = subprocess.Popen(args, cwd=REPO, process_group=0, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
    else:
        with log_path.open("wb") as output:
            proc = subprocess.Popen(args, cwd=REPO, process_group=0, stdout=output,
                                    stderr=output)
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                if log_path is not None:
                    err = log_path.read_text(errors="replace")
                else:
                    err = proc.stderr.read().decode() if proc.stderr else ""
                raise RuntimeError(f"{name} exited with {proc.returncode}: {err[-2000:]}")
            try:
                with socket.create_connection(_host_port(ready_url), timeout=0.2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name} did not start within 30 s") from None
                time.sleep(0.1)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _stop_on_sigterm() -> None:
    """Make SIGTERM end this process as Ctrl-C does, through every `finally`, so that the
    servers `process` started go with it. By default SIGTERM (a `timeout`, a `kill`) ends
    Python at once, and a server in its own process group lives on: a router left behind
    keeps its ports, and the next run's fails to start. Only from the main thread, and
    only over the default handler (never over a handler of the program's own)."""
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
        signal.signal(signal.SIGTERM, _terminated)


def _terminated(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def _host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


# --- JSON output and plots ----------------------------------------------------------


def write_json(path: Path, value: Any, default: Callable[[Any], Any] | None = None) -> None:
    """`value` as indented JSON (and a final newline) at `path`, its folder made as needed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2, default=default) + "\n")


def json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object of settings")
    return value


def pyplot(say: Callable[[str], None]) -> Any:
    """matplotlib's pyplot on its file-only backend, or None (and `say` why) when the
    `bench` extra is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say("matplotlib is not installed (pip install -e .[bench]): no plot")
        return None
    return plt


def save_figure(plt: Any, fig: Any, path: Path) -> None:
    """Lay `fig` out, write it to `path` (its folder made as needed) and close it."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- a minimal fake P/D for overhead runs (canned answers, no JSON parsing) ----------

_P_ANSWER = (
    b'{"id":"cmpl-x","object":"text_completion","model":"fake-model","choices":[{"index":0,'
    b'"text":"p","finish_reason":"length"}],"kv_transfer_params":{"do_remote_prefill":true,'
    b'"do_remote_decode":false,"remote_block_ids":[[1,2,3]],"remote_engine_id":"engine-0",'
    b'"remote_request_id":"cmpl-x-0","remote_host":"127.0.0.1","remote_port":5600,'
    b'"tp_size":1,"transfer_modes":["pull","push"]}}'
)
_D_ANSWER = (
    b'{"id":"cmpl-x","object":"text_completion","model":"fake-model","choices":[{"index":0,'
    b'"text":"t0","finish_reason":"length"}]}'
)
_D_EVENTS = (
    b'data: {"id":"cmpl-x","object":"text_completion","model":"fake-model","choices":'
    b'[{"index":0,"text":"t0","finish_reason":"length"}]}\n\ndata: [DONE]\n\n'
)
_MODELS = b'{"object":"list","data":[{"id":"fake-model","object":"model"}]}'


def _http(body: bytes, content_type: bytes = b"application/json") -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: " + content_type + b"\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


def _chunked(body: bytes) -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n" + f"{len(body):x}".encode() + b"\r\n"
            + body + b"\r\n0\r\n\r\n")


class _FakeProtocol(asyncio.Protocol):
    """Answers each request at once with a canned body: the cheapest possible upstream."""

    def __init__(self, role: str, delay_s: float = 0.0, kv: _BenchKV | None = None) -> None:
        import httptools

        self._role = role
        self._delay_s = delay_s
        self._kv = kv
        self._parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._body: list[bytes] = []
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self._url = url

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        body = b"".join(self._body)
        self._body.clear()
        assert self._transport is not None
        if self._url.startswith(b"/v1/models"):
            answer = _http(_MODELS)
        elif self._url.startswith(b"/health"):
            answer = _http(b"")
        elif self._kv is not None and not self._url.startswith(b"/v1/"):
            answer = self._kv.answer(self._url, body)
        elif self._role == "prefill":
            answer = _http(_P_ANSWER)
        elif b'"stream":true' in body or b'"stream": true' in body:
            answer = _chunked(_D_EVENTS)
        else:
            answer = _http(_D_ANSWER)
        if self._kv is not None and body and self._url.startswith((b"/v1/completions",
                                                                   b"/v1/chat/")):
            self._kv.serve(body)
        if self._delay_s and self._url.startswith(b"/v1/"):
            asyncio.get_running_loop().call_later(self._delay_s, self._write_if_open, answer)
        else:
            self._transport.write(answer)

    def _write_if_open(self, answer: bytes) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(answer)


class _BenchKV:
    """The fast fake's prefix cache, for kv_aware runs: a `FakePrefixCache` (vLLM's KV
    events over ZMQ) that every inference request's prompt goes through, plus vLLM's
    `POST /tokenize` (the fake tokenizer), `GET /kv_event_sources` and a `/metrics` with
    the cache's config. Tokenizations and block hashes are memoized by prompt, so the
    fake stays cheap next to the router (a benchmark repeats its prompts)."""

    def __init__(self, num_blocks: int = 100_000, block_size: int = 16) -> None:
        from testbed.fake_kv_cache import FakePrefixCache

        self.cache = FakePrefixCache(num_blocks, block_size)
        self.cache.start()
        self._tokens: dict[str, list[int]] = {}
        self._tokenized: dict[bytes, bytes] = {}  # /tokenize body -> answer
        # inference body -> its prompt's ids and block hashes (None: no prompt), so that
        # a prompt sent again costs the fake a dict lookup: in the overhead scenario it
        # shares the machine's cores with the router it measures
        self._served: dict[bytes, tuple[list[int], list[bytes]] | None] = {}
        self._metrics = (
            'vllm:num_requests_waiting{engine="0",model_name="fake-model"} 0.0\n'
            'vllm:num_requests_running{engine="0",model_name="fake-model"} 0.0\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="fake-model"} 0.0\n'
            f'vllm:cache_config_info{{block_size="{block_size}",engine="0",'
            f'num_gpu_blocks="{num_blocks}"}} 1.0\n').encode()

    @staticmethod
    def _memo(memo: dict[Any, Any], key: Any, make: Any, limit: int = 10_000) -> Any:
        """`make()`, remembered under `key` (None too) in `memo`, which is emptied past
        `limit` entries."""
        if key not in memo:
            if len(memo) > limit:
                memo.clear()
            memo[key] = make()
        return memo[key]

    def tokens(self, body: dict[str, Any]) -> list[int] | None:
        from testbed.fake_kv_cache import fake_chat_tokens, fake_tokenize

        prompt = body.get("prompt")
        if isinstance(prompt, list) and all(type(t) is int for t in prompt):
            return prompt
        if isinstance(prompt, str):
            return self._memo(self._tokens, prompt, lambda: fake_tokenize(prompt))  # type: ignore[no-any-return]
        messages = body.get("messages")
        return fake_chat_tokens(messages) if isinstance(messages, list) else None

    def serve(self, raw: bytes) -> None:
        import msgspec

        def prompt() -> tuple[list[int], list[bytes]] | None:
            tokens = self.tokens(msgspec.json.decode(raw))
            return (tokens, self.cache.hashes(tokens)) if tokens else None

        found = self._memo(self._served, raw, prompt, limit=1_000)
        if found is not None:
            self.cache.serve(*found)

    def answer(self, url: bytes, raw: bytes) -> bytes:
        import msgspec

        if url.startswith(b"/tokenize"):
            def tokenize() -> bytes:
                tokens = self.tokens(msgspec.json.decode(raw)) or []
                return msgspec.json.encode({"tokens": tokens, "count": len(tokens),
                                            "max_model_len": 1 << 20})
            return _http(self._memo(self._tokenized, raw, tokenize))
        if url.startswith(b"/kv_event_sources"):
            return _http(msgspec.json.encode(self.cache.sources()))
        if url.startswith(b"/metrics"):
            return _http(self._metrics, b"text/plain")
        return b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"


def serve_fake(role: str, port: int, delay_s: float = 0.0, kv_cache: bool = False) -> None:
    """A canned fast fake P or D; `kv_cache`: with a prefix cache publishing KV events
    and vLLM's /tokenize (`_BenchKV`), for kv_aware runs."""
    import uvloop

    async def run() -> None:
        loop = asyncio.get_running_loop()
        kv = _BenchKV() if kv_cache else None
        server = await loop.create_server(lambda: _FakeProtocol(role, delay_s, kv), "127.0.0.1",
                                          port, backlog=1024)
        async with server:
            await server.serve_forever()

    uvloop.run(run())


# --- load generators: both return throughput and the latency distribution ------------


DEFAULT_PROMPT = "Hello, benchmark!"


def request_body(stream: bool, prompt: str | list[int] = DEFAULT_PROMPT) -> dict[str, Any]:
    return {"model": "fake-model", "prompt": prompt, "max_tokens": 1, "stream": stream}


def wrk_load(url: str, *, seconds: float, concurrency: int, stream: bool,
             headers: dict[str, str], prompt: str | list[int] = DEFAULT_PROMPT) -> dict[str, Any]:
    """Load with wrk (one thread); its Lua `done` hook prints the latency percentiles."""
    body = json.dumps(request_body(stream, prompt))
    lines = ['wrk.method = "POST"', f"wrk.body = {json.dumps(body)}",
             'wrk.headers["Content-Type"] = "application/json"']
    lines += [f"wrk.headers[{json.dumps(k)}] = {json.dumps(v)}" for k, v in headers.items()]
    lines += ["done = function(summary, latency, requests)",
              '  local e = summary.errors',
              '  io.write(string.format("RESULT %d %d %d %d %d %d %d\\n", summary.requests,'
              " summary.duration, e.status, e.connect, e.read, e.write, e.timeout))",
              f"  for _, p in ipairs({{{', '.join(map(str, PERCENTILES))}}}) do",
              '    io.write(string.format("P %g %d\\n", p, latency:percentile(p)))',
              "  end", "end"]
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write("\n".join(lines) + "\n")
    try:
        out = subprocess.run(
            ["wrk", "-t1", f"-c{concurrency}", f"-d{max(1, round(seconds))}s", "-s", script.name,
             url], capture_output=True, text=True, check=True, timeout=seconds + 60).stdout
    finally:
        os.unlink(script.name)
    percentiles: dict[str, float] = {}
    requests = duration_us = 0
    errors: dict[str, int] = {}
    for line in out.splitlines():
        parts = line.split()
        if parts[:1] == ["RESULT"]:
            requests, duration_us = int(parts[1]), int(parts[2])
            kinds = ("status", "connect", "read", "write", "timeout")
            errors = {k: int(v) for k, v in zip(kinds, parts[3:8], strict=True) if int(v)}
        elif parts[:1] == ["P"]:
            percentiles[f"p{float(parts[1]):g}"] = int(parts[2]) / 1000  # us -> ms
    return {"req_per_s": round(requests / (duration_us / 1e6), 1), "requests": requests,
            "errors": sum(errors.values()), "error_kinds": errors, "latency_ms": percentiles}


async def python_load(url: str, *, seconds: float, concurrency: int, stream: bool,
                      headers: dict[str, str], prompt: str | list[int] = DEFAULT_PROMPT,
                      rate: float | None = None) -> dict[str, Any]:
    """Load from Python (aiohttp). Closed loop (no `rate`): `concurrency` workers, each one
    request at a time, so the slower of client and router sets the pace. Open loop
    (`rate` requests/s): requests start on a fixed schedule whatever the answers, at most
    `concurrency` in flight, so two routers can be measured at one offered rate. A
    request that finds every slot busy waits for one (`waited` counts them) and its
    latency counts from its scheduled start: a router that falls behind shows it in its
    latencies and rate, not in a quietly lower offered rate."""
    body = json.dumps(request_body(stream, prompt)).encode()
    headers = {"Content-Type": "application/json", **headers}
    latencies: list[float] = []
    errors = 0
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def send(started: float) -> None:
            nonlocal errors
            try:
                async with session.post(url, data=body, headers=headers) as r:
                    await r.read()
                    errors += r.status != 200
            except aiohttp.ClientError:
                errors += 1
            latencies.append(time.perf_counter() - started)

        async def worker(deadline: float) -> None:
            while time.perf_counter() < deadline:
                await send(time.perf_counter())

        started = time.perf_counter()
        waited = None
        if rate is None:
            await asyncio.gather(*(worker(started + seconds) for _ in range(concurrency)))
        else:
            waited = await _open_loop(send, started, seconds, concurrency, rate)
        wall = time.perf_counter() - started
    result = {"req_per_s": round(len(latencies) / wall, 1), "requests": len(latencies),
              "errors": errors, "latency_ms": percentiles_ms(latencies)}
    if rate is not None:
        result.update(offered_per_s=rate, waited=waited)
    return result


async def _open_loop(send: Callable[[float], Awaitable[None]], started: float,
                     seconds: float, concurrency: int, rate: float) -> int:
    """Start `send(scheduled)` at `rate` per second from `started` for `seconds`, at most
    `concurrency` at once; wait for those in flight (a task group: one that fails, or
    this being cancelled, cancels the rest). Returns how many waited for a slot. Each
    wake-up starts every request due by then: the mean rate holds although the event
    loop's sleeps are coarser than the gap between two requests."""
    slots = asyncio.Semaphore(concurrency)
    sent = waited = 0

    async def one(scheduled: float) -> None:
        try:
            await send(scheduled)
        finally:
            slots.release()

    total = int(seconds * rate)
    async with asyncio.TaskGroup() as in_flight:
        while sent < total:
            due = min(total, int((time.perf_counter() - started) * rate) + 1)
            while sent < due:
                if slots.locked():
                    waited += 1
                await slots.acquire()
                in_flight.create_task(one(started + sent / rate))
                sent += 1
            await asyncio.sleep(max(0.0, started + sent / rate - time.perf_counter()))
    return waited


def percentiles_ms(seconds: list[float]) -> dict[str, float]:
    """{"p50": ms, ...} for PERCENTILES."""
    ordered = sorted(seconds)
    if not ordered:
        return {}
    return {f"p{p:g}": round(ordered[min(len(ordered) - 1, int(len(ordered) * p / 100))] * 1000, 3)
            for p in PERCENTILES}


def apply_load(loader: str, url: str, **kwargs: Any) -> dict[str, Any]:
    """One load run with `loader` (wrk or python): throughput and latencies. `rate` (open
    loop, requests/s) is the Python loader's alone."""
    if loader == "wrk":
        if kwargs.pop("rate", None) is not None:
            raise ValueError("wrk loads in a closed loop: an offered rate needs the python loader")
        return wrk_load(url, **kwargs)
    return asyncio.run(python_load(url, **kwargs))


# --- measuring a server process ------------------------------------------------------


class ProcessGauge:
    """CPU seconds and memory of one process (Linux /proc), for the router's costs. CPU
    counts the whole process tree: a router with --workers N is N + 1 processes."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def cpu_seconds(self) -> float:
        """utime + stime of the process and its live descendants, plus the children it
        has reaped (cutime + cstime)."""
        return sum(self.cpu_times())

    def cpu_times(self) -> tuple[float, float]:
        """`cpu_seconds` split: (user, system). System time is the kernel's work for the
        process: on loopback its socket writes carry the receiver's TCP processing and
        wake-up. The kernel splits the two by sampling at its clock ticks, so only their
        sum is exact."""
        user = system = 0
        for pid in self._tree():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except FileNotFoundError:  # exited meanwhile
                continue
            user += int(fields[11]) + int(fields[13])
            system += int(fields[12]) + int(fields[14])
        tick = os.sysconf("SC_CLK_TCK")
        return user / tick, system / tick

    def _tree(self) -> list[int]:
        pids, todo = [], [self.pid]
        while todo:
            pid = todo.pop()
            pids.append(pid)
            for task in Path(f"/proc/{pid}/task").glob("*/children"):
                with contextlib.suppress(FileNotFoundError):
                    todo += [int(child) for child in task.read_text().split()]
        return pids

    def memory_mib(self) -> dict[str, float]:
        """Resident memory now (VmRSS) and its peak since the process started (VmHWM)."""
        values = {}
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) / 1024
        return {"rss_mib": round(values["VmRSS"], 1), "peak_rss_mib": round(values["VmHWM"], 1)}


# --- time to first token through a router (a real or emulated vLLM pair) -----------

MAX_TOKENS = 2
DIRECT = "direct"  # the whole request on P alone: no router, no KV hand-over


async def first_token_seconds(client: httpx.AsyncClient, url: str, prompt: list[int],
                              mode: str, extra_headers: dict[str, str] | None = None) -> float:
    """One streamed completion through the router; seconds to its first token.
    `extra_headers` go with the request's X-KV-Transfer-Mode (the answer must still name
    `mode`)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True, "ignore_eos": True}
    started = time.perf_counter()
    ttft = None
    headers = {} if mode == DIRECT else {"X-KV-Transfer-Mode": mode, **(extra_headers or {})}
    async with client.stream("POST", f"{url}/v1/completions", json=body,
                             headers=headers) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{mode}: HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        if mode != DIRECT and resp.headers.get("x-kv-transfer-mode") != mode:
            raise RuntimeError(f"asked {mode}, the router used {resp.headers.get('x-kv-transfer-mode')}")
        async for line in resp.aiter_lines():
            if ttft is None and line.startswith("data: {"):
                ttft = time.perf_counter() - started
    if ttft is None:
        raise RuntimeError(f"{mode}: the stream had no token")
    return ttft


async def batch(client: httpx.AsyncClient, url: str, mode: str, prompt_len: int,
                concurrency: int, rng: random.Random,
                extra_headers: dict[str, str] | None = None) -> list[float]:
    """`concurrency` streamed completions at once in `mode`, each a fresh random prompt of
    `prompt_len` tokens of the tiny test model: their seconds to first token."""
    from testbed.tiny_model import VOCAB_SIZE as VOCAB

    prompts = [[rng.randrange(10, VOCAB) for _ in range(prompt_len)] for _ in range(concurrency)]
    return list(await asyncio.gather(
        *(first_token_seconds(client, url, p, mode, extra_headers) for p in prompts)))
