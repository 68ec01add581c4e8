"""pd-proxy's build backend: setuptools', but when the request path is compiled (setup.py)
the build's environment also gets the router's own dependencies, so that mypyc
type-checks and compiles the modules against them, as the tests run them. Without them
(pip builds in an environment of its own, before it installs the dependencies) their
types are Any there: mypy refuses the modules, and a plain `pip install` into a new
environment came out pure Python."""

import os
import tomllib

from setuptools import build_meta
from setuptools.build_meta import (
    build_editable,
    build_sdist,
    build_wheel,
    get_requires_for_build_sdist,
    prepare_metadata_for_build_editable,
    prepare_metadata_for_build_wheel,
)

__all__ = [
    "build_editable", "build_sdist", "build_wheel", "get_requires_for_build_editable",
    "get_requires_for_build_sdist", "get_requires_for_build_wheel",
    "prepare_metadata_for_build_editable", "prepare_metadata_for_build_wheel",
]


def _dependencies() -> list[str]:
    """The project's dependencies, when the build compiles (the hooks run in its root)."""
    if os.environ.get("PDPROXY_COMPILE", "1") == "0":
        return []
    with open("pyproject.toml", "rb") as f:
        return list(tomllib.load(f)["project"]["dependencies"])


def get_requires_for_build_wheel(config_settings: dict[str, str] | None = None) -> list[str]:
    return build_meta.get_requires_for_build_wheel(config_settings) + _dependencies()


def get_requires_for_build_editable(config_settings: dict[str, str] | None = None) -> list[str]:
    return build_meta.get_requires_for_build_editable(config_settings) + _dependencies()
