from __future__ import annotations

import msgspec
import pytest

from connector.protocol.http_params import PrefillAnswer
from proxy.config import Mode
from proxy.errors import InvalidRequest, PayloadTooLarge
from proxy.protocol import (
    MAX_JSON_DEPTH,
    ClientRequest,
    PrefillCoordinates,
    Route,
    coordinates_from_answer,
    opening_brackets,
    parse_request,
    prefill_body,
    pull_decode_body,
    push_decode_body,
)

P_ANSWER_PARAMS = {
    "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2]],
    "remote_engine_id": "eng", "remote_request_id": "cmpl-r1-abcd", "remote_host": "10.0.0.1",
    "remote_port": 5600, "tp_size": 2, "transfer_mode": "pull",
}


def request(route: Route = Route.COMPLETIONS, **body: object) -> ClientRequest:
    base: dict[str, object] = {"model": "m", "prompt": "hi"} if route is Route.COMPLETIONS else {
        "model": "m", "messages": [{"role": "user", "content": "hi"}]}
    return parse_request(route, msgspec.json.encode({**base, **body}),
                         {"x-request-id": "r1"}, max_body_bytes=10_000)


def test_prefill_leg_is_one_token_not_streamed_and_keeps_kv() -> None:
    req = request(Route.CHAT, stream=True, max_tokens=50, min_tokens=5,
                  stream_options={"include_usage": True}, temperature=0)
    body = prefill_body(req, transfer_id=None)
    assert body["stream"] is False and body["max_tokens"] == 1 and body["max_completion_tokens"] == 1
    assert "min_tokens" not in body and "stream_options" not in body
    assert body["temperature"] == 0  # other client settings are kept
    assert body["kv_transfer_params"] == {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None}
    assert req.body["stream"] is True, "the client's body is not changed in place"


def test_prefill_leg_in_push_carries_the_transfer_id() -> None:
    body = prefill_body(request(), transfer_id="t-1")
    assert body["kv_transfer_params"]["transfer_id"] == "t-1"
    assert "max_completion_tokens" not in body


def _p_answer(params: object = None, **more: object) -> PrefillAnswer:
    """P's answer as the router decodes it, from its JSON."""
    document = {"id": "cmpl-1", "choices": [{"text": "p"}], **more}
    if params is not None:
        document["kv_transfer_params"] = params
    return msgspec.json.decode(msgspec.json.encode(document), type=PrefillAnswer)


def test_pull_decode_leg_is_the_client_body_plus_p_params_unchanged() -> None:
    req = request(max_tokens=7, stream=True)
    answer = _p_answer({**P_ANSWER_PARAMS, "vllm_key": [1, {"x": None}]})
    body = pull_decode_body(req, answer, answer.params())
    sent = msgspec.json.decode(msgspec.json.encode(body))  # as D receives it
    assert sent["kv_transfer_params"] == {**P_ANSWER_PARAMS, "vllm_key": [1, {"x": None}]}
    assert sent["max_tokens"] == 7 and sent["stream"] is True
    assert "kv_transfer_params" not in req.body, "the client's body is not changed in place"


@pytest.mark.parametrize("params", [None, [], {}, {**P_ANSWER_PARAMS, "remote_engine_id": None},
                                    {**P_ANSWER_PARAMS, "remote_port": "5600"},
                                    {**P_ANSWER_PARAMS, "do_remote_prefill": False},
                                    {k: v for k, v in P_ANSWER_PARAMS.items() if k != "remote_block_ids"}])
def test_pull_decode_leg_refuses_unusable_p_params(params: object) -> None:
    answer = _p_answer(params)
    with pytest.raises(ValueError):
        pull_decode_body(request(), answer, answer.params())


