"""The router installs and runs on its own: a plain install of the built wheel serves.

    .venv/bin/python -m scripts.check_install          (CI runs it before the tests)

Steps (each printed with its time; about 3-4 minutes on a 2-core machine, most of it the
C compiler on the request path):
1. build pd-proxy's wheel from a copy of this checkout's files (tracked and untracked, not
   ignored), so that nothing left over in the working tree ends up in it: its request path
   compiled by mypyc (setup.py), unless PDPROXY_COMPILE=0;
2. install it, with no extras, into a new virtual environment in a temporary folder:
   only its declared dependencies come with it (no vLLM, no test tools);
3. in that environment: every module of `proxy` imports (but `proxy.pool.discovery`, the
   `kubernetes` extra's), no vLLM plugin is registered (`vllm.general_plugins` is empty),
   vLLM is not installed and pd-proxy's files hold no testbed, scripts or tests, the
   request path's modules are the compiled ones (unless PDPROXY_COMPILE=0); a config
   that asks for Kubernetes discovery, or for tracing, is refused with a message naming
   the extra;
4. two fake vLLM servers (`testbed.fake_vllm`, run from this checkout's environment: test
   tooling, not in the wheel) as P and D, and the installed `pd-proxy serve` in front of
   them, run from the temporary folder; one completion in each of pull, push and local
   must answer 200 with D's tokens, saying the mode it used.
Every wait is bounded; on a failure the router's log is printed. Exit status 0 when all
holds, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from connector.protocol.http_params import TRANSFER_MODE_HEADER
from testbed.ports import free_port

REPO_ROOT = Path(__file__).resolve().parents[1]
BUILD_TIMEOUT_S = 900  # mypyc compiles the request path: about 3 minutes on 2 cores
VENV_TIMEOUT_S = 120
INSTALL_TIMEOUT_S = 300  # pip fetches the dependencies (from its cache after setup.sh)
PROBE_TIMEOUT_S = 60
START_TIMEOUT_S = 30  # a fake server or the router answering its /health
REQUEST_TIMEOUT_S = 10
FAKE_MODEL = "fake-model"  # what testbed.fake_vllm serves
# Modules of `proxy` that need an extra, and the extra.
EXTRA_MODULES = {"proxy.pool.discovery": "kubernetes"}
# Test and benchmark tooling, which pd-proxy's wheel must not ship.
TOOLING = ("testbed", "scripts", "tests")
# Run in the clean environment: what the install holds, as JSON.
PROBE = """
import importlib, importlib.util, json, pkgutil, sys
from importlib.metadata import entry_points, files
skip, tooling = json.loads(sys.argv[1]), json.loads(sys.argv[2])
failed = {}
def load(name):
    try:
        return importlib.import_module(name)
    except Exception as exc:
        failed[name] = f"{type(exc).__name__}: {exc}"
proxy = load("proxy")
for info in pkgutil.walk_packages(proxy.__path__ if proxy else [], "proxy.", lambda name: None):
    if info.name not in skip and not info.name.endswith(".__main__"):
        load(info.name)
print(json.dumps({
    "proxy": proxy.__file__ if proxy else None,
    "failed": failed,
    "plugins": sorted(ep.value for ep in entry_points(group="vllm.general_plugins")),
    "tooling": sorted({f.parts[0] for f in files("pd-proxy") or []} & set(tooling)),
    "vllm": importlib.util.find_spec("vllm") is not None,
    "pure": [name for name in json.loads(sys.argv[3])
             if importlib.util.find_spec(name).origin.endswith(".py")],
}))
"""
KUBERNETES_CONFIG = """\
prefill: [{url: "http://127.0.0.1:9"}]
decode: [{url: "http://127.0.0.1:9"}]
discovery:
  kubernetes: {namespace: llm, prefill_selector: "role=p", decode_selector: "role=d"}
