from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from proxy.cli import build_parser
from proxy.config import Mode, build_config
from proxy.errors import (
    InvalidRequest,
    KVTransferError,
    NoHealthyEndpoint,
    NotFound,
    PayloadTooLarge,
    RouterError,
    UpstreamConnectError,
    UpstreamProtocolError,
    UpstreamStatusError,
    UpstreamTimeout,
    sse_error_event,
)
from proxy.serve import load_config

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("error,status,error_type", [
    (InvalidRequest("x"), 400, "invalid_request_error"),
    (PayloadTooLarge("x"), 413, "invalid_request_error"),
    (NotFound("x"), 404, "not_found_error"),
    (NoHealthyEndpoint("x"), 503, "service_unavailable"),
    (KVTransferError("x"), 502, "kv_transfer_error"),
    (UpstreamConnectError("x"), 502, "upstream_error"),
    (UpstreamProtocolError("x"), 502, "upstream_error"),
    (UpstreamTimeout("x"), 504, "timeout"),
    (RouterError("x"), 500, "internal_error"),
])
def test_each_error_maps_to_its_status_and_openai_shape(error: RouterError, status: int, error_type: str) -> None:
    assert error.status == status
    body = msgspec.json.decode(error.body())
    assert body == {"error": {"message": "x", "type": error_type, "param": None, "code": status}}


def test_no_healthy_endpoint_says_when_to_retry() -> None:
    assert NoHealthyEndpoint("x").headers() == {"Retry-After": "1"}


def test_upstream_status_relays_upstream_json_but_wraps_other_bodies() -> None:
    vllm_body = b'{"error":{"message":"too long","type":"BadRequestError","code":400}}'
    assert UpstreamStatusError("x", status=400, content=vllm_body).body() == vllm_body
    wrapped = msgspec.json.decode(UpstreamStatusError("P said 500", status=500, content=b"<html>").body())
    assert wrapped["error"]["message"] == "P said 500" and wrapped["error"]["code"] == 500


def test_sse_error_event_closes_the_stream() -> None:
    event = sse_error_event(UpstreamTimeout("slow"))
    assert event.startswith(b"data: {") and event.endswith(b"data: [DONE]\n\n")


def test_flags_win_over_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("prefill: [http://p:1]\ndecode: [http://d:2]\nmode: push\nport: 9000\n")
    args = build_parser().parse_args(["serve", "--config", str(path), "--mode", "auto"])
    config = load_config(args)
    assert config.mode is Mode.AUTO and config.port == 9000
    assert [e.url for e in config.prefill] == ["http://p:1"]