def test_p_answer_is_read_in_one_typed_pass_or_leniently() -> None:
    answer = _p_answer(P_ANSWER_PARAMS, usage={"prompt_tokens": 9})
    assert answer.usage == {"prompt_tokens": 9}
    params = answer.params()
    assert params is not None and params.remote_block_ids == [[1, 2]]
    assert params.remote_engine_id == "eng" and params.tp_size == 2
    # a key of the wrong type counts as absent, the others are kept (decode_params' rule)
    lenient = _p_answer({**P_ANSWER_PARAMS, "push_port": "5700"}).params()
    assert lenient is not None and lenient.push_port is None and lenient.remote_port == 5600
    assert _p_answer().params() is None  # absent
    assert _p_answer(None, kv_transfer_params=None).params() is None  # null
    with pytest.raises(msgspec.ValidationError):  # not an object: the client's protocol error
        msgspec.json.decode(b"[1]", type=PrefillAnswer)


@pytest.mark.parametrize("route,prefix", [(Route.COMPLETIONS, "cmpl-"), (Route.CHAT, "chatcmpl-")])
def test_push_decode_leg_names_p_and_the_transfer(route: Route, prefix: str) -> None:
    coordinates = PrefillCoordinates(engine_id="eng", host="10.0.0.1", port=5600, tp_size=2)
    body = push_decode_body(request(route), coordinates, transfer_id="t-9")
    assert body["kv_transfer_params"] == {
        "remote_engine_id": "eng", "remote_host": "10.0.0.1", "remote_port": 5600, "tp_size": 2,
        "transfer_id": "t-9", "remote_request_id": prefix + "r1", "do_remote_prefill": True,
        "do_remote_decode": False, "transfer_mode": "push"}


def test_push_decode_leg_validates_what_it_sends() -> None:
    bad = PrefillCoordinates(engine_id="", host="h", port=5600)
    with pytest.raises(ValueError):
        push_decode_body(request(), bad, transfer_id="t")


@pytest.mark.parametrize("params,modes", [
    (P_ANSWER_PARAMS, {Mode.PULL}),
    ({**P_ANSWER_PARAMS, "transfer_mode": "push"}, {Mode.PUSH}),
    ({**P_ANSWER_PARAMS, "transfer_modes": ["pull", "push"]}, {Mode.PULL, Mode.PUSH}),
    ({k: v for k, v in P_ANSWER_PARAMS.items() if k != "transfer_mode"}, {Mode.PULL}),
])
def test_capabilities_from_p_answer(params: dict[str, object], modes: set[Mode]) -> None:
    found = coordinates_from_answer(params)
    assert found is not None
    assert (found.engine_id, found.host, found.port, found.tp_size) == ("eng", "10.0.0.1", 5600, 2)
    assert found.transfer_modes == modes


@pytest.mark.parametrize(("extra", "push_host", "push_port"), [
    pytest.param({"push_host": "10.0.0.7", "push_port": 5700}, "10.0.0.7", 5700, id="ours"),
    pytest.param({}, None, None, id="stock-no-side-channel"),
    pytest.param({"push_host": "10.0.0.7", "push_port": 0}, None, None, id="bad-port-ignored"),
    pytest.param({"push_host": "10.0.0.7", "push_port": "5700"}, None, None, id="port-not-int"),
])
def test_our_ps_push_side_channel_is_read_from_its_answer(
    extra: dict[str, object], push_host: str | None, push_port: int | None
) -> None:
    found = coordinates_from_answer({**P_ANSWER_PARAMS, **extra})
    assert found is not None
    assert (found.push_host, found.push_port) == (push_host, push_port)


def test_push_decode_leg_names_ps_push_side_channel_only_when_p_has_one() -> None:
    ours = PrefillCoordinates(engine_id="eng", host="10.0.0.1", port=5600, push_host="10.0.0.1",
                              push_port=5700)
    params = push_decode_body(request(), ours, transfer_id="t")["kv_transfer_params"]
    assert (params["push_host"], params["push_port"]) == ("10.0.0.1", 5700)
    stock = PrefillCoordinates(engine_id="eng", host="10.0.0.1", port=5600)
    params = push_decode_body(request(), stock, transfer_id="t")["kv_transfer_params"]
    assert "push_host" not in params and "push_port" not in params


def test_no_coordinates_in_an_answer_without_engine() -> None:
    assert coordinates_from_answer({"remote_host": "h"}) is None
    assert coordinates_from_answer(None) is None


