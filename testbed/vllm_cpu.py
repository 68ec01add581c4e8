"""Start real vLLM CPU servers as a prefill/decode (P/D) pair, for tests and demos.

    python -m testbed.vllm_cpu pair --connector NixlConnector \\
        --prefill-port 8100 --decode-port 8200

From Python:

    from testbed.vllm_cpu import pair
    with pair(connector="NixlConnector", model_dir=path) as p:
        print(p.prefill_url, p.decode_url)

In the GPU regime (`--gpu-profile llama8b-h100`, see `testbed`): the same servers with
the emulated model, whose every forward pass lasts as long as that GPU profile says,
a context of GPU_MAX_MODEL_LEN positions (16,384-token prompts and their answers) and
GPU_MAX_BATCHED_TOKENS per step (vLLM's default on an H100). Each server's emulated
steps are recorded in `<its log>.steps.jsonl` (testbed.clock.StepRecord, one JSON line
per forward).

Each server is `python -m vllm.entrypoints.openai.api_server` (the `vllm` console
script does not work for the `vllm-cpu` distribution) with the tiny model from
`testbed.tiny_model`, float32, eager mode, 1 GiB of KV cache, one pinned core (P on
core 0, D on core 1) and its own NIXL side-channel port on 127.0.0.1.

`--prefill-dp N` starts P with `--data-parallel-size N`: N engines behind P's one URL,
rank r's OpenMP threads on core r (modulo the cores: with 2 ranks on 2 cores, P takes
both, and its rank 1 shares core 1 with D), its NIXL side channel and our connector's
push port at the base ports + r (N ports in a row are reserved for each).

Servers start in a new process *group* (never a new session: separate sessions get
separate scheduler autogroups, and on 2 cores one server can then starve the other for
seconds). Stopping sends SIGTERM to the group, then SIGKILL after a bound, so vLLM's
engine-core and worker children go too. Each server logs to its own file; a start that
fails or times out raises `ServerStartError` carrying the log's tail.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from testbed.clock import STEP_LOG_ENV

Role = Literal["prefill", "decode"]

# Ours first: it does pull and push per request (module `connector` of this project).
DUAL_CONNECTOR = "NixlDualConnector"
CONNECTORS = (DUAL_CONNECTOR, "NixlConnector", "NixlPullConnector", "NixlPushConnector")
SERVED_MODEL_NAME = "tiny"
# vLLM's engine-core process names itself "VLLM::EngineCore"; Linux keeps 15 characters.
ENGINE_CORE = "VLLM::EngineCor"
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_DIR = REPO_ROOT / ".cache" / "tiny-model"
DEFAULT_LOG_DIR = REPO_ROOT / ".cache" / "vllm-logs"
DEFAULT_START_TIMEOUT_S = 180.0
DEFAULT_STOP_TIMEOUT_S = 15.0
# Core each role's OpenMP threads are bound to (the machine has 2 cores).
DEFAULT_CPU_BIND: Mapping[Role, str] = {"prefill": "0", "decode": "1"}
LOG_TAIL_LINES = 60
CPU_MAX_MODEL_LEN = 512  # the tiny model at CPU speed: short prompts
# The GPU regime (module docstring). The KV cache (VLLM_CPU_KVCACHE_SPACE, 1 GiB) holds
# about a million of the tiny model's tokens (1 KiB each in float32): many such prompts.
GPU_MAX_MODEL_LEN = 17408
GPU_MAX_BATCHED_TOKENS = 8192
GPU_REGIME_ARGS = ("--max-num-batched-tokens", str(GPU_MAX_BATCHED_TOKENS))
TESTBED_PLUGIN = "pd_proxy_testbed"  # its `vllm.general_plugins` entry point


class ServerStartError(RuntimeError):
    """A vLLM server exited or did not become healthy in time; the message has its log."""


_HANDED_OUT: set[int] = set()


def _listen_ports() -> range:
    """Ports below the kernel's ephemeral range: no outgoing connection can take one in
    the tens of seconds between choosing it and the server binding it."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return range(10000, max(12000, min(low, 32768)))


