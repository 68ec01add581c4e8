"""A systematic fault suite: each fault, in pull and in push mode, streamed and not where
it applies. After each one the client has either a clear error (OpenAI-shaped JSON with
502 for a broken upstream, 504 for an upstream timeout; once a stream has started, an SSE
error event and the end of the stream) or a complete answer, within the configured
limits (1 s here; see `fault_kit.TIMEOUTS`); and nothing leaks: both clusters have 0 in
flight, no upstream still runs a leg (the router cancelled it), and the loop has no more
tasks than before the request.

    fault                                   where      pull/push  json/sse
    1. D cut after two chunks               D          both       sse
       a server killed during a slow stream D          both       sse
       a server killed before its answer    P, D       both       both
    2. accepts and never answers (hang)     P, D       both       both    504
       stalls after its first token         D          both       sse     504 event
    3. answers garbage                      P, D       both       both    502
       cuts its answer inside an SSE event  D          both       sse     error event
         ...and the event framing survives  D          both       sse     whole events
       cuts a JSON body in half             D          both       json    502
    4. client leaves: while P computes      -          both       sse
                      before D's 1st byte   -          both       both
                      mid-stream            -          both       sse
                      right at the end      -          both       sse
    5. a client reading 1 byte a second     -          both       sse     others unaffected
         ...and D is not timed out for it   -          both       sse     no timeout

Already covered in test_failures.py, not repeated here:
    the client leaving during P with a JSON answer:
        test_client_leaving_during_prefill_cancels_the_legs
    P's or D's error status relayed, and the other leg cancelled:
        test_push_prefill_error_cancels_decode_at_once
        test_push_decode_error_cancels_prefill
        test_pull_prefill_failure_never_reaches_decode
    P dropping the connection in push mode:
        test_push_prefill_connection_drop_gives_502_and_cancels_decode
    an unreachable server:
        test_decode_unreachable_gives_502
        test_unreachable_server_is_replaced_before_any_byte
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from testbed.fake_vllm import MODEL, FakeVLLM
from tests.conftest import serve_router
from tests.integration.fault_kit import (
    SLACK_S,
    TIMEOUTS,
    RawClient,
    ScriptedDecode,
    Upstreams,
    assert_error_response,
    assert_no_leaks,
    assert_stream_ends_with_error,
    live_tasks,
    router_config,
    sse_data,
)

MODES = ["pull", "push"]
JSON_AND_SSE = [pytest.param(False, id="json"), pytest.param(True, id="sse")]
LIMIT_S = TIMEOUTS["prefill"]  # = first_token = stream_idle


@pytest.fixture
async def ups() -> AsyncIterator[Upstreams]:
    upstreams = Upstreams()
    await upstreams.start()
    try:
        yield upstreams
    finally:
        await upstreams.close()


@contextlib.asynccontextmanager
async def routed(ups: Upstreams, decode: FakeVLLM | ScriptedDecode | None = None,
                 **timeouts: float) -> AsyncIterator[tuple[str, Any, int]]:
    """The router in front of P and `decode` (the fake D by default); yields its URL, its
    app and the number of live tasks once it is up (the leak check's baseline)."""
    config = router_config(ups.url(ups.prefill), ups.url(decode or ups.decode))
    config["timeouts"].update(timeouts)
    async with serve_router(**config) as (url, app):
        await asyncio.sleep(0)  # one turn of the loop: tasks the start has ended are gone
        yield url, app, len(live_tasks())


def http_client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=10, verify=False)  # plain HTTP: no TLS context to build


@dataclasses.dataclass
class Answer:
    status: int
    content_type: str
    body: bytes
    elapsed: float

    @property
    def text(self) -> str:
        return self.body.decode()


