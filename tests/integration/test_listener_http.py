"""The router's listener speaks HTTP/1.1 to clients as uvicorn does, on both of its paths:
the inference routes' own cycle (`proxy.api.cycle`) and uvicorn's for everything else.
Raw sockets send the requests; h11, an HTTP library of its own, reads the answers, so a
framing mistake (a wrong length, a broken chunk) fails the test."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import socket
import sys
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import h11
import pytest

from proxy.api.app import RouterApp, create_app, serving
from proxy.api.cycle import InferenceCycle
from proxy.config import build_config
from tests.conftest import until
from tests.integration.conftest import Pair

BODY = b'{"model": "fake-model", "prompt": "hi", "max_tokens": 2}'
STREAM_BODY = b'{"model": "fake-model", "prompt": "hi", "max_tokens": 3, "stream": true}'
WAIT = 10.0  # seconds any one answer may take here


@contextlib.asynccontextmanager
async def router(pair: Pair, uvicorn_settings: dict[str, Any] | None = None,
                 **extra: Any) -> AsyncIterator[tuple[str, RouterApp, Any]]:
    config = build_config({"prefill": [pair.p_url], "decode": [pair.d_url],
                           "health": {"interval": 0}, "timeouts": {"health": 10.0}, **extra}, {})
    app = create_app(config)
    async with serving(app, name="listener-router", config=config,
                       **(uvicorn_settings or {})) as (url, server):
        yield url, app, server


def post(path: str = "/v1/completions", body: bytes = BODY, *, version: bytes = b"1.1",
         headers: bytes = b"") -> bytes:
    return (b"POST %s HTTP/%s\r\nHost: router\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n%s\r\n%s" % (path.encode(), version, len(body), headers, body))


class Client:
    """A raw client socket whose answers h11 reads. Requests go out as raw bytes (to send
    what h11 would not: pipelined requests, HTTP/1.0); h11 is told of each as if it had
    sent it, so that it reads the answer to it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self.h11 = h11.Connection(h11.CLIENT)
        self.told = 0  # requests h11 was told of whose answers were not read yet

    @classmethod
    async def to(cls, url: str) -> Client:
        parts = urlsplit(url)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (parts.hostname, parts.port))
        return cls(sock)

    async def send(self, data: bytes, *, requests: int = 1) -> None:
        """Send raw bytes that hold `requests` whole requests (0: part of one)."""
        self.told += requests
        await self.loop.sock_sendall(self.sock, data)

    async def _event(self) -> Any:
        while True:
            event = self.h11.next_event()
            if event is not h11.NEED_DATA:
                return event
            async with asyncio.timeout(WAIT):
                data = await self.loop.sock_recv(self.sock, 65536)
            self.h11.receive_data(data)

    async def answer(self) -> tuple[int, dict[bytes, bytes], bytes, list[int]]:
        """The next answer: (status, headers, body, the interim answers' statuses before
        it), its framing checked by h11."""
        assert self.told, "no request was sent"
        self.told -= 1
        if self.h11.our_state is h11.DONE:
            self.h11.start_next_cycle()
        self.h11.send(h11.Request(method="POST", target="/",
                                  headers=[("Host", "router"), ("Content-Length", "0")]))
        self.h11.send(h11.EndOfMessage())
        interim = []
        event = await self._event()
        while isinstance(event, h11.InformationalResponse):
            interim.append(event.status_code)
            event = await self._event()
        assert isinstance(event, h11.Response), event
        headers = {bytes(name): bytes(value) for name, value in event.headers}
        body = b""
        while not isinstance(part := await self._event(), h11.EndOfMessage):
            assert isinstance(part, h11.Data), part
            body += part.data
        return event.status_code, headers, body, interim

    async def closed(self) -> bool:
        """The router closed the connection (a read ends) within WAIT seconds."""
        async with asyncio.timeout(WAIT):
            while data := await self.loop.sock_recv(self.sock, 65536):
                assert not data.strip(), f"bytes after the last answer: {data!r}"
        return True

    def close(self) -> None:
        self.sock.close()


@contextlib.asynccontextmanager
async def client(url: str) -> AsyncIterator[Client]:
    made = await Client.to(url)
    try:
        yield made
    finally:
        made.close()


def served(answer: tuple[int, dict[bytes, bytes], bytes, list[int]]) -> None:
    """A served completion: 200, JSON with a choice (h11 checked its length)."""
    status, headers, body, _ = answer
    assert status == 200, body
    assert headers[b"content-type"].startswith(b"application/json")
    assert json.loads(body)["choices"]


def cycles(server: Any) -> list[Any]:
    """The cycle each open connection of the router's listener serves now."""
    return [connection.cycle for connection in server.server_state.connections]


