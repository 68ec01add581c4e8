"""Builds pd-proxy with its request path compiled: the modules listed under
`[tool.pd-proxy] compiled` in pyproject.toml become C extensions made by mypyc from their
typed Python, the rest of the package stays as it is. Everything else about the build is
in pyproject.toml.

PDPROXY_COMPILE=0 builds the package pure Python (no C compiler needed). If the compiled
modules fail to build (no C compiler, no Python headers), the package is left pure Python
too, with a warning and the compiler's error in the build log: the router then runs as
before, only with more CPU per request (it logs which at start).

After editing a compiled module, build again (`pip install -e .`, or `python setup.py
build_ext --inplace`): an extension module is imported before the source next to it
(tests/unit/test_compiled.py fails on a stale one).
"""

import json
import os
import sys
import tempfile
import tomllib
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent


def compiled_modules() -> list[str]:
    with open(HERE / "pyproject.toml", "rb") as f:
        return list(tomllib.load(f)["tool"]["pd-proxy"]["compiled"])


# The commands that build extension modules. setup.py also runs for the build's metadata
# and requirements, where compiling (minutes) would be wasted.
BUILDING = {"build", "build_ext", "bdist_wheel", "editable_wheel", "install", "develop"}


def ext_modules() -> list:
    if os.environ.get("PDPROXY_COMPILE", "1") == "0" or not BUILDING & set(sys.argv):
        return []
    from mypyc.build import mypycify

    # mypyc type-checks the modules and what they import in the build's own environment:
    # the router's dependencies are there (pd_build.py), vLLM and the extras are not, so
    # their types are Any. An ignore or a return that they make needed elsewhere, or the
    # connector's subclasses of vLLM's classes (not compiled), must not stop the build.
    options = ["--no-warn-unused-ignores", "--no-warn-return-any", "--allow-subclassing-any"]
    with tempfile.TemporaryDirectory() as scratch:
        config = Path(scratch) / "mypy.toml"
        config.write_text(build_mypy_config())
        try:
            return mypycify(["--config-file", str(config), *options, *compiled_modules()],
                            opt_level="3")
        except (Exception, SystemExit) as exc:  # mypy's errors end in SystemExit
            stay_pure(f"mypyc: {exc}")
            return []


# Packages that only the extras or vLLM install. The build does not follow imports of
# them: their types are Any, as in a plain install, where they are absent, so the same
# C comes out wherever the package is built. Where they are installed (vLLM's own
# environment, or scripts/setup.sh's), following them took mypy through some 10,000 more
# modules and checked their function bodies, which mypy skips outside of mypyc (mypyc
# keeps every syntax tree): on a 2-core VM 339 s against 24 s for the check alone.
NOT_FOLLOWED = ["vllm", "torch", "numpy", "transformers", "kubernetes_asyncio",
                "opentelemetry", "nixl"]


def build_mypy_config() -> str:
    """The lint's mypy settings (pyproject.toml's [tool.mypy]) and an override that skips
    NOT_FOLLOWED, as a mypy config file (JSON's strings, booleans and lists are TOML's)."""
    with open(HERE / "pyproject.toml", "rb") as f:
        settings = dict(tomllib.load(f)["tool"]["mypy"])
    overrides = [*settings.pop("overrides", []),
                 {"module": [f"{name}.*" for name in NOT_FOLLOWED],  # and the package itself
                  "follow_imports": "skip"}]
    lines = ["[tool.mypy]", *(f"{key} = {json.dumps(value)}" for key, value in settings.items())]
    for override in overrides:
        lines += ["[[tool.mypy.overrides]]",
                  *(f"{key} = {json.dumps(value)}" for key, value in override.items())]
    return "\n".join(lines) + "\n"


def stay_pure(why: str) -> None:
    print(f"warning: pd-proxy's request path is not compiled ({why}); it runs as pure "
          "Python, with more CPU per request", file=sys.stderr)


class BuildOrStayPure(build_ext):
    """Builds the compiled modules, or none of them: they share one library (built
    first), so a compiler error (no compiler, no Python headers) leaves the whole package
    pure Python, with a warning, rather than failing the install."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # setuptools' compile and link errors have no common base
            stay_pure(str(exc))
            self.extensions = []


setup(ext_modules=ext_modules(), cmdclass={"build_ext": BuildOrStayPure})
