"""The one background loop behind health checks, load scrapes and the config watch."""

from __future__ import annotations

import pytest

from proxy.pool.periodic import Periodic
from tests.conftest import until


async def witnessed_rounds(count: int) -> None:
    """Return once a loop of 10 ms with a first round at once, started now, has run
    `count` rounds: proof that the event loop gave every loop's rounds their time."""
    rounds: list[None] = []

    async def round() -> None:
        rounds.append(None)

    witness = Periodic("witness", 0.01, round, at_once=True)
    witness.start()
    try:
        await until(lambda: len(rounds) >= count, f"{count} rounds of the witness loop")
    finally:
        await witness.aclose()


async def test_a_round_that_raises_is_logged_and_the_next_one_runs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rounds: list[int] = []

    async def round() -> None:
        rounds.append(len(rounds))
        if len(rounds) == 1:
            raise RuntimeError("boom")

    loop = Periodic("test-loop", 0.01, round, at_once=True)
    loop.start()
    await until(lambda: len(rounds) >= 3, "three rounds, the first one failed")
    await loop.aclose()
    assert len(rounds) >= 3
    assert any("test-loop: a round failed" in r.getMessage() for r in caplog.records)
    count = len(rounds)
    await witnessed_rounds(5)
    assert len(rounds) == count, "a closed loop runs no more rounds"


async def test_an_interval_of_zero_is_off_and_the_first_round_waits_unless_at_once() -> None:
    rounds: list[str] = []

    async def round() -> None:
        rounds.append("ran")

    off = Periodic("off", 0, round, at_once=True)
    off.start()
    later = Periodic("later", 10, round)
    later.start()
    await witnessed_rounds(5)  # its first round came at once, and four more after it
    await off.aclose()
    await later.aclose()
    assert rounds == []
