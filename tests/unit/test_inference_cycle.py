"""The inference cycle frames the router's answers (whole with their length, streams
chunked, refusing a header value that could split them), sends a head with the
answer's first body bytes in one write, and reads a body that is still coming; a client
connection lost before a flow asks about it is told at once."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from proxy.api.cycle import InferenceCycle
from proxy.errors import InvalidRequest, PayloadTooLarge
from proxy.flow.relay import ClientConnection
from proxy.protocol import Route
from tests.conftest import until


class Transport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


class Flow:
    """uvicorn's FlowControl, as the cycle uses it: reading resumed only when paused."""

    write_paused = False
    read_paused = False
    reading_resumed = 0

    def pause_reading(self) -> None:
        self.read_paused = True

    def resume_reading(self) -> None:
        self.read_paused = False
        self.reading_resumed += 1


class ServerState:
    default_headers = [(b"server", b"test")]


class Protocol:
    """What the cycle is given of the listener's protocol."""

    def __init__(self) -> None:
        self.transport = Transport()
        self.flow = Flow()
        self.server_state = ServerState()
        self.answered = 0

    def on_response_complete(self) -> None:
        self.answered += 1

    def cycle(self, serve: Callable[[InferenceCycle], Awaitable[None]], route: Route,
              headers: list[tuple[bytes, bytes]], *, keep_alive: bool = True,
              expect_100_continue: bool = False) -> InferenceCycle:
        return InferenceCycle(route, headers, transport=self.transport, flow=self.flow,
                              server_state=self.server_state, extensions={},
                              on_response=self.on_response_complete, keep_alive=keep_alive,
                              expect_100_continue=expect_100_continue, serve=serve)


async def _serve_nothing(_: InferenceCycle) -> None:
    pass


def cycle(headers: list[tuple[bytes, bytes]] | None = None, *, keep_alive: bool = True,
          expect_100_continue: bool = False) -> tuple[InferenceCycle, Protocol]:
    protocol = Protocol()
    made = protocol.cycle(_serve_nothing, Route.COMPLETIONS, headers or [],
                          keep_alive=keep_alive, expect_100_continue=expect_100_continue)
    return made, protocol


async def test_a_whole_answer_goes_out_in_one_write() -> None:
    made, protocol = cycle()
    await made.whole(200, "application/json", [(b"x-request-id", b"r1")], b"{}")
    assert protocol.transport.writes == [
        b"HTTP/1.1 200 OK\r\nserver: test\r\ncontent-type: application/json\r\n"
        b"content-length: 2\r\nx-request-id: r1\r\n\r\n{}"]
    assert made.response_complete and protocol.answered == 1 and not protocol.transport.closed
    with pytest.raises(RuntimeError, match="complete already"):
        await made.whole(200, "application/json", [], b"{}")


