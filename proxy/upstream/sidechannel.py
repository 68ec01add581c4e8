"""The router's word to a P's push side channel: abandon a push whose D leg failed.

In push mode P's prefill and D's decode run at once; D registers its blocks with P, and
P holds the prompt's KV until a D claims it, or for `unclaimed_ttl` (120 s by default).
When the router's D leg fails before D registered (D refused the connection, crashed,
answered an error), nothing would tell P. `SideChannel.abandon` tells it: an `Abandon`
message (the connector's own wire struct, `connector.protocol.side_channel`) to P's push port, and P
frees the prompt's blocks at once. P honours it only while no D has registered the
transfer, so a late abandon never disturbs a push under way; knowing the transfer's
128-bit random id is the capability.

Fire and forget, never waiting: each P gets one DEALER socket (kept, so later abandons
reuse its connection), and a send that cannot be queued at once (P unreachable and its
queue full) is dropped and counted: P then frees the blocks at `unclaimed_ttl`, as it
would have anyway. With CURVE keys (`connector.shared.keys`), the router authenticates itself
to P; its public key must be among P's `curve_allowed_keys`.

Imports nothing from vLLM. Use it from the event loop's thread; `aclose()` at shutdown.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import zmq
import zmq.asyncio

from connector.protocol.side_channel import Abandon, ProtocolError, TransferId, encode
from connector.shared.keys import ClientKeys, load_key_pair, load_public_key

logger = logging.getLogger("pdproxy.sidechannel")

MAX_PORT = 65535
# Abandons waiting per P while its connection is (re)made: they are rare (one per failed
# D leg), so a short queue says all; beyond it they are dropped.
SEND_QUEUE = 64
# P's sockets kept at most (the least recently used goes first): more than any pool.
MAX_PEERS = 256
# While a P is unreachable its socket retries the connection, backing off to this (ms).
RECONNECT_MAX_MS = 5000


class SideChannel:
    """Sends `Abandon` to P's push side channels. Not thread-safe: one event loop."""

    def __init__(self, *, secret_key_file: str | None = None,
                 server_key_file: str | None = None, max_peers: int = MAX_PEERS) -> None:
        """`secret_key_file`: the router's CURVE key pair (a `.key_secret` file);
        `server_key_file`: the P servers' public key (a `.key` file). Both, or neither
        (then P must run without side-channel authentication). Raises ValueError (a
        `connector.shared.keys.KeyFileError`) for a file that holds no valid key."""
        if (secret_key_file is None) != (server_key_file is None):
            raise ValueError("secret_key_file and server_key_file go together: the router's "
                             "key pair and P's public key")
        self._keys: ClientKeys | None = None
        if secret_key_file is not None and server_key_file is not None:
            self._keys = ClientKeys(load_key_pair(secret_key_file),
                                    load_public_key(server_key_file))
        if max_peers < 1:
            raise ValueError(f"max_peers must be >= 1, got {max_peers}")
        self._max_peers = max_peers
        self._context = zmq.asyncio.Context()
        self._sockets: OrderedDict[str, zmq.asyncio.Socket] = OrderedDict()
        self._closed = False
        self.sent = 0  # abandons queued for sending
        self.dropped = 0  # abandons not sent: bad coordinates, a full queue, or closed

    def abandon(self, push_host: str, push_port: int, transfer_id: str) -> bool:
        """Tell the P at `push_host:push_port` that `transfer_id`'s D leg failed. Returns
        at once: True when the message is queued for sending, False when dropped."""
        address = _address(push_host, push_port)
        try:
            payload = encode(Abandon(transfer_id=TransferId(transfer_id)))
        except ProtocolError:
            address = None
        if address is None or self._closed:
            self.dropped += 1
            logger.debug("abandon of %r for P %s:%s not sent (%s)", transfer_id, push_host,
                         push_port, "closed" if self._closed else "bad coordinates")
            return False
        try:
            socket = self._socket(address)
            # With NOBLOCK the send is tried at once, so its future is already resolved.
            future: Any = socket.send(payload, zmq.NOBLOCK)
            error = future.exception() if future.done() else None
        except zmq.ZMQError as exc:  # an address zmq refuses
            error = exc
        if error is not None:
            self.dropped += 1
            logger.warning("abandon of push %s not sent to P %s: %s; P frees its blocks at "
                           "its unclaimed_ttl", transfer_id, address, error)
            return False
        self.sent += 1
        return True

    async def aclose(self) -> None:
        """Close every socket (queued abandons are dropped: linger 0). Idempotent."""
        if self._closed:
            return
        self._closed = True
        while self._sockets:
            _, socket = self._sockets.popitem()
            socket.close(linger=0)
        self._context.term()

    async def __aenter__(self) -> SideChannel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _socket(self, address: str) -> zmq.asyncio.Socket:
        socket = self._sockets.get(address)
        if socket is not None:
            self._sockets.move_to_end(address)
            return socket
        if len(self._sockets) >= self._max_peers:
            _, oldest = self._sockets.popitem(last=False)
            oldest.close(linger=0)
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, SEND_QUEUE)
        socket.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_MAX_MS)
        if self._keys is not None:
            socket.setsockopt(zmq.CURVE_SECRETKEY, self._keys.pair.secret)
            socket.setsockopt(zmq.CURVE_PUBLICKEY, self._keys.pair.public)
            socket.setsockopt(zmq.CURVE_SERVERKEY, self._keys.server_public)
        try:
            socket.connect(address)  # in the background: sends queue until it is made
        except zmq.ZMQError:
            socket.close(linger=0)
            raise
        self._sockets[address] = socket
        return socket


def _address(host: str, port: int) -> str | None:
    """`tcp://host:port` (an IPv6 address in brackets); None for unusable values."""
    if not isinstance(host, str) or not host or any(c.isspace() for c in host) \
            or not isinstance(port, int) or isinstance(port, bool) \
            or not 1 <= port <= MAX_PORT:
        return None
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


__all__ = ["SideChannel"]
