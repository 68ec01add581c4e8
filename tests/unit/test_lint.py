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
