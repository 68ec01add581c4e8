"""The push side channel's wire messages: round trips, and every refusal as ProtocolError."""

from __future__ import annotations

import math
import tracemalloc
from typing import Any

import msgspec
import pytest

from connector.protocol.side_channel import (
    MAX_KV_GROUPS,
    MAX_WITHHELD,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Abandon,
    Abort,
    Ack,
    EngineId,
    FailReason,
    Grant,
    LeaseToken,
    Message,
    Nack,
    NackReason,
    Ping,
    Pong,
    ProtocolError,
    PullOffer,
    PushDone,
    PushFailed,
    RegisterBlocks,
    TransferId,
    decode,
    encode,
)

TID = TransferId("t-1")

REGISTER_FIELDS: dict[str, Any] = {
    "type": "register_blocks", "version": PROTOCOL_VERSION, "transfer_id": "t-1",
    "engine_id": "d-engine", "request_id": "cmpl-d-1", "tp_size": 2, "tp_rank": 1, "block_ids": [[0, 1, 2], [7]],
    "block_size": 16, "host": "10.0.0.2", "port": 5601, "ttl_s": 30.0,
}


def register_blocks() -> RegisterBlocks:
    fields = {k: v for k, v in REGISTER_FIELDS.items() if k not in ("type", "version")}
    return RegisterBlocks(**fields)


TOKEN = LeaseToken(instance=2**61 + 5, sent=1234.5, lease_s=3.0, write_s=10.0)
GRANT = Grant(token=TOKEN, adds=[TransferId("t-0")], withheld=[TransferId("t-9")])

ONE_OF_EACH: list[Message] = [
    register_blocks(),
    msgspec.structs.replace(register_blocks(), grant=GRANT),
    Ack(transfer_id=TID, engine_id=EngineId("p"), block_size=16, tp_size=2),
    Ack(transfer_id=TID, engine_id=EngineId("p"), block_size=16, tp_size=2, lease=TOKEN,
        granted=True),
    Nack(transfer_id=TID, reason=NackReason.DUPLICATE, message="again"),
    Abort(transfer_id=TID),
    Abandon(transfer_id=TID),
    PushDone(transfer_id=TID),
    PushFailed(transfer_id=TID, reason=FailReason.WRITE_ERROR, message="nixl"),
    PushFailed(transfer_id=TID, reason=FailReason.WRITE_ERROR, message="nixl",
               pull=PullOffer(request_id="p-req", block_ids=[[4, 9], [2]], ttl_s=30.0)),
    Ping(),
    Ping(grant=GRANT),
    Pong(),
    Pong(lease=TOKEN),
]

TRANSFER_MESSAGES: list[Message] = [m for m in ONE_OF_EACH if not isinstance(m, (Ping, Pong))]


def raw(**fields: Any) -> bytes:
    """A register_blocks message as a peer might send it, with some fields replaced
    (a value of `...` removes the field)."""
    merged = {**REGISTER_FIELDS, **fields}
    return msgspec.msgpack.encode({k: v for k, v in merged.items() if v is not ...})


@pytest.mark.parametrize("message", ONE_OF_EACH, ids=lambda m: str(m.__struct_config__.tag))
def test_every_message_round_trips_with_its_type_and_version_on_the_wire(
    message: Message,
) -> None:
    data = encode(message)
    assert decode(data) == message
    assert type(decode(data)) is type(message)
    on_wire = msgspec.msgpack.decode(data)
    assert on_wire["type"] == message.__struct_config__.tag
    assert on_wire["version"] == PROTOCOL_VERSION


def test_the_message_union_and_the_known_types_agree() -> None:
    assert MESSAGE_TYPES == {message.__struct_config__.tag for message in ONE_OF_EACH}
    assert {"ping", "pong"} <= MESSAGE_TYPES


@pytest.mark.parametrize(("message", "lease"), [(Ping(), "grant"), (Pong(), "lease")],
                         ids=["ping", "pong"])
