"""The workers' NIXL poller thread survives what NIXL or our code raise: a failed poll is
counted and logged, and polling goes on; a poller that fails every poll gives up, and
the worker's next step raises `ThreadDied` (vLLM then stops the engine, and its health
check fails) instead of leaving pushes to wait for a poll that never comes."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any, cast

import pytest

from connector.decode.worker_side import DecodeWorker
from connector.shared import channel_thread
from connector.shared.channel_thread import Guard, ThreadDied
from connector.worker import DualWorker
from tests.conftest import until_sync


@pytest.fixture
def poller() -> Iterator[Callable[[Callable[[], bool]], Any]]:
    """A worker with only what its poller thread uses, P's half's WRITE poll replaced by
    `poll_writes`; the thread is started and stopped here."""
    made: list[Any] = []

    def make(poll_writes: Callable[[], bool]) -> Any:
        decode = DecodeWorker(cast(Any, SimpleNamespace()), wake_at=("engine-poller-test", 0),
                              wake_poller=lambda: None)  # no push awaited: polls nothing
        worker: Any = SimpleNamespace(
            _stopping=threading.Event(), _poll_wanted=threading.Event(),
            _poller_guard=Guard("pd-nixl-poller"),
            prefill=SimpleNamespace(poll_writes=poll_writes), decode=decode)
        worker._poll_once = lambda wake: DualWorker._poll_once(worker, wake)
        worker.check_poller = lambda: DualWorker.check_poller(worker)
        worker._poller = threading.Thread(target=DualWorker._poll, args=(worker,),
                                          name="pd-nixl-poller", daemon=True)
        worker._poller.start()
        made.append(worker)
        return worker

    try:
        yield make
    finally:
        for worker in made:
            worker._stopping.set()
            worker._poll_wanted.set()
            worker._poller.join(5.0)


def test_a_poll_that_raises_is_counted_and_polling_goes_on(
    poller: Callable[[Callable[[], bool]], Any],
) -> None:
    polls = [0]

    def poll_writes() -> bool:
        polls[0] += 1
        if polls[0] == 1:
            raise RuntimeError("NIXL said something odd")
        return polls[0] < 4  # three more polls, then no WRITE is in flight

    worker = poller(poll_writes)
    worker._poll_wanted.set()
    until_sync(lambda: polls[0] == 4, "the poller polled on after the error")
    assert worker._poller_guard.errors == 1
    DualWorker.check_poller(worker)  # alive: the step goes on
    worker._poll_wanted.set()  # the next push wakes it as before
    until_sync(lambda: polls[0] == 5, "the poller woke for the next push")


def test_a_poller_that_fails_every_poll_makes_the_next_step_raise(
    poller: Callable[[Callable[[], bool]], Any], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(channel_thread, "MAX_FAILED_PASSES", 3)

    def poll_writes() -> bool:
        raise RuntimeError("the agent is gone")

    worker = poller(poll_writes)
    worker._poll_wanted.set()
    until_sync(lambda: not worker._poller.is_alive(), "the poller gave up")
    assert worker._poller_guard.errors == 3
    with pytest.raises(ThreadDied, match="pd-nixl-poller thread died.*the agent is gone"):
        DualWorker.check_poller(worker)
    with pytest.raises(ThreadDied):
        DualWorker.start_step(worker, SimpleNamespace())  # type: ignore[arg-type]


def test_a_stopped_poller_is_not_a_dead_one(poller: Callable[[Callable[[], bool]], Any]) -> None:
    worker = poller(lambda: False)
    worker._stopping.set()
    worker._poll_wanted.set()
    worker._poller.join(5.0)
    DualWorker.check_poller(worker)
