"""The connector's wall around vLLM (`connector.vllm_compat`): every vLLM name it imports
and every private attribute our subclasses borrow exists in the installed vLLM, with the
signatures we call; no other connector module imports vLLM; and vLLM versions outside the
supported range are refused by name."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import logging
import re
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any, cast

import pytest
import vllm

import connector.vllm_compat as compat

CONNECTOR = Path(compat.__file__).parent


def _vllm_imports(path: Path) -> list[tuple[str, str]]:
    """(module, name) of every `from vllm... import name` in `path`, and ("vllm", "")
    for a plain `import vllm...`, under `if TYPE_CHECKING:` too."""
    found: list[tuple[str, str]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
            found.extend((node.module or "", alias.name) for alias in node.names)
        elif isinstance(node, ast.Import):
            found.extend((alias.name, "") for alias in node.names
                         if alias.name.split(".")[0] == "vllm")
    return found


def test_every_name_the_wall_imports_exists_in_the_installed_vllm() -> None:
    names = _vllm_imports(Path(compat.__file__))
    assert len(names) >= 20  # the check below would pass vacuously on a parse slip
    missing = []
    for module, name in names:
        imported = importlib.import_module(module)
        if name and not hasattr(imported, name):
            try:  # a submodule imported by name (`from package import module`)
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"{module}.{name}")
    assert not missing, f"vLLM {vllm.__version__} lacks {missing}"


def test_only_the_wall_imports_vllm() -> None:
    offenders = {path.name: _vllm_imports(path) for path in sorted(CONNECTOR.glob("*.py"))
                 if path.name != "vllm_compat.py"}
    assert {name: found for name, found in offenders.items() if found} == {}


def _assigned_in_source(cls: type[Any], attribute: str) -> bool:
    """Whether a class in `cls`'s MRO sets `self.<attribute>` in its source."""
    pattern = re.compile(rf"\bself\.{re.escape(attribute)}\s*(:|=(?!=))")  # annotated, or set
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] != "vllm":
            continue
        if pattern.search(inspect.getsource(klass)):
            return True
    return False


def test_every_borrowed_attribute_exists() -> None:
    missing = []
    for owner, attributes in compat.BORROWED.items():
        for attribute in attributes:
            if isinstance(owner, ModuleType):
                present = hasattr(owner, attribute)
            else:
                assert isinstance(owner, type)
                present = hasattr(owner, attribute) or _assigned_in_source(owner, attribute)
            if not present:
                missing.append(f"{getattr(owner, '__name__', owner)}.{attribute}")
    assert not missing, f"vLLM {vllm.__version__} lacks {missing}"


def test_every_name_a_present_feature_needs_exists() -> None:
    """What `vllm_compat` reads of vLLM 0.33's differences, where this vLLM has them."""
    missing: list[str] = []
    for feature, borrowed in compat.BORROWED_WITH_FEATURE.items():
        if not compat.FEATURES[feature]:
            continue
        for owner, attributes in borrowed.items():
            assert isinstance(owner, type)
            missing.extend(f"{owner.__name__}.{attribute} ({feature})"
                           for attribute in attributes
                           if not hasattr(owner, attribute)
                           and not _assigned_in_source(owner, attribute))
    assert not missing, f"vLLM {vllm.__version__} lacks {missing}"


def test_the_attribute_check_can_fail() -> None:
    assert not _assigned_in_source(compat.NixlPullConnectorWorker, "_no_such_field")
    assert _assigned_in_source(compat.NixlPullConnectorWorker, "_reqs_to_send")


# The borrowed methods, called as our code calls them (positional and keyword arguments,
# without self): `inspect.Signature.bind` fails if vLLM's signature no longer takes them.
CALLS: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = [
    (compat.NixlPullConnectorWorker._ensure_handshake, ("engine", "host", 1, 1, 1, 1), {}),
    (compat.NixlPullConnectorWorker._ensure_handshake, ("engine", "host", 1, 1), {}),
    (compat.NixlPullConnectorWorker._read_blocks_for_req, ("req", None), {}),
    (compat.NixlPullConnectorWorker._logical_to_kernel_block_ids, ([[1]], 1), {}),
    (compat.NixlPullConnectorWorker._pop_done_transfers, ({},), {}),
    (compat.NixlPullConnectorWorker._try_release_xfer_handle, ("shutdown", 1), {}),
    (compat.NixlPullConnectorWorker._handle_heartbeat, ("payload",), {}),
    (compat.NixlPushConnectorWorker._xfer_blocks_for_req, ("req", None), {}),
    (compat.NixlPullConnectorScheduler.get_exchange_clipped_blocks, ([[1]],), {}),
]


