"""The local flow: no P; D computes the prompt itself (conditional disaggregation).

    client ──▶ router ──▶ D (the client's body as it is) ──▶ answer relayed to the client

No P is picked, leased or called, so a local request is served while every P is down.
D gets no `kv_transfer_params`: a D with a KV connector then simply computes the prompt.
D's leg is the same as a pull's D leg (`Exchange.relay_decode`) with the same retry: a D
that refuses the connection or fails with a 5xx other than 503 before the client got a
byte is replaced by another D of the model, once, within the retry budget.

Local is cheapest for a short prompt (no hand-over at all), but D's prompt compute runs
between the decode steps of every stream D is answering, and slows them. So wherever
local may be used (`auto.local`, `mode: local`, or `local` among `client_modes`),
`ItlWatchedResponse` measures the inter-token latency of the streams each D answers and
marks the local prompts D is computing; `proxy.flow.learn.LocalBudget` reads both to
decide where auto may still go local, and which D is over its budget for any local
request (the router then runs it as a pull).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from starlette.types import Receive

from proxy.errors import RouterError, UpstreamError
from proxy.flow.exchange import Exchange
from proxy.flow.learn import LocalBudget
from proxy.flow.relay import ClientAnswer, ClientConnection, Downstream, FlowResponse, Headers
from proxy.pool.endpoints import ClusterName, DecodeStreams

DONE_EVENT = b"data: [DONE]\n\n"  # an OpenAI stream's last event: the end, not a token


async def run_local(exchange: Exchange, down: Downstream) -> None:
    body = exchange.request.body  # the client's own (it never holds kv_transfer_params)
    try:
        await exchange.relay_decode(body, down)
    except UpstreamError as exc:  # raised again, or once more on another D
        exchange.retry(ClusterName.DECODE, exc, down)
        await exchange.relay_decode(body, down)


class ItlWatchedResponse(FlowResponse):
    """A `FlowResponse` that measures, for auto's local budget, what the client receives
    from D: the inter-token latency of a streamed answer, and for a local request the
    time D spends on its prompt (from sending it until its first byte).

    It watches the answer going out (`_Watched`): per part a few comparisons and a count
    of the event ends in it (a C-level scan); the clock is read only at the first and the
    last part. The stream's ITL is (last - first) / (its token events - 1), `data: [DONE]`
    not counted as a token. Only streams that end with `data: [DONE]` count: one cut
    short or ended by an error event may have waited out a time limit, which says
    nothing of D's pace. Used only where local may be used, for streamed and local
    requests."""

    def __init__(
        self,
        flow: Callable[[Downstream], Awaitable[None]],
        *,
        streaming: bool,
        headers: Headers,
        done: Callable[[Downstream, RouterError | None, bool], None],
        exchange: Exchange,
        budget: LocalBudget,
        local: bool,
    ) -> None:
        super().__init__(flow, streaming=streaming, headers=headers, done=done)
        self._exchange = exchange
        self._budget = budget
        self._local = local

    async def answer(self, out: ClientAnswer, connection: ClientConnection | None,
                     receive: Receive | None = None) -> None:
        watched = _Watched(out, self._budget, self._exchange, local=self._local,
                           measure=self._streaming)
        try:
            await super().answer(watched, connection, receive)
        finally:
            watched.ended()


class _Watched:
    """The `ClientAnswer` an `ItlWatchedResponse` answers to: the answer passed on to
    `out`, each part counted on the way."""

    __slots__ = ("_out", "_budget", "_exchange", "_measure", "_marked", "_status", "_events",
                 "_done", "_first_at", "_streams", "_clean", "_local_started")

    def __init__(self, out: ClientAnswer, budget: LocalBudget, exchange: Exchange, *,
                 local: bool, measure: bool) -> None:
        self._out = out
        self._budget = budget
        self._exchange = exchange
        self._measure = measure  # only a stream has gaps between tokens
        # A local prompt is D's work from now until its first byte (a retried request
        # keeps the mark on the D it first went to: that one failed, it is not decoding).
        marked = budget.of(exchange.decode_endpoint) if local else None
        if marked is not None:
            marked.local_begin()
        self._marked = marked
        self._status = 0
        self._events = 0  # SSE events sent so far
        self._done = False  # the last part so far ends with data: [DONE]
        self._first_at = 0.0
        self._streams: DecodeStreams | None = None  # the D answering, known at the first byte
        self._clean = False
        self._local_started = 0

    async def whole(self, status: int, content_type: str, headers: Headers, body: bytes) -> None:
        self._status = status
        self._part(body, last=True)
        await self._out.whole(status, content_type, headers, body)

    async def start(self, status: int, content_type: str, headers: Headers) -> None:
        self._status = status
        await self._out.start(status, content_type, headers)

    async def write(self, chunk: bytes) -> None:
        self._part(chunk, last=False)
        await self._out.write(chunk)

    async def end(self, chunk: bytes) -> None:
        self._part(chunk, last=True)
        await self._out.end(chunk)

    def _part(self, body: bytes, *, last: bool) -> None:
        if body:
            if self._marked is not None:  # D has computed the local prompt
                self._marked.local_end()
                self._marked = None
            if self._events == 0 and self._measure and self._status == 200:
                self._first_at = time.perf_counter()
                answering = self._streams = self._budget.of(self._exchange.decode_endpoint)
                self._clean = answering.local_prefills == 0
                self._local_started = answering.local_started
            self._events += body.count(b"\n\n")
            self._done = body.endswith(DONE_EVENT)
        streams = self._streams
        if streams is not None and last and self._done:
            tokens = self._events - 1  # [DONE] is no token
            if tokens >= 2:
                itl = (time.perf_counter() - self._first_at) / (tokens - 1)
                streams.observe(itl, clean=self._clean and streams.local_started == self._local_started,
                                smoothing=self._budget.smoothing)

    def ended(self) -> None:
        """The flow is over: a local prompt still marked got no byte back (it failed, was
        cancelled, or the client left)."""
        if self._marked is not None:
            self._marked.local_end()
            self._marked = None
