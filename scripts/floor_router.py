"""The floor: the least CPU a Python router on uvloop and httptools can spend on a pull.

Not a router to run: a yardstick for `scripts.bench overhead --compare-cmd`. It does what
every pull must do and nothing else, in the cheapest shape Python allows (callbacks on
protocols, no task, coroutine or future per request, no limits, metrics, logs, errors or
retries):

- parse the client's request (httptools) and decode its JSON body (msgspec);
- send P the body with max_tokens=1 and kv_transfer_params, over a kept-alive connection;
- decode P's answer for its kv_transfer_params and send D the client's body with them;
- relay D's answer to the client: whole with its length, or a stream chunk by chunk.

One P and one D, HTTP/1.1 only, every request a pull. What `pd-proxy` spends over this
is the price of its features; what this spends is the price of Python's event loop, the
parsers and the system calls, which no change inside a Python router removes.

`--tasks` runs each request as a coroutine in a task of its own, awaiting a future per
upstream answer (as `pd-proxy` does), instead of as callbacks: the price of asyncio's
tasks on this path.

    python -m scripts.floor_router --prefill http://127.0.0.1:8100 \
        --decode http://127.0.0.1:8200 --port 8000
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import httptools
import msgspec
import uvloop

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


class Upstream(asyncio.Protocol):
    """A kept-alive connection to P or D: one request at a time, its answer's body parts
    handed to `on_part` and its end to `on_end`."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.on_part: Callable[[bytes], None] = _drop
        self.on_end: Callable[[int], None] = _drop

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self in self.pool.idle:
            self.pool.idle.remove(self)

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        self.on_part(body)

    def on_message_complete(self) -> None:
        status = self.parser.get_status_code()
        on_end, self.on_part, self.on_end = self.on_end, _drop, _drop
        self.pool.idle.append(self)
        on_end(status)


class Pool:
    """Kept-alive connections to one server; a request waits for a new one only when none
    is idle."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.head = (b"POST %%b HTTP/1.1\r\nhost: %b:%d\r\ncontent-type: application/json\r\n"
                     b"content-length: %%d\r\n\r\n" % (self.host.encode(), self.port))
        self.idle: list[Upstream] = []

    def send(self, path: bytes, body: bytes, on_part: Callable[[bytes], None],
             on_end: Callable[[int], None]) -> None:
        data = self.head % (path, len(body)) + body
        if self.idle:
            self._start(self.idle.pop(), data, on_part, on_end)
            return
        loop = asyncio.get_running_loop()
        task = loop.create_task(loop.create_connection(lambda: Upstream(self), self.host, self.port))
        task.add_done_callback(lambda t: self._start(t.result()[1], data, on_part, on_end))

    @staticmethod
    def _start(conn: Upstream, data: bytes, on_part: Callable[[bytes], None],
               on_end: Callable[[int], None]) -> None:
        conn.on_part, conn.on_end = on_part, on_end
        assert conn.transport is not None
        conn.transport.write(data)


class Client(asyncio.Protocol):
    """One client connection: each request is a pull, P then D."""

    def __init__(self, p: Pool, d: Pool, tasks: bool) -> None:
        self.p, self.d = p, d
        self.tasks = tasks
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_begin(self) -> None:
        self.url = b""

    def on_url(self, url: bytes) -> None:
        self.url += url  # it may come in pieces

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        request = _decode(b"".join(self.body))
        self.body = []
        if self.tasks:
            asyncio.get_running_loop().create_task(pull_in_a_task(self, request))
        else:
            Pull(self, request).start()

    def write(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)


class Pull:
    """One request's pull: P's answer, then D's relayed (`start`: as callbacks)."""

    __slots__ = ("client", "request", "p_answer", "stream", "d_body", "started")

    def __init__(self, client: Client, request: dict[str, Any]) -> None:
        self.client = client
        self.request = request
        self.stream = bool(request.get("stream"))
        self.p_answer: list[bytes] = []
        self.d_body: list[bytes] = []
        self.started = False

    def start(self) -> None:
        self.client.p.send(self.client.url, self.prefill_body(), self.p_answer.append,
                           self._p_done)

    def prefill_body(self) -> bytes:
        body = dict(self.request, max_tokens=1, stream=False,
                    kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
        body.pop("stream_options", None)
        return _encode(body)

    def decode_body(self) -> bytes:
        answer = _decode(b"".join(self.p_answer))
        return _encode(dict(self.request, kv_transfer_params=answer.get("kv_transfer_params")))

    def on_d_part(self) -> Callable[[bytes], None]:
        return self._d_part if self.stream else self.d_body.append

    def _p_done(self, status: int) -> None:
        self.client.d.send(self.client.url, self.decode_body(), self.on_d_part(), self.d_done)

    def _d_part(self, part: bytes) -> None:
        """A streamed part, relayed as it comes (its head with the first; 200 whatever D
        said, as D's status comes with its head)."""
        head = b"" if self.started else (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                         b"transfer-encoding: chunked\r\n\r\n")
        self.started = True
        self.client.write(b"%b%x\r\n%b\r\n" % (head, len(part), part) if part else head)

    def d_done(self, status: int) -> None:
        if self.stream:
            if not self.started:
                self._d_part(b"")
            self.client.write(b"0\r\n\r\n")
            return
        body = b"".join(self.d_body)
        self.client.write(b"HTTP/1.1 %d OK\r\ncontent-type: application/json\r\n"
                          b"content-length: %d\r\n\r\n%b" % (status, len(body), body))


async def pull_in_a_task(client: Client, request: dict[str, Any]) -> None:
    """`Pull` as a coroutine: the same work, each upstream answer's end awaited (a stream's
    parts are still relayed as they come)."""
    pull = Pull(client, request)
    loop = asyncio.get_running_loop()
    p_done: asyncio.Future[int] = loop.create_future()
    client.p.send(client.url, pull.prefill_body(), pull.p_answer.append, p_done.set_result)
    await p_done
    d_done: asyncio.Future[int] = loop.create_future()
    client.d.send(client.url, pull.decode_body(), pull.on_d_part(), d_done.set_result)
    pull.d_done(await d_done)


def _drop(_: object) -> None:
    pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", required=True, help="P's URL")
    parser.add_argument("--decode", required=True, help="D's URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--tasks", action="store_true",
                        help="each request a coroutine in its own task (default: callbacks)")
    args = parser.parse_args()

    async def serve() -> None:
        p, d = Pool(args.prefill), Pool(args.decode)
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: Client(p, d, args.tasks), args.host, args.port, backlog=1024)
        async with server:
            await server.serve_forever()

    uvloop.run(serve())


if __name__ == "__main__":
    main()
