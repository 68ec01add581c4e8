"""The contract between the router and vLLM's servers on the HTTP legs: the
`kv_transfer_params` object of each leg and each answer, and the header names.

One module for both sides, free of vLLM (and of ZMQ), so the router imports it as
cheaply as the connector does: every key is named here once, and nowhere else in
`proxy/` or `connector/`. Each side decodes the object it receives once, at its edge,
into a typed `KVTransferParams` (`decode_params`; `decode_params_json` from the object's
JSON), and builds what it sends with the key names below.

Who sends what (vLLM 0.32's NIXL keys, plus ours):

- P leg, both modes: `do_remote_decode` true, nulls for `remote_*`; in push, also
  `transfer_id` and `transfer_mode` "push", and `push_layers` true or false when the
  client asked for a push written layer by layer or whole (`PUSH_LAYERS_HEADER`; absent:
  P's connector decides); a probe adds `probe` true; a test may add `fail_write` true
  (honoured only with the connector's `fault_injection`).
- P's answer: `do_remote_prefill` true, `remote_engine_id`, `remote_block_ids`,
  `remote_host`, `remote_port`, `tp_size`, ...; from our connector also
  `transfer_modes`, `push_host`, `push_port`, `dp_rank` (the data-parallel rank of the
  engine that answered) and `dp_size` (how many ranks P has; absent when the engine does
  not know: vLLM runs a dense model's ranks as independent engines of size 1), and
  `transfer_mode` "push" for a push.
- D leg, pull: P's answer, unchanged.
- D leg, push: P's coordinates (`remote_engine_id`, `remote_host`, `remote_port`,
  `tp_size`, `push_host`, `push_port`), `transfer_id`, `transfer_mode` "push",
  `remote_request_id` (P's request id), `do_remote_prefill` true, no block ids.

Decoding is lenient by design: the object also carries keys of vLLM's that we do not
read (kept, never checked), and a key of ours whose value has the wrong type counts as
absent, so a malformed optional key (a P's `push_port` given as a string) costs only
what it names, not the whole answer.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from connector.protocol.side_channel import TransferId

# The request body's key that holds them.
KV_TRANSFER_PARAMS: Final = "kv_transfer_params"

# vLLM's NIXL keys.
DO_REMOTE_DECODE: Final = "do_remote_decode"
DO_REMOTE_PREFILL: Final = "do_remote_prefill"
REMOTE_ENGINE_ID: Final = "remote_engine_id"
REMOTE_BLOCK_IDS: Final = "remote_block_ids"
REMOTE_HOST: Final = "remote_host"
REMOTE_PORT: Final = "remote_port"
REMOTE_REQUEST_ID: Final = "remote_request_id"
TP_SIZE: Final = "tp_size"
# Ours (the router's and our connector's).
TRANSFER_ID: Final = "transfer_id"
TRANSFER_MODE: Final = "transfer_mode"
TRANSFER_MODES: Final = "transfer_modes"
PUSH_HOST: Final = "push_host"
PUSH_PORT: Final = "push_port"
PROBE: Final = "probe"
FAIL_WRITE: Final = "fail_write"
PUSH_LAYERS: Final = "push_layers"
DP_RANK: Final = "dp_rank"
DP_SIZE: Final = "dp_size"

# The values of `transfer_mode` and the members of `transfer_modes`.
PULL: Final = "pull"
PUSH: Final = "push"
TRANSFER_MODE_VALUES: Final = (PULL, PUSH)

# Headers. vLLM names a leg's request after REQUEST_ID_HEADER (with a prefix per route);
# the router reads a client's choice of mode from TRANSFER_MODE_HEADER and answers with
# the mode used in it.
REQUEST_ID_HEADER: Final = "X-Request-Id"
TRANSFER_MODE_HEADER: Final = "X-KV-Transfer-Mode"
# vLLM's: a server started with --data-parallel-size runs the request on this rank's
# engine (0-based; out of range: 400). The router pins a push's P leg with it.
DATA_PARALLEL_RANK_HEADER: Final = "X-data-parallel-rank"
# A client's choice, for a push, of writing the KV layer by layer while P computes
# ("on") or whole once P is done ("off"); absent or "auto": P's connector decides.
PUSH_LAYERS_HEADER: Final = "X-KV-Push-Layers"


class KVTransferParams(msgspec.Struct, frozen=True, kw_only=True):
    """A leg's or an answer's kv_transfer_params, as far as the router or the connector
    reads them. A key that is absent, null or of the wrong type has its default."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_block_ids: list[Any] | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_request_id: str | None = None
    tp_size: int | None = None
    transfer_id: str | None = None
    transfer_mode: str | None = None
    transfer_modes: list[str] | None = None
    push_host: str | None = None
    push_port: int | None = None
    probe: bool = False
    fail_write: bool = False
    push_layers: bool | None = None
    dp_rank: int | None = None
    dp_size: int | None = None

    @property
    def is_push(self) -> bool:
        return self.transfer_mode == PUSH


