"""A background round run every few seconds: health checks, load scrapes, config watch.

`Periodic` owns its one task: `start` creates it (not when the interval is 0, which
means off), `aclose` cancels it and waits for it to end. A round that raises is logged
and the next round still runs, so one bad round never ends the loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

logger = logging.getLogger("pdproxy.periodic")


class Periodic:
    def __init__(self, name: str, interval: float, round: Callable[[], Awaitable[object]],
                 *, at_once: bool = False) -> None:
        self.name = name
        self.interval = interval
        self._round = round
        self._at_once = at_once  # run the first round at start, not one interval later
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.interval > 0 and self._task is None:
            self._task = asyncio.create_task(self._run(), name=self.name)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        if not self._at_once:
            await asyncio.sleep(self.interval)
        while True:
            try:
                await self._round()
            except Exception:  # one bad round must not end the loop
                logger.exception("%s: a round failed", self.name)
            await asyncio.sleep(self.interval)
