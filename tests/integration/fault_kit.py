"""Helpers for the fault suite (`test_fault_suite.py`): upstreams that can be killed,
scripted D servers that break an answer in ways the fake cannot, a raw-socket client
that leaves or reads at the moment a test chooses, and the leak check run after each
fault."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any, Protocol

import msgspec
from aiohttp import web

from testbed.fake_vllm import MODEL, Fabric, FakeVLLM, Seen

PREFILL_COORDS = {"engine_id": "engine-p0", "side_channel_host": "127.0.0.1", "side_channel_port": 5601}
# Short limits, so that every timeout fault ends within a second or two.
TIMEOUTS = {"connect": 1.0, "prefill": 1.0, "first_token": 1.0, "stream_idle": 1.0}
# What a busy 2-core machine may add to a bound. The faults themselves last 30 s or
# forever, so ending within the limit plus this still shows the router acted.
SLACK_S = 2.0


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    """Serve `app` on a free port. Its runner's cleanup is a kill: running handlers get
    a twentieth of a second, then are cancelled and their connections closed."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=0.05)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def router_config(p_url: str, d_url: str, **extra: Any) -> dict[str, Any]:
    """One P (coordinates configured: no probe) and one D; the mode comes per request."""
    return {
        "prefill": [{"url": p_url, **PREFILL_COORDS}],
        "decode": [d_url],
        "models": [MODEL],  # no /v1/models lookups in the way
        "timeouts": dict(TIMEOUTS),
        "push_recovery": "error",  # P's failures reach the client (recovery: test_failures)
        **extra,
    }


class Recorder(Protocol):
    seen: list[Seen]


# --- scripted D servers ----------------------------------------------------------------


def _event(rid: str, text: str) -> bytes:
    chunk = {"id": f"cmpl-{rid}", "object": "text_completion", "model": MODEL,
             "choices": [{"index": 0, "text": text, "finish_reason": None}]}
    return b"data: " + msgspec.json.encode(chunk) + b"\n\n"


