"""What travels on the wire: the client's request, validated, and the bodies of each leg.

The client's body stays a plain JSON object end to end (we must forward fields we do not
know), but it is checked once here, at the edge, and the fields the router itself needs
are pulled out into a typed `ClientRequest`. `kv_transfer_params`, which the router builds
and validates, are typed structs.

kv_transfer_params, as vLLM 0.32 speaks them:
- P leg (both modes): do_remote_decode=true and nulls for the rest (+ transfer_id in push).
- P's answer: do_remote_prefill=true, remote_engine_id, remote_block_ids, host, port, ...
- D leg, pull: P's answer, unchanged.
- D leg, push: P's coordinates (engine id, side channel, tp size), the transfer id and
  P's request id (`remote_request_id`), and no block ids.
"""

from __future__ import annotations

import enum
import random
import re
from secrets import token_hex
from typing import Any, Final, final

import msgspec
from msgspec import convert
from msgspec.json import decode as decode_json

from connector.protocol import http_params as wire
from proxy.config import Mode
from proxy.errors import InvalidRequest, PayloadTooLarge


class Route(str, enum.Enum):
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"

    @property
    def request_id_prefix(self) -> str:
        """vLLM names a request `<prefix><X-Request-Id>` (plus a random suffix)."""
        return "chatcmpl-" if self is Route.CHAT else "cmpl-"


# Each route's path, looked up where it is read per request: an enum member's `.value`
# is two Python calls in Python 3.11.
ROUTE_PATH = {route: route.value for route in Route}


# Keys the router owns on the way to P; a client must not set them.
ROUTER_OWNED_FIELDS = (wire.KV_TRANSFER_PARAMS,)
_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


@final
class ClientRequest:
    """The client's request after validation: its raw body and what the router needs.

    A plain class compiled with the request path (not a msgspec struct): the flows read
    its fields some 25 times per request, each a C field read here where a struct's was a
    generic attribute lookup (about 230 instructions each, counted with callgrind:
    docs/benchmarks.md). Its fields are `Final`: read-only once made."""

    def __init__(
        self,
        *,
        route: Route,
        body: dict[str, Any],
        model: str,
        stream: bool,
        request_id: str,
        mode_override: Mode | None,
        push_layers: bool | None = None,
        token_ids: list[int] | None = None,
    ) -> None:
        self.route: Final = route
        self.body: Final = body
        self.model: Final = model
        self.stream: Final = stream
        self.request_id: Final = request_id
        self.mode_override: Final = mode_override
        # A push written layer by layer (True) or whole (False), from PUSH_LAYERS_HEADER;
        # None: P's connector decides.
        self.push_layers: Final = push_layers
        # A completion's prompt given as token ids (one prompt, not a batch), checked once
        # here; None for text, chats and anything else.
        self.token_ids: Final = token_ids

    def __repr__(self) -> str:
        return (f"ClientRequest(route={self.route.value!r}, model={self.model!r}, "
                f"stream={self.stream}, request_id={self.request_id!r})")


def prefix_key(request: ClientRequest, chars: int) -> str | None:
    """The start of the prompt, for prefix affinity: a completion's prompt (text, or token
    ids), or a chat's messages in order; None when there is none."""
    body = request.body
    if request.route is Route.CHAT:
        parts = []
        for message in body.get("messages") or ():
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):  # content parts: take the text ones
                parts.extend(str(p.get("text", "")) for p in content if isinstance(p, dict))
            if sum(map(len, parts)) >= chars:
                break
        text = "\n".join(parts)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list):  # token ids
            text = " ".join(map(str, prompt[:chars]))
        else:
            text = prompt if isinstance(prompt, str) else ""
    return text[:chars] or None


CHARS_PER_TOKEN = 4  # a prompt given as token ids counts this many characters per token


def prompt_chars(request: ClientRequest) -> int:
    """The prompt's length in characters (token ids count CHARS_PER_TOKEN each), for
    `auto` mode's prompt-length buckets."""
    body = request.body
    if request.route is Route.CHAT:
        total = 0
        for message in body.get("messages") or ():
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                total += len(content)
            elif isinstance(content, list):
                total += sum(len(str(p.get("text", ""))) for p in content if isinstance(p, dict))
        return total
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):  # a batch
        return sum(len(p) for p in prompt if isinstance(p, str))
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):  # batch of ids
        return CHARS_PER_TOKEN * sum(len(p) for p in prompt if isinstance(p, list))
    return CHARS_PER_TOKEN * len(prompt) if isinstance(prompt, list) else 0