def free_port(span: int = 1) -> int:
    """A TCP port on 127.0.0.1, free now, outside the ephemeral range, and not handed out
    before by this process (a server binds its ports well after they are chosen); with
    `span`, the first of that many such ports in a row (a data-parallel server's ranks
    offset their ports by the rank)."""
    from testbed.link import DATA_PORTS  # the emulated link's ports: never a server's

    ports = _listen_ports()
    for _ in range(1000):
        port = random.randrange(ports.start, ports.stop - span + 1)
        run = range(port, port + span)
        if any(p in _HANDED_OUT or p in DATA_PORTS for p in run) or not all(map(_bindable, run)):
            continue
        _HANDED_OUT.update(run)
        return port
    raise RuntimeError(f"no {span} free port(s) in a row in {ports.start}-{ports.stop - 1}")


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def kv_transfer_config(connector: str, **extra_config: object) -> str:
    """The `--kv-transfer-config` JSON for a NIXL connector on CPU: vLLM's, or ours (which
    also needs its module, a `push_port`, and recomputes a prompt whose push failed)."""
    config: dict[str, object] = {
        "kv_connector": connector,
        "kv_role": "kv_both",
        "kv_buffer_device": "cpu",
    }
    if connector == DUAL_CONNECTOR:
        config["kv_connector_module_path"] = "connector"
        config["kv_load_failure_policy"] = "recompute"
        extra_config.setdefault("push_port", free_port())
    if extra_config:
        config["kv_connector_extra_config"] = extra_config
    return json.dumps(config)


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"(no log at {path}: {exc})"
    return "\n".join(text.splitlines()[-lines:])


@dataclass(frozen=True, kw_only=True)
class ServerSpec:
    """How to start one vLLM server. `kv_config` is the `--kv-transfer-config` JSON."""

    name: str
    model_dir: Path
    port: int
    log_path: Path
    kv_config: str | None = None
    side_channel_port: int | None = None
    cpu_bind: str = "0"
    host: str = "127.0.0.1"
    max_model_len: int = CPU_MAX_MODEL_LEN
    extra_args: Sequence[str] = ()
    extra_env: Mapping[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def step_log_path(self) -> Path:
        """Where the emulated model (`testbed`) records its steps; others ignore it."""
        return self.log_path.with_suffix(".steps.jsonl")

    def command(self) -> list[str]:
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir),
            "--served-model-name", SERVED_MODEL_NAME,
            "--host", self.host,
            "--port", str(self.port),
            "--dtype", "float32",
            "--max-model-len", str(self.max_model_len),
            "--enforce-eager",
        ]  # fmt: skip
        if self.kv_config is not None:
            cmd += ["--kv-transfer-config", self.kv_config]
        return cmd + list(self.extra_args)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_CPU_OMP_THREADS_BIND=self.cpu_bind,
            # torch puts large allocations, the KV cache among them, on transparent huge
            # pages: NIXL's copies between the servers are faster on them.
            THP_MEM_ALLOC_ENABLE="1",
            VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
            # No usage-stats thread phoning home from a machine with no internet.
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            PYTHONUNBUFFERED="1",
        )
        if self.side_channel_port is not None:
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self.side_channel_port)
        env[STEP_LOG_ENV] = str(self.step_log_path)
        env.update(self.extra_env)
        return env


