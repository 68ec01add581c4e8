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

from starlette.types import Message, Receive, Scope, Send

from proxy.errors import RouterError
from proxy.flow.exchange import Exchange
from proxy.flow.learn import DecodeStreams, LocalBudget
from proxy.flow.relay import Downstream, FlowResponse
from proxy.pool.endpoints import ClusterName

DONE_EVENT = b"data: [DONE]\n\n"  # an OpenAI stream's last event: the end, not a token


async def run_local(exchange: Exchange, down: Downstream) -> None:
    body = exchange.request.body  # the client's own (it never holds kv_transfer_params)
    await exchange.with_retry(ClusterName.DECODE, lambda: exchange.relay_decode(body, down), down)


class ItlWatchedResponse(FlowResponse):
    """A `FlowResponse` that measures, for auto's local budget, what the client receives
    from D: the inter-token latency of a streamed answer, and for a local request the
    time D spends on its prompt (from sending it until its first byte).

    It watches the ASGI messages going out: per message a few comparisons and a count of
    the event ends in the body (a C-level scan); the clock is read only at the first and
    the last body message. The stream's ITL is (last - first) / (its token events - 1),
    `data: [DONE]` not counted as a token. Only streams that end with `data: [DONE]`
    count: one cut short or ended by an error event may have waited out a time limit,
    which says nothing of D's pace. Used only where local may be used, for streamed and
    local requests."""

    def __init__(
        self,
        flow: Callable[[Downstream], Awaitable[None]],
        *,
        streaming: bool,
        headers: list[tuple[bytes, bytes]],
        done: Callable[[Downstream, RouterError | None, bool], None],
        exchange: Exchange,
        budget: LocalBudget,
        local: bool,
    ) -> None:
        super().__init__(flow, streaming=streaming, headers=headers, done=done)
        self._exchange = exchange
        self._budget = budget
        self._local = local
        self._measure = streaming  # only a stream has gaps between tokens

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        budget, exchange = self._budget, self._exchange
        # A local prompt is D's work from now until its first byte (a retried request
        # keeps the mark on the D it first went to: that one failed, it is not decoding).
        marked: DecodeStreams | None = budget.of(exchange.decode_endpoint) if self._local else None
        if marked is not None:
            marked.local_begin()
        status = 0
        events = 0  # SSE events sent so far
        ended = False  # the last body so far ends with data: [DONE]
        first_at = 0.0
        streams: DecodeStreams | None = None  # the D answering, known at the first byte
        clean = False
        local_started = 0

        async def watched(message: Message) -> None:
            nonlocal status, events, ended, first_at, streams, clean, local_started, marked
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                body: bytes = message.get("body", b"")
                if body:
                    if marked is not None:  # D has computed the local prompt
                        marked.local_end()
                        marked = None
                    if events == 0 and self._measure and status == 200:
                        first_at = time.perf_counter()
                        streams = budget.of(exchange.decode_endpoint)
                        clean = streams.local_prefills == 0
                        local_started = streams.local_started
                    events += body.count(b"\n\n")
                    ended = body.endswith(DONE_EVENT)
                if streams is not None and ended and not message.get("more_body", False):
                    tokens = events - 1  # [DONE] is no token
                    if tokens >= 2:
                        itl = (time.perf_counter() - first_at) / (tokens - 1)
                        streams.observe(itl, clean=clean and streams.local_started == local_started,
                                        smoothing=budget.smoothing)
            await send(message)

        try:
            await super().__call__(scope, receive, watched)
        finally:
            if marked is not None:  # no byte came back (failed, cancelled, client gone)
                marked.local_end()
