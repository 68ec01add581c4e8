"""One client request on its way through a P and a D: its legs, timings and accounting.

The flows (`pull.py`, `push.py`) decide the order of the legs; this module does each leg:
lease the endpoint, call it, record latency and errors, and relay D's answer downstream.
"""

from __future__ import annotations

import enum
import logging
from asyncio import CancelledError
from logging import INFO
from time import monotonic, perf_counter
from typing import Any

import msgspec

from connector.protocol import http_params as wire
from proxy.config import Mode
from proxy.errors import (
    NoHealthyEndpoint,
    Overloaded,
    RouterError,
    UpstreamConnectError,
    UpstreamConnectionLost,
    UpstreamError,
)
from proxy.flow.context import FlowContext
from proxy.flow.modes import ModeDecision
from proxy.flow.relay import Downstream, relay_events
from proxy.pool.endpoints import ClusterName, Endpoint
from proxy.pool.kv.blocks import PromptBlocks
from proxy.pool.outlier import counts_as_failure
from proxy.pool.retry import retry_reason
from proxy.protocol import ROUTE_PATH, ClientRequest
from proxy.tracing import LegSpan, RequestTrace
from proxy.upstream.client import UpstreamClient

logger = logging.getLogger("pdproxy.access")
MODE_HEADER = b"x-kv-transfer-mode"  # the mode a request ran as, in its answer's head
# Whether the router asked P to write the push layer by layer (where it learns that), in
# the answer's head; dropped when the request runs as another mode.
PUSH_LAYERS_HEADER = wire.PUSH_LAYERS_HEADER.lower().encode()
# A mode's string, looked up: an enum's `.value` is two Python calls in Python 3.11.
_MODE_LABEL = {mode: mode.value for mode in Mode}
# Each status as the metrics label it is, looked up: `str()` of an int was about 1,000
# instructions per request (callgrind).
_STATUS_LABELS = {code: str(code) for code in range(100, 600)}
_PREFILL = ClusterName.PREFILL.value  # kv_aware's predictions are by cluster name
_check_decode_answer = msgspec.json.Decoder(wire.DecodeAnswer).decode


class LegState(str, enum.Enum):
    RUNNING = "running"
    DONE = "done"  # the server answered (any status it chose to; errors are FAILED)
    FAILED = "failed"  # a transport error, or an answer the router counts as a failure
    CANCELLED = "cancelled"  # the client left, or the other leg failed first


class Leg:
    """One call to one server for this request (P's or D's leg, a retry's second try),
    and its lease on the server: `with exchange.leg(endpoint, tokens):` counts one
    request in flight there (and `tokens` prompt tokens it computes, kv_aware's queue)
    for the block, always given back, and the leg's state follows how the block ends,
    whatever the path. A traced request's leg also ends its span there, saying its
    state, its error and, for D's, when the first byte came. (One object, a class: this
    is on every leg's path; a lease and a state keeper apart were five calls more a leg,
    and a traced leg of another class made each `with` a generic lookup of `__enter__`
    and `__exit__`.)"""

    __slots__ = ("cluster", "endpoint", "attempt", "tokens", "state", "span", "exchange")

    def __init__(self, endpoint: Endpoint, attempt: int, tokens: int = 0) -> None:
        self.cluster = endpoint.cluster
        self.endpoint = endpoint
        self.attempt = attempt  # 1, then 2 for a retry or a recovery on this cluster
        self.tokens = tokens
        self.state = LegState.RUNNING
        # A traced request's (`Exchange._trace_leg`): its span, and whose leg it is until
        # the span ends (then let go: the exchange holds its legs, and no cycle is left)
        self.span: LegSpan | None = None
        self.exchange: Exchange | None = None

    def __str__(self) -> str:
        return f"{self.cluster.value}#{self.attempt}={self.state.value}"

    def __enter__(self) -> Leg:
        endpoint = self.endpoint
        endpoint.in_flight += 1
        endpoint.pending_tokens += self.tokens
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None = None,
                 _traceback: object = None) -> None:
        endpoint = self.endpoint
        endpoint.in_flight -= 1
        endpoint.pending_tokens -= self.tokens
        if kind is None:
            self.state = LegState.DONE
        elif issubclass(kind, CancelledError):
            self.state = LegState.CANCELLED
        else:
            self.state = LegState.FAILED
        if self.span is not None:
            self._end_span(error)

    def _end_span(self, error: BaseException | None) -> None:
        exchange, span = self.exchange, self.span
        assert exchange is not None and exchange.trace is not None and span is not None
        self.exchange = self.span = None
        prefill = self.cluster is ClusterName.PREFILL
        exchange.trace.leg_ended(
            span, prefill=prefill, state=self.state.value,
            error=error if isinstance(error, Exception) else None,
            first_byte_s=None if prefill else exchange.decode_first_byte_seconds)