def test_toml_config(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('decode = ["http://d:2"]\n[[prefill]]\nurl = "http://p:1"\nengine_id = "e"\n'
                    '[timeouts]\nprefill = 5.0\n')
    config = load_config(build_parser().parse_args(["serve", "--config", str(path)]))
    assert config.prefill[0].engine_id == "e" and config.timeouts.prefill == 5.0


@pytest.mark.parametrize("values,words", [
    ({"decode": ["http://d:1"]}, "prefill"),
    ({"prefill": ["http://p:1"]}, "decode"),
    ({"prefill": ["ftp://p"], "decode": ["http://d:1"]}, "URL"),
    ({"prefill": ["http://p:1/v1"], "decode": ["http://d:1"]}, "without a path"),
    ({"prefill": ["http://p:1"], "decode": ["http://d:1"], "mode": "fast"}, "mode"),
    ({"prefill": ["http://p:1"], "decode": ["http://d:1"], "timeouts": {"prefill": 0}}, "timeouts.prefill"),
    ({"prefill": ["http://p:1"], "decode": ["http://d:1"], "colour": "red"}, "colour"),
    ({"prefill": ["http://p:1"], "decode": ["http://d:1"], "timeouts": {"pool": 0}}, "timeouts.pool"),
    ({"prefill": ["http://p:1"], "decode": ["http://d:1"], "limits": {"max_in_flight": -1}},
     "limits.max_in_flight"),
    ({"prefill": ["http://p:1"], "decode": ["http://d:1"], "admin_listen": "8001"}, "host:port"),
    ({"prefill": ["http://p:1"], "decode": ["http://d:1"], "push_recovery": "pray"},
     "push_recovery"),
])
def test_bad_config_is_refused_with_the_reason(values: dict[str, object], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        build_config(values, {})


@pytest.mark.parametrize("name", ["1p1d-cpu.yaml", "example.yaml"])
def test_shipped_configs_are_valid(name: str) -> None:
    args = build_parser().parse_args(["serve", "--config", str(REPO / "configs" / name)])
    config = load_config(args)
    assert config.prefill and config.decode


def test_a_secret_may_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from proxy.config import resolve_secret

    monkeypatch.setenv("ROUTER_TEST_KEY", "s3cret")
    assert resolve_secret("env:ROUTER_TEST_KEY") == "s3cret"
    assert resolve_secret("plain") == "plain" and resolve_secret(None) is None
    monkeypatch.delenv("ROUTER_TEST_KEY")
    with pytest.raises(ValueError, match="ROUTER_TEST_KEY"):
        resolve_secret("env:ROUTER_TEST_KEY")


@pytest.mark.parametrize("where", ["prefill", "auth", "admin_token"])
def test_a_secret_whose_variable_is_unset_fails_the_config_with_its_name_and_place(
    where: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("ROUTER_TEST_UNSET", raising=False)
    file_values: dict[str, object] = {
        "prefill": [{"url": "http://p:1", "api_key": "env:ROUTER_TEST_UNSET"}],
        "auth": {"client_api_keys": ["k", "env:ROUTER_TEST_UNSET"]},
        "admin_token": "env:ROUTER_TEST_UNSET",
    }
    values = {"decode": [{"url": "http://d:1"}], where: file_values[where]}
    if where != "prefill":
        values["prefill"] = [{"url": "http://p:1"}]
    with pytest.raises(ValueError, match=r"ROUTER_TEST_UNSET.*not set") as raised:
        build_config(values, {})
    assert where in str(raised.value) or where == "admin_token"  # msgspec names the field's path
    monkeypatch.setenv("ROUTER_TEST_UNSET", "set now")
    assert build_config(values, {}).decode[0].url == "http://d:1"


@pytest.mark.parametrize("key", ["", "  ", "env:ROUTER_TEST_BLANK"])
@pytest.mark.parametrize("where,field", [
    ("prefill", "api_key"),
    ("auth.prefill_api_key", "prefill_api_key"),
    ("auth.decode_api_key", "decode_api_key"),
    ("auth.client_api_keys", "client_api_keys[1]"),
])
def test_an_empty_or_blank_key_fails_the_config_with_its_field(
    key: str, where: str, field: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A key set to nothing (literally, or by a variable that is set but blank) must not
    vanish: an empty client key list would let every client in."""
    monkeypatch.setenv("ROUTER_TEST_BLANK", " ")
    values: dict[str, object] = {"prefill": [{"url": "http://p:1"}], "decode": ["http://d:1"]}
    if where == "prefill":
        values["prefill"] = [{"url": "http://p:1", "api_key": key}]
    elif where == "auth.client_api_keys":
        values["auth"] = {"client_api_keys": ["good-key", key]}
    else:
        values["auth"] = {where.removeprefix("auth."): key}
    with pytest.raises(ValueError, match=rf"{re.escape(field)} is empty") as raised:
        build_config(values, {})
    assert ("ROUTER_TEST_BLANK" in str(raised.value)) == key.startswith("env:")


@pytest.mark.parametrize("listed", ["", " ", ",", "alpha,,beta", "alpha, "])
def test_a_blank_key_in_the_client_keys_variable_fails_the_config(
    listed: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PDPROXY_CLIENT_API_KEYS", listed)
    values = {"prefill": ["http://p:1"], "decode": ["http://d:1"]}
    with pytest.raises(ValueError, match="PDPROXY_CLIENT_API_KEYS has an empty key"):
        build_config(values, {})
    monkeypatch.setenv("PDPROXY_CLIENT_API_KEYS", "alpha, beta")
    assert build_config(values, {}).auth.client_api_keys == []  # read by the app, as before
