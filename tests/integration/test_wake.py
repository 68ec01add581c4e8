"""D's workers wake D's pausing scheduler when a push lands: real ZMQ over IPC. The
engine's local sockets (wake-up, early WRITE) are files in a directory only the server's
user can enter, removed on close."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import zmq

from connector.decode.wake import WakeListener, WakeSender, wake_address
from connector.prefill.early import EarlyOutbox
from connector.shared.ipc import ipc_dir

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_wake_up_ends_the_wait_at_once_and_silence_lets_it_time_out() -> None:
    engine = f"test-{uuid.uuid4()}"
    listener, sender = WakeListener(engine, 0), WakeSender(engine, 0)
    try:
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
        # The three cross ZMQ's I/O threads to the listener, which shows no count of what
        # it holds: a bounded wait, far longer than a local IPC hop. Too short a wait
        # would fail the test (a wake-up left over), never pass it wrongly.
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


def socket_path(address: str) -> str:
    """The path a Unix socket connects to (the abstract namespace's "@" is a NUL)."""
    path = address.removeprefix("ipc://")
    return "\0" + path[1:] if path.startswith("@") else path


def assert_private(address: str) -> None:
    path = socket_path(address)
    assert not path.startswith("\0"), f"{address}: abstract, open to every local process"
    info = os.lstat(os.path.dirname(path))
    assert stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o700, \
        stat.filemode(info.st_mode)
    assert info.st_uid == os.getuid()
    assert stat.S_ISSOCK(os.lstat(path).st_mode)


def test_the_wake_socket_is_in_a_private_directory_removed_on_close() -> None:
    listener = WakeListener(f"test-{uuid.uuid4()}", 0)
    try:
        assert_private(listener.address)
        assert str(os.getuid()) in os.path.basename(ipc_dir(listener.address))
    finally:
        listener.close()
    assert not os.path.exists(ipc_dir(listener.address)), "nothing left behind"


def test_the_early_write_socket_is_in_a_private_directory_removed_on_close() -> None:
    context = zmq.Context()
    try:
        outbox = EarlyOutbox(context, f"test-{uuid.uuid4()}", 0, 5700, ranks=2)
        try:
            assert len(set(outbox.addresses)) == 2, "one socket per rank"
            for address in outbox.addresses:
                assert_private(address)
        finally:
            outbox.close()
        for address in outbox.addresses:
            assert not os.path.exists(ipc_dir(address))
    finally:
        context.term()


@pytest.fixture
def engine() -> Iterator[str]:
    name = f"test-{uuid.uuid4()}"
    yield name
    directory = ipc_dir(wake_address(name, 0))
    if os.path.isdir(directory):
        os.rmdir(directory)


def test_a_directory_another_user_may_enter_is_refused(engine: str) -> None:
    os.mkdir(ipc_dir(wake_address(engine, 0)), 0o700)
    os.chmod(ipc_dir(wake_address(engine, 0)), 0o755)
    with pytest.raises(OSError, match="mode 0700"):
        WakeListener(engine, 0)
    assert os.listdir(ipc_dir(wake_address(engine, 0))) == [], "nothing was bound there"


def test_a_directory_left_by_a_killed_server_is_reused(engine: str) -> None:
    os.mkdir(ipc_dir(wake_address(engine, 0)), 0o700)
    listener, sender = WakeListener(engine, 0), WakeSender(engine, 0)
    try:
        sender.wake()
        assert listener.wait(5.0) is True
    finally:
        sender.close()
        listener.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")
def test_another_user_cannot_connect() -> None:
    listener = WakeListener(f"test-{uuid.uuid4()}", 0)
    try:
        child = os.fork()
        if child == 0:  # the child, as user nobody: try to reach the socket
            code = 3
            try:
                os.setgid(65534)
                os.setuid(65534)
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                    sock.connect(socket_path(listener.address))
                code = 0
            except PermissionError:
                code = 1
            finally:
                os._exit(code)
        _, status = os.waitpid(child, 0)
        assert os.WEXITSTATUS(status) == 1, "another user reached the socket"
    finally:
        listener.close()


EXIT_SCRIPT = """
import sys
from connector.prefill.early import EarlyOutbox
from connector.decode.wake import WakeListener
import zmq
listener = WakeListener(sys.argv[1], 0)
outbox = EarlyOutbox(zmq.Context(), sys.argv[1], 0, 5700)
print(listener.address, *outbox.addresses, flush=True)
sys.exit(0)  # no close(): as a server whose engine is not shut down
"""


def test_a_process_that_exits_without_closing_leaves_no_directory(engine: str) -> None:
    done = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, engine], cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=True)
    addresses = done.stdout.split()
    assert len(addresses) == 2, done
    for address in addresses:
        assert not os.path.exists(ipc_dir(address)), f"{address} left behind"