def test_request_id_is_generated_when_absent() -> None:
    raw = b'{"model":"m","prompt":"x"}'
    a = parse_request(Route.COMPLETIONS, raw, {}, max_body_bytes=100)
    b = parse_request(Route.COMPLETIONS, raw, {}, max_body_bytes=100)
    assert a.request_id != b.request_id and len(a.request_id) == 32


def test_size_limit_and_mode_header() -> None:
    with pytest.raises(PayloadTooLarge):
        parse_request(Route.COMPLETIONS, b'{"model":"m","prompt":"xxxx"}', {}, max_body_bytes=10)
    req = parse_request(Route.COMPLETIONS, b'{"model":"m","prompt":[1,2]}',
                        {"x-kv-transfer-mode": "PUSH"}, max_body_bytes=100)
    assert req.mode_override is Mode.PUSH
    with pytest.raises(InvalidRequest):
        parse_request(Route.COMPLETIONS, b'{"model":"m","prompt":[]}', {}, max_body_bytes=100)


@pytest.mark.parametrize(("value", "sent"), [("on", True), (" OFF", False), ("auto", None),
                                             (None, None)])
def test_a_push_written_by_layer_or_whole_is_the_clients_choice(value: str | None,
                                                                 sent: bool | None) -> None:
    headers = {} if value is None else {"x-kv-push-layers": value}
    req = parse_request(Route.COMPLETIONS, b'{"model":"m","prompt":"x"}', headers,
                        max_body_bytes=100)
    params = prefill_body(req, transfer_id="t-1")["kv_transfer_params"]
    assert params.get("push_layers", "absent") == ("absent" if sent is None else sent)
    # A pull's P leg never carries it: it names how a push is written.
    assert "push_layers" not in prefill_body(req, transfer_id=None)["kv_transfer_params"]
    # The router's learned choice goes only where the client said nothing.
    for learned in (True, False):
        params = prefill_body(req, transfer_id="t-1", push_layers=learned)["kv_transfer_params"]
        assert params["push_layers"] is (learned if sent is None else sent)
        assert "push_layers" not in prefill_body(req, transfer_id=None,
                                                 push_layers=learned)["kv_transfer_params"]


def test_an_unknown_push_layers_value_is_a_400_naming_the_header() -> None:
    with pytest.raises(InvalidRequest, match="X-KV-Push-Layers must be on, off or auto"):
        parse_request(Route.COMPLETIONS, b'{"model":"m","prompt":"x"}',
                      {"x-kv-push-layers": "yes"}, max_body_bytes=100)


@pytest.mark.parametrize("raw", [
    b"", b"{}", b'{"prompt": "a [ b { c"}', b'{"messages": [' + b'{"a": [1]},' * 7 + b'{}]}',
    b"[" * 16 + b"{", b"[" * 17, b"{" * 9 + b"[" * 9, b'{"x": "' + b"[{" * 500 + b'"}',
])
def test_opening_brackets_are_counted_few_or_many(raw: bytes) -> None:
    assert opening_brackets(raw) == raw.count(b"[") + raw.count(b"{")


def test_a_body_nested_past_the_limit_is_refused_and_one_at_it_is_not() -> None:
    def body(depth: int) -> bytes:
        return b'{"model": "m", "prompt": "p", "x": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"

    parse_request(Route.COMPLETIONS, body(MAX_JSON_DEPTH), {}, max_body_bytes=10_000)
    with pytest.raises(InvalidRequest, match="nested more than 200 levels deep"):
        parse_request(Route.COMPLETIONS, body(MAX_JSON_DEPTH + 1), {}, max_body_bytes=10_000)


def test_the_shortest_body_nested_past_the_limit_is_refused() -> None:
    """A body nested deeper than the limit opens and closes each level, one more than
    the limit: the parse skips the search of shorter bodies, not of the shortest such
    object (its key, 3 bytes, on top)."""
    raw = b'{"":' + b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH + b"}"
    assert len(raw) == 2 * (MAX_JSON_DEPTH + 1) + 3
    with pytest.raises(InvalidRequest, match="nested more than 200 levels deep"):
        parse_request(Route.COMPLETIONS, raw, {}, max_body_bytes=10_000)
