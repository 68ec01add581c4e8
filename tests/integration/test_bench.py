"""The benchmark suite's command on emulated backends: a short pass writes the JSON
result and the PNG plots, measures against a second router started by --compare-cmd,
and keeps many streams open at once through the router."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from proxy.serve import request_path_build
from tests.conftest import until_sync

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_a_short_bench_writes_results_ratios_and_plots(tmp_path: Path) -> None:
    peer = f"{sys.executable} -m proxy serve --prefill {{prefill}} --decode {{decode}} " \
           "--port {port} --log-level warning"
    # a second, named one: as another checkout of the router would be, for before/after
    before = f"before={sys.executable} -m proxy serve --prefill {{prefill}} " \
             "--decode {decode} --port {port} --log-level warning --workers 1"
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "scripts.bench", "--scenarios", "overhead,streams", "--quick",
         "--concurrency", "1,8", "--seconds", "0.5", "--loader", "python", "--streams", "60",
         "--token-delay", "0.1", "--slow-clients", "2", "--compare-cmd", peer,
         "--compare-cmd", before, "--out", str(out), "--plots", str(tmp_path)],
        capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())

    rows = result["overhead"]["rows"]
    targets = {r["target"] for r in rows}
    assert targets == {"direct", "ours-pull", "ours-push", "peer", "before"}
    assert len(rows) == 5 * 2 * 2  # targets x concurrencies x (streamed or not)
    assert all(r["errors"] == 0 and r["req_per_s"] > 0 and r["latency_ms"]["p50"] > 0 for r in rows)
    assert all(r["cpu_s_per_1000"] > 0 for r in rows
               if r["target"] in ("ours-pull", "peer", "before"))
    # the split adds up to the whole (each part rounded on its own)
    assert all(abs(r["cpu_user_s_per_1000"] + r["cpu_system_s_per_1000"] - r["cpu_s_per_1000"])
               <= 0.001 and r["cpu_user_s_per_1000"] > 0 for r in rows if "cpu_s_per_1000" in r)
    assert {r["loader"] for r in rows} == {"python"}

    summary = result["summary"]
    assert summary["router_cpu_s_per_1000_requests"] > 0
    for point in ("c1", "c8", "c1-stream", "c8-stream"):
        assert 0 < summary["ratios"][f"ours-pull/direct {point}"]
        assert 0 < summary["ratios"][f"ours-pull/peer {point}"]
        assert 0 < summary["ratios"][f"ours-pull/before {point}"]
        assert 0 < summary["cpu_per_request_ratios"][f"ours-pull/before {point}"]
        user, system = summary["router_cpu_us_per_request_user_system"][f"ours-pull {point}"]
        assert user > 0 and system >= 0

    streams = result["streams"]
    assert streams["errors"] == 0
    assert streams["peak_streams_open"] >= 50, "the streams were not open at once"
    assert streams["router_peak_rss_mib"] > 0 and len(streams["slow_client_bytes"]) == 2
    assert all(n >= 1 for n in streams["slow_client_bytes"]), "a slow client got nothing"

    for name in ("throughput.png", "latency_cdf.png"):
        assert (tmp_path / name).read_bytes().startswith(PNG_MAGIC), name
    assert "done in" in done.stdout


def test_bench_help_explains_the_scenarios() -> None:
    done = subprocess.run([sys.executable, "-m", "scripts.bench", "--help"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    for word in ("overhead", "streams", "real", "--compare", "--quick"):
        assert word in done.stdout


def test_kv_aware_overhead_measures_both_policies_against_caching_fakes(tmp_path: Path) -> None:
    """--kv-aware: a kv_aware router beside the default one, on two emulated P and D whose
    prefix caches publish KV events, with a prompt of --prompt-tokens tokens; the summary
    has the kv_aware router's CPU per request over the default's."""
    for token_ids in (False, True):
        out = tmp_path / f"kv-{token_ids}.json"
        done = subprocess.run(
            [sys.executable, "-m", "scripts.bench", "--scenarios", "overhead", "--quick",
             "--kv-aware", "--prompt-tokens", "64", *(["--token-ids"] if token_ids else []),
             "--modes", "pull", "--concurrency", "4", "--seconds", "0.5", "--no-stream",
             "--loader", "python", "--out", str(out), "--plots", str(tmp_path)],
            capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        result = json.loads(out.read_text())
        overhead = result["overhead"]
        assert overhead["prompt_tokens"] == 64 and overhead["token_ids"] is token_ids
        assert len(overhead["backends"]["prefill"]) == 2 == len(overhead["backends"]["decode"])
        rows = overhead["rows"]
        assert {r["target"] for r in rows} == {"direct", "ours-pull", "ours-kv-pull"}
        assert all(r["errors"] == 0 and r["req_per_s"] > 0 for r in rows)
        summary = result["summary"]
        assert summary["kv_aware_cpu_ratios"]["ours-kv-pull/ours-pull c4"] > 0
        assert summary["router_cpu_ms_per_request"]["ours-kv-pull c4"] > 0


def test_profile_splits_the_routers_cpu_per_request_by_stage(tmp_path: Path) -> None:
    """--scenarios profile: our router under the CPU-time sampler, its CPU per request
    and each stage's share; the kept stacks are py-spy's raw format."""
    out, stacks = tmp_path / "profile.json", tmp_path / "stacks.txt"
    done = subprocess.run(
        [sys.executable, "-m", "scripts.bench", "--scenarios", "profile", "--concurrency", "4",
         "--profile-seconds", "2", "--loader", "python", "--profile-keep", str(stacks),
         "--out", str(out), "--plots", str(tmp_path)],
        capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    profile = json.loads(out.read_text())["profile"]
    assert profile["errors"] == 0 and profile["cpu_us_per_request"] > 0
    assert profile["samples"] >= 50  # a sample a CPU millisecond, over seconds of load
    stages = profile["stages"]
    assert abs(sum(stages.values()) - 1) < 0.01
    # the request path's own stages are seen, and start-up (imports) is not sampled; a
    # compiled module (setup.py) has no Python frames to sample: only the interpreted
    # event loop around it is seen then
    compiled = request_path_build() == "compiled"
    for stage in ("event loop, tasks, context managers",) if compiled else (
            "upstream HTTP client (pool, parsing, deadlines)",
            "flow: modes, legs, relaying, access log"):
        assert stages.get(stage, 0) > 0, stages
    lines = stacks.read_text().splitlines()
    assert lines and all(line.rpartition(" ")[2].isdigit() for line in lines)
    assert not any("_find_and_load" in line for line in lines)


def bench_path(*args: str) -> str:
    """`scripts.bench_path` with `args`, which must succeed; its output."""
    done = subprocess.run([sys.executable, "-m", "scripts.bench_path", *args],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


def test_the_path_bench_measures_ours_and_the_floor_in_one_process() -> None:
    """`scripts.bench_path`: CPU and Python calls per request for our router and for the
    floor router, each answered with 200 (the harness fails the run otherwise)."""
    out = bench_path("-n", "500", "-c", "8", "--calls")
    found = dict(re.findall(r"round 1 (\w+): [\d.]+ us CPU per request under cProfile, ([\d.]+) Python calls",
                            out))
    assert set(found) == {"ours", "floor"}, out
    if request_path_build() == "compiled":  # (setup.py) only the harness's and a few left
        assert float(found["floor"]) > float(found["ours"]) > 10, found
    else:  # the router's features cost calls the floor does not make
        assert float(found["ours"]) > float(found["floor"]) > 10, found
    assert "ours / floor, CPU per request:" in out


def test_the_path_bench_counts_bytecodes_per_request_and_names_the_functions() -> None:
    """`scripts.bench_path --bytecodes N`: the bytecodes executed per request (the same
    count within a few every run) for our router and the floor, the N functions and files
    that execute the most (ours: its own code among them), and ours over the floor in
    bytecodes."""
    out = bench_path("-n", "200", "-c", "4", "--bytecodes", "5")
    found = dict(re.findall(r"round 1 (\w+): [\d.]+ us CPU per request traced, (\d+) bytecodes",
                            out))
    assert set(found) == {"ours", "floor"}, out
    compiled = request_path_build() == "compiled"
    if compiled:  # interpreted, the floor runs more than ours (and the harness most)
        assert int(found["floor"]) > int(found["ours"]) > 100, found
    else:
        assert int(found["ours"]) > int(found["floor"]) > 100, found
    rows = re.findall(r"^ +([\d.]+) +([\d.]+)  (\S+):(\d+) (\S+)$", out, re.MULTILINE)
    assert len(rows) == 10, out  # five a target
    if not compiled:
        assert any(path.startswith("proxy/") for _, _, path, _, _ in rows[:5]), rows
    files = re.findall(r"^ +([\d.]+) +(\S+) \(the file's functions\)$", out, re.MULTILINE)
    assert len(files) == 10, out
    # compiled, the router's own interpreted code is little more than each task's first
    # frame (proxy/task_scope.py)
    assert any(path.startswith("proxy/") for _, path in files[:5]), files
    assert "ours / floor, bytecodes per request:" in out


def test_the_path_bench_compares_kv_aware_with_the_default_policy_on_the_same_fakes() -> None:
    """`scripts.bench_path --target ours,kv`: kv_aware (its index in sync with the fakes'
    KV events before anything is measured) makes more calls per request than the default
    policy, and the ratio of their CPU is printed. (Compiled, setup.py, its tokenizing,
    scoring and metrics make no Python calls.)"""
    out = bench_path("--target", "ours,kv", "--servers", "2", "--prompt-tokens", "64",
                     "-n", "500", "-c", "8", "--calls")
    found = dict(re.findall(r"round 1 (\w+): [\d.]+ us CPU per request under cProfile, ([\d.]+) Python calls",
                            out))
    assert set(found) == {"ours", "kv"}, out
    if request_path_build() == "compiled":  # its work and its metrics make no Python call
        assert float(found["kv"]) >= float(found["ours"]), found
    else:  # tokenizing, scoring, credit
        assert float(found["kv"]) > float(found["ours"]) + 20, found
    assert "kv / ours, CPU per request:" in out


# Every scenario of `python -m scripts.bench SCENARIO`, and what its own --help starts with:
# this module's own scenarios, or the usage line of the script that runs it.
SCENARIO_HELP = {
    "overhead": "usage: python -m scripts.bench overhead",
    "streams": "usage: python -m scripts.bench streams",
    "real": "usage: python -m scripts.bench real",
    "profile": "usage: python -m scripts.bench profile",
    "push": "usage: python -m scripts.bench_push",
    "regime": "usage: python -m scripts.bench_regime",
    "idle": "usage: python -m scripts.bench_idle",
    "memory": "usage: python -m scripts.bench_memory",
    "path": "usage: python -m scripts.bench_path",
    "nixl": "usage: python -m scripts.bench_nixl",
    "soak": "usage: python -m scripts.soak",
    "drill": "usage: python -m scripts.bench drill {flood,stall}",
    "drill flood": "usage: python -m scripts.drill_flood",
    "drill stall": "usage: python -m scripts.drill_stall",
    "kv-routing": "usage: python -m scripts.bench_cache",
    "tokenize": "usage: python -m scripts.bench_tokenize",
    "xpyd": "usage: python -m scripts.bench_proxy",
}


def test_one_command_lists_every_scenario_and_each_gives_its_own_help() -> None:
    """`python -m scripts.bench --help` names every scenario, and `python -m scripts.bench
    SCENARIO --help` exits 0 with that scenario's own help, which says what it leaves out;
    an unknown scenario is refused."""
    listed = subprocess.run([sys.executable, "-m", "scripts.bench", "--help"],
                            capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    for name in SCENARIO_HELP:
        assert f"\n  {name} " in listed.stdout, f"--help does not list {name}"
    helps = {name: subprocess.Popen([sys.executable, "-m", "scripts.bench", *name.split(),
                                     "--help"], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
             for name in SCENARIO_HELP}
    for name, started in helps.items():
        out, err = started.communicate(timeout=120)
        assert started.returncode == 0, f"{name} --help: {err[-2000:]}"
        assert out.startswith(SCENARIO_HELP[name]), f"{name} --help:\n{out[:500]}"
        assert "leaves out" in out.lower(), f"{name} --help says not what it leaves out"
    unknown = subprocess.run([sys.executable, "-m", "scripts.bench", "no-such-scenario"],
                             capture_output=True, text=True, timeout=60)
    assert unknown.returncode == 2 and "unknown scenario" in unknown.stderr


def test_each_scripts_own_module_command_still_runs() -> None:
    """The module commands the docs cite (`python -m scripts.bench_push` and the like) run
    as before: each gives the same help as its scenario does."""
    modules = {usage.removeprefix("usage: python -m ") for usage in SCENARIO_HELP.values()
               if not usage.startswith("usage: python -m scripts.bench ")}
    helps = {module: subprocess.Popen([sys.executable, "-m", module, "--help"],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for module in modules}
    for module, started in helps.items():
        out, err = started.communicate(timeout=120)
        assert started.returncode == 0, f"{module} --help: {err[-2000:]}"
        assert out.startswith(f"usage: python -m {module} "), out[:300]


async def test_the_path_bench_stops_at_an_answer_other_than_200() -> None:
    """`scripts.bench_path`'s client fails the run at once on a 500 (a router that broke
    the path must not hang the bench until its timeout, nor pass as measured)."""
    from scripts.bench_path import BenchFailed, _load

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\n\r\n")
        await writer.drain()
        await reader.read()  # until the client closes
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    async with server:
        port = server.sockets[0].getsockname()[1]
        started = time.monotonic()
        with pytest.raises(BenchFailed, match="answered 500"):
            await _load(port, 100, 4, False, None)
        assert time.monotonic() - started < 10


def test_a_bench_stopped_by_sigterm_stops_the_servers_it_started() -> None:
    """A SIGTERM to the bench (a `timeout`, a `kill`) stops the emulated servers and the
    routers it started, each in its own process group, with it: none is left holding its
    ports for the next run."""
    from scripts.benchkit import ProcessGauge

    bench = subprocess.Popen(
        [sys.executable, "-m", "scripts.bench", "overhead", "--modes", "pull", "--concurrency",
         "1", "--seconds", "60", "--loader", "python", "--no-stream", "--out", "/dev/null"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    def servers_up() -> list[int]:
        """The emulated P and D and our router, once the router answers: the bench is
        measuring then."""
        assert bench.poll() is None, "the bench ended before its servers were up"
        servers = [pid for pid in ProcessGauge(bench.pid)._tree()
                   if pid != bench.pid and _command(pid)[2:4] in (["proxy", "serve"],
                                                                  ["scripts.bench", "--serve-fake"])]
        return servers if len(servers) >= 3 and _answers(servers) else []

    try:
        servers = until_sync(servers_up, "the bench's 3 servers up", 60)
        bench.terminate()
        assert bench.wait(30) == 128 + 15  # through its `finally`s, not killed outright
        until_sync(lambda: not [pid for pid in servers if _running(pid)],
                   f"none of the bench's servers {servers} left running", 15)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()


def _command(pid: int) -> list[str]:
    """The command line of process `pid` (empty once it has ended)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().split("\0")
    except FileNotFoundError:
        return []