@pytest.mark.parametrize(("method", "args", "kwargs"), CALLS,
                         ids=[f"{c[0].__qualname__}/{len(c[1])}" for c in CALLS])
def test_borrowed_methods_take_our_arguments(method: Any, args: tuple[Any, ...],
                                             kwargs: dict[str, Any]) -> None:
    inspect.signature(method).bind(None, *args, **kwargs)


def test_the_metadata_we_build_has_our_fields() -> None:
    req_meta = {f.name for f in dataclasses.fields(compat.ReqMeta)}
    assert {"local_block_ids", "local_physical_block_ids", "tp_size", "dcp_size", "pp_size",
            "remote"} <= req_meta
    remote = {f.name for f in dataclasses.fields(compat.RemoteMeta)}
    assert {"block_ids", "host", "port", "engine_id", "request_id"} <= remote
    metadata = compat.NixlConnectorMetadata()  # type: ignore[no-untyped-call]  # vLLM's
    assert "reqs_to_recv" in vars(metadata)


def test_scheduled_blocks_names_vllms_values() -> None:
    output = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="new", block_ids=([1, 2],))],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=["more", "back"], new_block_ids=[([3],), None],
            resumed_req_ids={"back"}))
    # only the fields vLLM's `yield_req_data` reads, standing in for its SchedulerOutput
    # (both versions' meanings of the third value: tests/unit/test_vllm_compat_versions.py)
    assert list(compat.scheduled_blocks(cast("compat.SchedulerOutput", output))) == [
        compat.ScheduledBlocks("new", ([1, 2],), full_table=True),
        compat.ScheduledBlocks("more", ([3],), full_table=False),
        compat.ScheduledBlocks("back", None, full_table=True),
    ]


# --- the version check -----------------------------------------------------------------


def test_the_installed_vllm_is_supported() -> None:
    compat.check_vllm_version(vllm.__version__, env={})


@pytest.mark.parametrize("installed", ["0.32.0", "0.32.7", "0.32.0+cpu", "0.32.1.dev3+g1a2b",
                                       "0.33.0", "0.33.0rc1", "0.33.2+cu129"])
def test_supported_versions_pass(installed: str) -> None:
    compat.check_vllm_version(installed, env={})


@pytest.mark.parametrize("installed", ["0.31.2", "0.34.0", "0.34.0rc1", "1.0.0", "not-a-version"])
def test_other_versions_fail_naming_both(installed: str) -> None:
    with pytest.raises(compat.UnsupportedVllmVersion) as caught:
        compat.check_vllm_version(installed, env={})
    message = str(caught.value)
    assert installed in message and ">=0.32,<0.34" in message
    assert compat.ALLOW_UNSUPPORTED_ENV in message


def test_an_unsupported_vllm_fails_the_import_naming_both_versions(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(compat.ALLOW_UNSUPPORTED_ENV, raising=False)
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    try:
        # The reload makes a new exception class: compare by name.
        with pytest.raises(RuntimeError, match=r">=0\.32,<0\.34, but vLLM 0\.34\.0 is") as got:
            importlib.reload(compat)  # the module's import runs the check
        assert type(got.value).__name__ == "UnsupportedVllmVersion"
    finally:
        monkeypatch.undo()
        importlib.reload(compat)


def test_the_override_starts_anyway_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=compat.logger.name):
        compat.check_vllm_version("0.34.0", env={compat.ALLOW_UNSUPPORTED_ENV: "1"})
    assert any("0.34.0" in r.getMessage() and r.levelno == logging.WARNING
               for r in caplog.records)
    with pytest.raises(compat.UnsupportedVllmVersion):  # only "1" overrides
        compat.check_vllm_version("0.34.0", env={compat.ALLOW_UNSUPPORTED_ENV: "yes"})