def test_ping_and_pong_round_trip_and_carry_only_their_type_version_and_lease(
    message: Message, lease: str,
) -> None:
    data = encode(message)
    assert msgspec.msgpack.decode(data) == {
        "type": message.__struct_config__.tag, "version": PROTOCOL_VERSION, lease: None}
    decoded = decode(data)
    assert decoded == message and type(decoded) is type(message)
    assert not hasattr(decoded, "transfer_id"), "liveness names no transfer"


@pytest.mark.parametrize("kind", ["ping", "pong"])
def test_a_ping_or_pong_of_another_version_is_refused(kind: str) -> None:
    data = msgspec.msgpack.encode({"type": kind, "version": PROTOCOL_VERSION + 1})
    with pytest.raises(ProtocolError, match=f"received a '{kind}' message of version"):
        decode(data)


@pytest.mark.parametrize("message", TRANSFER_MESSAGES,
                         ids=lambda m: str(m.__struct_config__.tag))
def test_every_transfer_message_refuses_an_empty_transfer_id(message: Message) -> None:
    values = {**msgspec.structs.asdict(message), "transfer_id": ""}
    with pytest.raises(ProtocolError, match="transfer_id must be a non-empty string"):
        type(message)(**values)


@pytest.mark.parametrize("message", [
    *(PushFailed(transfer_id=TID, reason=reason) for reason in FailReason),
    *(Nack(transfer_id=TID, reason=reason) for reason in NackReason),
], ids=lambda m: f"{m.__struct_config__.tag}-{m.reason.value}")
def test_every_reason_round_trips(message: Message) -> None:
    assert decode(encode(message)) == message


def test_the_abort_reasons_are_on_the_wire_as_their_names() -> None:
    assert FailReason.ABORTED.value == "aborted"
    assert FailReason.PREFILL_ABORTED.value == "prefill_aborted"
    assert NackReason.PREFILL_ABORTED.value == "prefill_aborted"
    on_wire = msgspec.msgpack.decode(encode(
        Nack(transfer_id=TID, reason=NackReason.PREFILL_ABORTED)))
    assert on_wire["reason"] == "prefill_aborted"


def test_a_peers_plain_map_decodes_and_ints_are_accepted_for_float_fields() -> None:
    message = decode(raw(ttl_s=30))
    assert message == register_blocks()
    assert isinstance(message, RegisterBlocks) and isinstance(message.ttl_s, float)


@pytest.mark.parametrize("data", [
    pytest.param(b"", id="empty"),
    pytest.param(b"\xc1", id="never-used-byte"),
    pytest.param(encode(register_blocks())[:-3], id="truncated"),
    pytest.param(msgspec.msgpack.encode([1, 2, 3]), id="array"),
    pytest.param(msgspec.msgpack.encode(7), id="int"),
    pytest.param(msgspec.msgpack.encode({"version": PROTOCOL_VERSION, "transfer_id": "t"}), id="no-type"),
    pytest.param(raw(version=...), id="no-version"),
    pytest.param(raw(version="1"), id="version-is-a-string"),
    pytest.param(msgspec.json.encode(REGISTER_FIELDS), id="json-not-msgpack"),
])
def test_malformed_bytes_are_a_protocol_error(data: bytes) -> None:
    with pytest.raises(ProtocolError, match="malformed"):
        decode(data)


def test_an_unknown_type_is_a_protocol_error_that_names_it() -> None:
    with pytest.raises(ProtocolError, match="unknown message type 'hello'"):
        decode(raw(type="hello"))


@pytest.mark.parametrize("version", [0, PROTOCOL_VERSION + 1, -1])
def test_another_version_is_refused_and_both_versions_are_named(version: int) -> None:
    with pytest.raises(ProtocolError, match="version mismatch") as caught:
        decode(raw(version=version))
    assert f"version {version}," in str(caught.value)
    assert f"speaks version {PROTOCOL_VERSION}" in str(caught.value)