class VllmServer:
    """One running vLLM server process (and its process group).

    `start()` launches it, `wait_healthy()` blocks until `GET /health` answers 200,
    `stop()` ends the whole process group. Use `run_server()` for a context manager.
    """

    def __init__(self, spec: ServerSpec) -> None:
        self.spec = spec
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at: float | None = None  # time.monotonic() at start()
        self.healthy_after_s: float | None = None

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def start(self) -> None:
        if self.proc is not None:
            raise RuntimeError(f"{self.spec.name} was already started")
        self.spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.spec.log_path, "wb") as log:
            log.write(f"$ {' '.join(self.spec.command())}\n".encode())
            log.flush()
            self.started_at = time.monotonic()
            self.proc = subprocess.Popen(
                self.spec.command(),
                env=self.spec.env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                process_group=0,  # own group, same session: see module docstring
                preexec_fn=_die_with_parent,  # noqa: PLW1509 - only calls libc
            )

    def poll_healthy(self) -> bool:
        """One health check. Raises ServerStartError if the process has exited."""
        if self.proc is None:
            raise RuntimeError(f"{self.spec.name} was not started")
        code = self.proc.poll()
        if code is not None:
            raise ServerStartError(self._failure(f"exited with code {code}"))
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                healthy = bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False
        if healthy and self.healthy_after_s is None and self.started_at is not None:
            self.healthy_after_s = time.monotonic() - self.started_at
        return healthy

    def wait_healthy(self, timeout_s: float = DEFAULT_START_TIMEOUT_S) -> None:
        wait_all_healthy([self], timeout_s=timeout_s)

    def stop(self, timeout_s: float = DEFAULT_STOP_TIMEOUT_S) -> int | None:
        """SIGTERM the process group, SIGKILL it after `timeout_s`; return the exit code."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        # The leader may have exited while children (engine core, workers) linger.
        _signal_group(proc.pid, signal.SIGKILL)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        return proc.returncode

    def rss_bytes(self) -> int:
        """Resident memory of the whole process group (server, engine core, workers)."""
        if self.proc is None:
            return 0
        return _group_rss_bytes(self.proc.pid)

    def cpu_seconds(self, process: str | None = None) -> float:
        """CPU time used so far by the whole process group, all threads, user + system;
        or only by its processes whose name starts with `process` (vLLM names its own,
        such as ENGINE_CORE)."""
        if self.proc is None:
            return 0.0
        tick = os.sysconf("SC_CLK_TCK")
        return sum(_group_stats(self.proc.pid, lambda stat: (
            int(stat[_STAT_UTIME]) + int(stat[_STAT_STIME])) / tick, process))

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return log_tail(self.spec.log_path, lines)

    def _failure(self, what: str) -> str:
        return (
            f"vLLM {self.spec.name} server ({self.url}) {what}; "
            f"log {self.spec.log_path}, last lines:\n{self.log_tail()}"
        )


def _load_libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
    except OSError:
        return None


_LIBC = _load_libc()  # loaded here: the child must not import or load after fork()
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the parent dies (Linux only).

    Keeps a crashed or SIGKILLed test run from leaving servers behind; vLLM's engine
    processes already exit when the API server does. It only calls into libc, so it
    is safe as a `preexec_fn` even with other threads in the parent.
    """
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


# Positions in a /proc/PID/stat line's fields after the command name (0: the state):
# user and system CPU time in clock ticks, resident memory in pages (proc(5)).
_STAT_UTIME, _STAT_STIME, _STAT_RSS = 11, 12, 21


def _group_stats(pgid: int, field: Callable[[list[str]], float],
                 name_prefix: str | None = None) -> list[float]:
    """`field` of each live process in the group (or of those whose name starts with
    `name_prefix`), from its /proc/PID/stat fields (the list starts after the process
    name, at the state field)."""
    values = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) != pgid:
                continue
            stat = (entry / "stat").read_text()
            name_end = stat.rindex(")")  # the name may itself hold parentheses
            if name_prefix is not None and \
                    not stat[stat.index("(") + 1:name_end].startswith(name_prefix):
                continue
            values.append(field(stat[name_end + 2:].split()))
        except (OSError, ValueError, IndexError):
            continue
    return values


def _group_rss_bytes(pgid: int) -> int:
    page = os.sysconf("SC_PAGE_SIZE")
    return int(sum(_group_stats(pgid, lambda stat: int(stat[_STAT_RSS]) * page)))


def wait_all_healthy(
    servers: Sequence[VllmServer], *, timeout_s: float = DEFAULT_START_TIMEOUT_S
) -> None:
    """Wait until every server answers /health; raise ServerStartError naming the culprit."""
    deadline = time.monotonic() + timeout_s
    pending = list(servers)
    while pending:
        pending = [server for server in pending if not server.poll_healthy()]
        if not pending:
            return
        if time.monotonic() > deadline:
            raise ServerStartError(pending[0]._failure(f"was not healthy after {timeout_s:.0f} s"))
        time.sleep(0.5)


@contextlib.contextmanager
def run_servers(
    specs: Sequence[ServerSpec], *, start_timeout_s: float = DEFAULT_START_TIMEOUT_S
) -> Iterator[list[VllmServer]]:
    """Start all servers at once, wait until all are healthy, stop all on exit."""
    servers = [VllmServer(spec) for spec in specs]
    try:
        for server in servers:
            server.start()
        wait_all_healthy(servers, timeout_s=start_timeout_s)
        yield servers
    finally:
        for server in servers:
            server.stop()


