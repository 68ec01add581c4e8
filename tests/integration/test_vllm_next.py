"""The connector against vLLM 0.33's own code, in the same run as the 0.32 tests.

There is no CPU build of vLLM 0.33, so no server runs on it here. What can run is its
Python code: scripts/setup.sh puts vLLM 0.33's package in `.vllm-next` (never
installed into the environment), and this test runs the connector's unit tests in a
child pytest with that folder first on the path, so `import vllm` finds 0.33 there
(its CUDA kernels do not load; the connector does not need them). The child must run
the tests marked `vllm_next` (0.33's `_read_blocks_for_req` and push-worker check), and
the names `connector.vllm_compat` borrows must all exist in 0.33.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NEXT = ROOT / ".vllm-next"  # scripts/setup.sh's NEXT_DIR
NEXT_VERSION = "0.33"
SUITES = [  # the connector's unit tests that touch vLLM's classes or functions
    "tests/unit/test_vllm_compat_versions.py",
    "tests/unit/test_connector_vllm.py",
    "tests/unit/test_connector_access.py",
    "tests/unit/test_connector_registry.py",
]


def run_on_next_vllm(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    assert (NEXT / "vllm").is_dir(), (
        f"{NEXT} holds no vLLM {NEXT_VERSION}: run `bash scripts/setup.sh`, which puts it there")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(NEXT), str(ROOT)])}
    env.pop("PDPROXY_ALLOW_UNSUPPORTED_VLLM", None)  # 0.33 must pass the version check itself
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


def test_the_path_gives_vllm_033() -> None:
    shown = run_on_next_vllm("-c", "import json, vllm, connector.vllm_compat as c; "
                                   "print(vllm.__version__, vllm.__file__, json.dumps(c.FEATURES))",
                             timeout=120)
    assert shown.returncode == 0, shown.stderr[-3000:]
    version, where, features = shown.stdout.strip().split(maxsplit=2)
    assert version.startswith(NEXT_VERSION + "."), shown.stdout
    assert Path(where).is_relative_to(NEXT), shown.stdout
    # 0.33 has all three differences the connector handles, and its push code passes the
    # start-up check of a prefix hit's trim
    assert json.loads(features) == {"full_table_flag": True, "registration_generations": True,
                                    "draft_tp_check": True, "push_trims_decode_tail": True}


def test_the_connectors_unit_tests_pass_on_vllm_033() -> None:
    child = run_on_next_vllm("-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                             "-rfEs", *SUITES, timeout=600)
    summary = child.stdout.strip().splitlines()[-1] if child.stdout.strip() else ""
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-3000:]
    counts = dict((word, int(n)) for n, word in re.findall(r"(\d+) (\w+)", summary))
    assert counts.get("passed", 0) > 0, summary
    assert set(counts) == {"passed"}, f"nothing may be skipped or deselected on 0.33: {summary}"
    marked = run_on_next_vllm("-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                              "--collect-only", "-m", "vllm_next", *SUITES, timeout=300)
    assert re.search(r"\b([1-9]\d*)(/\d+)? tests? (collected|selected)", marked.stdout), (
        marked.stdout[-2000:])