def parse_request(
    route: Route, raw: bytes, headers: dict[str, str], *, max_body_bytes: int
) -> ClientRequest:
    """Validate a client's request. Raises InvalidRequest (400/413) naming the problem."""
    if len(raw) > max_body_bytes:
        raise body_too_large(len(raw), max_body_bytes)
    try:
        body = decode_json(raw)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # bad UTF-8 in a string: the latter
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    except RecursionError:  # nested deeper than the interpreter's recursion limit
        raise _nested_too_deep() from None
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    if _too_deep(raw, body):
        raise _nested_too_deep()

    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' is required and must be a non-empty string", param="model")
    token_ids = None
    if route is Route.COMPLETIONS:
        token_ids = _check_prompt(body.get("prompt"))
    else:
        _check_messages(body.get("messages"))

    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be a boolean", param="stream")
    _check_optional_int(body, "max_tokens", minimum=1)
    _check_optional_int(body, "max_completion_tokens", minimum=1)
    _check_disaggregation_limits(body)
    if wire.KV_TRANSFER_PARAMS in body:
        raise InvalidRequest(
            f"'{wire.KV_TRANSFER_PARAMS}' is set by the router and must not come from the client",
            param=wire.KV_TRANSFER_PARAMS,
        )

    return ClientRequest(
        route=route,
        body=body,
        model=model,
        stream=stream,
        request_id=_request_id(headers.get(_REQUEST_ID_HEADER)),
        mode_override=_mode_override(headers.get(_TRANSFER_MODE_HEADER)),
        push_layers=_push_layers(headers.get(_PUSH_LAYERS_HEADER)),
        token_ids=token_ids,
    )


# Deeper bodies are refused: decoding one near the interpreter's recursion limit succeeds
# at the edge, but encoding it again for a leg, a few frames deeper, raised RecursionError.
MAX_JSON_DEPTH = 200
# A body nested deeper than MAX_JSON_DEPTH opens and closes one more level than that:
# a shorter body is not, and is not searched (3 searches were 4,300 instructions of a
# short body's parse, callgrind).
_SHORTEST_TOO_DEEP = 2 * (MAX_JSON_DEPTH + 1)


def _too_deep(raw: bytes, body: dict[str, Any]) -> bool:
    """Whether `body` nests lists and objects more than MAX_JSON_DEPTH levels deep."""
    if len(raw) < _SHORTEST_TOO_DEEP or opening_brackets(raw) <= MAX_JSON_DEPTH:
        return False  # each level opens a bracket: the usual case, no walk needed
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return True
        for child in value.values() if isinstance(value, dict) else value:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
    return False


_FEW_BRACKETS = 16


def opening_brackets(raw: bytes) -> int:
    """How many `[` and `{` are in `raw`. Found one at a time while they are few, as in
    most bodies (a search for one byte skips the rest at memory speed); past
    `_FEW_BRACKETS`, counted in one pass. `bytes.count` reads every byte slower: two
    counts took 4.2 us for a 1k-token prompt's 8 KB body and ten times that for 10k
    tokens, against 0.3 us of searches (`python -m timeit`, a 2-core machine)."""
    found = 0
    for bracket in (b"[", b"{"):
        at = raw.find(bracket)
        while at >= 0:
            found += 1
            if found > _FEW_BRACKETS:
                return raw.count(b"[") + raw.count(b"{")
            at = raw.find(bracket, at + 1)
    return found


def _nested_too_deep() -> InvalidRequest:
    return InvalidRequest(f"request body is nested more than {MAX_JSON_DEPTH} levels deep")


def refuse_declared_too_large(headers: list[tuple[bytes, bytes]], limit: int) -> None:
    """Refuse (413) a body whose Content-Length is over `limit` before a byte is read."""
    for name, value in headers:
        if name == b"content-length" and value.isdigit() and int(value) > limit:
            raise body_too_large(int(value), limit)