"""
TRACING_CONFIG = """\
prefill: [{url: "http://127.0.0.1:9"}]
decode: [{url: "http://127.0.0.1:9"}]
tracing: {enabled: true}
"""
# A config that needs an extra, and the extra its refusal must name.
NEEDS_EXTRA = {"Kubernetes discovery": (KUBERNETES_CONFIG, "kubernetes"),
               "tracing": (TRACING_CONFIG, "tracing")}


class CheckFailed(RuntimeError):
    pass


def say(message: str) -> None:
    print(f"[check-install] {message}", flush=True)


@contextmanager
def step(what: str) -> Iterator[None]:
    say(f"{what} ...")
    started = time.monotonic()
    yield
    say(f"{what}: done in {time.monotonic() - started:.1f} s")


def run(cmd: Sequence[str | Path], *, timeout: float, cwd: Path, env: dict[str, str] | None = None,
        ok: bool = True) -> subprocess.CompletedProcess[str]:
    """Run `cmd` to its end (at most `timeout` s); with `ok`, a non-zero exit fails the
    check with its output."""
    shown = " ".join(str(c) if "\n" not in str(c) else "<script>" for c in cmd)
    try:
        done = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise CheckFailed(f"{shown} ran past {timeout:.0f} s") from exc
    if ok and done.returncode != 0:
        raise CheckFailed(f"{shown} exited with {done.returncode}:\n"
                          f"{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return done


def compiled_modules() -> list[str]:
    """The modules setup.py compiles (pyproject.toml's `[tool.pd-proxy] compiled`), by name."""
    with open(REPO_ROOT / "pyproject.toml", "rb") as f:
        paths = tomllib.load(f)["tool"]["pd-proxy"]["compiled"]
    return [path.removesuffix(".py").replace("/", ".") for path in paths]


def clean_env() -> dict[str, str]:
    """This process's environment without what would point Python at this checkout or at
    its virtual environment."""
    drop = {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP"}
    return {k: v for k, v in os.environ.items() if k not in drop}


def copy_sources(dest: Path) -> None:
    """The checkout's files as git sees them (tracked, and untracked but not ignored)."""
    listed = run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                 timeout=30, cwd=REPO_ROOT).stdout
    for name in filter(None, listed.split("\0")):
        source = REPO_ROOT / name
        if source.is_file():  # a tracked file deleted in the working tree is left out
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def build_wheel(work: Path) -> Path:
    src, dist = work / "src", work / "dist"
    copy_sources(src)
    cmd: list[str | Path] = [sys.executable, "-m", "pip", "wheel", "--no-deps",
                             "--disable-pip-version-check", "-w", dist, src]
    if _has_build_backend():
        cmd.insert(4, "--no-build-isolation")  # this environment's setuptools: no download
    run(cmd, timeout=BUILD_TIMEOUT_S, cwd=work)
    wheels = sorted(dist.glob("pd_proxy-*.whl"))
    if len(wheels) != 1:
        raise CheckFailed(f"expected one pd-proxy wheel in {dist}, found {wheels}")
    return wheels[0]


def _has_build_backend() -> bool:
    try:
        import setuptools
    except ImportError:
        return False
    return int(setuptools.__version__.split(".")[0]) >= 68  # as pyproject.toml requires


def install(work: Path, wheel: Path) -> Path:
    venv = work / "venv"
    run([sys.executable, "-m", "venv", "--clear", venv], timeout=VENV_TIMEOUT_S, cwd=work,
        env=clean_env())
    python = venv / "bin" / "python"
    run([python, "-m", "pip", "install", "--disable-pip-version-check", "--no-input", wheel],
        timeout=INSTALL_TIMEOUT_S, cwd=work, env=clean_env())
    return venv


def check_contents(venv: Path, work: Path) -> None:
    python = venv / "bin" / "python"
    out = run([python, "-c", PROBE, json.dumps(sorted(EXTRA_MODULES)), json.dumps(TOOLING),
               json.dumps(compiled_modules())],
              timeout=PROBE_TIMEOUT_S, cwd=work, env=clean_env()).stdout
    found = json.loads(out.strip().splitlines()[-1])
    problems = []
    if found["proxy"] is not None and not Path(found["proxy"]).is_relative_to(venv):
        problems.append(f"proxy was imported from {found['proxy']}, not from {venv}")
    problems += [f"{name} does not import: {why}" for name, why in found["failed"].items()]
    if found["plugins"]:
        problems.append(f"vLLM general plugins are registered: {found['plugins']}")
    if found["tooling"]:
        problems.append(f"the wheel ships test tooling: {found['tooling']}")
    if found["vllm"]:
        problems.append("vLLM was installed with it")
    compiled = os.environ.get("PDPROXY_COMPILE", "1") != "0"
    if compiled and found["pure"]:
        problems.append(f"the request path is not compiled: {', '.join(found['pure'])} "
                        "import as pure Python (see the build's warning)")
    if problems:
        raise CheckFailed("the installed package:\n  " + "\n  ".join(problems))
    say(f"the request path is {'compiled' if compiled else 'pure Python (PDPROXY_COMPILE=0)'}; "
        "every module of proxy imports (but those of an extra: "
        f"{', '.join(f'{m} [{e}]' for m, e in EXTRA_MODULES.items())}); no vLLM and no vLLM "
        f"plugin; none of {', '.join(TOOLING)} in the wheel")

    for what, (text, extra) in NEEDS_EXTRA.items():
        config = work / f"{extra}.yaml"
        config.write_text(text)
        refused = run([venv / "bin" / "pd-proxy", "serve", "--config", config],
                      timeout=PROBE_TIMEOUT_S, cwd=work, env=clean_env(), ok=False)
        said = refused.stdout + refused.stderr
        if refused.returncode == 0 or f"pd-proxy[{extra}]" not in said:
            raise CheckFailed(f"a config with {what}, without the {extra} extra: exit "
                              f"{refused.returncode}, expected a refusal naming the extra:\n"
                              f"{said[-2000:]}")
        say(f"{what} without its extra is refused, naming pd-proxy[{extra}]")


@contextmanager
def process(cmd: Sequence[str | Path], *, cwd: Path, log: Path,
            env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """A background process, logging to `log`, stopped on exit (killed after 10 s)."""
    with log.open("wb") as out:
        proc = subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=REQUEST_TIMEOUT_S) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def wait_healthy(url: str, proc: subprocess.Popen[bytes], what: str, log: Path,
                 *, ready: Callable[[bytes], bool] = lambda body: True) -> None:
    """Until GET url/health answers 200 with a body that is `ready`, at most
    START_TIMEOUT_S; a process that exits first fails at once."""
    deadline = time.monotonic() + START_TIMEOUT_S
    last = "no answer"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise CheckFailed(f"{what} exited with {proc.returncode}:\n{_tail(log)}")
        try:
            status, body = get(f"{url}/health")
            last = f"{status} {body[:200]!r}"
            if status == 200 and ready(body):
                return
        except OSError as exc:
            last = str(exc)
        time.sleep(0.2)
    raise CheckFailed(f"{what} not healthy after {START_TIMEOUT_S} s (last: {last}):\n"
                      f"{_tail(log)}")


def _tail(log: Path, lines: int = 40) -> str:
    text = log.read_text(errors="replace") if log.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


def both_healthy(body: bytes) -> bool:
    """The router's /health counts a healthy P and a healthy D (in local mode it answers
    200 with a D alone; pull and push need the P too)."""
    healthy = json.loads(body).get("healthy", {})
    return all(healthy.get(role, 0) >= 1 for role in ("prefill", "decode"))


def texts(answer: Any) -> list[Any]:
    """The texts of a completion's choices."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    return [c.get("text") for c in choices if isinstance(c, dict)] if isinstance(choices, list) else []


def complete(router: str, mode: str | None) -> tuple[int, str | None, Any]:
    """One completion through the router, asking for `mode` (None: the router's own)."""
    body = json.dumps({"model": FAKE_MODEL, "prompt": "Hello", "max_tokens": 3}).encode()
    headers = {"Content-Type": "application/json"}
    if mode is not None:
        headers[TRANSFER_MODE_HEADER] = mode
    request = urllib.request.Request(f"{router}/v1/completions", data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as resp:
            answer = json.loads(resp.read())
            return resp.status, resp.headers.get(TRANSFER_MODE_HEADER), answer
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get(TRANSFER_MODE_HEADER), {"error": exc.read().decode()}


def serve_and_ask(venv: Path, work: Path) -> None:
    prefill_port, decode_port, router_port = free_port(), free_port(), free_port()
    router = f"http://127.0.0.1:{router_port}"
    logs = work / "logs"
    logs.mkdir()
    with ExitStack() as stack:
        for role, port in (("prefill", prefill_port), ("decode", decode_port)):
            log = logs / f"fake-{role}.log"
            fake = stack.enter_context(process(
                [sys.executable, "-m", "testbed.fake_vllm", "--role", role, "--port", str(port)],
                cwd=REPO_ROOT, log=log))
            wait_healthy(f"http://127.0.0.1:{port}", fake, f"the fake {role} server", log)
        log = logs / "router.log"
        # The router's own mode is local; pull and push are asked for per request, which
        # every client may do by default.
        proc = stack.enter_context(process(
            [venv / "bin" / "pd-proxy", "serve", "--host", "127.0.0.1", "--port", str(router_port),
             "--prefill", f"http://127.0.0.1:{prefill_port}",
             "--decode", f"http://127.0.0.1:{decode_port}", "--mode", "local"],
            cwd=work, log=log, env=clean_env()))
        wait_healthy(router, proc, "the router", log, ready=both_healthy)
        say(f"the installed router serves on {router}, in front of two fake vLLM servers")
        for asked, expected in (("pull", "pull"), ("push", "push"), (None, "local")):
            status, used, answer = complete(router, asked)
            said = texts(answer)
            if status != 200 or used != expected or said != ["t0 t1 t2"]:
                raise CheckFailed(f"a {expected} completion: status {status}, mode {used}, "
                                  f"answer {answer}\n{_tail(log)}")
            say(f"{expected}: 200, {TRANSFER_MODE_HEADER}: {used}, text {said[0]!r}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", action="store_true",
                        help="keep the temporary folder (wheel, environment, logs)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="pd-proxy-install-"))
    try:
        with step("building the wheel"):
            wheel = build_wheel(work)
        say(f"built {wheel.name}")
        with step("installing it, no extras, into a new virtual environment"):
            venv = install(work, wheel)
        with step("checking what it installed"):
            check_contents(venv, work)
        with step("serving pull, push and local from it"):
            serve_and_ask(venv, work)
    except CheckFailed as exc:
        say(f"FAILED: {exc}")
        say(f"kept {work} for a look")
        return 1
    if args.keep:
        say(f"kept {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    say(f"passed in {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
