"""Private IPC sockets between the processes of one server, on this host: D's wake-up
socket (`connector.decode.wake`) and P's early-WRITE socket (`connector.prefill.early`).

Only the server's own user may connect to these sockets (`ipc_address`): each is a file
in a directory of its own, made with mode 0700 by the end that binds, and removed with
it on close. (Linux's abstract namespace, used before, has no permissions: any local
process could connect and send.)
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import tempfile
import weakref

_SOCKET_NAME = "sock"
# A Unix socket's path must fit sockaddr_un.sun_path (108 bytes with its NUL on Linux).
_MAX_PATH = 100


def _base_dirs() -> list[str]:
    """Where a socket's directory may go, best first: the user's runtime directory
    (private to the user, cleared at logout), else the temporary directory."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    dirs = [runtime] if runtime and os.path.isdir(runtime) else []
    return [*dirs, tempfile.gettempdir(), "/tmp"]


def ipc_address(prefix: str, engine_id: str, dp_index: int) -> str:
    """The IPC address of one of an engine's local sockets: a file in a directory named
    after this user, `prefix` and the engine, which the binding end makes private
    (`prepare_ipc_dir`). Every process of one server computes the same address."""
    digest = hashlib.sha256(f"{engine_id}/{dp_index}".encode()).hexdigest()[:16]
    name = f"pd-{os.getuid()}-{prefix}-{digest}"
    paths = [os.path.join(base, name, _SOCKET_NAME) for base in _base_dirs()]
    return "ipc://" + next((p for p in paths if len(p) <= _MAX_PATH), paths[-1])


def ipc_dir(address: str) -> str:
    """The private directory that holds the socket file of `address`."""
    return os.path.dirname(address.removeprefix("ipc://"))


def prepare_ipc_dir(address: str) -> None:
    """Before binding at `address`: make its directory, mode 0700, so that no other user
    can reach the socket. One left by a killed server of this user is reused; anything
    else at that path (another owner, looser permissions, not a directory) is refused
    with OSError, as it may let another user in."""
    directory = ipc_dir(address)
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() \
            or info.st_mode & 0o077:
        raise OSError(
            f"{directory} must be a directory of user {os.getuid()} with mode 0700 (it is "
            f"owned by user {info.st_uid}, mode {stat.filemode(info.st_mode)}); remove it")
    os.chmod(directory, 0o700)  # in case a umask took bits from mkdir's mode


def remove_ipc_file(address: str) -> None:
    """After closing a socket bound at `address`: remove its file and its directory."""
    with contextlib.suppress(OSError):
        os.unlink(address.removeprefix("ipc://"))
    with contextlib.suppress(OSError):
        os.rmdir(ipc_dir(address))


def remove_at_exit(owner: object, address: str) -> weakref.finalize[[str], object]:
    """Remove `address`'s file and directory when `owner` closes (call the result), is
    collected, or the process exits without closing it (a server whose engine is not
    shut down). Only a killed process leaves them behind."""
    return weakref.finalize(owner, remove_ipc_file, address)
