"""A free TCP port on the loopback address, for a server a test or a benchmark starts.

The kernel picks it (an ephemeral port, free when asked); `vllm_cpu.free_port` is the
variant for servers that bind their ports long after they are chosen."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