async def test_a_stream_is_chunked_and_its_head_goes_with_the_first_event() -> None:
    made, protocol = cycle()
    await made.start(200, "text/event-stream", [])
    assert protocol.transport.writes == []  # the head waits for the first event
    await made.write(b"data: 1\n\n")
    await made.write(b"")
    await made.end(b"data: [DONE]\n\n")
    head, *rest = protocol.transport.writes
    assert head.startswith(b"HTTP/1.1 200 OK\r\nserver: test\r\ncontent-type: text/event-stream\r\n")
    assert head.endswith(b"transfer-encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n")
    assert rest == [b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"]  # nothing sent for an empty part
    assert protocol.answered == 1
    made, protocol = cycle()
    await made.start(200, "text/event-stream", [])
    await made.end(b"")  # a stream with no event: its head and its end, in one write
    assert protocol.transport.writes[0].endswith(b"chunked\r\n\r\n0\r\n\r\n")


async def test_without_keep_alive_the_answer_says_so_and_closes() -> None:
    made, protocol = cycle(keep_alive=False)
    await made.whole(200, "application/json", [], b"")
    assert b"connection: close\r\n" in protocol.transport.writes[0]
    assert protocol.transport.closed and protocol.answered == 1


async def test_a_header_that_could_split_the_answer_is_refused() -> None:
    made, protocol = cycle()
    with pytest.raises(RuntimeError, match="Invalid HTTP header"):
        await made.whole(200, "application/json", [(b"x-request-id", b"a\r\nset-cookie: x")],
                         b"{}")
    with pytest.raises(RuntimeError, match="Invalid HTTP header"):
        await made.start(200, "text/event-stream\nset-cookie: x", [])  # an upstream's
    with pytest.raises(RuntimeError, match="Invalid HTTP header"):
        await made.start(200, "text/event-stream\x00", [])
    assert protocol.transport.writes == [] and not made.response_started


async def test_nothing_is_sent_to_a_client_gone() -> None:
    made, protocol = cycle()
    made.disconnected = True
    await made.whole(200, "application/json", [], b"x")
    assert protocol.transport.writes == [] and protocol.answered == 0


def waiting(made: InferenceCycle) -> bool:
    """The cycle's body reader waits for more (its arrival has a waiter not woken)."""
    waiter = made.message_event._waiter
    return waiter is not None and not waiter.done()


async def test_a_body_still_coming_is_waited_for() -> None:
    made, protocol = cycle([(b"content-length", b"4")], expect_100_continue=True)
    protocol.flow.pause_reading()  # as over the reader's high water
    reading = asyncio.ensure_future(made.read_body(10))
    await until(lambda: protocol.flow.reading_resumed == 1, "the reader waiting")
    assert protocol.transport.writes == [b"HTTP/1.1 100 Continue\r\n\r\n"]
    protocol.flow.pause_reading()
    made.body += b"ab"
    made.message_event.set()
    await until(lambda: protocol.flow.reading_resumed == 2, "the reader waiting again")
    assert not reading.done()
    made.body += b"c"
    made.message_event.set()  # reading was not paused: nothing to resume
    await until(lambda: waiting(made), "the reader waiting once more")
    protocol.flow.pause_reading()
    made.body += b"d"
    made.more_body = False
    made.message_event.set()
    assert await reading == b"abcd"
    # reading resumes once the body is in (so a client leaving is seen), and the cycle
    # keeps no copy of the body
    assert protocol.flow.reading_resumed == 3 and not protocol.flow.read_paused
    assert made.body == b""


async def test_a_body_over_the_limit_or_cut_short_is_refused() -> None:
    made, protocol = cycle([(b"content-length", b"100")])
    with pytest.raises(PayloadTooLarge):
        await made.read_body(10)  # by its Content-Length, before a byte is read
    made, _ = cycle()
    made.body += b"x" * 11
    with pytest.raises(PayloadTooLarge):
        await made.read_body(10)
    made, protocol = cycle()
    protocol.flow.pause_reading()
    reading = asyncio.ensure_future(made.read_body(10))
    await until(lambda: protocol.flow.reading_resumed == 1, "the reader waiting")
    made.disconnected = True
    made.message_event.set()
    with pytest.raises(InvalidRequest, match="left"):
        await reading


@pytest.mark.parametrize("started", [False, True], ids=["before its head", "after its head"])
async def test_an_app_that_fails_before_a_byte_of_its_answer_gets_a_500(started: bool) -> None:
    protocol = Protocol()

    async def serve(made: InferenceCycle) -> None:
        if started:  # a head not sent yet (it waits for the body) can still be a 500
            await made.start(200, "text/event-stream", [])
        raise ValueError("boom")

    await protocol.cycle(serve, Route.CHAT, []).run_asgi(None)
    [answer] = protocol.transport.writes
    assert answer.startswith(b"HTTP/1.1 500 ") and answer.endswith(b"\r\n\r\nInternal Server Error")
    assert protocol.transport.closed


async def test_an_app_that_fails_mid_answer_closes_the_connection() -> None:
    protocol = Protocol()

    async def serve(made: InferenceCycle) -> None:
        await made.start(200, "text/event-stream", [])
        await made.write(b"data: 1\n\n")
        raise ValueError("boom")

    await protocol.cycle(serve, Route.CHAT, []).run_asgi(None)
    assert len(protocol.transport.writes) == 1 and b" 200 " in protocol.transport.writes[0]
    assert protocol.transport.closed and protocol.answered == 0


def test_a_connection_lost_before_the_flow_asks_is_told_at_once() -> None:
    connection = ClientConnection()
    told: list[str] = []
    connection.on_lost(lambda: told.append("first"))
    connection.on_lost(None)  # that request ended
    connection.lost()
    assert told == []
    connection.on_lost(lambda: told.append("late"))  # the next flow, after the loss
    assert told == ["late"]