def body_too_large(size: int, limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"request body is {size} bytes or more, over the limit of {limit} (limits.max_body_bytes)"
    )


def _check_prompt(prompt: Any) -> list[int] | None:
    """Check a completion's prompt; returns it when it is token ids, else None."""
    if isinstance(prompt, str) and prompt:
        return None
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if type(first) is int:
            # Token ids, checked in C (msgspec refuses bools and floats): a Python loop over
            # 1k ids cost 0.21 ms a request, msgspec 0.016 ms (measured on a 2-core machine).
            try:
                return convert(prompt, list[int])
            except msgspec.ValidationError:
                pass
        elif isinstance(first, str) and all(isinstance(p, str) for p in prompt):
            if len(prompt) > 1:
                raise InvalidRequest(
                    "a batch of prompts is not supported through P/D disaggregation; "
                    "send one prompt per request",
                    param="prompt",
                )
            return None
        elif all(isinstance(p, list) for p in prompt):
            raise InvalidRequest(
                "a batch of token prompts is not supported through P/D disaggregation; "
                "send one prompt per request",
                param="prompt",
            )
    raise InvalidRequest(
        "'prompt' is required: a non-empty string or a list of token ids", param="prompt"
    )


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' is required and must be a non-empty list", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequest(
                f"messages[{i}] must be an object with a string 'role'", param="messages"
            )


def _check_optional_int(body: dict[str, Any], name: str, *, minimum: int) -> None:
    value = body.get(name)
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InvalidRequest(f"'{name}' must be an integer >= {minimum}", param=name)


def _check_disaggregation_limits(body: dict[str, Any]) -> None:
    """Refuse what one P/D hand-over cannot serve: several choices share no KV hand-over."""
    for name in ("n", "best_of"):
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InvalidRequest(f"'{name}' must be an integer >= 1", param=name)
        if value > 1:
            raise InvalidRequest(
                f"'{name}' > 1 is not supported through P/D disaggregation "
                "(one KV hand-over serves one sequence); send separate requests",
                param=name,
            )


def _request_id(value: str | None) -> str:
    if value is None or value == "":
        return new_id()
    if not _REQUEST_ID_RE.match(value):
        raise InvalidRequest(
            f"{wire.REQUEST_ID_HEADER} must be 1-128 characters of letters, digits and . _ : -",
            param=wire.REQUEST_ID_HEADER,
        )
    return value


# The headers' names as the listener hands them over (lowercase), named once.
_REQUEST_ID_HEADER = wire.REQUEST_ID_HEADER.lower()
_TRANSFER_MODE_HEADER = wire.TRANSFER_MODE_HEADER.lower()

# A mode by its name: `Mode(name)` runs the enum's lookup in interpreted Python, 0.66 us
# against 0.03 for a dict's (`python -m timeit`, a 2-core machine), and a client that
# picks the mode sends the header on every request (1.3% of the router's samples, `perf`
# on the overhead scenario, which does).
_MODES: dict[str, Mode] = {mode.value: mode for mode in Mode}


def _mode_override(value: str | None) -> Mode | None:
    if value is None or value == "":
        return None
    mode = _MODES.get(value)  # as sent, the usual case: no copies to strip and lower
    if mode is not None:
        return mode
    try:
        return _MODES[value.strip().lower()]
    except KeyError:
        raise InvalidRequest(
            f"{wire.TRANSFER_MODE_HEADER} must be pull, push, local or auto, got {value!r}",
            param=wire.TRANSFER_MODE_HEADER,
        ) from None


_PUSH_LAYERS_HEADER = wire.PUSH_LAYERS_HEADER.lower()
_PUSH_LAYERS_VALUES = {"on": True, "off": False, "auto": None, "": None}


def _push_layers(value: str | None) -> bool | None:
    if value is None:
        return None
    try:
        return _PUSH_LAYERS_VALUES[value.strip().lower()]
    except KeyError:
        raise InvalidRequest(
            f"{wire.PUSH_LAYERS_HEADER} must be on, off or auto, got {value!r}",
            param=wire.PUSH_LAYERS_HEADER,
        ) from None