def _answers(servers: list[int]) -> bool:
    """Whether the router among `servers` (`python -m proxy serve ... --port N`) accepts
    connections on its port."""
    for pid in servers:
        command = _command(pid)
        if command[2:4] == ["proxy", "serve"]:
            port = int(command[command.index("--port") + 1])
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
            except OSError:
                return False
            return True
    return False


def _running(pid: int) -> bool:
    """Whether `pid` still runs (a zombie, ended but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


async def _fake_decode(delay_s: float = 0.0) -> asyncio.Server:
    from scripts.benchkit import _FakeProtocol

    return await asyncio.get_running_loop().create_server(
        lambda: _FakeProtocol("decode", delay_s=delay_s), "127.0.0.1", 0)


async def test_the_python_loader_offers_a_fixed_rate_in_an_open_loop() -> None:
    """`--rate`'s loader starts its requests on a schedule: the offered count is sent and
    answered in about the scheduled time, none waits for a slot when the server keeps
    up; one that can only hold one request at a time makes them wait, and their
    latencies count from the schedule (they grow past the server's own delay)."""
    from scripts.benchkit import python_load

    server = await _fake_decode()
    async with server:
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/completions"
        result = await python_load(url, seconds=1.0, concurrency=8, stream=False, headers={},
                                   rate=200)
        assert result["requests"] == 200 and result["errors"] == 0
        assert result["offered_per_s"] == 200 and result["waited"] == 0
        assert 150 <= result["req_per_s"] <= 205, result  # 200 sent over about 1 s
    slow = await _fake_decode(delay_s=0.02)  # at most 50 answers/s on one connection
    async with slow:
        url = f"http://127.0.0.1:{slow.sockets[0].getsockname()[1]}/v1/completions"
        behind = await python_load(url, seconds=0.5, concurrency=1, stream=False, headers={},
                                   rate=200)
        assert behind["requests"] == 100 and behind["errors"] == 0
        assert behind["waited"] > 50, behind
        assert behind["req_per_s"] < 60, behind
        # the last requests waited for most of the run: counted from their schedule
        assert behind["latency_ms"]["p99"] > 1000, behind


def test_an_offered_rate_needs_the_python_loader() -> None:
    """wrk loads in a closed loop: `--rate` with it is refused, as is a rate <= 0."""
    for loader, rate in (("wrk", "100"), ("python", "0")):
        refused = subprocess.run([sys.executable, "-m", "scripts.bench", "overhead",
                                  "--loader", loader, "--rate", rate],
                                 capture_output=True, text=True, timeout=60)
        assert refused.returncode == 2 and "--rate takes" in refused.stderr, refused.stderr


def test_the_path_bench_runs_with_health_checks_off_and_refuses_a_negative_interval() -> None:
    """`scripts.bench_path --health-interval 0` (for runs under valgrind) builds a valid
    router config with health checks off and measures ours; a negative interval is
    refused before anything starts."""
    out = bench_path("--target", "ours", "-n", "300", "-c", "8", "--health-interval", "0")
    assert re.search(r"round 1 ours: [\d.]+ us CPU per request", out), out
    refused = subprocess.run([sys.executable, "-m", "scripts.bench_path", "--health-interval",
                              "-1"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--health-interval must be >= 0" in refused.stderr