async def ask(url: str, mode: str, *, stream: bool, prompt: str = "hello", max_tokens: int = 3,
              request_id: str | None = None, client: httpx.AsyncClient | None = None) -> Answer:
    headers = {"X-KV-Transfer-Mode": mode, **({"X-Request-Id": request_id} if request_id else {})}
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    async with contextlib.AsyncExitStack() as stack:
        if client is None:
            client = await stack.enter_async_context(http_client())
        started = time.perf_counter()
        r = await client.post(f"{url}/v1/completions", json=body, headers=headers)
        elapsed = time.perf_counter() - started
    assert r.headers.get("x-kv-transfer-mode") == mode  # the mode asked, not a fallback
    return Answer(r.status_code, r.headers.get("content-type", ""), r.content, elapsed)


def expect_error(answer: Answer, status: int, error_type: str) -> None:
    assert_error_response(answer.status, answer.content_type, answer.body, status, error_type)


def outcomes(fake: FakeVLLM | ScriptedDecode) -> list[str]:
    return [s.outcome for s in fake.seen]


# --- 1. a backend killed ------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_decode_cut_after_two_chunks(ups: Upstreams, mode: str) -> None:
    ups.decode.behavior.tokens = 6
    ups.decode.behavior.cut_stream_after = 2
    async with routed(ups) as (url, app, tasks):
        answer = await ask(url, mode, stream=True, max_tokens=6)
        await assert_no_leaks(app, tasks, ups.prefill, ups.decode)
    assert answer.status == 200 and answer.elapsed < SLACK_S
    events = sse_data(answer.text)
    assert ['"t0"' in events[0], '"t1"' in events[1], len(events)] == [True, True, 4]
    assert_stream_ends_with_error(answer.text, "upstream_error")
    assert outcomes(ups.decode) == ["failed"]


@pytest.mark.parametrize("mode", MODES)
async def test_decode_killed_during_a_slow_stream(ups: Upstreams, mode: str) -> None:
    """D's server really stops (its runner's cleanup cancels the running handler and
    closes its connections) after the client got two tokens of fifty."""
    ups.decode.behavior.tokens = 50
    ups.decode.behavior.token_delay = 0.1
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 50, "stream": True}
    killed_at: float | None = None
    async with routed(ups) as (url, app, tasks):
        async with http_client() as client:
            received = ""
            async with client.stream("POST", f"{url}/v1/completions", json=body,
                                     headers={"X-KV-Transfer-Mode": mode}) as r:
                async for text in r.aiter_text():
                    received += text
                    if received.count("\n\n") == 2 and killed_at is None:
                        await ups.kill(ups.decode)
                        killed_at = time.perf_counter()
                ended_at = time.perf_counter()
        await assert_no_leaks(app, tasks, ups.prefill, ups.decode)
    assert r.status_code == 200 and killed_at is not None and ended_at - killed_at < SLACK_S
    assert len(sse_data(received)) < 20  # of 50: the stream did not go on
    assert_stream_ends_with_error(received, "upstream_error")
    assert outcomes(ups.decode) == ["cancelled"]


@pytest.mark.parametrize("stream", JSON_AND_SSE)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("victim", ["prefill", "decode"])
async def test_server_killed_before_its_answer(ups: Upstreams, victim: str, mode: str, stream: bool) -> None:
    fake = ups.prefill if victim == "prefill" else ups.decode
    fake.behavior.delay = 30
    async with routed(ups) as (url, app, tasks):
        call = asyncio.create_task(ask(url, mode, stream=stream))
        await fake.until(lambda seen: len(seen) == 1)
        if mode == "push":
            await ups.decode.until(lambda seen: len(seen) == 1)
        killed_at = time.perf_counter()
        await ups.kill(fake)
        answer = await asyncio.wait_for(call, 5)
        ended_at = time.perf_counter()
        await assert_no_leaks(app, tasks, ups.prefill, ups.decode)
    expect_error(answer, 502, "upstream_error")
    assert ended_at - killed_at < SLACK_S
    assert outcomes(fake) == ["cancelled"]
    if victim == "prefill":  # pull: D never asked; push: D's leg cancelled
        assert outcomes(ups.decode) == ([] if mode == "pull" else ["cancelled"])
    else:
        assert outcomes(ups.prefill) == ["ok"]


# --- 2. a backend that never answers ----------------------------------------------------


