"""OpenTelemetry traces of the router's requests (`tracing.enabled`; the `tracing` extra).

Each request is one span (`POST /v1/completions`, kind SERVER), continuing the trace of
the client's W3C `traceparent` when it sent one (`tracing.continue_client_traces`). Its
children, kind CLIENT, are the legs: one span per call to a server (`prefill` and
`decode`, a retry's or a recovery's call its own span, with its attempt number), each
sending the server a `traceparent` that names the leg's span, so a vLLM started with
`--otlp-traces-endpoint` puts its own spans under it. A `kv handoff` span covers the time
from P's answer to D's first byte (as the router sees the two legs: the connector's
answers carry no timing of their own). The routing decision is the request span's
attributes (`pd.*`).

Which spans are kept and where they go are the OpenTelemetry SDK's own standard
settings, read from the environment: OTEL_TRACES_SAMPLER (and _ARG), OTEL_SERVICE_NAME
(else `pd-proxy`), OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_EXPORTER (`otlp`, the default,
`console` or `none`), OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL (`http/protobuf`, the default,
or `grpc`), OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT and the batch processor's OTEL_BSP_*.

Nothing here imports OpenTelemetry until a `Tracing` is made, which only a config with
tracing enabled does: the router installs and runs without the extra, and with tracing
off a request pays one `is None` test at each place a span would start or end.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

from proxy.config import TracingConfig

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

T = TypeVar("T")
EXTRA = "pd-proxy[tracing]"
SERVICE_NAME = "pd-proxy"  # the service's name unless OTEL_SERVICE_NAME gives one
TRACER_NAME = "pd-proxy"
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
_TRACE_HEADERS = (TRACEPARENT.encode(), TRACESTATE.encode())

# The request being routed, from `Tracing.handled` to the exchange that adopts it (the
# same task: `Router.handle` builds the exchange before it returns).
_current: contextvars.ContextVar[RequestTrace | None] = contextvars.ContextVar(
    "pdproxy_request_trace", default=None)


class TracingUnavailable(ValueError):
    """Tracing is configured but the OpenTelemetry packages it needs are missing."""


def _otel_import_error(exc: ImportError) -> TracingUnavailable:
    return TracingUnavailable(f"tracing.enabled needs OpenTelemetry ({exc}): install pd-proxy "
                              f"with its tracing extra (pip install '{EXTRA}')")


def span_exporter() -> SpanExporter | None:
    """The exporter the environment asks for (OTEL_TRACES_EXPORTER, the OTLP protocol);
    None for `none`."""
    kind = os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() or "otlp"
    if kind == "none":
        return None
    try:
        if kind == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter
            return ConsoleSpanExporter()
        if kind != "otlp":
            raise ValueError(f"OTEL_TRACES_EXPORTER={kind!r}: the router exports by otlp, "
                             "console or none")
        protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                    or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf").strip()
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter as GrpcExporter,
            )
            return GrpcExporter()
        if protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter as HttpExporter,
            )
            return HttpExporter()
    except ImportError as exc:
        raise _otel_import_error(exc) from exc
    raise ValueError(f"OTLP protocol {protocol!r}: the router exports by http/protobuf or grpc")


class Tracing:
    """The router's tracer: one per router process, made by `Tracing.of` when the config
    enables tracing, shut down (its last spans exported) with `shutdown`.

    It has its own `TracerProvider` (not OpenTelemetry's global one), so an application
    that embeds the router keeps its own; `provider` takes more span processors (tests add
    an in-memory exporter)."""

    def __init__(self, config: TracingConfig) -> None:
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )
        except ImportError as exc:
            raise _otel_import_error(exc) from exc
        resource = Resource.create()  # OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME
        if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
            resource = resource.merge(Resource({"service.name": SERVICE_NAME}))
        self.config = config
        self.provider: TracerProvider = TracerProvider(resource=resource)  # OTEL_TRACES_SAMPLER
        exporter = span_exporter()
        if exporter is not None:
            self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer: Tracer = self.provider.get_tracer(TRACER_NAME)
        self.propagator: TraceContextTextMapPropagator = TraceContextTextMapPropagator()

    @classmethod
    def of(cls, config: TracingConfig) -> Tracing | None:
        return cls(config) if config.enabled else None

    async def handled(self, route: str, headers: Iterable[tuple[bytes, bytes]],
                      handle: Callable[[], Awaitable[T]]) -> T:
        """Run `handle()` (the router's choice of P, D and mode) inside a new request
        span, which the exchange it builds adopts (`adopt`); when it raises instead, the
        span ends here with the error."""
        trace = self.begin(route, headers)
        token = _current.set(trace)
        try:
            return await handle()
        except BaseException as exc:
            trace.end_early(exc)
            raise
        finally:
            _current.reset(token)

    def begin(self, route: str, headers: Iterable[tuple[bytes, bytes]]) -> RequestTrace:
        """A request's span, a child of the client's `traceparent` (when continued)."""
        from opentelemetry.trace import SpanKind

        parent: Context | None = None
        if self.config.continue_client_traces:
            carrier = {name.decode("latin-1"): value.decode("latin-1")
                       for name, value in headers if name in _TRACE_HEADERS}
            if carrier:
                parent = self.propagator.extract(carrier)
        span = self.tracer.start_span(
            f"POST {route}", context=parent, kind=SpanKind.SERVER,
            attributes={"http.request.method": "POST", "http.route": route, "url.path": route})
        return RequestTrace(self, span)

    @staticmethod
    def adopt() -> RequestTrace | None:
        """The request span `handled` is running (None outside it)."""
        return _current.get()

    def shutdown(self) -> None:
        """Export what is left and stop (blocking: the exporter's own time limits)."""
        self.provider.shutdown()


class RequestTrace:
    """One request's span and its leg spans."""

    __slots__ = ("_tracing", "span", "_ended", "prefill_answered_ns", "first_byte_ns")

    def __init__(self, tracing: Tracing, span: Span) -> None:
        self._tracing = tracing
        self.span = span
        self._ended = False
        self.prefill_answered_ns: int | None = None  # when P's leg ended with an answer
        self.first_byte_ns: int | None = None  # when D's first byte came

    def decided(self, *, request_id: str, model: str, stream: bool, requested: str,
                decided: str, reason: str, prefill: str | None, decode: str,
                prompt_tokens: int | None, predicted: dict[str, int | None] | None) -> None:
        """The routing decision, as the request span's attributes: the mode asked for,
        the mode chosen and why, the P and D chosen (by name), and kv_aware's prediction
        of the prompt tokens each held (when it predicted)."""
        attributes: dict[str, Any] = {
            "pd.request_id": request_id, "pd.model": model, "pd.stream": stream,
            "pd.mode.requested": requested, "pd.mode.decided": decided,
            "pd.mode.reason": reason, "pd.decode.server": decode,
        }
        if prefill is not None:
            attributes["pd.prefill.server"] = prefill
        if prompt_tokens is not None:
            attributes["pd.prompt_tokens"] = prompt_tokens
        for cluster, hit in (predicted or {}).items():
            if hit is not None:
                attributes[f"pd.{cluster}.predicted_hit_tokens"] = hit
        self.span.set_attributes(attributes)

    def leg(self, cluster: str, attempt: int, server: str, url: str, route: str,
            headers: dict[str, str]) -> tuple[LegSpan, dict[str, str]]:
        """A leg's span (`prefill leg`, `decode leg`), a child of the request's, and
        `headers` plus the `traceparent` (and any `tracestate`) naming it, for the server."""
        from opentelemetry.trace import SpanKind, set_span_in_context

        parts = urlsplit(url)
        tracing = self._tracing
        started_ns = time.time_ns()
        span = tracing.tracer.start_span(
            f"{cluster} leg", context=set_span_in_context(self.span), kind=SpanKind.CLIENT,
            start_time=started_ns,
            attributes={"pd.leg.cluster": cluster, "pd.leg.attempt": attempt,
                        "pd.leg.server": server, "server.address": parts.hostname or "",
                        "server.port": parts.port or (443 if parts.scheme == "https" else 80),
                        "http.request.method": "POST", "url.full": f"{url}{route}"})
        sent = dict(headers)
        tracing.propagator.inject(sent, context=set_span_in_context(span))
        return LegSpan(span, started_ns), sent

    def leg_ended(self, leg: LegSpan, *, prefill: bool, state: str, error: Exception | None,
                  first_byte_s: float | None) -> None:
        """A leg is over (`state`: done, failed, cancelled); D's, when its answer's first
        byte came, marks that moment (an event)."""
        attributes: dict[str, Any] = {"pd.leg.state": state}
        first_byte_ns = None
        if first_byte_s is not None and self.first_byte_ns is None:  # this leg's first byte
            first_byte_ns = self.first_byte_ns = leg.started_ns + int(first_byte_s * 1e9)
            attributes["pd.decode.first_byte_ms"] = round(first_byte_s * 1000, 3)
        span = leg.span
        if first_byte_ns is not None:
            span.add_event("first byte", timestamp=first_byte_ns)
        span.set_attributes(attributes)
        if error is not None:
            _failed(span, error)
        ended = time.time_ns()
        span.end(end_time=ended)
        if prefill and state == "done":
            self.prefill_answered_ns = ended

    def end(self, status: int | str, error: BaseException | None, *, mode: str,
            legs: list[str], notes: list[str], prefill: str | None, decode: str,
            prefill_s: float | None, prefill_cached: int | None, ttfb_s: float | None) -> None:
        """The request's answer is done: its status, the mode it ran as (after any
        fallback or recovery), the servers that answered, its legs and remarks, P's cached
        tokens, the hand-off span (P's answer to D's first byte, when both came), and the
        span's end."""
        if self._ended:
            return
        self._ended = True
        span = self.span
        if self.prefill_answered_ns is not None and self.first_byte_ns is not None \
                and self.first_byte_ns >= self.prefill_answered_ns:
            self._handoff(mode)
        attributes: dict[str, Any] = {"pd.mode.used": mode, "pd.legs": legs,
                                      "pd.decode.server": decode}
        if prefill is not None:  # the P that answered, after any retry
            attributes["pd.prefill.server"] = prefill
        if notes:
            attributes["pd.notes"] = list(notes)
        if prefill_s is not None:
            attributes["pd.prefill_ms"] = round(prefill_s * 1000, 3)
        if prefill_cached is not None:  # vLLM's --enable-prompt-tokens-details
            attributes["pd.prefill.cached_tokens"] = prefill_cached
        if ttfb_s is not None:
            attributes["pd.ttfb_ms"] = round(ttfb_s * 1000, 3)
        span.set_attributes(attributes)
        self._status(status, error)
        span.end()

    def end_early(self, exc: BaseException) -> None:
        """No exchange was built: the router answered `exc` (or the client left)."""
        if self._ended:
            return
        self._ended = True
        if isinstance(exc, asyncio.CancelledError):
            self._status("client_closed", None)
        else:
            status = getattr(exc, "status", None)  # a RouterError's HTTP status
            self._status(status if isinstance(status, int) else 500, exc)
        self.span.end()

    def _status(self, status: int | str, error: BaseException | None) -> None:
        from opentelemetry.trace import StatusCode

        span = self.span
        if isinstance(status, int):
            span.set_attribute("http.response.status_code", status)
        else:
            span.set_attribute("pd.status", status)
        if error is not None:
            _failed(span, error)
        elif isinstance(status, int) and status >= 500:
            span.set_status(StatusCode.ERROR)

    def _handoff(self, mode: str) -> None:
        from opentelemetry.trace import set_span_in_context

        assert self.prefill_answered_ns is not None and self.first_byte_ns is not None
        handoff = self._tracing.tracer.start_span(
            "kv handoff", context=set_span_in_context(self.span),
            start_time=self.prefill_answered_ns,
            attributes={"pd.mode": mode, "pd.handoff.from": "prefill_answer",
                        "pd.handoff.to": "decode_first_byte"})
        handoff.end(end_time=self.first_byte_ns)


class LegSpan:
    """One leg's span, and when it started (ns since the epoch)."""

    __slots__ = ("span", "started_ns")

    def __init__(self, span: Span, started_ns: int) -> None:
        self.span = span
        self.started_ns = started_ns


def _failed(span: Span, error: BaseException) -> None:
    from opentelemetry.trace import StatusCode

    span.set_attribute("error.type", type(error).__name__)
    span.set_status(StatusCode.ERROR, str(error))