_FIELDS = tuple((f.encode_name, f.name, f.type) for f in msgspec.structs.fields(KVTransferParams))


def decode_params(raw: object) -> KVTransferParams | None:
    """`raw`, a kv_transfer_params object, decoded; None when it is not an object (absent,
    null, or something else). Never raises: a key of the wrong type counts as absent."""
    if not isinstance(raw, dict):
        return None
    try:
        return msgspec.convert(raw, KVTransferParams)  # the usual case: one pass, ~1 us
    except msgspec.ValidationError:
        pass
    values: dict[str, Any] = {}  # a value of the wrong type: take the keys one by one
    for key, name, kind in _FIELDS:
        value = raw.get(key)
        if value is None:
            continue
        try:
            values[name] = msgspec.convert(value, kind)
        except msgspec.ValidationError:
            continue
    return KVTransferParams(**values)


_params_decoder = msgspec.json.Decoder(KVTransferParams)


def decode_params_json(raw: bytes | msgspec.Raw) -> KVTransferParams | None:
    """A kv_transfer_params object as JSON (an answer's, kept as it came), decoded as
    `decode_params` decodes it: in one typed pass when every key has its type, else
    leniently (`raw` comes from a document already decoded: it is valid JSON). Empty
    (the key was absent): None."""
    if not raw:
        return None
    try:
        return _params_decoder.decode(raw)  # the usual case: no dict built first
    except msgspec.ValidationError:
        return decode_params(msgspec.json.decode(raw))


class PrefillAnswer(msgspec.Struct):
    """What the router reads of P's answer; the rest is skipped as it is decoded.

    `kv_transfer_params` stays the JSON P sent (empty when absent): D's leg in pull mode
    carries it unchanged, so it is neither built into objects nor encoded again (its
    block ids grow with the prompt: 64 for 1k tokens of 16-token blocks); what the
    router reads of it is decoded once, typed (`params`). `usage` tells P's prefix-cache
    hits, when P's server reports them. (Here, not in the router's compiled modules:
    mypyc would give the struct `type` for `Any`.)"""

    kv_transfer_params: msgspec.Raw = msgspec.Raw()
    usage: Any = None

    def params(self) -> KVTransferParams | None:
        """The kv_transfer_params decoded (None: absent, null or not an object)."""
        return decode_params_json(self.kv_transfer_params)


class DecodeAnswer(msgspec.Struct):
    """D's whole answer as the router checks it before relaying its bytes: a JSON object,
    whose members are skipped unread (their syntax checked, their strings' encoding
    not). Decoding it into objects only to test its type was 4.5 times the cost
    (0.36 against 1.6 us for the benchmark's 124-byte answer, `timeit`; callgrind:
    5,870 instructions per request for the check), and grows with the answer."""


def push_channel_address(params: KVTransferParams) -> str | None:
    """The tcp:// address of the P push side channel that `params` name (`push_host`, else
    `remote_host`, and `push_port`); None when they name none."""
    host, port = params.push_host or params.remote_host, params.push_port
    if host is None or port is None or not 0 < port < 65536:
        return None
    return f"tcp://{host}:{port}"


def transfer_id_of(params: KVTransferParams) -> TransferId | None:
    """The router's `transfer_id`, naming this push on P and D; None when absent."""
    return TransferId(params.transfer_id) if params.transfer_id else None
