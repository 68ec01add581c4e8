"""The configuration reference the docs site generates (docs/hooks/config_reference.py)
holds every setting of the router and of the connector, each with its default and a
description taken from the code, and the site's pages are wired to it."""

from __future__ import annotations

import functools
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec
import pytest
import yaml

from connector.config import DualConfig
from proxy.config import Balance, RouterConfig, Timeouts

ROOT = Path(__file__).resolve().parents[2]
HOOK = ROOT / "docs" / "hooks" / "config_reference.py"
ROOTS = {"proxy.config": RouterConfig, "connector.config": DualConfig}


@functools.cache
def _hook() -> ModuleType:
    """The hook, loaded from its file as MkDocs loads it (docs/ is no package)."""
    spec = importlib.util.spec_from_file_location("docs_config_reference", HOOK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _settings_types(annotation: Any) -> list[type]:
    if isinstance(annotation, type) and issubclass(annotation, msgspec.Struct):
        return [annotation]
    return [found for argument in getattr(annotation, "__args__", ())
            for found in _settings_types(argument)]


def _every_key(cls: type, key: str = "") -> set[str]:
    """Every setting under `cls`, walked here on its own, as the reference should list it."""
    keys: set[str] = set()
    for info in msgspec.structs.fields(cls):
        full = f"{key}.{info.name}" if key else info.name
        keys.add(full)
        for struct in _settings_types(info.type):
            if struct is not cls:
                suffix = "[]" if getattr(info.type, "__origin__", None) is list else ""
                keys |= _every_key(struct, full + suffix)
    return keys


@pytest.mark.parametrize("spec", sorted(ROOTS))
def test_every_setting_is_listed_with_a_description(spec: str) -> None:
    sections = _hook().sections(spec, ROOTS[spec].__name__)
    listed = {field.key for section in sections for field in section.fields}
    # A type found under several keys (prefill[] and decode[]) has one section, listed
    # under its first key.
    expected = {key for key in _every_key(ROOTS[spec]) if not key.startswith("decode[].")}
    assert listed == expected
    undescribed = [field.key for section in sections for field in section.fields
                   if not field.description]
    assert undescribed == [], (
        f"settings with no description: {undescribed}. Put a comment on the field (above "
        "it or at its end), in the code: the docs site's reference is generated from it")


def test_defaults_and_descriptions_are_the_codes() -> None:
    hook = _hook()
    fields = {field.key: field for section in hook.sections("proxy.config", "RouterConfig")
              for field in section.fields}
    assert fields["timeouts.prefill"].default == f"`{Timeouts().prefill!r}`"
    assert fields["balance.prefill"].default == f"`{Balance().prefill.value}`"
    assert "least_outstanding" in fields["balance.prefill"].description  # the enum's values
    assert fields["prefill[].url"].default == "required"
    assert fields["limits.max_body_bytes"].default == "`8388608` (`8 * 1024 * 1024`)"
    assert fields["client_modes"].default == "`[pull, push, auto]`"
    assert "X-KV-Transfer-Mode" in fields["client_modes"].description
    assert fields["prefill[].drain"].type == "bool"
    connector = {field.key: field for section in hook.sections("connector.config", "DualConfig")
                 for field in section.fields}
    assert connector["push_port"].default == "required"
    assert connector["nixl_progress_thread"].description.endswith(
        "One of `event`, `off`, `spin`.")
    assert connector["max_pending"].default == "`16384` (`DEFAULT_MAX_PENDING`)"


def test_rendered_tables_are_whole() -> None:
    """Every row of every table has its four cells: a `|` in a description is escaped."""
    text = _hook().render("proxy.config", "RouterConfig")
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert rows
    for row in rows:
        assert len(re.split(r"(?<!\\)\|", row)) == 6, row


def test_the_site_uses_the_hook_and_every_page_exists() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config["hooks"] == ["docs/hooks/config_reference.py"]
    pages: list[str] = []

    def walk(entries: list[Any]) -> None:
        for entry in entries:
            value = next(iter(entry.values())) if isinstance(entry, dict) else entry
            if isinstance(value, list):
                walk(value)
            else:
                pages.append(value)

    walk(config["nav"])
    missing = [page for page in pages if not (ROOT / "docs" / page).is_file()]
    assert missing == []
    markers = {page: _hook().MARKER.findall((ROOT / "docs" / page).read_text())
               for page in pages}
    used = {spec for found in markers.values() for spec, _, _ in found}
    assert used == set(ROOTS)
