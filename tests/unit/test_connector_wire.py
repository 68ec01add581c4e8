"""The one wire contract between the router and the connector (`connector.protocol.http_params`): its
decoding at each edge, its key names, and that the router's legs and the connector's
reads agree on them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from connector.protocol import http_params as wire
from proxy.config import Mode
from proxy.protocol import (
    PREFILL_KV_PARAMS,
    PrefillCoordinates,
    PushDecodeKVParams,
    Route,
    parse_request,
    prefill_body,
    push_decode_body,
)

ROOT = Path(__file__).resolve().parents[2]
FIELDS = {f.encode_name for f in msgspec.structs.fields(wire.KVTransferParams)}
KEY_CONSTANTS = {name: value for name, value in vars(wire).items()
                 if name.isupper() and isinstance(value, str)
                 and name not in ("KV_TRANSFER_PARAMS", "PULL", "PUSH")
                 and not name.endswith("_HEADER")}


def test_every_key_is_named_once_and_decoded() -> None:
    assert set(KEY_CONSTANTS.values()) == FIELDS
    assert all(value == name.lower() for name, value in KEY_CONSTANTS.items())


@pytest.mark.parametrize("raw", [None, [], "push", 3])
def test_no_object_decodes_to_none(raw: object) -> None:
    assert wire.decode_params(raw) is None


def test_a_push_leg_decodes_to_its_fields() -> None:
    params = wire.decode_params({
        wire.DO_REMOTE_DECODE: True, wire.REMOTE_ENGINE_ID: None, wire.TRANSFER_ID: "t-1",
        wire.TRANSFER_MODE: wire.PUSH, wire.PROBE: False, "a_key_of_vllms": [1]})
    assert params == wire.KVTransferParams(do_remote_decode=True, transfer_id="t-1",
                                           transfer_mode="push")
    assert params.is_push


def test_a_value_of_the_wrong_type_counts_as_absent_and_only_it() -> None:
    params = wire.decode_params({wire.PUSH_PORT: "5700", wire.PUSH_HOST: "10.0.0.7",
                                 wire.TRANSFER_ID: 7, wire.TP_SIZE: 2, wire.FAIL_WRITE: "yes"})
    assert params == wire.KVTransferParams(push_host="10.0.0.7", tp_size=2)


@pytest.mark.parametrize(("raw", "address"), [
    pytest.param({wire.PUSH_HOST: "10.0.0.7", wire.PUSH_PORT: 5700,
                  wire.REMOTE_HOST: "10.0.0.1"}, "tcp://10.0.0.7:5700", id="push-host"),
    pytest.param({wire.REMOTE_HOST: "10.0.0.1", wire.PUSH_PORT: 5700}, "tcp://10.0.0.1:5700",
                 id="remote-host"),
    pytest.param({wire.REMOTE_HOST: "10.0.0.1"}, None, id="no-port"),
    pytest.param({wire.REMOTE_HOST: "10.0.0.1", wire.PUSH_PORT: 0}, None, id="port-0"),
    pytest.param({wire.REMOTE_HOST: "10.0.0.1", wire.PUSH_PORT: 65536}, None, id="port-big"),
    pytest.param({wire.PUSH_PORT: 5700}, None, id="no-host"),
])
def test_ps_push_channel_address(raw: dict[str, Any], address: str | None) -> None:
    params = wire.decode_params(raw)
    assert params is not None
    assert wire.push_channel_address(params) == address


def test_the_transfer_modes_are_the_routers() -> None:
    assert {Mode(m) for m in wire.TRANSFER_MODE_VALUES} == {Mode.PULL, Mode.PUSH}


def _keys(struct: type[msgspec.Struct]) -> set[str]:
    return {f.encode_name for f in msgspec.structs.fields(struct)}


def test_the_routers_legs_use_only_the_contracts_keys() -> None:
    assert set(PREFILL_KV_PARAMS) <= FIELDS
    assert _keys(PushDecodeKVParams) <= FIELDS
    request = parse_request(Route.COMPLETIONS, b'{"model":"m","prompt":"x"}', {},
                            max_body_bytes=1000)
    p_leg = prefill_body(request, transfer_id="t-1")[wire.KV_TRANSFER_PARAMS]
    assert set(p_leg) <= FIELDS
    coordinates = PrefillCoordinates(engine_id="e", host="h", port=5600, push_host="h",
                                     push_port=5700)
    d_leg = push_decode_body(request, coordinates, transfer_id="t-1")[wire.KV_TRANSFER_PARAMS]
    assert set(d_leg) <= FIELDS


def test_what_the_router_sends_the_connector_reads_back() -> None:
    request = parse_request(Route.COMPLETIONS, b'{"model":"m","prompt":"x"}', {},
                            max_body_bytes=1000)
    p_leg = wire.decode_params(prefill_body(request, transfer_id="t-1")[wire.KV_TRANSFER_PARAMS])
    assert p_leg is not None and p_leg.is_push and p_leg.do_remote_decode
    assert p_leg.transfer_id == "t-1"
    coordinates = PrefillCoordinates(engine_id="e", host="h", port=5600, tp_size=2,
                                     push_host="10.0.0.7", push_port=5700)
    d_raw = push_decode_body(request, coordinates, transfer_id="t-1")[wire.KV_TRANSFER_PARAMS]
    d_leg = wire.decode_params(d_raw)
    assert d_leg is not None and d_leg.is_push and d_leg.do_remote_prefill
    assert (d_leg.transfer_id, d_leg.remote_engine_id, d_leg.tp_size) == ("t-1", "e", 2)
    assert wire.push_channel_address(d_leg) == "tcp://10.0.0.7:5700"


def test_the_router_imports_no_vllm() -> None:
    code = ("import sys, proxy.api.app, proxy.protocol, connector.protocol.http_params; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm'))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