# The inference routes' own cycle

async def test_an_inference_request_runs_on_the_routers_cycle(pair: Pair) -> None:
    async with router(pair) as (url, app, server), client(url) as c:
        await c.send(post())
        served(await c.answer())
        assert [type(cycle) for cycle in cycles(server)] == [InferenceCycle]
        await c.send(post("/v1/models?x=1", b"", headers=b"X-Other: 1\r\n"))
        status, _, body, _ = await c.answer()  # any other request: uvicorn's cycle
        assert status == 405 and json.loads(body)["error"]["code"] == 405
        assert [type(cycle) for cycle in cycles(server)] != [InferenceCycle]
        await c.send(post())  # and back, on the same connection
        served(await c.answer())
        assert [type(cycle) for cycle in cycles(server)] == [InferenceCycle]
    assert app.in_flight == 0


@pytest.mark.parametrize(("version", "headers", "ours"), [
    (b"1.1", b"", True),
    (b"1.1", b"Connection: keep-alive\r\n", True),
    (b"1.1", b"Proxy-Connection: keep-alive\r\n", True),
    (b"1.0", b"Connection: keep-alive\r\n", False),
    (b"1.0", b"Proxy-Connection: keep-alive\r\n", False),
], ids=["1.1", "1.1 keep-alive", "1.1 proxy keep-alive", "1.0 keep-alive",
        "1.0 proxy keep-alive"])
async def test_only_http_1_1_runs_on_the_routers_cycle(
    pair: Pair, version: bytes, headers: bytes, ours: bool
) -> None:
    # HTTP/1.0 asking to be kept alive goes to uvicorn's cycle as HTTP/1.0 without it
    # does (the close test below), which closes the connection after the answer; the
    # router's would keep it open. The reader asks the parser for the version only when
    # a request names a Connection header or is not kept alive.
    async with router(pair) as (url, _, server), client(url) as c:
        await c.send(post(version=version, headers=headers))
        served(await c.answer())
        if ours:
            assert [type(cycle) for cycle in cycles(server)] == [InferenceCycle]
        else:  # (closing, or closed already)
            assert not any(isinstance(cycle, InferenceCycle) for cycle in cycles(server))
            assert await c.closed()


@pytest.mark.parametrize("settings", [{}, {"proxy_headers": False}],
                         ids=["as configured", "without X-Forwarded-For"])
async def test_with_uvicorns_access_log_on_uvicorns_cycle_serves_them(
    pair: Pair, settings: dict[str, Any]
) -> None:
    # The router's access_log turns on uvicorn's, and its X-Forwarded-For middleware,
    # which hides the router's app; without that middleware, the log alone decides.
    async with router(pair, settings, access_log=True) as (url, _, server), client(url) as c:
        await c.send(post())
        served(await c.answer())
        [cycle] = cycles(server)
        assert not isinstance(cycle, InferenceCycle) and cycle.response_complete


@pytest.mark.parametrize("access_log", [False, True], ids=["the router's cycle", "uvicorn's"])
async def test_both_paths_give_the_same_answers(pair: Pair, access_log: bool) -> None:
    """The router's cycle writes a flow's answer itself; uvicorn's cycle gets the same
    answer as ASGI messages (`relay.AsgiAnswer`). A whole answer, a stream, an error
    before the flow and an error with a header of its own come out alike."""
    keys = {"auth": {"client_api_keys": ["k1"]}}
    auth = b"Authorization: Bearer k1\r\n"
    async with router(pair, access_log=access_log, **keys) as (url, _, server), \
            client(url) as c:
        await c.send(post(headers=auth))
        status, headers, body, _ = whole = await c.answer()
        served(whole)
        assert headers[b"x-kv-transfer-mode"] == b"pull" and headers[b"x-request-id"]
        assert headers[b"content-length"] == b"%d" % len(body)
        [cycle] = cycles(server)
        assert isinstance(cycle, InferenceCycle) is not access_log
        await c.send(post(body=STREAM_BODY, headers=auth))
        status, headers, body, _ = await c.answer()
        assert status == 200 and headers[b"content-type"].startswith(b"text/event-stream")
        assert headers[b"transfer-encoding"] == b"chunked" and b"content-length" not in headers
        assert body.endswith(b"data: [DONE]\n\n")
        await c.send(post(body=b"{not json", headers=auth))
        status, headers, body, _ = await c.answer()
        assert status == 400 and headers[b"content-type"] == b"application/json"
        assert json.loads(body)["error"]["message"].startswith("request body is not valid JSON")
        await c.send(post())  # no key
        status, headers, body, _ = await c.answer()
        assert status == 401 and headers[b"www-authenticate"] == b"Bearer"
        assert json.loads(body)["error"]["type"] == "authentication_error"