@pytest.mark.parametrize("stream", JSON_AND_SSE)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("victim", ["prefill", "decode"])
async def test_hanging_server_gives_504_in_time(ups: Upstreams, victim: str, mode: str, stream: bool) -> None:
    fake = ups.prefill if victim == "prefill" else ups.decode
    fake.behavior.hang = True
    async with routed(ups) as (url, app, tasks):
        answer = await ask(url, mode, stream=stream)
        await assert_no_leaks(app, tasks, ups.prefill, ups.decode)
    expect_error(answer, 504, "timeout")
    assert LIMIT_S - 0.1 < answer.elapsed < LIMIT_S + SLACK_S
    assert outcomes(fake) == ["cancelled"]
    if victim == "prefill":
        assert outcomes(ups.decode) == ([] if mode == "pull" else ["cancelled"])
    else:
        assert outcomes(ups.prefill) == ["ok"]


@pytest.mark.parametrize("mode", MODES)
async def test_decode_stalling_mid_stream_ends_with_a_timeout_event(ups: Upstreams, mode: str) -> None:
    ups.decode.behavior.tokens = 3
    ups.decode.behavior.token_delay = 30  # the first token, then silence
    async with routed(ups) as (url, app, tasks):
        answer = await ask(url, mode, stream=True)
        await assert_no_leaks(app, tasks, ups.prefill, ups.decode)
    assert answer.status == 200
    assert LIMIT_S - 0.1 < answer.elapsed < LIMIT_S + SLACK_S
    assert '"t0"' in sse_data(answer.text)[0]
    assert_stream_ends_with_error(answer.text, "timeout")
    assert outcomes(ups.decode) == ["cancelled"]


# --- 3. garbage, and a stream cut inside an event ---------------------------------------


@pytest.mark.parametrize("stream", JSON_AND_SSE)
@pytest.mark.parametrize("mode", MODES)
async def test_garbage_from_prefill_gives_502(ups: Upstreams, mode: str, stream: bool) -> None:
    ups.prefill.behavior.garbage = True
    async with routed(ups) as (url, app, tasks):
        answer = await ask(url, mode, stream=stream)
        await assert_no_leaks(app, tasks, ups.prefill, ups.decode)
    expect_error(answer, 502, "upstream_error")
    assert answer.elapsed < SLACK_S
    # Push: D's leg was cancelled, or P failed so fast that D never got to read it.
    assert outcomes(ups.decode) in ([[]] if mode == "pull" else [["cancelled"], []])


@pytest.mark.parametrize("stream", JSON_AND_SSE)
@pytest.mark.parametrize("mode", MODES)
async def test_garbage_from_decode_gives_502(ups: Upstreams, mode: str, stream: bool) -> None:
    """D answers 200 with bytes that are not JSON (and, streamed, not an event stream)."""
    ups.decode.behavior.garbage = True
    async with routed(ups) as (url, app, tasks):
        answer = await ask(url, mode, stream=stream)
        await assert_no_leaks(app, tasks, ups.prefill, ups.decode)
    expect_error(answer, 502, "upstream_error")
    assert answer.elapsed < SLACK_S
    assert outcomes(ups.prefill) == ["ok"] and outcomes(ups.decode) == ["failed"]


@pytest.mark.parametrize("mode", MODES)
async def test_stream_cut_inside_an_event_ends_with_an_error(ups: Upstreams, mode: str) -> None:
    """D sends one whole event and half of the next, then closes: the client gets the
    first event, an error and the end of the stream, in time, and nothing leaks. (Whether
    the error event is still readable as an event: the test below.)"""
    async with routed(ups, decode=ups.scripted) as (url, app, tasks):
        answer = await ask(url, mode, stream=True, prompt="half_event")
        await assert_no_leaks(app, tasks, ups.prefill, ups.scripted)
    assert answer.status == 200 and answer.elapsed < SLACK_S
    assert '"text":"t0"' in sse_data(answer.text)[0]
    assert '"type":"upstream_error"' in answer.text
    assert answer.text.endswith("data: [DONE]\n\n")
    assert outcomes(ups.scripted) == ["failed"]


