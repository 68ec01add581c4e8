"""OpenTelemetry tracing (`tracing.enabled`, proxy/tracing.py) through the router against
fake P/D servers, with the SDK's in-memory exporter: one trace per request, the request
span with a child per leg (retries and recoveries their own, with attempt numbers) and
the hand-off, the routing decision as attributes, a `traceparent` naming each leg's span
sent to its server, sampling from OTEL_TRACES_SAMPLER; and with tracing off, no
`traceparent` on any leg."""

from __future__ import annotations

import contextlib
import gc
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from proxy.config import TracingConfig, build_config
from tests.conftest import serve_router, until
from tests.integration.conftest import Pair

ROOT = Path(__file__).resolve().parents[2]
BODY = {"model": "fake-model", "prompt": "hello there", "max_tokens": 3}
CLIENT_TRACE = 0x0AF7651916CD43DD8448EB211C80319C
CLIENT_SPAN = 0xB7AD6B7169203331
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE:032x}-{CLIENT_SPAN:016x}-01"
PREFILL_COORDS = {"engine_id": "engine-p0", "side_channel_host": "127.0.0.1",
                  "side_channel_port": 5601}


@pytest.fixture(autouse=True)
def _no_exporter(monkeypatch: pytest.MonkeyPatch) -> None:
    """The router's own exporter off (OTEL_TRACES_EXPORTER=none): the tests read the
    in-memory one."""
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")


@contextlib.asynccontextmanager
async def traced_router(**config: Any) -> AsyncIterator[tuple[httpx.AsyncClient, InMemorySpanExporter]]:
    """The router with tracing on, its spans kept in memory; yields a client for it."""
    spans = InMemorySpanExporter()
    async with serve_router(tracing={"enabled": True, **config.pop("tracing", {})},
                            **config) as (url, app):
        app.state.router.tracing.provider.add_span_processor(SimpleSpanProcessor(spans))
        async with httpx.AsyncClient(base_url=url) as client:
            yield client, spans


