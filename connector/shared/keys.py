"""CURVE keys for the push side channel: loading them, and making them.

With keys, the side channel is authenticated and encrypted (ZMQ's CURVE): P's ROUTER is
the CURVE server and accepts only peers whose public key it was given; D's DEALERs, and
the router's abandon sender, are CURVE clients that must know P's public key. The files
are ZMQ's certificate files (`zmq.auth`): `NAME.key` holds a public key, `NAME.key_secret`
the key pair. To make a pair:

    python -m connector.shared.keys DIR [NAME]    # writes DIR/NAME.key and DIR/NAME.key_secret

Keep `.key_secret` files private (the helper makes them readable by their owner only);
copy `.key` files to where the peers' allowed keys are read from.

vLLM-free: the router imports this module too.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable

import msgspec
import zmq.auth
from zmq.utils import z85

KEY_LENGTH = 40  # a CURVE key in Z85 text


class KeyFileError(ValueError):
    """A key file that cannot be read or holds no valid key."""


class KeyPair(msgspec.Struct, frozen=True):
    """One side's CURVE key pair, both keys in Z85 text (as ZMQ's socket options take)."""

    public: bytes
    secret: bytes


class ServerKeys(msgspec.Struct, frozen=True):
    """P's push port: its own pair, and the public keys of the peers it accepts."""

    pair: KeyPair
    allowed: frozenset[bytes]


class ClientKeys(msgspec.Struct, frozen=True):
    """A peer of P (D, or the router): its own pair, and P's public key."""

    pair: KeyPair
    server_public: bytes


def _valid(key: bytes | None, path: str, what: str) -> bytes:
    if key is None or len(key) != KEY_LENGTH:
        raise KeyFileError(f"{path} holds no CURVE {what} key (make one with "
                        "`python -m connector.shared.keys DIR`)")
    try:
        z85.decode(key)
    except ValueError as exc:
        raise KeyFileError(f"{path}: not a Z85 CURVE key: {exc}") from exc
    return key


def load_key_pair(path: str) -> KeyPair:
    """The key pair in a `.key_secret` file."""
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise KeyFileError(f"cannot read the CURVE key pair in {path}: {exc}") from exc
    pair = KeyPair(_valid(public, path, "public"), _valid(secret, path, "secret"))
    if zmq.curve_public(pair.secret) != pair.public:
        raise KeyFileError(f"{path}: its public key is not its secret key's")
    return pair


def load_public_key(path: str) -> bytes:
    """The public key in a `.key` (or `.key_secret`) file."""
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise KeyFileError(f"cannot read the CURVE public key in {path}: {exc}") from exc
    return _valid(public, path, "public")


def load_allowed(source: str | Iterable[str]) -> frozenset[bytes]:
    """Allowed peers' public keys: every `*.key` file in a directory, or the listed files.
    An empty set is refused: it would shut every peer out."""
    if isinstance(source, str):
        if not os.path.isdir(source):
            raise KeyFileError(f"{source} is not a directory of public key files (*.key)")
        paths = sorted(os.path.join(source, name) for name in os.listdir(source)
                       if name.endswith(".key"))
        where = f"directory {source}"
    else:
        paths = list(source)
        where = "the list"
    keys = frozenset(load_public_key(path) for path in paths)
    if not keys:
        raise KeyFileError(f"no public key file (*.key) in {where}: no peer could connect")
    return keys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m connector.shared.keys",
        description="Make a CURVE key pair for the push side channel: DIR/NAME.key "
                    "(public; give it to the peers) and DIR/NAME.key_secret (keep it).")
    parser.add_argument("dir", help="directory to write the two files in (made if absent)")
    parser.add_argument("name", nargs="?", default="server",
                        help="file name without extension (default: server)")
    args = parser.parse_args(argv)
    os.makedirs(args.dir, mode=0o700, exist_ok=True)
    public_file, secret_file = zmq.auth.create_certificates(args.dir, args.name)
    os.chmod(secret_file, 0o600)
    print(f"public key: {public_file}\nkey pair:   {secret_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
