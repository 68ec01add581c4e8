"""The side channel's threads survive what they are handed, over real ZMQ on 127.0.0.1:
a message or an engine event whose handling raises is counted and logged, and the thread
serves the next one; a thread that dies anyway makes the engine's next step raise
(`check_alive`, `DualScheduler.build_connector_meta`), so vLLM's health check fails
instead of pushes failing silently. D's sockets to P servers are bounded: an LRU of
`max_peers`, unreachable and idle ones closed, and a push for which no socket can be had
fails at once instead of killing D's thread (the ZMQ context's socket limit)."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace
from typing import Any

import pytest
import zmq

from connector.decode import channel as decode_channel
from connector.prefill.channel import StartWrite
from connector.protocol.side_channel import TransferId
from connector.scheduler import DualScheduler
from connector.shared import channel_thread
from connector.shared.channel_thread import ThreadDied
from testbed.ports import free_port
from tests.integration.test_push_channel import (
    HOST,
    P_BLOCKS,
    P_REQ,
    Channels,
    assert_acked,
    registration,
    wait_actions,
    wait_failures,
    wait_for,
)


def dead_address() -> str:
    """A P address where nothing listens."""
    return f"tcp://{HOST}:{free_port()}"


def raise_for(transfer: str, call: Any) -> Any:
    """`call`, except that it raises for `transfer` (its first argument's transfer id)."""

    def wrapped(first: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(first, "transfer_id", first) == transfer:
            raise RuntimeError(f"a bug meets {transfer}")
        return call(first, *args, **kwargs)

    return wrapped


# --- a message or an event that raises ----------------------------------------------------


def test_a_registration_whose_handling_raises_costs_itself_only(
    channels: Channels, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.ERROR, logger="vllm.pd_connector.channel")
    p = channels.prefill()
    monkeypatch.setattr(p.registry, "register", raise_for("t-bad", p.registry.register))
    d = channels.decode(ack_timeout=1.0)
    d.register(p.address, registration(d, "t-bad"))
    good = registration(d, "t-good")
    d.register(p.address, good)
    p.prefill_finished(good.transfer_id, P_REQ, P_BLOCKS)
    (action,) = wait_actions(p)
    assert isinstance(action, StartWrite) and action.transfer_id == good.transfer_id
    assert p.errors == 1
    (line,) = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert "RegisterBlocks for transfer t-bad from b'engine-d1'" in line, line
    assert "RuntimeError: a bug meets t-bad" in line, line
    (failure,) = wait_failures(d, timeout=3.0)  # D gives up on the one P never answered
    assert failure.transfer_id == "t-bad", failure
    p.check_alive()  # alive and well


def test_an_engine_event_whose_handling_raises_costs_itself_only(
    channels: Channels, monkeypatch: pytest.MonkeyPatch,
) -> None:
    p = channels.prefill()
    monkeypatch.setattr(p.registry, "prefill_finished",
                        raise_for("t-bad", p.registry.prefill_finished))
    d = channels.decode()
    good = registration(d, "t-good")
    d.register(p.address, good)
    wait_for(lambda: len(p.registry) == 1, 2.0, "P holds the registration")
    p.prefill_finished(TransferId("t-bad"), "p-req-bad", P_BLOCKS)
    p.prefill_finished(good.transfer_id, P_REQ, P_BLOCKS)
    p.wait_caught_up(1.0)
    assert not p._events_pending(), "the event that raised still counts as handled"
    (action,) = wait_actions(p)
    assert isinstance(action, StartWrite) and action.transfer_id == good.transfer_id
    assert p.errors == 1


def test_d_survives_a_message_and_an_event_that_raise(
    channels: Channels, monkeypatch: pytest.MonkeyPatch,
) -> None:
    p = channels.prefill()
    # P's Ack for t-good must come within ack_timeout: 3 s, not 1, so that a loaded
    # machine (the test suite runs beside other work) does not fail it.
    d = channels.decode(ack_timeout=3.0)
    monkeypatch.setattr(d, "_on_message", raise_for("t-bad", d._on_message))
    monkeypatch.setattr(d, "_drop", raise_for("t-gone", d._drop))
    d.register(p.address, registration(d, "t-bad"))  # P's Ack for it raises on D
    d.forget(TransferId("t-gone"))  # and so does this event
    wait_for(lambda: d.errors == 2, 2.0, "D counted both")
    (failure,) = wait_failures(d, timeout=6.0)  # its Ack was lost to the bug
    assert failure.transfer_id == "t-bad", failure
    registered_at = time.monotonic()
    d.register(p.address, registration(d, "t-good"))
    assert_acked(d, registered_at)
    d.check_alive()


# --- a thread that dies anyway ----------------------------------------------------------------


def test_a_thread_that_dies_makes_the_engines_next_step_raise(
    channels: Channels, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.CRITICAL, logger="vllm.pd_connector.channel")
    p = channels.prefill()
    d = channels.decode()
    scheduler = SimpleNamespace(prefill=SimpleNamespace(channel=p),
                                decode=SimpleNamespace(channel=d))
    scheduler.check_threads = lambda: DualScheduler.check_threads(scheduler)  # type: ignore[arg-type]
    scheduler.check_threads()  # both alive

    def escape() -> None:
        raise SystemExit("not an Exception: past every guard")

    monkeypatch.setattr(d, "_pass", escape)
    d._wakeup.set()  # the pass under way ends; the next one is the patched one
    wait_for(lambda: d.guard.death is not None, 3.0, "D's thread died")
    with pytest.raises(ThreadDied, match="pd-push-decode thread died .*SystemExit"):
        d.check_alive()
    with pytest.raises(ThreadDied, match="pd-push-decode"):
        DualScheduler.build_connector_meta(scheduler, None)  # type: ignore[arg-type]
    assert any("pd-push-decode thread died" in r.getMessage() for r in caplog.records)
    p.check_alive()


def test_a_thread_whose_every_pass_fails_gives_up_and_says_so(
    channels: Channels, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A broken socket fails every pass: the thread waits a little more after each,
    then ends after MAX_FAILED_PASSES in a row."""
    monkeypatch.setattr(channel_thread, "MAX_FAILED_PASSES", 4)
    p = channels.prefill()

    def broken(*_: Any) -> dict[Any, int]:
        raise zmq.ZMQError(zmq.ENOTSOCK, "a socket that is gone")

    monkeypatch.setattr(p, "_poll", broken)
    p._wakeup.set()
    wait_for(lambda: p.guard.death is not None, 3.0, "P's thread gave up")
    assert p.errors == 4
    with pytest.raises(ThreadDied, match="failed 4 passes in a row.*a socket that is gone"):
        p.check_alive()


def test_a_stopped_thread_is_not_a_dead_one(channels: Channels) -> None:
    p = channels.prefill()
    channels.stop(p)
    p.check_alive()


# --- D's sockets to P servers -------------------------------------------------------------------


def test_a_push_that_gets_no_socket_fails_at_once_and_d_goes_on(channels: Channels) -> None:
    """ZMQ's context holds a limited number of sockets (1023 by default; 3 here). Past
    it, a registration to one more P fails at once (D computes that prompt), D's thread
    goes on, and closes the sockets of the P servers that did not answer."""
    d = channels.decode(ack_timeout=0.5)
    d._context.set(zmq.MAX_SOCKETS, 3)  # before D makes its first socket
    dead = [registration(d, f"t-dead-{i}") for i in range(5)]
    for reg in dead:
        d.register(dead_address(), reg)
    failures = wait_failures(d, timeout=3.0, count=5)
    no_socket = [f for f in failures if "no socket to P" in f.why]
    assert len(no_socket) == 2, failures
    wait_for(lambda: d.open_peers == 0, 2.0, "D closed the sockets to the silent P servers")
    p = channels.prefill()
    registered_at = time.monotonic()
    d.register(p.address, registration(d, "t-live"))
    assert_acked(d, registered_at)
    assert d.errors == 0 and d.no_socket == 2
    d.check_alive()


def test_d_holds_at_most_max_peers_sockets(channels: Channels) -> None:
    """P servers come and go: with every socket busy, a push to one more P fails at once;
    once their pushes failed, the unreachable ones are closed, and a live P is served."""
    d = channels.decode(ack_timeout=0.5, max_peers=4)
    for i in range(10):
        d.register(dead_address(), registration(d, f"t-dead-{i}"))
    failures = wait_failures(d, timeout=3.0, count=10)
    assert sum("its limit (max_peers)" in f.why for f in failures) == 6, failures
    wait_for(lambda: d.open_peers == 0 and d.peers_closed == 4, 2.0,
             "D closed the sockets to the silent P servers")
    p = channels.prefill()
    registered_at = time.monotonic()
    d.register(p.address, registration(d, "t-live"))
    assert_acked(d, registered_at)
    assert d.open_peers == 1


def test_an_idle_socket_is_closed_and_made_again_when_needed(
    channels: Channels, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(decode_channel, "PEER_IDLE_S", 0.3)
    p = channels.prefill()
    d = channels.decode()
    first = registration(d, "t-1")
    d.register(p.address, first)
    wait_for(lambda: len(p.registry) == 1, 2.0, "P holds the registration")
    d.forget(first.transfer_id)  # its push arrived
    wait_for(lambda: d.open_peers == 0, 3.0, "D closed the idle socket")
    assert d.peers_closed == 1
    registered_at = time.monotonic()
    d.register(p.address, registration(d, "t-2"))
    assert_acked(d, registered_at)


def test_a_ps_socket_retries_with_a_capped_backoff(channels: Channels) -> None:
    d = channels.decode(ack_timeout=5.0)
    d.register(dead_address(), registration(d, "t-1"))
    wait_for(lambda: d.open_peers == 1, 2.0, "D made the socket")
    d.wait_caught_up(1.0)
    (peer,) = list(d._peers.values())
    assert peer.socket.getsockopt(zmq.RECONNECT_IVL) == decode_channel.RECONNECT_IVL_MS
    assert peer.socket.getsockopt(zmq.RECONNECT_IVL_MAX) == decode_channel.RECONNECT_IVL_MAX_MS
    assert 0 < decode_channel.RECONNECT_IVL_MS < decode_channel.RECONNECT_IVL_MAX_MS