@pytest.mark.parametrize("mode", MODES)
async def test_stream_cut_inside_an_event_keeps_the_error_event_readable(ups: Upstreams, mode: str) -> None:
    async with routed(ups, decode=ups.scripted) as (url, _app, _tasks):
        answer = await ask(url, mode, stream=True, prompt="half_event")
    assert_stream_ends_with_error(answer.text, "upstream_error")


@pytest.mark.parametrize("mode", MODES)
async def test_json_body_cut_in_half_gives_502(ups: Upstreams, mode: str) -> None:
    async with routed(ups, decode=ups.scripted) as (url, app, tasks):
        answer = await ask(url, mode, stream=False, prompt="half_event")
        await assert_no_leaks(app, tasks, ups.prefill, ups.scripted)
    expect_error(answer, 502, "upstream_error")
    assert answer.elapsed < SLACK_S


# --- 4. the client leaves, at every stage ------------------------------------------------


STAGES = [
    pytest.param("prefill", True, id="while_P_computes-sse"),  # JSON: see test_failures.py
    pytest.param("before_first_byte", False, id="before_D_first_byte-json"),
    pytest.param("before_first_byte", True, id="before_D_first_byte-sse"),
    pytest.param("mid_stream", True, id="mid_stream-sse"),
    pytest.param("at_end", True, id="at_end-sse"),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("stage", "stream"), STAGES)
async def test_client_leaving_cancels_both_legs(ups: Upstreams, stage: str, stream: bool, mode: str) -> None:
    p, d = ups.prefill, ups.decode
    if stage == "prefill":
        p.behavior.delay = 30
    elif stage == "before_first_byte":
        d.behavior.delay = 30  # P answers; D takes its time (push: after P's WRITE too)
    else:
        d.behavior.tokens = 50 if stage == "mid_stream" else 4
        d.behavior.token_delay = 0.1 if stage == "mid_stream" else 0.02
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 50, "stream": stream}
    async with routed(ups) as (url, app, tasks):
        client = await RawClient.send(url, body, mode=mode)
        try:
            if stage == "prefill":
                await p.until(lambda seen: len(seen) == 1)
                if mode == "push":
                    await d.until(lambda seen: len(seen) == 1)
            elif stage == "before_first_byte":
                await p.until(lambda seen: len(seen) == 1 and seen[0].outcome == "ok")
                await d.until(lambda seen: len(seen) == 1)
            elif stage == "mid_stream":
                received = await client.read_until(b"\n\n\r\n")  # the first event, whole
                assert received.startswith(b"HTTP/1.1 200") and received.count(b"data: ") == 1
            else:
                received = await client.read_until(b"data: [DONE]\n\n")
                assert received.count(b"data: ") == 5  # four tokens and [DONE]: all of it
        finally:
            client.leave()
        left_at = time.perf_counter()
        await assert_no_leaks(app, tasks, p, d)
        settled = time.perf_counter() - left_at
    assert settled < SLACK_S
    assert outcomes(p) == (["cancelled"] if stage == "prefill" else ["ok"])
    if stage == "prefill" and mode == "pull":
        assert outcomes(d) == []
    else:
        assert outcomes(d) == (["ok"] if stage == "at_end" else ["cancelled"])


# --- 5. a slow client --------------------------------------------------------------------

# Observed: the router applies backpressure. D's writes block once about 7-8 MB are in
# transit (on loopback: the kernel's socket buffers on both hops, the router's 256 KiB read
# buffer before it pauses reading D, and uvicorn's write buffer towards the client); that
# amount does not grow with the length of the answer, and D's leg stays running, blocked,
# for as long as the client dawdles. A fast client takes the same 24 MB in about half a
# second (on a quiet machine), and its D leg is done.
BIG_EVENTS = 384  # of 64 KiB: 24 MiB, about three times what is in transit when D blocks


async def read_slowly(client: RawClient, got: list[float]) -> None:
    """One byte a second, until cancelled."""
    while True:
        await client.read_byte()
        got.append(time.perf_counter())
        await asyncio.sleep(1.0)