def by_name(spans: Sequence[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [span for span in spans if span.name == name]


def the_request(spans: Sequence[ReadableSpan]) -> ReadableSpan:
    (request,) = by_name(spans, "POST /v1/completions")
    return request


def names(header: str) -> tuple[int, int, bool]:
    """A `traceparent`'s trace id, parent span id and sampled flag."""
    version, trace_id, span_id, flags = header.split("-")
    assert version == "00"
    return int(trace_id, 16), int(span_id, 16), bool(int(flags, 16) & 1)


def traceparent(span: ReadableSpan) -> tuple[int, int, bool]:
    """What a `traceparent` naming `span` (sampled) says."""
    return span.context.trace_id, span.context.span_id, True


def legs(spans: Sequence[ReadableSpan], cluster: str) -> list[ReadableSpan]:
    found = by_name(spans, f"{cluster} leg")
    return sorted(found, key=lambda span: int(attrs(span)["pd.leg.attempt"]))


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


@pytest.mark.parametrize("stream", [False, True])
async def test_a_pull_is_one_trace_under_the_clients_with_a_span_per_leg(
        pair: Pair, stream: bool) -> None:
    async with traced_router(prefill=[pair.p_url], decode=[{"url": pair.d_url, "name": "d-a"}]) \
            as (client, exported):
        r = await client.post("/v1/completions", json={**BODY, "stream": stream},
                              headers={"traceparent": CLIENT_TRACEPARENT, "X-Request-Id": "r1"})
    assert r.status_code == 200, r.text
    spans = exported.get_finished_spans()
    assert {span.context.trace_id for span in spans} == {CLIENT_TRACE}, "one trace, the client's"
    request = the_request(spans)
    assert request.parent is not None and request.parent.span_id == CLIENT_SPAN
    assert request.kind is SpanKind.SERVER
    (p_leg,), (d_leg,) = legs(spans, "prefill"), legs(spans, "decode")
    (handoff,) = by_name(spans, "kv handoff")
    for child in (p_leg, d_leg, handoff):
        assert child.parent is not None and child.parent.span_id == request.context.span_id
    assert p_leg.kind is d_leg.kind is SpanKind.CLIENT
    a = attrs(request)
    assert a["pd.mode.requested"] == a["pd.mode.decided"] == a["pd.mode.used"] == "pull"
    assert a["pd.mode.reason"] == "requested"
    assert a["pd.prefill.server"] == "1" and a["pd.decode.server"] == "d-a"
    assert a["pd.request_id"] == "r1" and a["pd.stream"] is stream
    assert a["http.response.status_code"] == 200
    assert a["pd.legs"] == ("prefill#1=done", "decode#1=done")
    assert request.status.status_code is StatusCode.UNSET
    assert attrs(p_leg)["pd.leg.attempt"] == attrs(d_leg)["pd.leg.attempt"] == 1
    assert attrs(p_leg)["pd.leg.state"] == attrs(d_leg)["pd.leg.state"] == "done"
    assert attrs(d_leg)["pd.leg.server"] == "d-a"
    assert attrs(d_leg)["pd.decode.first_byte_ms"] > 0
    assert [event.name for event in d_leg.events] == ["first byte"]
    # The hand-off: from P's answer to D's first byte, within the request.
    assert p_leg.end_time == handoff.start_time
    assert handoff.end_time == d_leg.events[0].timestamp
    assert request.start_time <= p_leg.start_time < p_leg.end_time <= d_leg.start_time  # type: ignore[operator]
    assert d_leg.end_time <= request.end_time  # type: ignore[operator]
    # Each server was told its leg's span: vLLM's own spans go under it.
    (p_seen,), (d_seen,) = pair.prefill.seen, pair.decode.seen
    assert names(p_seen.headers["traceparent"]) == traceparent(p_leg)
    assert names(d_seen.headers["traceparent"]) == traceparent(d_leg)


async def test_a_push_traces_both_legs_at_once_and_the_handoff(pair: Pair) -> None:
    pair.prefill.behavior.delay = 0.2
    config = {"prefill": [{"url": pair.p_url, **PREFILL_COORDS}], "decode": [pair.d_url],
              "mode": "push"}
    async with traced_router(**config) as (client, exported):
        r = await client.post("/v1/completions", json={**BODY, "stream": True})
    assert r.status_code == 200, r.text
    spans = exported.get_finished_spans()
    assert len({span.context.trace_id for span in spans}) == 1
    request = the_request(spans)
    assert request.parent is None, "no traceparent from the client: a trace of its own"
    assert attrs(request)["pd.mode.used"] == "push"
    (p_leg,), (d_leg,) = legs(spans, "prefill"), legs(spans, "decode")
    assert d_leg.start_time < p_leg.end_time, "D was asked while P computed"  # type: ignore[operator]
    (handoff,) = by_name(spans, "kv handoff")
    assert handoff.start_time == p_leg.end_time and attrs(handoff)["pd.mode"] == "push"
    assert names(pair.prefill.seen[0].headers["traceparent"]) == traceparent(p_leg)
    assert names(pair.decode.seen[0].headers["traceparent"]) == traceparent(d_leg)


async def test_a_traced_request_leaves_no_reference_cycle(pair: Pair) -> None:
    """A traced leg holds its exchange (for its span's end) only until that span ends:
    the exchange, which holds its legs, is freed as soon as its request is done, with
    the garbage collector off."""
    def exchanges() -> int:
        return sum(type(o).__name__ == "Exchange" for o in gc.get_objects())

    gc.collect()
    gc.disable()
    try:
        async with traced_router(prefill=[pair.p_url], decode=[pair.d_url]) as (client, exported):
            for stream in (False, True):
                r = await client.post("/v1/completions", json={**BODY, "stream": stream})
                assert r.status_code == 200, r.text
            await until(lambda: len(by_name(exported.get_finished_spans(),
                                            "POST /v1/completions")) == 2, "both requests' spans")
            await until(lambda: exchanges() == 0, "no exchange left alive", timeout=2.0)
    finally:
        gc.enable()


async def test_a_retry_is_a_second_leg_span_with_its_attempt(pair: Pair) -> None:
    dead = "http://127.0.0.1:9"  # nothing listens: the connection is refused
    async with traced_router(prefill=[dead, pair.p_url], decode=[pair.d_url]) as (client, exported):
        for _ in range(2):  # ties are taken in turn: one of the two goes to the dead P first
            assert (await client.post("/v1/completions", json=BODY)).status_code == 200
    spans = exported.get_finished_spans()
    (retried,) = [span for span in by_name(spans, "POST /v1/completions")
                  if len([s for s in legs(spans, "prefill")
                          if s.context.trace_id == span.context.trace_id]) == 2]
    mine = [s for s in spans if s.context.trace_id == retried.context.trace_id]
    first, second = legs(mine, "prefill")
    assert [attrs(first)["pd.leg.attempt"], attrs(second)["pd.leg.attempt"]] == [1, 2]
    assert attrs(first)["pd.leg.state"] == "failed"
    assert first.status.status_code is StatusCode.ERROR
    assert attrs(first)["error.type"] == "UpstreamConnectError"
    assert attrs(first)["url.full"].startswith(dead)
    assert attrs(second)["pd.leg.state"] == "done"
    a = attrs(retried)
    assert a["pd.legs"] == ("prefill#1=failed", "prefill#2=done", "decode#1=done")
    assert any(note.startswith("retried_prefill:connect:") for note in a["pd.notes"])
    assert a["http.response.status_code"] == 200
    (p_seen,) = [seen for seen in pair.prefill.seen
                 if names(seen.headers["traceparent"])[0] == retried.context.trace_id]
    assert names(p_seen.headers["traceparent"]) == traceparent(second)


async def test_a_push_recovered_by_decode_shows_every_leg(pair: Pair) -> None:
    """P drops the push: D's leg is cancelled and D computes the prompt (a new leg)."""
    pair.prefill.behavior.drop_connection = True
    config = {"prefill": [{"url": pair.p_url, **PREFILL_COORDS}], "decode": [pair.d_url],
              "mode": "push", "push_recovery": "pull"}
    async with traced_router(**config) as (client, exported):
        r = await client.post("/v1/completions", json={**BODY, "stream": True})
    assert r.status_code == 200 and r.headers["x-kv-transfer-recovery"] == "recompute"
    spans = exported.get_finished_spans()
    request = the_request(spans)
    a = attrs(request)
    assert (a["pd.mode.decided"], a["pd.mode.used"]) == ("push", "local")
    assert a["pd.legs"] == ("prefill#1=failed", "decode#1=cancelled", "decode#2=done")
    (p_leg,) = legs(spans, "prefill")
    d1, d2 = legs(spans, "decode")
    assert attrs(p_leg)["pd.leg.state"] == "failed"
    assert (attrs(d1)["pd.leg.state"], attrs(d2)["pd.leg.state"]) == ("cancelled", "done")
    assert by_name(spans, "kv handoff") == [], "no P answer: no hand-off"
    # D's first leg may be cancelled before it reached D; its second did.
    told = [names(seen.headers["traceparent"]) for seen in pair.decode.seen]
    assert told[-1] == traceparent(d2) and set(told) <= {traceparent(d1), traceparent(d2)}


async def test_an_answer_before_any_leg_ends_the_request_span(pair: Pair) -> None:
    async with traced_router(prefill=[pair.p_url], decode=[pair.d_url],
                             models=["fake-model"]) as (client, exported):
        r = await client.post("/v1/completions", json={**BODY, "model": "no-such-model"})
    assert r.status_code == 404
    (request,) = exported.get_finished_spans()
    assert attrs(request)["http.response.status_code"] == 404
    assert attrs(request)["error.type"] == "NotFound"
    assert request.status.status_code is StatusCode.ERROR
    assert pair.prefill.seen == pair.decode.seen == []


async def test_a_client_trace_is_not_continued_when_so_configured(pair: Pair) -> None:
    async with traced_router(prefill=[pair.p_url], decode=[pair.d_url],
                             tracing={"continue_client_traces": False}) as (client, exported):
        await client.post("/v1/completions", json=BODY,
                          headers={"traceparent": CLIENT_TRACEPARENT})
    request = the_request(exported.get_finished_spans())
    assert request.parent is None and request.context.trace_id != CLIENT_TRACE
    assert names(pair.decode.seen[0].headers["traceparent"])[0] == request.context.trace_id


async def test_sampling_comes_from_the_environment(pair: Pair,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """OTEL_TRACES_SAMPLER=always_off: nothing is recorded, and the legs still carry a
    `traceparent`, flagged not sampled, so the servers record nothing either."""
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    async with traced_router(prefill=[pair.p_url], decode=[pair.d_url]) as (client, exported):
        assert (await client.post("/v1/completions", json=BODY)).status_code == 200
    assert exported.get_finished_spans() == ()
    for seen in (*pair.prefill.seen, *pair.decode.seen):
        assert names(seen.headers["traceparent"])[2] is False


async def test_with_tracing_off_no_leg_carries_a_traceparent(pair: Pair) -> None:
    async with serve_router(prefill=[pair.p_url], decode=[pair.d_url]) as (url, app):
        assert app.state.router.tracing is None
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.post("/v1/completions", json=BODY,
                                  headers={"traceparent": CLIENT_TRACEPARENT})
    assert r.status_code == 200
    for seen in (*pair.prefill.seen, *pair.decode.seen):
        assert "traceparent" not in seen.headers and "tracestate" not in seen.headers


def test_tracing_without_the_extra_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import proxy.config

    monkeypatch.setattr(proxy.config, "_installed", lambda module: False)
    with pytest.raises(ValueError, match=r"pip install 'pd-proxy\[tracing\]'"):
        build_config({"prefill": ["http://p:1"], "decode": ["http://d:1"],
                      "tracing": {"enabled": True}}, {})
    assert TracingConfig().enabled is False  # off by default, with or without the extra


def test_an_unknown_exporter_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from proxy.tracing import Tracing

    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    with pytest.raises(ValueError, match="OTEL_TRACES_EXPORTER='zipkin'"):
        Tracing(TracingConfig(enabled=True))


def test_with_tracing_off_opentelemetry_is_never_imported() -> None:
    """The router's modules, and a router made and closed, load nothing of OpenTelemetry
    unless tracing is on (so it runs without the extra, and costs nothing off)."""
    code = """
import asyncio, sys
from proxy.api.app import create_app
from proxy.config import build_config
from proxy.flow.router import Router
config = build_config({"prefill": ["http://127.0.0.1:9"], "decode": ["http://127.0.0.1:9"]}, {})
create_app(config)
async def made_and_closed():
    router = Router(config)
    assert router.tracing is None
    await router.aclose()
asyncio.run(made_and_closed())
loaded = sorted(name for name in sys.modules if name.startswith("opentelemetry"))
assert not loaded, loaded
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
