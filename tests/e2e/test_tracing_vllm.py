"""Tracing end to end: the router (`tracing.enabled`) in front of a real vLLM P and D
(the tiny Llama, our connector on both) started with `--otlp-traces-endpoint`, all three
exporting OTLP/HTTP to a receiver the test runs. A pull and a push, each sent with a
client's `traceparent`, are each one trace holding the router's request span, its leg
spans, and P's and D's own `llm_request` spans, each a child of the leg that called it.
The pair is started once for the module (its own: the session's pairs have no tracing)."""

from __future__ import annotations

import asyncio
import gzip
import http.server
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from testbed.vllm_cpu import Pair, server_spec
from tests.conftest import serve_router
from tests.e2e.conftest import DUAL, DUAL_EXTRA_CONFIG, LOG_DIR, PairManager
from tests.e2e.vllm_client import COMPLETIONS, TIMEOUT, make_body

pytestmark = pytest.mark.e2e

ROUTER_SERVICE = "pd-proxy"
SERVICES = {"prefill": "vllm-prefill", "decode": "vllm-decode"}
EXPORT_WAIT_S = 30.0  # the exporters batch (OTEL_BSP_SCHEDULE_DELAY, 200 ms here)


@dataclass(frozen=True)
class Received:
    """One span as the receiver got it."""

    service: str
    name: str
    trace_id: int
    span_id: int
    parent_id: int  # 0: a root
    attributes: dict[str, Any]


class OtlpReceiver:
    """An OTLP/HTTP trace receiver (`POST /v1/traces`, protobuf) on 127.0.0.1, in a thread."""

    def __init__(self) -> None:
        self.spans: list[Received] = []
        self._lock = threading.Lock()  # guards `spans` (the server's threads append)
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver.take(ExportTraceServiceRequest.FromString(body))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="otlp-receiver", daemon=True)
        self._thread.start()

    def take(self, request: ExportTraceServiceRequest) -> None:
        found = []
        for resource_spans in request.resource_spans:
            service = next((a.value.string_value for a in resource_spans.resource.attributes
                            if a.key == "service.name"), "")
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    found.append(Received(
                        service, span.name, int.from_bytes(span.trace_id, "big"),
                        int.from_bytes(span.span_id, "big"),
                        int.from_bytes(span.parent_span_id, "big") if span.parent_span_id else 0,
                        {a.key: _value(a.value) for a in span.attributes}))
        with self._lock:
            self.spans.extend(found)

    def trace(self, trace_id: int) -> list[Received]:
        with self._lock:
            return [span for span in self.spans if span.trace_id == trace_id]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    made = OtlpReceiver()
    try:
        yield made
    finally:
        made.close()


@pytest.fixture(scope="module")
def tracing_pair(pair_manager: PairManager, tiny_model: Path,
                 receiver: OtlpReceiver) -> Iterator[Pair]:
    """A P and a D with our connector, exporting their spans to `receiver`."""
    specs = [server_spec(role, connector=DUAL, model_dir=tiny_model, log_dir=LOG_DIR,
                         name=f"{role}-traced", kv_extra_config=DUAL_EXTRA_CONFIG,
                         extra_args=("--otlp-traces-endpoint", receiver.endpoint),
                         extra_env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
                                    "OTEL_SERVICE_NAME": SERVICES[role],
                                    "OTEL_BSP_SCHEDULE_DELAY": "200"})
             for role in ("prefill", "decode")]
    with pair_manager.own_pair(specs, "traced") as running:
        yield running


async def test_one_trace_holds_the_routers_and_both_servers_spans(
        tracing_pair: Pair, receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.endpoint,
                        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
                        "OTEL_SERVICE_NAME": ROUTER_SERVICE,
                        "OTEL_BSP_SCHEDULE_DELAY": "200"}.items():
        monkeypatch.setenv(name, value)
    clients: dict[str, tuple[int, int]] = {}  # mode -> the client's trace and span ids
    async with serve_router(prefill=[tracing_pair.prefill_url],
                            decode=[tracing_pair.decode_url], mode="pull",
                            tracing={"enabled": True}) as (url, _app):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            for mode in ("pull", "push"):
                trace_id, span_id = secrets.randbits(128) | 1, secrets.randbits(64) | 1
                clients[mode] = (trace_id, span_id)
                r = await client.post(COMPLETIONS, json=make_body(COMPLETIONS), headers={
                    "X-KV-Transfer-Mode": mode,
                    "traceparent": f"00-{trace_id:032x}-{span_id:016x}-01"})
                assert r.status_code == 200, r.text
                assert r.headers["x-kv-transfer-mode"] == mode, "the router fell back"
    # The router's spans are exported by its shutdown at the latest; the servers' batch.
    for mode, (trace_id, span_id) in clients.items():
        deadline = time.monotonic() + EXPORT_WAIT_S
        while True:
            spans = receiver.trace(trace_id)
            services = {span.service for span in spans}
            if services >= {ROUTER_SERVICE, *SERVICES.values()}:
                break
            assert time.monotonic() < deadline, (
                f"{mode}: within {EXPORT_WAIT_S} s the receiver got spans of this trace from "
                f"{sorted(services)} only: {spans}")
            await asyncio.sleep(0.2)
        ours = [span for span in spans if span.service == ROUTER_SERVICE]
        (request,) = [span for span in ours if span.name == f"POST {COMPLETIONS}"]
        assert request.parent_id == span_id, "the router continued the client's trace"
        assert request.attributes["pd.mode.used"] == mode
        for role, service in SERVICES.items():
            (leg,) = [span for span in ours if span.name == f"{role} leg"]
            assert leg.parent_id == request.span_id
            served = [span for span in spans if span.service == service]
            assert served, f"{mode}: no span of {service}"
            (llm_request,) = [span for span in served if span.name == "llm_request"]
            assert llm_request.parent_id == leg.span_id, (
                f"{mode}: {service}'s llm_request is not under the router's {role} leg")