async def plateau(written: dict[str, int], rid: str, *, quiet: float, within: float) -> int:
    """Wait (bounded) until D has written nothing for `quiet` seconds; its byte count."""
    deadline = time.monotonic() + within
    last = -1
    while written.get(rid, 0) != last:
        assert time.monotonic() < deadline, f"D kept writing: {written.get(rid)} bytes"
        last = written.get(rid, 0)
        await asyncio.sleep(quiet)
    return last


@pytest.mark.parametrize("mode", MODES)
async def test_slow_client_gets_backpressure_and_holds_up_nobody(ups: Upstreams, mode: str) -> None:
    d = ups.scripted
    total = BIG_EVENTS * (d.big_event_bytes + 200)
    big = {"model": MODEL, "prompt": "big", "max_tokens": BIG_EVENTS, "stream": True}
    # a slow client must not time out D either: test_slow_client_does_not_time_out_...
    async with routed(ups, decode=d, stream_idle=1.0) as (url, app, tasks):
        slow = await RawClient.send(url, big, mode=mode, request_id="slow", receive_buffer=4096)
        got: list[float] = []
        reader = asyncio.create_task(read_slowly(slow, got))
        try:
            blocked_at = await plateau(d.written, "slow", quiet=0.3, within=5)
            assert blocked_at < total / 2  # D blocks: the router does not read it all in

            # Meanwhile others are served at full speed: small answers in both modes at
            # once, then the same big stream for a fast client (one after the other: all
            # here shares one thread, so a 24 MB relay would slow the small ones by itself).
            async with http_client() as others:
                small = await asyncio.wait_for(asyncio.gather(*(
                    ask(url, m, stream=s, request_id=f"other-{m}-{s}", client=others)
                    for m in MODES for s in (False, True))), 5)
                fast = await asyncio.wait_for(ask(url, mode, stream=True, prompt="big", max_tokens=BIG_EVENTS,
                                                  request_id="fast", client=others), 10)
            assert [a.status for a in small] == [200] * 4
            # Tens of milliseconds when the machine is quiet; the bound leaves room for a
            # busy one, and is below what waiting for the slow client would take (it goes on
            # reading, and D stays blocked, after they are done: checked below).
            assert max(a.elapsed for a in small) < SLACK_S, [a.elapsed for a in small]
            assert fast.status == 200 and fast.text.endswith("data: [DONE]\n\n")
            assert [s.outcome for s in d.seen if s.headers.get("x-request-id") == "fast"] == ["ok"]
            assert d.written["fast"] == BIG_EVENTS * len(fast.text.split("\n\n")[0].encode() + b"\n\n")

            # The slow client keeps reading for a few seconds; D stays blocked all along.
            read_by_then = len(got)
            async with asyncio.timeout(8):
                while len(got) < max(4, read_by_then + 1):
                    await asyncio.sleep(0.05)
            slow_leg = next(s for s in d.seen if s.headers.get("x-request-id") == "slow")
            assert slow_leg.outcome == "running"
            assert d.written["slow"] < total / 2
            assert app.state.router.decode.in_flight() == 1
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            slow.leave()
        await assert_no_leaks(app, tasks, ups.prefill, d)
    assert slow_leg.outcome == "cancelled"
    assert len(got) >= 4 and b"HTTP/1.1 200".startswith(bytes(slow.received))  # a byte a second


@pytest.mark.parametrize("mode", MODES)
async def test_slow_client_does_not_time_out_a_healthy_decode(ups: Upstreams, mode: str) -> None:
    d = ups.scripted
    big = {"model": MODEL, "prompt": "big", "max_tokens": BIG_EVENTS, "stream": True}
    async with routed(ups, decode=d, stream_idle=0.5) as (url, _app, _tasks):
        slow = await RawClient.send(url, big, mode=mode, request_id="slow", receive_buffer=4096)
        try:
            for _ in range(4):  # two seconds at a byte every half second: 4 x stream_idle
                await slow.read_byte()
                await asyncio.sleep(0.5)
            assert [s.outcome for s in d.seen] == ["running"]
        finally:
            slow.leave()