@contextlib.contextmanager
def run_server(
    spec: ServerSpec, *, start_timeout_s: float = DEFAULT_START_TIMEOUT_S
) -> Iterator[VllmServer]:
    """Start one server, wait until healthy, yield it, stop it on exit."""
    with run_servers([spec], start_timeout_s=start_timeout_s) as (server,):
        yield server


def server_spec(
    role: Role,
    *,
    connector: str | None,
    model_dir: Path = DEFAULT_MODEL_DIR,
    port: int | None = None,
    side_channel_port: int | None = None,
    log_dir: Path = DEFAULT_LOG_DIR,
    name: str | None = None,
    kv_extra_config: Mapping[str, object] | None = None,
    extra_args: Sequence[str] = (),
    extra_env: Mapping[str, str] | None = None,
    max_model_len: int = CPU_MAX_MODEL_LEN,
    data_parallel_size: int = 1,
) -> ServerSpec:
    """A spec for one P or D server; `connector=None` gives a plain server (no KV transfer).
    `data_parallel_size` N > 1: N engines (`--data-parallel-size`), rank r on core r
    modulo the cores, each rank's side channel and push port r above the base."""
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be at least 1, got {data_parallel_size}")
    port = port or free_port()
    name = name or role
    cpu_bind = DEFAULT_CPU_BIND[role]
    if data_parallel_size > 1:
        cores = os.cpu_count() or 1
        cpu_bind = "|".join(str(rank % cores) for rank in range(data_parallel_size))
        extra_args = (*extra_args, "--data-parallel-size", str(data_parallel_size))
        if connector == DUAL_CONNECTOR:
            kv_extra_config = {"push_port": free_port(data_parallel_size),
                               **dict(kv_extra_config or {})}
    return ServerSpec(
        name=name,
        model_dir=Path(model_dir),
        port=port,
        log_path=Path(log_dir) / f"{name}-{port}.log",
        kv_config=(
            None if connector is None
            else kv_transfer_config(connector, **dict(kv_extra_config or {}))
        ),
        side_channel_port=(
            None if connector is None else side_channel_port or free_port(data_parallel_size)
        ),
        cpu_bind=cpu_bind,
        extra_args=tuple(extra_args),
        extra_env=dict(extra_env or {}),
        max_model_len=max_model_len,
    )  # fmt: skip


@dataclass(frozen=True)
class Pair:
    """A running P/D pair."""

    connector: str
    prefill: VllmServer
    decode: VllmServer
    prefill_dp: int = 1  # P's data-parallel size

    @property
    def prefill_url(self) -> str:
        return self.prefill.url

    @property
    def decode_url(self) -> str:
        return self.decode.url


@contextlib.contextmanager
def pair(
    connector: str = "NixlConnector",
    *,
    model_dir: Path = DEFAULT_MODEL_DIR,
    prefill_port: int | None = None,
    decode_port: int | None = None,
    prefill_side_channel_port: int | None = None,
    decode_side_channel_port: int | None = None,
    log_dir: Path = DEFAULT_LOG_DIR,
    kv_extra_config: Mapping[str, object] | None = None,
    extra_args: Sequence[str] = (),
    extra_env: Mapping[str, str] | None = None,
    max_model_len: int = CPU_MAX_MODEL_LEN,
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
    prefill_dp: int = 1,
) -> Iterator[Pair]:
    """Start a P and a D server concurrently with the same connector; yield the `Pair`.

    Ports left as None are picked free. Both servers are stopped on exit, also when
    one of them fails to start (the error names it and carries its log tail).
    `prefill_dp` N > 1 starts P data-parallel (see `server_spec`).
    """
    if connector not in CONNECTORS:
        raise ValueError(f"connector must be one of {CONNECTORS}, got {connector!r}")

    def spec(role: Role, port: int | None, side_channel_port: int | None) -> ServerSpec:
        return server_spec(
            role,
            connector=connector,
            model_dir=model_dir,
            port=port,
            side_channel_port=side_channel_port,
            log_dir=log_dir,
            kv_extra_config=kv_extra_config,
            extra_args=extra_args,
            extra_env=extra_env,
            max_model_len=max_model_len,
            data_parallel_size=prefill_dp if role == "prefill" else 1,
        )

    specs = [
        spec("prefill", prefill_port, prefill_side_channel_port),
        spec("decode", decode_port, decode_side_channel_port),
    ]
    with run_servers(specs, start_timeout_s=start_timeout_s) as (prefill, decode):
        yield Pair(connector=connector, prefill=prefill, decode=decode, prefill_dp=prefill_dp)


