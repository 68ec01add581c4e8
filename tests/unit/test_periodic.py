"""The one background loop behind health checks, load scrapes and the config watch."""

from __future__ import annotations

import asyncio

import pytest

from proxy.periodic import Periodic


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
    for _ in range(200):
        if len(rounds) >= 3:
            break
        await asyncio.sleep(0.01)
    await loop.aclose()
    assert len(rounds) >= 3
    assert any("test-loop: a round failed" in r.getMessage() for r in caplog.records)
    count = len(rounds)
    await asyncio.sleep(0.05)
    assert len(rounds) == count, "a closed loop runs no more rounds"


async def test_an_interval_of_zero_is_off_and_the_first_round_waits_unless_at_once() -> None:
    rounds: list[str] = []

    async def round() -> None:
        rounds.append("ran")

    off = Periodic("off", 0, round, at_once=True)
    off.start()
    later = Periodic("later", 10, round)
    later.start()
    await asyncio.sleep(0.05)
    await off.aclose()
    await later.aclose()
    assert rounds == []