# --- kv_transfer_params --------------------------------------------------------------


class PrefillCoordinates(msgspec.Struct, frozen=True, kw_only=True):
    """Where D finds a P for a push: P's engine id and side channel, and what P can do."""

    engine_id: str
    host: str
    port: int
    tp_size: int = 1
    transfer_modes: frozenset[Mode] = frozenset({Mode.PULL})
    # Our connector's push side channel (D registers its blocks there); None for stock
    # vLLM connectors, whose push goes through NIXL notifications instead.
    push_host: str | None = None
    push_port: int | None = None
    # The data-parallel rank of the engine these name and P's number of ranks, as P's
    # answer told them (our connector): rank None for a P that does not tell (stock
    # connectors); size None for a data-parallel P whose engines do not know it.
    dp_rank: int | None = None
    dp_size: int | None = None

    @property
    def data_parallel(self) -> bool:
        """P runs several engines behind its one URL: a push must pin the rank."""
        return self.dp_rank is not None and self.dp_size != 1


class PushDecodeKVParams(msgspec.Struct, kw_only=True, omit_defaults=False):
    """D's kv_transfer_params in push mode. Every field must be set: a missing one takes
    a stock vLLM 0.32 decode server down (its engine core dies on a KeyError)."""

    remote_engine_id: str
    remote_host: str
    remote_port: int
    tp_size: int
    transfer_id: str
    remote_request_id: str
    do_remote_prefill: bool = True
    do_remote_decode: bool = False
    transfer_mode: str = "push"
    push_host: str | None = None
    push_port: int | None = None

    def __post_init__(self) -> None:
        if not self.remote_engine_id or not self.remote_host or not self.transfer_id:
            raise ValueError("push kv_transfer_params need engine id, host and transfer id")
        if not 0 < self.remote_port < 65536:
            raise ValueError(f"bad remote_port {self.remote_port!r}")
        if self.tp_size < 1:
            raise ValueError(f"bad tp_size {self.tp_size!r}")
        if not self.remote_request_id:
            raise ValueError("push kv_transfer_params need remote_request_id")


# P's kv_transfer_params in both modes: keep the KV for a remote decode.
PREFILL_KV_PARAMS: dict[str, Any] = {
    wire.DO_REMOTE_DECODE: True,
    wire.DO_REMOTE_PREFILL: False,
    wire.REMOTE_ENGINE_ID: None,
    wire.REMOTE_BLOCK_IDS: None,
    wire.REMOTE_HOST: None,
    wire.REMOTE_PORT: None,
}


def prefill_body(request: ClientRequest, *, transfer_id: str | None,
                 push_layers: bool | None = None) -> dict[str, Any]:
    """P's leg: the client's body, one token, not streamed, asking P to keep the KV. A
    push is written layer by layer or whole as the client asked (X-KV-Push-Layers), else
    as `push_layers` says (the router's learned choice), else as P's connector decides."""
    body = dict(request.body)
    body["stream"] = False
    body["max_tokens"] = 1
    if request.route is Route.CHAT:
        body["max_completion_tokens"] = 1
    # (looked up first: removing what is absent was two calls a request for nothing)
    if "min_tokens" in body:
        del body["min_tokens"]
    if "stream_options" in body:
        del body["stream_options"]
    params = dict(PREFILL_KV_PARAMS)
    if transfer_id is not None:
        params[wire.TRANSFER_ID] = transfer_id
        params[wire.TRANSFER_MODE] = wire.PUSH
        layers = request.push_layers if request.push_layers is not None else push_layers
        if layers is not None:
            params[wire.PUSH_LAYERS] = layers
    body[wire.KV_TRANSFER_PARAMS] = params
    return body