def require_testbed_plugin() -> None:
    """Fail clearly when vLLM would not find the emulated model: its plugin is an entry
    point of the testbed's own distribution (testbed/pyproject.toml), which
    scripts/setup.sh installs with `pip install -e ./testbed` (pd-proxy registers none)."""
    from importlib.metadata import entry_points

    if TESTBED_PLUGIN not in {ep.name for ep in entry_points(group="vllm.general_plugins")}:
        raise ServerStartError(
            f"vLLM plugin {TESTBED_PLUGIN!r} is not installed in {sys.prefix}: run "
            "`bash scripts/setup.sh` (or `pip install -e ./testbed`) again so that vLLM "
            "can load the emulated GPU model"
        )


def gpu_model_dir(profile: str, tiny_dir: Path = DEFAULT_MODEL_DIR, layers: int = 1) -> Path:
    """The emulated model for a GPU profile (`testbed`) with `layers` decoder layers,
    derived from the tiny model (both built on first use)."""
    from testbed import model_dir
    from testbed.tiny_model import build

    require_testbed_plugin()
    return model_dir.build(build(tiny_dir), profile, layers=layers)


@dataclass(frozen=True)
class Regime:
    """What a server needs for the CPU regime (the tiny model as is) or a GPU profile's."""

    model_dir: Path
    max_model_len: int = CPU_MAX_MODEL_LEN
    extra_args: tuple[str, ...] = ()


def _regime(args: argparse.Namespace) -> Regime:
    from testbed.tiny_model import build

    if args.gpu_profile is None:
        return Regime(model_dir=build(args.model_dir))
    from testbed.profiles import get_profile

    print(get_profile(args.gpu_profile).describe(), flush=True)
    return Regime(
        model_dir=gpu_model_dir(args.gpu_profile, args.model_dir),
        max_model_len=GPU_MAX_MODEL_LEN,
        extra_args=GPU_REGIME_ARGS,
    )