async def test_keep_alive_and_pipelined_requests_are_answered_in_order(pair: Pair) -> None:
    async with router(pair) as (url, app, _), client(url) as c:
        for _ in range(3):
            await c.send(post())
            served(await c.answer())
        ids = [b"first", b"second", b"third"]
        # One write, three requests (the middle one through uvicorn's cycle: a query
        # string), answered one after another in the order asked.
        await c.send(b"".join(post("/v1/completions" + ("?q=1" if i == b"second" else ""),
                                   headers=b"X-Request-Id: %s\r\n" % i) for i in ids), requests=3)
        answers = [await c.answer() for _ in ids]
        assert [headers[b"x-request-id"] for _, headers, _, _ in answers] == ids
        for answer in answers:
            served(answer)
    assert app.in_flight == 0 and len(pair.decode.seen) == 6


async def test_a_connections_requests_are_served_by_one_task_that_ends_with_it(
    pair: Pair,
) -> None:
    async with router(pair) as (url, app, server):
        c = await Client.to(url)
        tasks = []
        for body in (BODY, STREAM_BODY, BODY):
            await c.send(post(body=body))
            status, _, answer, _ = await c.answer()
            assert status == 200 and answer.rstrip().endswith(b"}" if body is BODY else b"[DONE]")
            await until(lambda: app.in_flight == 0, "the request done")
            tasks.append(set(server.server_state.tasks))
        assert len(tasks[0]) == 1 and tasks[0] == tasks[1] == tasks[2], tasks
        c.close()
        await until(lambda: not server.server_state.tasks and not server.server_state.connections,
                    "the connection's task ended with it")


async def test_a_cancelled_connection_task_ends_and_the_next_request_gets_a_new_one(
    pair: Pair,
) -> None:
    async with router(pair) as (url, app, server), client(url) as c:
        await c.send(post())
        served(await c.answer())
        await until(lambda: app.in_flight == 0, "the request done")
        [first] = server.server_state.tasks
        first.cancel()  # as a forced shutdown would, while it waits for the next request
        await until(lambda: first.done() and not server.server_state.tasks, "the task ended")
        await c.send(post())
        served(await c.answer())
        [second] = server.server_state.tasks
        assert second is not first


