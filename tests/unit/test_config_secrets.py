"""No config type shows a secret in its repr, str or rich pretty print: a config logged,
printed in a traceback or looked at in a debugger must not hand out a key.

The walk covers every msgspec config type of the router (proxy.config) and of the
connector (connector.config). A field whose name says it holds a credential is either
one of its type's `secret_fields` (masked) or listed in NOT_SECRETS with the reason."""

from __future__ import annotations

import inspect
import re
from typing import Any, get_args, get_origin, get_type_hints

import msgspec
import pytest

import connector.config
import proxy.config
from proxy.config import build_config

MASK = "***"  # how the router masks a secret

# Names that suggest a credential.
CREDENTIAL_NAME = re.compile(r"key|token|secret|password|credential", re.IGNORECASE)
# Fields with such a name that hold no secret value, and why.
NOT_SECRETS = {
    "curve_secret_key_file": "the path of a key file, not the key",
    "curve_server_key_file": "the path of a public key file",
    "curve_allowed_keys": "paths of public key files",
    "admin_secret_env_prefix": "a prefix of environment variable names",
}
# The fields each type needs to be built at all (besides its secrets).
REQUIRED: dict[str, dict[str, Any]] = {
    "EndpointConfig": {"url": "http://127.0.0.1:9"},
    "RouterConfig": {"prefill": [{"url": "http://127.0.0.1:9"}],
                     "decode": [{"url": "http://127.0.0.1:10"}]},
}


def config_types() -> list[type[msgspec.Struct]]:
    found = []
    for module in (proxy.config, connector.config):
        for _, value in inspect.getmembers(module, inspect.isclass):
            if issubclass(value, msgspec.Struct) and value.__module__ == module.__name__:
                found.append(value)
    return found


def holds_text(annotation: Any) -> bool:
    """Whether a field's type may hold a string (str, str | None, list[str], ...)."""
    if annotation is str:
        return True
    return any(holds_text(arg) for arg in get_args(annotation))


def secret_fields(cls: type[msgspec.Struct]) -> frozenset[str]:
    return getattr(cls, "secret_fields", frozenset())


def test_the_walk_finds_the_types_with_credentials() -> None:
    names = {cls.__name__ for cls in config_types()}
    assert {"Auth", "EndpointConfig", "RouterConfig", "Limits", "DualConfig"} <= names


@pytest.mark.parametrize("cls", config_types(), ids=lambda cls: cls.__name__)
def test_every_credential_field_is_masked(cls: type[msgspec.Struct]) -> None:
    hints = get_type_hints(cls, vars(inspect.getmodule(cls)))
    for name in cls.__struct_fields__:
        if CREDENTIAL_NAME.search(name) and holds_text(hints[name]) and name not in NOT_SECRETS:
            assert name in secret_fields(cls), f"{cls.__name__}.{name} is not masked in its repr"


def sentinel(cls: str, field: str) -> str:
    return f"s3cr3t-{cls}-{field}"


def with_secrets(cls: type[msgspec.Struct], hints: dict[str, Any]) -> dict[str, Any]:
    values = dict(REQUIRED.get(cls.__name__, {}))
    for name in secret_fields(cls):
        value = sentinel(cls.__name__, name)
        values[name] = [value] if get_origin(hints[name]) is list else value
    return values


def shown(obj: Any) -> list[str]:
    """Every way a config may be printed."""
    rich = list(obj.__rich_repr__()) if hasattr(obj, "__rich_repr__") else []
    return [repr(obj), str(obj), f"{obj}", repr([obj]), repr(rich)]


@pytest.mark.parametrize("cls", [c for c in config_types() if secret_fields(c)],
                         ids=lambda cls: cls.__name__)
def test_no_secret_value_is_shown(cls: type[msgspec.Struct]) -> None:
    hints = get_type_hints(cls, vars(inspect.getmodule(cls)))
    obj = msgspec.convert(with_secrets(cls, hints), cls)
    for text in shown(obj):
        for name in secret_fields(cls):
            assert sentinel(cls.__name__, name) not in text, f"{cls.__name__}.{name} shown"
        assert MASK in text


def test_a_whole_router_config_shows_no_secret() -> None:
    config = build_config({
        "prefill": [{"url": "http://127.0.0.1:9", "api_key": "s3cr3t-p"}],
        "decode": [{"url": "http://127.0.0.1:10", "api_key": "s3cr3t-d"}],
        "admin_token": "s3cr3t-admin",
        "auth": {"prefill_api_key": "s3cr3t-pk", "decode_api_key": "s3cr3t-dk",
                 "client_api_keys": ["s3cr3t-c1", "s3cr3t-c2"]},
    }, {})
    for text in shown(config):
        assert "s3cr3t" not in text
        assert "http://127.0.0.1:9" in text  # the rest is still shown
    # An "env:NAME" reference names a variable, not the secret: shown, to help debugging.
    env = build_config({"prefill": ["http://127.0.0.1:9"], "decode": ["http://127.0.0.1:10"],
                        "admin_token": "env:PATH"}, {})
    assert "admin_token='env:PATH'" in repr(env)


def test_masking_leaves_the_values_themselves_alone() -> None:
    auth = proxy.config.Auth(prefill_api_key="k1", client_api_keys=["k2"])
    assert (auth.prefill_api_key, auth.client_api_keys) == ("k1", ["k2"])
    assert msgspec.to_builtins(auth)["prefill_api_key"] == "k1"
