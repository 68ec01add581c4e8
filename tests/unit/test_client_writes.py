"""The listener's client transport sends an answer's head with its first body bytes,
in one system call, and never delays or reorders anything else."""

from __future__ import annotations

import asyncio
from typing import Any

from proxy.api.listener import _CoalescingTransport

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n"


class RecordingTransport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False
        self.aborted = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 1234) if name == "peername" else default


async def test_a_head_goes_out_with_the_body_in_one_write() -> None:
    inner = RecordingTransport()
    transport = _CoalescingTransport(inner, asyncio.get_running_loop())  # type: ignore[arg-type]
    transport.write(HEAD)
    assert inner.writes == [] and transport.get_write_buffer_size() == len(HEAD)
    transport.write(b"{}")
    assert inner.writes == [HEAD + b"{}"]
    await asyncio.sleep(0)  # the fallback flush finds nothing held
    assert inner.writes == [HEAD + b"{}"]
    transport.write(b"more")  # anything after the head goes at once
    assert inner.writes[-1] == b"more"


async def test_a_head_alone_goes_out_within_the_loop_turn() -> None:
    inner = RecordingTransport()
    transport = _CoalescingTransport(inner, asyncio.get_running_loop())  # type: ignore[arg-type]
    transport.write(HEAD)
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert inner.writes == [HEAD]


async def test_close_sends_what_is_held_and_abort_drops_it() -> None:
    loop = asyncio.get_running_loop()
    inner = RecordingTransport()
    transport = _CoalescingTransport(inner, loop)  # type: ignore[arg-type]
    transport.write(HEAD)
    transport.close()
    assert inner.writes == [HEAD] and inner.closed
    inner2 = RecordingTransport()
    transport2 = _CoalescingTransport(inner2, loop)  # type: ignore[arg-type]
    transport2.write(HEAD)
    transport2.abort()
    await asyncio.sleep(0)
    assert inner2.writes == [] and inner2.aborted


async def test_a_body_that_looks_like_a_head_keeps_its_order() -> None:
    inner = RecordingTransport()
    transport = _CoalescingTransport(inner, asyncio.get_running_loop())  # type: ignore[arg-type]
    transport.write(b"HTTP/1.1 is text\r\n\r\n")  # held, as a head would be
    transport.write(b"next")
    assert b"".join(inner.writes) == b"HTTP/1.1 is text\r\n\r\nnext"
    assert transport.get_extra_info("peername") == ("127.0.0.1", 1234)  # the rest passes through