class Exchange:
    # The request's trace (`proxy.tracing`), when tracing is on; a class attribute, so
    # an untraced exchange pays nothing for it.
    trace: RequestTrace | None = None

    def __init__(
        self,
        context: FlowContext,
        request: ClientRequest,
        *,
        prefill: Endpoint | None,
        decode: Endpoint,
        decision: ModeDecision,
        bucket: int | None = None,
        prefix: str | None = None,
        prompt: PromptBlocks | None = None,
    ) -> None:
        self.context = context  # what of the router the flows may use
        self.request = request
        self.prefill_endpoint = prefill  # None for a local exchange: D computes the prompt
        self.decode_endpoint = decode
        self.decision = decision
        self.bucket = bucket  # the prompt-length bucket auto mode learns in (streamed requests)
        self.prefix = prefix  # the prompt's prefix key (prefix affinity), for a retry's pick
        self.prompt = prompt  # its token blocks (kv_aware), for a retry's pick and the log
        # The mode the request actually ran as: the decision's, until a flow falls back
        # (an unpinned push run as a pull, a failed push recovered by a pull or by D).
        self.used = decision.used
        self.mode = _MODE_LABEL[decision.used]
        self.path = ROUTE_PATH[request.route]  # the route's path, read on every leg
        # Whether a push goes layer by layer, where the router learns it (auto.push_layers:
        # learn) and the client did not say; None: as the client or P's connector says.
        self.push_layers: bool | None = None
        self.upstream_headers = {wire.REQUEST_ID_HEADER: request.request_id}
        self.started_at = perf_counter()
        self.prefill_seconds: float | None = None
        self.prefill_cached: int | None = None  # prompt tokens P says its cache held
        # P's kv_transfer_params, decoded once from its answer (None: it gave none usable)
        self.prefill_params: wire.KVTransferParams | None = None
        self.decode_first_byte_seconds: float | None = None
        self.notes: list[str] = []  # remarks for the access log (fallback, recompute, ...)
        self.legs: list[Leg] = []  # every call to a server for it, in the order made

    def leg(self, endpoint: Endpoint, tokens: int = 0) -> Leg:
        """A new leg to `endpoint`, its attempt counted within its cluster; `tokens`: the
        prompt tokens it computes there (P's, by kv_aware's prediction)."""
        attempt = 1
        for leg in self.legs:  # a loop: a generator is two calls more
            if leg.cluster is endpoint.cluster:
                attempt += 1
        leg = Leg(endpoint, attempt, tokens)
        self.legs.append(leg)
        return leg

    def remark(self, note: str) -> None:
        """One more remark for the access log line (all are kept, in order)."""
        self.notes.append(note)

    def ran_as(self, mode: Mode, down: Downstream, note: str) -> None:
        """The request runs as `mode`, not as decided: the `X-KV-Transfer-Mode` header
        (not sent yet: the head goes with the first byte), the metrics' mode label and the
        access log say so, and auto's learner does not learn from it."""
        self.used = mode
        self.mode = _MODE_LABEL[mode]
        down.headers[:] = [(name, mode.value.encode() if name == MODE_HEADER else value)
                           for name, value in down.headers
                           if name != PUSH_LAYERS_HEADER or mode is Mode.PUSH]
        self.remark(note)

    # --- the legs ---------------------------------------------------------------------

    def retry(self, cluster: ClusterName, failed: UpstreamError,
              down: Downstream | None = None) -> None:
        """After a leg to `cluster` failed with `failed`: raise it again, unless it failed
        in a way worth retrying (see `proxy.pool.retry`) before any byte reached the
        client (`down`) and the retry budget allows; then the exchange points at another
        healthy server of the same cluster, picked with every filter of the first pick
        (model, transfer mode, draining, ejection) and without the failed server, and the
        flow runs the leg once more:

            try:
                answer = await exchange.prefill(body)
            except UpstreamError as exc:
                exchange.retry(ClusterName.PREFILL, exc)
                answer = await exchange.prefill(body)

        (Called only when a leg failed: a coroutine wrapping every leg was a level of
        coroutines more on each leg's happy path, and a closure per leg: 3,100
        instructions a request, callgrind.)"""
        reason = retry_reason(failed)
        if reason is None or (down is not None and down.started):
            raise failed
        server = self.prefill_server if cluster is ClusterName.PREFILL else self.decode_endpoint
        try:
            other = self.pick_again(cluster, exclude=server)
        except NoHealthyEndpoint:
            raise failed from None
        metrics = self.context.metrics
        if not self.context.retry_budget.try_spend():
            metrics.child(metrics.retries_refused, cluster.value, reason).inc()
            raise failed
        metrics.child(metrics.retries, cluster.value, reason).inc()
        self.remark(f"retried_{cluster.value}:{reason}:{server.url}->{other.url}")
        if cluster is ClusterName.PREFILL:
            self.prefill_endpoint = other
        else:
            self.decode_endpoint = other

    def pick_again(
        self, cluster: ClusterName, *, exclude: Endpoint, mode: Mode | None = None
    ) -> Endpoint:
        """Another server of `cluster` for this request, filtered as the first pick was
        (the request's model, the mode in use unless `mode` says, healthy, not draining,
        not ejected)."""
        pool = self.context.cluster(cluster)
        return pool.pick(exclude=exclude, key=self.prefix, mode=mode or self.decision.used,
                         model=self.request.model, prompt=self.prompt)

    @property
    def prefill_server(self) -> Endpoint:
        """The P of a pull or a push (only those flows ask: a local exchange has none)."""
        assert self.prefill_endpoint is not None, "a local exchange has no prefill server"
        return self.prefill_endpoint

    async def prefill(
        self, body: dict[str, Any], *, headers: dict[str, str] | None = None
    ) -> wire.PrefillAnswer:
        """P's leg: one token, not streamed. Returns what the router reads of P's answer,
        its kv_transfer_params decoded in `prefill_params`. `headers`: more headers for
        P's leg alone (a push's data-parallel rank)."""
        p = self.prefill_server
        started = perf_counter()
        sent = self.upstream_headers if headers is None else {**self.upstream_headers, **headers}
        leg = self.leg(p, self.prefill_work())
        if self.trace is not None:
            sent = self._trace_leg(leg, sent)
        with leg:
            try:
                answer: wire.PrefillAnswer = await self.context.client.post_json(
                    f"{p.url}{self.path}",
                    body,
                    headers=sent,
                    endpoint=p.url,
                    cluster=p.cluster_label,
                    timeout=self.context.config.timeouts.prefill,
                    type=wire.PrefillAnswer,
                )
            except UpstreamError as exc:
                self._upstream_failed(p, exc)
                raise
        self.prefill_seconds = perf_counter() - started
        p.outlier.success()
        p.observe_latency(self.prefill_seconds)
        metrics = self.context.metrics
        metrics.prefill_latency.observe((self.mode,), self.prefill_seconds)
        params = self.prefill_params = answer.params()
        self.context.prober.observe(p, params)
        self._observe_cached(answer.usage)
        return answer

    def _observe_cached(self, usage: Any) -> None:
        """What P says it hit in its prefix cache, when its answer tells (vLLM's
        --enable-prompt-tokens-details), for the metrics and the access log."""
        details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        prompt = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        if type(cached) is not int or type(prompt) is not int or prompt <= 0:
            return
        self.prefill_cached = cached
        metrics = self.context.metrics
        metrics.kv_actual_hits.observe((_PREFILL,), min(1.0, cached / prompt))

    def prefill_work(self) -> int:
        """The prompt tokens P's leg computes, by kv_aware's prediction (0 without it)."""
        prompt = self.prompt
        if prompt is None:
            return 0
        hit = prompt.predicted.get(_PREFILL)
        return len(prompt) - (hit or 0)

    async def relay_decode(self, body: dict[str, Any], down: Downstream) -> None:
        """D's leg: send D its request and pass its answer to the client as it comes."""
        d = self.decode_endpoint
        sent_at = perf_counter()
        sent = self.upstream_headers
        leg = self.leg(d)
        if self.trace is not None:
            sent = self._trace_leg(leg, sent)
        client = self.context.client
        with leg:
            try:
                if not self.request.stream:  # D's whole answer, read at once
                    whole = await client.post_whole(f"{d.url}{self.path}", body, headers=sent,
                                                    endpoint=d.url, cluster=d.cluster_label)
                    self._decode_first_byte(sent_at)
                    _check_whole_answer(whole.body, d, client)
                    d.outlier.success()
                    await down.whole(whole.status,
                                     whole.header(b"content-type") or "application/json",
                                     whole.body)
                    return
                async with client.stream(
                    f"{d.url}{self.path}",
                    body,
                    headers=sent,
                    endpoint=d.url,
                    cluster=d.cluster_label,
                ) as answer:
                    _check_stream_answer(answer.content_type, d, client)
                    d.outlier.success()  # D answered a stream with a success status
                    await relay_events(answer, down, first_byte=lambda: self._decode_first_byte(sent_at))
            except UpstreamError as exc:
                self._upstream_failed(d, exc)
                raise

    # --- tracing (a traced request only: `self.trace` is set) -------------------------

    def traced(self, trace: RequestTrace | None) -> None:
        """Trace this exchange as `trace`'s request: the routing decision on its span."""
        if trace is None:
            return
        self.trace = trace
        p, prompt = self.prefill_endpoint, self.prompt
        request, decision = self.request, self.decision
        trace.decided(request_id=request.request_id, model=request.model, stream=request.stream,
                      requested=decision.requested.value, decided=decision.used.value,
                      reason=decision.reason, prefill=None if p is None else p.name,
                      decode=self.decode_endpoint.name,
                      prompt_tokens=None if prompt is None else len(prompt),
                      predicted=None if prompt is None else prompt.predicted)

    def _trace_leg(self, leg: Leg, headers: dict[str, str]) -> dict[str, str]:
        """Trace `leg` (its span ends with it): `headers` with the `traceparent` that
        names its span."""
        assert self.trace is not None
        endpoint = leg.endpoint
        leg.span, sent = self.trace.leg(leg.cluster.value, leg.attempt, endpoint.name,
                                        endpoint.url, self.path, headers)
        leg.exchange = self
        return sent

    def _decode_first_byte(self, sent_at: float) -> None:
        self.decode_first_byte_seconds = perf_counter() - sent_at
        self.decode_endpoint.observe_latency(self.decode_first_byte_seconds)
        metrics = self.context.metrics
        metrics.decode_first_token.observe((self.mode,), self.decode_first_byte_seconds)

    def _upstream_failed(self, endpoint: Endpoint, exc: UpstreamError) -> None:
        endpoint.last_error = str(exc)
        self.context.metrics.upstream_errors.labels(
            endpoint.cluster.value, endpoint.url, exc.kind
        ).inc()
        if isinstance(exc, UpstreamConnectError):
            self.context.health.mark_down(endpoint, str(exc))
        elif isinstance(exc, UpstreamConnectionLost):
            self.context.health.count_failure(endpoint, str(exc))
        if counts_as_failure(exc):
            ejected_for = endpoint.outlier.failure(monotonic())
            if ejected_for is not None:
                self.context.metrics.ejections.labels(endpoint.cluster.value, endpoint.url).inc()
                logger.warning("%s server %s ejected for %.0f s after %d failures in a row "
                               "(last: %s)", endpoint.cluster.value, endpoint.url, ejected_for,
                               endpoint.outlier.config.consecutive_failures, exc)

    # --- the end ----------------------------------------------------------------------

    def finish(self, down: Downstream, error: RouterError | None, client_left: bool) -> None:
        """Account for the exchange once, whatever happened: metrics and one log line."""
        metrics = self.context.metrics
        code = down.status or (error.status if error else 0)
        status = "client_closed" if client_left else _STATUS_LABELS.get(code) or str(code)
        metrics.requests.inc((self.path, self.mode, status))
        if isinstance(error, Overloaded):
            metrics.child(metrics.rejected, error.reason).inc()
        if down.first_byte_at is not None:
            ttfb = down.first_byte_at - self.started_at
            metrics.time_to_first_byte.observe((self.mode,), ttfb)
            learner = self.context.learner
            if (learner and self.bucket is not None and self.request.stream
                    and down.status == 200 and self.used is self.decision.used):
                learner.observe(self.used, self.bucket, ttfb)
                if learner.layers is not None and self.push_layers is not None:
                    learner.layers.observe(self.push_layers, self.bucket, ttfb)
        local = self.prefill_endpoint is None  # no P leg: D computed the prompt
        if self.trace is not None:
            self._trace_end(down, error, status)
        if client_left:
            for cluster in ("decode",) if local else ("prefill", "decode"):
                metrics.cancelled_legs.labels(cluster, "client_disconnected").inc()
        if not logger.isEnabledFor(INFO):
            return
        logger.info(
            "request_id=%s route=%s mode=%s requested=%s why=%s prefill=%s decode=%s status=%s "
            "ttfb_ms=%s prefill_ms=%s decode_ttfb_ms=%s total_ms=%.1f legs=%s%s%s%s%s",
            self.request.request_id,
            self.path,
            self.mode,
            self.decision.requested.value,
            self.decision.reason,
            "-" if self.prefill_endpoint is None else self.prefill_endpoint.url,
            self.decode_endpoint.url,
            status,
            _ms(down.first_byte_at - self.started_at if down.first_byte_at else None),
            _ms(self.prefill_seconds),
            _ms(self.decode_first_byte_seconds),
            (perf_counter() - self.started_at) * 1000,
            ",".join(map(str, self.legs)) or "-",
            f" note={','.join(self.notes)}" if self.notes else "",
            _predicted(self.prompt),
            "" if self.prefill_cached is None else f" prefill_cached={self.prefill_cached}",
            f" error={str(error)!r}" if error else "",  # an upstream's: with its URL
        )

    def _trace_end(self, down: Downstream, error: RouterError | None, status: str) -> None:
        assert self.trace is not None
        self.trace.end(
            int(status) if status.isdigit() else status, error, mode=self.mode,
            legs=[str(leg) for leg in self.legs], notes=self.notes,
            prefill=None if self.prefill_endpoint is None else self.prefill_endpoint.name,
            decode=self.decode_endpoint.name, prefill_s=self.prefill_seconds,
            prefill_cached=self.prefill_cached,
            ttfb_s=None if down.first_byte_at is None else down.first_byte_at - self.started_at)