def test_another_version_is_refused_even_when_its_body_would_not_parse() -> None:
    with pytest.raises(ProtocolError, match="version mismatch"):
        decode(raw(version=PROTOCOL_VERSION + 1, port="a new shape", block_ids=...))


INVALID_REGISTER_FIELDS = [
    pytest.param({"transfer_id": ""}, "transfer_id", id="empty-transfer-id"),
    pytest.param({"engine_id": ""}, "engine_id", id="empty-engine-id"),
    pytest.param({"request_id": ""}, "request_id", id="empty-request-id"),
    pytest.param({"host": ""}, "host", id="empty-host"),
    pytest.param({"tp_size": 0}, "tp_size", id="tp-size-0"),
    pytest.param({"tp_rank": -1}, "tp_rank", id="negative-rank"),
    pytest.param({"tp_rank": 2}, "tp_rank", id="rank-equals-tp-size"),
    pytest.param({"block_ids": []}, "block_ids", id="no-kv-groups"),
    pytest.param({"block_ids": [[]] * (MAX_KV_GROUPS + 1)}, "block_ids",
                 id="too-many-kv-groups"),
    pytest.param({"block_ids": [[1, -1]]}, "block_ids", id="negative-block-id"),
    pytest.param({"block_size": 0}, "block_size", id="block-size-0"),
    pytest.param({"port": 0}, "port", id="port-0"),
    pytest.param({"port": 65536}, "port", id="port-65536"),
    pytest.param({"ttl_s": 0.0}, "ttl_s", id="ttl-0"),
    pytest.param({"ttl_s": -1.0}, "ttl_s", id="ttl-negative"),
    pytest.param({"ttl_s": math.inf}, "ttl_s", id="ttl-inf"),
    pytest.param({"ttl_s": math.nan}, "ttl_s", id="ttl-nan"),
]


@pytest.mark.parametrize(("fields", "named"), INVALID_REGISTER_FIELDS)
def test_each_invalid_field_is_refused_on_decode(fields: dict[str, Any], named: str) -> None:
    with pytest.raises(ProtocolError, match="invalid 'register_blocks' message") as caught:
        decode(raw(**fields))
    assert named in str(caught.value)


@pytest.mark.parametrize(("fields", "named"), INVALID_REGISTER_FIELDS)
def test_each_invalid_field_is_refused_when_built_here_too(
    fields: dict[str, Any], named: str
) -> None:
    values = {**msgspec.structs.asdict(register_blocks()), **fields}
    with pytest.raises(ProtocolError, match=named):
        RegisterBlocks(**values)


PULL_OFFERS_BAD: list[tuple[str, dict[str, object]]] = [
    ("empty-request-id", {"request_id": ""}),
    ("no-groups", {"block_ids": []}),
    ("too-many-groups", {"block_ids": [[]] * (MAX_KV_GROUPS + 1)}),
    ("negative-block", {"block_ids": [[1, -1]]}),
    ("ttl-0", {"ttl_s": 0}),
    ("no-ttl", {"ttl_s": None}),
]


