"""`EventFramer`: whole SSE events only, in time linear in the bytes fed (one huge event
in many small chunks is not copied again at each chunk), and an event over its cap is
refused before the framer holds more than the cap."""

from __future__ import annotations

import random
import time

import pytest

from proxy.flow.relay import EventFramer, EventTooLarge


class Reference:
    """The rule, written plainly (and quadratic): the held bytes and the new chunk,
    cut after their last blank line."""

    def __init__(self) -> None:
        self.held = b""

    def feed(self, chunk: bytes) -> bytes:
        data, self.held = self.held + chunk, b""
        lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
        cut = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
        self.held = data[cut:]
        return data[:cut]


def random_stream(rng: random.Random) -> bytes:
    parts = []
    for _ in range(rng.randrange(1, 30)):
        body = bytes(rng.choice(b"ab:{} \r\n") for _ in range(rng.randrange(0, 40)))
        parts.append(b"data: " + body + rng.choice([b"\n\n", b"\r\n\r\n", b"\n", b""]))
    return b"".join(parts)


def test_framing_is_linear_and_passes_exactly_the_whole_events() -> None:
    rng = random.Random(7)
    for _ in range(500):  # any cut of any stream: the whole events, as the rule says
        data = random_stream(rng)
        cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randrange(0, 12))))
        framer, reference, out = EventFramer(), Reference(), b""
        for start, end in zip([0, *cuts], [*cuts, len(data)], strict=True):
            chunk = data[start:end]
            events = framer.feed(chunk)
            assert events == reference.feed(chunk), (data, cuts)
            assert not events or events.endswith((b"\n\n", b"\r\n\r\n"))
            out += events
        assert out + framer.rest() == data
    # One 8 MiB event in 64-byte chunks: linear is well under a second; re-joining the
    # held part at each chunk copies about 500 GB.
    framer = EventFramer()
    chunk = b"y" * 64
    deadline = time.monotonic() + 10
    for _ in range(8 * 1024 * 1024 // 64):
        assert framer.feed(chunk) == b""
        assert time.monotonic() < deadline, "framing a long event is not linear"
    assert framer.feed(b"\n\n") == chunk * (8 * 1024 * 1024 // 64) + b"\n\n"


def test_an_event_over_the_cap_raises_and_whole_events_under_it_pass() -> None:
    framer = EventFramer(limit=1024)
    assert framer.feed(b"data: 1\n\ndata: ") == b"data: 1\n\n"
    assert framer.feed(b"x" * 1000) == b""
    with pytest.raises(EventTooLarge):
        framer.feed(b"x" * 100)
    # many events in one chunk, each under the cap: fine, however long the chunk
    many = b"data: " + b"z" * 500 + b"\n\n"
    assert EventFramer(limit=1024).feed(many * 100) == many * 100
    # a partial event held after whole ones counts alone
    assert EventFramer(limit=1024).feed(many * 10 + b"data: q") == many * 10
