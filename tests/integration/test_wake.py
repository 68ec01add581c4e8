"""D's workers wake D's pausing scheduler when a push lands: real ZMQ over IPC."""

from __future__ import annotations

import sys
import threading
import time
import uuid

from connector.wake import WakeListener, WakeSender


def test_a_wake_up_ends_the_wait_at_once_and_silence_lets_it_time_out() -> None:
    engine = f"test-{uuid.uuid4()}"
    listener, sender = WakeListener(engine, 0), WakeSender(engine, 0)
    try:
        if sys.platform == "linux":  # abstract namespace: nothing on disk to leak
            assert listener.address.startswith("ipc://@")
        started = time.monotonic()
        assert listener.wait(0.05) is False
        assert time.monotonic() - started >= 0.04

        timer = threading.Timer(0.1, sender.wake)
        timer.start()
        started = time.monotonic()
        assert listener.wait(5.0) is True
        assert time.monotonic() - started < 2.0
        timer.join()

        for _ in range(3):  # queued wake-ups are drained by one wait
            sender.wake()
        time.sleep(0.1)
        assert listener.wait(0.05) is True
        assert listener.wait(0.05) is False
    finally:
        sender.close()
        listener.close()


def test_a_sender_with_no_listener_never_blocks() -> None:
    sender = WakeSender(f"test-{uuid.uuid4()}")
    try:
        started = time.monotonic()
        for _ in range(100):
            sender.wake()
        assert time.monotonic() - started < 1.0
    finally:
        sender.close()