@pytest.mark.parametrize("data", [
    pytest.param(raw(port="5601"), id="port-is-a-string"),
    pytest.param(raw(block_ids=[["a"]]), id="block-id-is-a-string"),
    pytest.param(raw(block_ids=[1, 2]), id="block-ids-not-grouped"),
    pytest.param(raw(engine_id=...), id="missing-engine-id"),
    pytest.param(raw(request_id=...), id="missing-request-id"),
    pytest.param(raw(request_id=7), id="request-id-is-an-int"),
    pytest.param(raw(tp_rank=True), id="bool-for-int"),
    pytest.param(msgspec.msgpack.encode({"type": "nack", "version": PROTOCOL_VERSION, "transfer_id": "t",
                                         "reason": "bored"}), id="unknown-nack-reason"),
    pytest.param(msgspec.msgpack.encode({"type": "push_failed", "version": PROTOCOL_VERSION,
                                         "transfer_id": "t"}), id="missing-fail-reason"),
    pytest.param(msgspec.msgpack.encode({"type": "ack", "version": PROTOCOL_VERSION, "transfer_id": "t",
                                         "engine_id": "p", "block_size": 0, "tp_size": 1}),
                 id="ack-block-size-0"),
    pytest.param(msgspec.msgpack.encode({"type": "ack", "version": PROTOCOL_VERSION, "transfer_id": "t",
                                         "engine_id": "", "block_size": 16, "tp_size": 1}),
                 id="ack-empty-engine-id"),
    pytest.param(msgspec.msgpack.encode({"type": "ack", "version": PROTOCOL_VERSION, "transfer_id": "t",
                                         "engine_id": "p", "block_size": 16, "tp_size": 0}),
                 id="ack-tp-size-0"),
    pytest.param(msgspec.msgpack.encode({"type": "abort", "version": PROTOCOL_VERSION, "transfer_id": ""}),
                 id="abort-empty-transfer-id"),
    *[pytest.param(msgspec.msgpack.encode({
        "type": "push_failed", "version": PROTOCOL_VERSION, "transfer_id": "t",
        "reason": "write_error", "pull": {"request_id": "p", "block_ids": [[1]], "ttl_s": 5.0,
                                          **bad}}), id=f"pull-offer-{name}")
      for name, bad in PULL_OFFERS_BAD],
])
def test_mistyped_missing_or_invalid_fields_are_a_protocol_error(data: bytes) -> None:
    with pytest.raises(ProtocolError, match="invalid '"):
        decode(data)


def test_a_million_empty_kv_groups_are_refused_before_they_are_built() -> None:
    """One byte a group: a million fit in a frame P accepts. Built, they would take tens
    of MB and most of a second on P's side channel thread."""
    data = raw(block_ids=[[]] * 1_000_000)
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError, match=f"length <= {MAX_KV_GROUPS}"):
            decode(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"decoding it allocated {peak} bytes"


def test_protocol_error_is_a_value_error_chained_to_its_cause() -> None:
    with pytest.raises(ValueError) as caught:
        decode(raw(port=0))
    assert isinstance(caught.value, ProtocolError)
    assert isinstance(caught.value.__cause__, msgspec.ValidationError)


@pytest.mark.parametrize(("token", "named"), [
    pytest.param({"sent": math.nan}, "sent", id="sent-nan"),
    pytest.param({"lease_s": 0.0}, "lease_s", id="no-lease"),
    pytest.param({"lease_s": math.inf}, "lease_s", id="endless-lease"),
    pytest.param({"write_s": -1.0}, "write_s", id="negative-write"),
])
def test_a_lease_token_with_a_bad_term_is_refused(token: dict[str, Any], named: str) -> None:
    fields = {"instance": 1, "sent": 1.0, "lease_s": 3.0, "write_s": 10.0, **token}
    with pytest.raises(ProtocolError, match=named):
        LeaseToken(**fields)
    wire = msgspec.to_builtins(Pong(lease=TOKEN))
    wire["lease"] = fields
    with pytest.raises(ProtocolError, match=named):
        decode(msgspec.msgpack.encode(wire))


@pytest.mark.parametrize("names", ["adds", "withheld"])
def test_a_grant_names_no_empty_id_and_no_more_than_its_limit(names: str) -> None:
    with pytest.raises(ProtocolError, match="transfer_id must be a non-empty string"):
        Grant(token=TOKEN, **{names: [TransferId("")]})
    wire = msgspec.to_builtins(Ping(grant=GRANT))
    wire["grant"][names] = ["t"] * (MAX_WITHHELD + 1)
    with pytest.raises(ProtocolError, match=f"length <= {MAX_WITHHELD}"):
        decode(msgspec.msgpack.encode(wire))


def test_messages_are_immutable() -> None:
    with pytest.raises(AttributeError):
        Abort(transfer_id=TID).transfer_id = TransferId("other")  # type: ignore[misc]
