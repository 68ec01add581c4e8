"""The request path's compiled modules (setup.py: pyproject.toml's `[tool.pd-proxy]
compiled`) are the ones the tests run, and none is older than its source: an extension
module is imported before the source next to it, so an edit not built again would go
untested (and unrun). Built pure Python on purpose (PDPROXY_COMPILE=0), none is compiled."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import os
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REBUILD = "build it again: pip install -e . (or PDPROXY_COMPILE=0 for pure Python)"


def compiled_sources() -> list[Path]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return [ROOT / path for path in tomllib.load(f)["tool"]["pd-proxy"]["compiled"]]


def module_name(source: Path) -> str:
    return ".".join(source.relative_to(ROOT).with_suffix("").parts)


def test_the_request_path_runs_as_built() -> None:
    origins = {module_name(s): importlib.util.find_spec(module_name(s)) for s in compiled_sources()}
    pure = sorted(name for name, spec in origins.items()
                  if spec is not None and str(spec.origin).endswith(".py"))
    assert all(spec is not None for spec in origins.values())
    if os.environ.get("PDPROXY_COMPILE", "1") == "0":
        assert pure == sorted(origins), f"compiled, though PDPROXY_COMPILE=0: {REBUILD}"
    else:
        assert not pure, f"not compiled: {', '.join(pure)}; {REBUILD}"


def test_no_compiled_module_is_older_than_its_source() -> None:
    stale = [str(built.relative_to(ROOT)) for source in compiled_sources()
             for built in source.parent.glob(f"{source.stem}.*.so")
             if built.stat().st_mtime < source.stat().st_mtime]
    assert not stale, f"older than their sources: {', '.join(stale)}; {REBUILD}"


def test_the_tasks_own_exception_state_stays_interpreted() -> None:
    """`proxy.task_scope.own_exception_state` gives a task whose coroutine is compiled an
    exception state of its own only as an interpreted coroutine (its frame's)."""
    from proxy import task_scope

    assert ROOT / "proxy" / "task_scope.py" not in compiled_sources()
    assert str(importlib.util.find_spec("proxy.task_scope").origin).endswith(".py")  # type: ignore[union-attr]
    assert task_scope.own_exception_state.__code__.co_flags & inspect.CO_COROUTINE


# What makes a coroutine the top of a task of its own.
_TASK_MAKERS = {"create_task", "ensure_future", "gather", "shield", "wait_for"}


def test_every_task_a_compiled_module_starts_has_its_own_exception_state() -> None:
    """A coroutine a compiled module hands to `create_task`, `gather` and the like runs
    as a task's top: it goes through `own_exception_state` (`proxy.task_scope`), or a
    compiled coroutine there could leave its exception to every other task."""
    bare = []
    for source in compiled_sources():
        for call in ast.walk(ast.parse(source.read_text(), str(source))):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                    and call.func.attr in _TASK_MAKERS):
                continue
            for arg in call.args:
                made = arg.value if isinstance(arg, ast.Starred) else arg
                if isinstance(made, ast.GeneratorExp):
                    made = made.elt
                if isinstance(made, ast.Call) and not (
                        isinstance(made.func, ast.Name) and made.func.id == "own_exception_state"):
                    bare.append(f"{source.relative_to(ROOT)}:{call.lineno}")
    assert not bare, f"coroutines started without own_exception_state: {bare}"


def test_the_build_checks_against_the_routers_dependencies_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """mypyc's mypy (setup.py's `build_mypy_config`), as mypy reads it: the lint's
    settings, and vLLM, torch and the extras' packages not followed (their types Any, as
    in a plain install), the router's own dependencies followed."""
    import setuptools
    from mypy.config_parser import parse_config_file
    from mypy.options import Options

    monkeypatch.setattr(setuptools, "setup", lambda **_: None)  # setup.py's last line
    spec = importlib.util.spec_from_file_location("pd_proxy_setup", ROOT / "setup.py")
    assert spec is not None and spec.loader is not None
    setup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup)
    config = tmp_path / "mypy.toml"
    config.write_text(setup.build_mypy_config())
    options, strict = Options(), []
    parse_config_file(options, lambda: strict.append(True), str(config), stdout=None, stderr=None)

    assert strict, "the lint's strict = true is not in the build's config"
    assert options.python_version == (3, 11)
    for module in ("vllm", "vllm.v1.core.kv_cache_utils", "torch", "kubernetes_asyncio.client"):
        assert options.clone_for_module(module).follow_imports == "skip", module
    for module in ("fastapi", "starlette.types", "msgspec", "prometheus_client", "proxy.config"):
        assert options.clone_for_module(module).follow_imports == "normal", module


# Calls that decode into a type: the type is their second argument or `type=`.
_DECODERS = {"Decoder": 0, "decode": 1, "convert": 1, "post_json": None}


def _decoded_types(tree: ast.AST) -> set[str]:
    """The names of the types `tree` decodes into (`Decoder(T)`, `decode(raw, type=T)`,
    `convert(value, T)`, `post_json(..., type=T)`)."""
    names = set()
    for call in ast.walk(tree):
        if not isinstance(call, ast.Call):
            continue
        func = call.func
        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if called not in _DECODERS:
            continue
        at = _DECODERS[called]
        args = [*(call.args[at:at + 1] if at is not None else []),
                *(k.value for k in call.keywords if k.arg == "type")]
        names |= {arg.id for arg in args if isinstance(arg, ast.Name)}
        names |= {arg.attr for arg in args if isinstance(arg, ast.Attribute)}
    return names


def test_no_struct_the_router_decodes_is_compiled() -> None:
    """mypyc keeps a class's annotations as the types it compiles to: a msgspec struct
    defined in a compiled module has `list` for `list[int]` and `type` for `int | None`,
    so msgspec checks next to nothing when it decodes into one. The structs the router
    decodes live in interpreted modules (`proxy.pool.kv.answers`, the wire module)."""
    compiled_structs = {
        node.name: source.relative_to(ROOT)
        for source in compiled_sources()
        for node in ast.walk(ast.parse(source.read_text(), str(source)))
        if isinstance(node, ast.ClassDef) and any(
            (isinstance(b, ast.Attribute) and b.attr == "Struct")
            or (isinstance(b, ast.Name) and b.id == "Struct") for b in node.bases)
    }
    decoded = set()
    for source in [*(ROOT / "proxy").rglob("*.py"), *(ROOT / "connector" / "protocol").glob("*.py")]:
        decoded |= _decoded_types(ast.parse(source.read_text(), str(source)))
    assert compiled_structs, "the scan found no struct in a compiled module: is it blind?"
    assert decoded >= {"TokenizeAnswer", "PrefillAnswer", "DecodeAnswer"}, \
        "the scan missed a decode"
    both = {name: str(where) for name, where in compiled_structs.items() if name in decoded}
    assert not both, f"decoded into structs of compiled modules: {both}"


def test_the_structs_the_router_decodes_check_their_types_as_built() -> None:
    """In the build the tests run (compiled or not), a /tokenize answer whose ids are not
    integers is refused as it is decoded, and so are P's and D's answers that are not
    objects."""
    import msgspec

    from connector.protocol.http_params import DecodeAnswer, PrefillAnswer
    from proxy.pool.kv.answers import TokenizeAnswer

    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"tokens": [1, "2"]}', type=TokenizeAnswer)
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b"[1]", type=PrefillAnswer)
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'[{"id": 1}]', type=DecodeAnswer)
    assert msgspec.json.decode(b'{"tokens": [1, 2]}', type=TokenizeAnswer).tokens == [1, 2]