def _predicted(prompt: PromptBlocks | None) -> str:
    """kv_aware's prediction for the log: the prompt's tokens and, per leg, how many of
    them the chosen server held by the KV index (`?`: unknown)."""
    if prompt is None or not prompt.predicted:
        return ""
    legs = " ".join(f"{cluster}_hit={'?' if hit is None else hit}"
                    for cluster, hit in prompt.predicted.items())
    return f" prompt_tokens={len(prompt)} {legs}"


def _check_whole_answer(content: bytes, d: Endpoint, client: UpstreamClient) -> None:
    """D's whole answer must be a JSON object: garbage is D's failure (502), never the
    client's 200. Checked, not built (`wire.DecodeAnswer`)."""
    try:
        _check_decode_answer(content)
    except msgspec.DecodeError:  # not JSON, or not an object (a ValidationError)
        raise client.protocol_error(d.url, d.cluster.value,
                                    "answered 200 with a body that is not a JSON object",
                                    repr(content[:80])) from None


def _check_stream_answer(content_type: str, d: Endpoint, client: UpstreamClient) -> None:
    """A streamed request must get an event stream (not, say, a JSON body with 200)."""
    if not content_type.startswith("text/event-stream"):
        raise client.protocol_error(
            d.url, d.cluster.value,
            f"answered a streamed request with {content_type!r}, not an event stream")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"