def _cmd_pair(args: argparse.Namespace) -> int:
    regime = _regime(args)
    print(f"starting {args.connector} pair (logs in {args.log_dir}) ...", flush=True)
    started = time.monotonic()
    with pair(
        args.connector,
        model_dir=regime.model_dir,
        prefill_port=args.prefill_port,
        decode_port=args.decode_port,
        prefill_side_channel_port=args.prefill_side_channel_port,
        decode_side_channel_port=args.decode_side_channel_port,
        log_dir=args.log_dir,
        extra_args=regime.extra_args,
        max_model_len=regime.max_model_len,
        start_timeout_s=args.start_timeout,
        prefill_dp=args.prefill_dp,
    ) as p:
        print(f"healthy after {time.monotonic() - started:.1f} s", flush=True)
        print(
            f"prefill: {p.prefill_url}  (side channel "
            f"{p.prefill.spec.side_channel_port}, log {p.prefill.spec.log_path})"
        )
        if args.prefill_dp > 1:
            print(f"prefill: {args.prefill_dp} data-parallel ranks; rank r's side channel "
                  "and push port are the base + r, its threads on core r "
                  f"(modulo {os.cpu_count()} cores)")
        print(
            f"decode:  {p.decode_url}  (side channel "
            f"{p.decode.spec.side_channel_port}, log {p.decode.spec.log_path})"
        )
        if args.gpu_profile is not None:
            print(f"emulated steps: {p.prefill.spec.step_log_path}, "
                  f"{p.decode.spec.step_log_path}")
        print("Ctrl-C to stop.", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(1)
                for server in (p.prefill, p.decode):
                    server.poll_healthy()  # raises if a server died
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    regime = _regime(args)
    spec = server_spec(
        args.role,
        connector=args.connector,
        model_dir=regime.model_dir,
        port=args.port,
        side_channel_port=args.side_channel_port,
        log_dir=args.log_dir,
        extra_args=regime.extra_args,
        max_model_len=regime.max_model_len,
    )
    with run_server(spec, start_timeout_s=args.start_timeout) as server:
        print(f"{args.role}: {server.url}  (log {spec.log_path}); Ctrl-C to stop.", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(1)
                server.poll_healthy()
    return 0


def _gpu_profiles() -> list[str]:
    from testbed.profiles import PROFILES

    return sorted(PROFILES)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m testbed.vllm_cpu",
        description=(
            "Start real vLLM servers on CPU with the tiny test model (built on first "
            "use) for prefill/decode disaggregation. Servers stay up until Ctrl-C."
        ),
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--model-dir",
        type=Path,
        default=DEFAULT_MODEL_DIR,
        help="tiny model directory, built if missing (default: %(default)s)",
    )
    common.add_argument(
        "--log-dir",
        type=Path,
        default=DEFAULT_LOG_DIR,
        help="where server logs go (default: %(default)s)",
    )
    common.add_argument(
        "--start-timeout",
        type=float,
        default=DEFAULT_START_TIMEOUT_S,
        help="seconds to wait for /health (default: %(default)s)",
    )
    common.add_argument(
        "--gpu-profile",
        choices=_gpu_profiles(),
        default=None,
        help="serve the emulated model, each forward pass as long as this GPU profile "
             f"says, with a {GPU_MAX_MODEL_LEN:,}-token context (default: none, the tiny "
             "model at CPU speed); steps are recorded beside each server's log "
             "(*.steps.jsonl)",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p_pair = sub.add_parser(
        "pair",
        parents=[common],
        help="start a prefill and a decode server",
        description="Start P (core 0) and D (core 1) concurrently and print their URLs.",
    )
    p_pair.add_argument(
        "--connector",
        choices=CONNECTORS,
        default="NixlConnector",
        help="KV connector on both servers: ours (NixlDualConnector: pull and push per "
             "request) or one of vLLM's (default: %(default)s)",
    )
    p_pair.add_argument(
        "--prefill-port", type=int, default=8100, help="HTTP port of P (default: %(default)s)"
    )
    p_pair.add_argument(
        "--decode-port", type=int, default=8200, help="HTTP port of D (default: %(default)s)"
    )
    p_pair.add_argument(
        "--prefill-side-channel-port",
        type=int,
        default=None,
        help="NIXL side-channel port of P (default: a free port)",
    )
    p_pair.add_argument(
        "--decode-side-channel-port",
        type=int,
        default=None,
        help="NIXL side-channel port of D (default: a free port)",
    )
    p_pair.add_argument(
        "--prefill-dp",
        type=int,
        default=1,
        metavar="N",
        help="start P with --data-parallel-size N: N engines behind its URL, rank r on "
             "core r modulo the cores (2 on this 2-core machine: P takes both), side "
             "channel and push ports offset by the rank (default: %(default)s)",
    )
    p_pair.set_defaults(func=_cmd_pair)

    p_serve = sub.add_parser(
        "serve",
        parents=[common],
        help="start one server",
        description="Start one server, e.g. a plain one (no connector) as a reference.",
    )
    p_serve.add_argument(
        "--role",
        choices=("prefill", "decode"),
        default="prefill",
        help="which core to pin to: prefill=0, decode=1 (default: %(default)s)",
    )
    p_serve.add_argument(
        "--connector",
        choices=CONNECTORS,
        default=None,
        help="KV connector (default: none, a plain server)",
    )
    p_serve.add_argument("--port", type=int, default=8000, help="HTTP port (default: %(default)s)")
    p_serve.add_argument(
        "--side-channel-port",
        type=int,
        default=None,
        help="NIXL side-channel port (default: a free port)",
    )
    p_serve.set_defaults(func=_cmd_serve)
    return parser


def _stop_on_signals() -> None:
    """Make Ctrl-C and SIGTERM unwind normally, so the servers get stopped.

    A shell starts background jobs with SIGINT ignored, and Python's default for
    SIGTERM is to die without running `finally` blocks.
    """

    def raise_interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, raise_interrupt)
    signal.signal(signal.SIGTERM, raise_interrupt)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _stop_on_signals()
    try:
        return int(args.func(args))
    except ServerStartError as exc:
        print(exc, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