def pull_decode_body(request: ClientRequest, answer: wire.PrefillAnswer,
                     params: wire.KVTransferParams | None) -> dict[str, Any]:
    """D's leg in pull mode: the client's body plus P's kv_transfer_params, unchanged
    (`answer`'s, `params` decoded).

    Raises ValueError when P's params lack what D needs to pull."""
    if params is None:
        raise ValueError("P's kv_transfer_params is not an object")
    if (params.remote_engine_id is None or params.remote_block_ids is None
            or params.remote_host is None or params.remote_port is None):
        lacking = [name for name, value in (
            (wire.REMOTE_ENGINE_ID, params.remote_engine_id),
            (wire.REMOTE_BLOCK_IDS, params.remote_block_ids),
            (wire.REMOTE_HOST, params.remote_host), (wire.REMOTE_PORT, params.remote_port),
        ) if value is None]
        raise ValueError(f"P's kv_transfer_params lack {', '.join(lacking)} (absent, null "
                         "or not of their type)")
    if not params.do_remote_prefill:
        raise ValueError("P's kv_transfer_params do not ask D for a remote prefill")
    body = dict(request.body)
    body[wire.KV_TRANSFER_PARAMS] = answer.kv_transfer_params
    return body


def push_decode_body(
    request: ClientRequest, coordinates: PrefillCoordinates, *, transfer_id: str
) -> dict[str, Any]:
    """D's leg in push mode: P's coordinates and the transfer id, no block ids."""
    params = PushDecodeKVParams(
        remote_engine_id=coordinates.engine_id,
        remote_host=coordinates.host,
        remote_port=coordinates.port,
        tp_size=coordinates.tp_size,
        transfer_id=transfer_id,
        remote_request_id=request.route.request_id_prefix + request.request_id,
        push_host=coordinates.push_host,
        push_port=coordinates.push_port,
    )
    body = dict(request.body)
    kv_params = msgspec.to_builtins(params)
    if coordinates.push_port is None:  # a stock P: no side channel of ours to name
        del kv_params[wire.PUSH_HOST], kv_params[wire.PUSH_PORT]
    body[wire.KV_TRANSFER_PARAMS] = kv_params
    return body


def coordinates_from_answer(p_params: Any) -> PrefillCoordinates | None:
    """Read a P's coordinates and capabilities from the kv_transfer_params of its answer.

    Capabilities: `transfer_modes` (a list; our connector), else `transfer_mode`, else
    pull only. Returns None when the answer does not name an engine and side channel."""
    return coordinates_from_params(wire.decode_params(p_params))


def coordinates_from_params(params: wire.KVTransferParams | None) -> PrefillCoordinates | None:
    """`coordinates_from_answer` for kv_transfer_params already decoded."""
    if params is None:
        return None
    engine_id, host, port = params.remote_engine_id, params.remote_host, params.remote_port
    if engine_id is None or host is None or port is None:
        return None
    push_port = params.push_port
    has_push_channel = push_port is not None and 0 < push_port < 65536
    return PrefillCoordinates(
        engine_id=engine_id,
        host=host,
        port=port,
        tp_size=params.tp_size if params.tp_size is not None and params.tp_size > 0 else 1,
        transfer_modes=_modes_of(params),
        push_host=params.push_host if has_push_channel else None,
        push_port=push_port if has_push_channel else None,
        dp_rank=params.dp_rank if params.dp_rank is not None and params.dp_rank >= 0 else None,
        dp_size=params.dp_size if params.dp_size is not None and params.dp_size > 0 else None,
    )


def _modes_of(params: wire.KVTransferParams) -> frozenset[Mode]:
    modes = {Mode(m) for m in params.transfer_modes or () if m in wire.TRANSFER_MODE_VALUES}
    if modes:
        return frozenset(modes)
    if params.transfer_mode in wire.TRANSFER_MODE_VALUES:
        return frozenset({Mode(params.transfer_mode)})
    return frozenset({Mode.PULL})


def new_id() -> str:
    """A fresh 128-bit id in hex, for request and transfer ids. Random, not secret: no
    system call per request (uuid4 reads the OS's entropy each time)."""
    return _ids.getrandbits(128).to_bytes(16, "big").hex()  # (0.11 us; formatting: 0.30)


def new_transfer_id() -> str:
    """A fresh transfer id: 128 bits from the OS's secure random source, in hex.

    Unlike request ids it is a secret: knowing it is the capability to abandon a push on
    P's side channel, or to register for its KV first. So it must not be guessable from
    the request ids a client sees echoed (`new_id`'s generator is predictable from about
    156 of them), nor repeat in a forked process."""
    return token_hex(16)


_ids = random.Random()
