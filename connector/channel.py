"""The push side channel: ZMQ between D's scheduler and P's scheduler, one thread each.

Its parts, each in its own module:

- `connector.channel_thread`: what both sides share (one owned thread, its wake-up pipe,
  the engine's typed events for it, bounded waits).
- `connector.prefill_channel`: P's `PrefillChannel` (a ROUTER on P's push port, the
  thread that owns P's `PushRegistry`) and what it tells P's engine (`StartWrite`,
  `FreeBlocks`).
- `connector.decode_channel`: D's `DecodeChannel` (a DEALER per P, D's pushes and their
  deadlines) and what it tells D's engine (`PushFailure`).

The messages on the wire are in `connector.messages`. This module gathers the names the
engine (`connector.scheduler`) and the tests use.
"""

from __future__ import annotations

from connector.decode_channel import DecodeChannel, PushFailure
from connector.prefill_channel import FreeBlocks, PrefillAction, PrefillChannel, StartWrite

__all__ = [
    "DecodeChannel",
    "FreeBlocks",
    "PrefillAction",
    "PrefillChannel",
    "PushFailure",
    "StartWrite",
]