class ExceptionLeftBehind(logging.Handler):
    """An access-log handler that records the exception state each request's line is
    written under and, on the first request's, leaves an exception as the one being
    handled: as a compiled coroutine can (`proxy.task_scope`), in the exception state of
    the interpreted coroutine nearest on the stack (CPython's `PyErr_SetExcInfo`, which
    takes a reference to each of its arguments)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seen: list[BaseException | None] = []
        self.left: BaseException | None = None

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append(sys.exc_info()[1])
        if self.left is None:
            self.left = RuntimeError("left behind by the first request")
            state = (RuntimeError, self.left, None)
            for item in state:
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(item))
            ctypes.pythonapi.PyErr_SetExcInfo(*(ctypes.py_object(item) for item in state))


@pytest.mark.parametrize("pipelined", [False, True])
async def test_an_exception_a_request_leaves_behind_does_not_reach_the_next(
    pair: Pair, pipelined: bool,
) -> None:
    """The connection's task ends with a request that left an exception state behind;
    the next request, sent after the answer or pipelined behind it, gets a new task and
    starts with none. (Compiled, nothing else stands between them; interpreted, each
    coroutine has a state of its own and the test passes either way.)"""
    access = logging.getLogger("pdproxy.access")
    handler = ExceptionLeftBehind()
    level = access.level
    access.addHandler(handler)
    access.setLevel(logging.INFO)
    try:
        async with router(pair) as (url, app, server), client(url) as c:
            if pipelined:
                await c.send(post() + post(), requests=2)
                served(await c.answer())
            else:
                await c.send(post())
                served(await c.answer())
                await until(lambda: len(handler.seen) == 1, "the first request's log line")
                await c.send(post())
            served(await c.answer())
            await until(lambda: len(handler.seen) == 2 and app.in_flight == 0,
                        "the second request's log line")
            assert len(server.server_state.tasks) == 1  # the second request's, waiting
    finally:
        access.removeHandler(handler)
        access.setLevel(level)
    assert handler.left is not None and handler.seen == [None, None], handler.seen


async def test_a_streamed_answer_is_chunked_and_ends(pair: Pair) -> None:
    async with router(pair) as (url, _, _), client(url) as c:
        for _ in range(2):  # and the connection is reused after it
            await c.send(post(body=STREAM_BODY))
            status, headers, body, _ = await c.answer()
            assert status == 200 and headers[b"transfer-encoding"] == b"chunked"
            assert headers[b"content-type"].startswith(b"text/event-stream")
            assert body.endswith(b"data: [DONE]\n\n") and body.count(b"\n\n") >= 2


async def test_connection_close_and_http_1_0_close_after_the_answer(pair: Pair) -> None:
    async with router(pair) as (url, app, _):
        async with client(url) as c:
            await c.send(post(headers=b"Connection: close\r\n"))
            answer = await c.answer()
            served(answer)
            assert answer[1][b"connection"] == b"close"
            assert await c.closed()
        async with client(url) as c:  # HTTP/1.0: uvicorn's cycle, which closes too
            await c.send(post(version=b"1.0"))
            served(await c.answer())
            assert await c.closed()
    assert app.in_flight == 0


async def test_expect_100_continue_gets_its_interim_answer(pair: Pair) -> None:
    async with router(pair) as (url, _, _), client(url) as c:
        head, body = post(headers=b"Expect: 100-continue\r\n").split(b"\r\n\r\n", 1)
        await c.send(head + b"\r\n\r\n", requests=1)
        interim = b"HTTP/1.1 100 Continue\r\n\r\n"  # before the body: it is asked for
        got = b""
        while len(got) < len(interim):
            async with asyncio.timeout(WAIT):
                got += await c.loop.sock_recv(c.sock, len(interim) - len(got))
        assert got == interim
        await c.send(body, requests=0)
        status, _, _, _ = await c.answer()
        assert status == 200


async def test_a_body_in_chunks_and_pieces_is_read_whole(pair: Pair) -> None:
    async with router(pair) as (url, _, _), client(url) as c:
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: router\r\n"
                b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunks = [BODY[:10], BODY[10:30], BODY[30:]]
        await c.send(head, requests=1)
        for chunk in chunks:  # each in its own write, the body's end last
            await c.send(b"%x\r\n%s\r\n" % (len(chunk), chunk), requests=0)
            await asyncio.sleep(0.01)
        await c.send(b"0\r\n\r\n", requests=0)
        served(await c.answer())
    assert [s.body["prompt"] for s in pair.decode.seen] == ["hi"]


async def test_a_client_leaving_mid_body_leaves_nothing_behind(pair: Pair) -> None:
    async with router(pair) as (url, app, server):
        c = await Client.to(url)
        request = post()
        await c.send(request[:-10], requests=0)
        await until(lambda: app.in_flight == 1, "the request admitted")
        c.close()
        await until(lambda: app.in_flight == 0 and not server.server_state.connections
                    and not server.server_state.tasks, "the request, its task and connection gone")
    assert not pair.prefill.seen and not pair.decode.seen


async def test_a_client_leaving_after_a_large_body_cancels_its_request(pair: Pair) -> None:
    # Over 64 KiB, uvicorn's protocol pauses reading while the body comes in; it must read
    # again afterwards, or the client's leaving would go unseen until D answered.
    pair.decode.behavior.delay = 60.0
    body = b'{"model": "fake-model", "prompt": "%s", "max_tokens": 2}' % (b"x " * 100_000)
    async with router(pair) as (url, app, server):
        c = await Client.to(url)
        await c.send(post(body=body))
        await until(lambda: len(pair.decode.seen) == 1, "D asked", timeout=WAIT)
        c.close()
        await until(lambda: app.in_flight == 0 and not server.server_state.tasks,
                    "the request cancelled", timeout=WAIT)
        await until(lambda: pair.decode.seen[0].outcome == "cancelled", "D's leg cancelled",
                    timeout=WAIT)


async def test_an_early_error_answer_keeps_the_connection_usable(pair: Pair) -> None:
    async with router(pair, auth={"client_api_keys": ["secret"]}) as (url, app, _), client(url) as c:
        await c.send(post())  # no key: refused before its body is read
        status, headers, body, _ = await c.answer()
        assert status == 401 and json.loads(body)["error"]["code"] == 401
        await c.send(post(headers=b"Authorization: Bearer secret\r\n"))
        served(await c.answer())
        await c.send(post(body=b"x" * 100, headers=b"Authorization: Bearer secret\r\n"))
        status, _, body, _ = await c.answer()
        assert status == 400 and json.loads(body)["error"]["code"] == 400
    assert app.in_flight == 0


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
async def test_a_body_over_the_limit_is_413(pair: Pair, declared: bool) -> None:
    async with router(pair, limits={"max_body_bytes": 1024}) as (url, app, _), client(url) as c:
        body = b'{"prompt": "%s"}' % (b"x" * 2000)
        if declared:
            await c.send(post(body=body))
        else:
            await c.send(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked"
                         b"\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
        status, _, answer, _ = await c.answer()
        assert status == 413 and json.loads(answer)["error"]["code"] == 413
    assert app.in_flight == 0 and not pair.decode.seen
