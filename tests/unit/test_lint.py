"""The code passes the project's linters: ruff on the whole tree, and mypy (strict, as
configured in pyproject.toml) on the shipped packages, the scripts, the testbed and the
tests.

The versions are pinned in the `lint` extra, which scripts/setup.sh installs, so a new
release of either tool cannot fail this test on its own. A missing tool fails it too."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINTERS = {
    "ruff": ["ruff", "check", "."],
    "mypy": ["mypy", "proxy", "connector", "scripts", "testbed", "tests"],
}


@pytest.mark.parametrize("linter", LINTERS)
def test_the_code_passes(linter: str) -> None:
    done = subprocess.run([sys.executable, "-m", *LINTERS[linter]], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{linter} found problems:\n{done.stdout}{done.stderr}"


def test_no_two_test_files_share_a_name() -> None:
    """tests/ has no packages, so pytest imports each test file by its bare name: two files
    of one name in different folders cannot both be collected in one run."""
    by_name: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        by_name.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    repeated = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert repeated == {}, f"test files that share a name: {repeated}"