class ScriptedDecode:
    """A D that answers pull and push alike (it does not wait for a KV write) with one
    of these scripts, chosen per request by the prompt:

    - "half_event": streamed, one whole SSE event, then the first half of the next
      event's bytes, then the connection closes (a cut inside an event, not between two);
      not streamed, half of a JSON body announced with its full Content-Length.
    - "big": `max_tokens` events of `big_event_bytes` each, as fast as the reader takes
      them; `written[request id]` counts the bytes written so far.
    - anything else: a short, correct answer (4 events, or one JSON body)."""

    def __init__(self, big_event_bytes: int = 64 * 1024) -> None:
        self.big_event_bytes = big_event_bytes
        self.seen: list[Seen] = []
        self.written: dict[str, int] = {}
        self.app = web.Application()
        self.app.router.add_post("/v1/completions", self._infer)

    async def _infer(self, request: web.Request) -> web.StreamResponse:
        body = msgspec.json.decode(await request.read())
        headers = {k.lower(): v for k, v in request.headers.items()}
        seen = Seen(request.path, body, headers, time.perf_counter())
        self.seen.append(seen)
        try:
            response = await self._answer(request, body, seen)
            if seen.outcome == "running":
                seen.outcome = "ok"
            return response
        except (asyncio.CancelledError, ConnectionResetError, OSError):
            seen.outcome = "cancelled"
            raise
        finally:
            seen.finished = time.perf_counter()

    async def _answer(self, request: web.Request, body: dict[str, Any], seen: Seen) -> web.StreamResponse:
        rid = request.headers.get("X-Request-Id", "none")
        script = body.get("prompt")
        stream = bool(body.get("stream"))
        if script == "half_event" and not stream:
            whole = msgspec.json.encode({"id": f"cmpl-{rid}", "object": "text_completion",
                                         "model": MODEL, "choices": [{"index": 0, "text": "t0 t1",
                                                                      "finish_reason": "length"}]})
            response = web.StreamResponse(headers={"Content-Type": "application/json",
                                                   "Content-Length": str(len(whole))})
            await response.prepare(request)
            await response.write(whole[: len(whole) // 2])
            return self._cut(request, seen, response)
        if not stream:
            return web.json_response({"id": f"cmpl-{rid}", "object": "text_completion", "model": MODEL,
                                      "choices": [{"index": 0, "text": "t0 t1 t2 t3",
                                                   "finish_reason": "length"}]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if script == "half_event":
            await response.write(_event(rid, "t0"))
            await asyncio.sleep(0.05)  # the whole event reaches the client on its own
            second = _event(rid, "t1")
            await response.write(second[: len(second) // 2])
            await asyncio.sleep(0.05)  # and so does the half
            return self._cut(request, seen, response)
        if script == "big":
            event = _event(rid, "x" * self.big_event_bytes)
            self.written[rid] = 0
            for _ in range(int(body.get("max_tokens") or 1)):
                await response.write(event)  # blocks while the router does not read
                self.written[rid] += len(event)
        else:
            for i in range(4):
                await response.write(_event(rid, f"t{i}"))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    @staticmethod
    def _cut(request: web.Request, seen: Seen, response: web.StreamResponse) -> web.StreamResponse:
        seen.outcome = "failed"
        assert request.transport is not None
        request.transport.close()
        return response


class Upstreams:
    """A fake P and a fake D sharing a fabric (push really waits for P), plus a scripted
    D; each on its own killable runner."""

    def __init__(self) -> None:
        fabric = Fabric()
        self.prefill = FakeVLLM("prefill", engine_id="engine-p0", side_channel_port=5601, fabric=fabric)
        self.decode = FakeVLLM("decode", engine_id="engine-d0", fabric=fabric)
        self.scripted = ScriptedDecode()
        self.runners: dict[int, web.AppRunner] = {}
        self.urls: dict[int, str] = {}

    async def start(self) -> None:
        for server in (self.prefill, self.decode, self.scripted):
            self.runners[id(server)], self.urls[id(server)] = await serve(server.app)

    def url(self, server: object) -> str:
        return self.urls[id(server)]

    async def kill(self, server: object) -> None:
        await self.runners[id(server)].cleanup()

    async def close(self) -> None:
        for runner in self.runners.values():
            await runner.cleanup()  # a second cleanup of a killed one is harmless


# --- leaks -----------------------------------------------------------------------------


def live_tasks() -> list[asyncio.Task[Any]]:
    """The loop's unfinished tasks, less the upstream servers' idle keep-alive connection
    loops (a connection the router keeps in its pool is reuse, not a leak; a request
    still handled upstream shows up in `seen` and as its own handler task)."""
    return [t for t in asyncio.all_tasks() if not t.done() and _name(t) != "RequestHandler.start"]


def _name(task: asyncio.Task[Any]) -> str:
    return str(getattr(task.get_coro(), "__qualname__", task.get_name()))


async def assert_no_leaks(app: Any, tasks_before: int, *servers: Recorder, within: float = 5.0) -> None:
    """Within `within` seconds: nothing in flight on either cluster, no request still
    running on an upstream, and no more tasks than before the request."""
    router = app.state.router
    deadline = time.monotonic() + within
    while True:
        in_flight = (router.prefill.in_flight(), router.decode.in_flight())
        running = [s for server in servers for s in server.seen if s.outcome == "running"]
        tasks = live_tasks()
        if in_flight == (0, 0) and not running and len(tasks) <= tasks_before:
            return
        if time.monotonic() > deadline:
            raise AssertionError(
                f"leaked after {within} s: in flight (P, D) {in_flight}, running upstream "
                f"{[s.path for s in running]}, tasks {len(tasks)} > {tasks_before}: "
                f"{sorted(_name(t) for t in tasks)}")
        await asyncio.sleep(0.02)


# --- SSE -------------------------------------------------------------------------------


def sse_data(text: str) -> list[str]:
    """Each event's data, as an SSE client reads it: events end at a blank line, and an
    event's `data:` lines are joined with newlines."""
    events = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        lines = [line[5:].removeprefix(" ") for line in block.split("\n") if line.startswith("data:")]
        if lines:
            events.append("\n".join(lines))
    return events


def assert_stream_ends_with_error(text: str, error_type: str) -> dict[str, Any]:
    """A started stream that failed: every event is whole JSON, and it ends with an
    OpenAI-shaped error event and [DONE]."""
    events = sse_data(text)
    assert text.endswith("\n\n") and events[-1] == "[DONE]", text[-300:]
    decoded = [msgspec.json.decode(e) for e in events[:-1]]  # each one parses on its own
    error: dict[str, Any] = decoded[-1]["error"]
    assert error["type"] == error_type and error["message"], error
    return error


def assert_error_response(status: int, content_type: str, body: bytes, expected: int,
                          error_type: str | None = None) -> dict[str, Any]:
    assert status == expected, body[:300]
    assert content_type.startswith("application/json"), content_type
    error: dict[str, Any] = msgspec.json.decode(body)["error"]
    assert isinstance(error["message"], str) and error["message"]
    if error_type is not None:
        assert error["type"] == error_type, error
    return error


# --- a raw client -----------------------------------------------------------------------


class RawClient:
    """One HTTP/1.1 request on a bare non-blocking socket: the test decides when bytes
    are read (one at a time, if it likes) and when the client goes away."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.received = bytearray()

    @classmethod
    async def send(cls, base_url: str, body: dict[str, Any], *, mode: str, request_id: str = "raw",
                   receive_buffer: int | None = None) -> RawClient:
        host, port = base_url.removeprefix("http://").split(":")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        if receive_buffer is not None:  # before connecting: it sets the TCP window
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(5):
            await loop.sock_connect(sock, (host, int(port)))
            payload = msgspec.json.encode(body)
            head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
                    f"X-KV-Transfer-Mode: {mode}\r\nX-Request-Id: {request_id}\r\n\r\n").encode()
            await loop.sock_sendall(sock, head + payload)
        return cls(sock)

    async def read_until(self, marker: bytes, timeout: float = 5.0) -> bytes:
        """Read (as it comes) until `marker` was received; return all received so far."""
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(timeout):
            while marker not in self.received:
                data = await loop.sock_recv(self.sock, 65536)
                if not data:
                    raise AssertionError(f"closed before {marker!r}: {bytes(self.received)[-300:]!r}")
                self.received += data
        return bytes(self.received)

    async def read_byte(self) -> bytes:
        data = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(self.sock, 1), 5)
        self.received += data
        return data

    def leave(self) -> None:
        self.sock.close()
