"""A fake vLLM prefix cache that publishes vLLM's KV events over real ZMQ.

`FakePrefixCache` is what a vLLM server's block pool does as far as a router can see:
`num_blocks` blocks of `block_size` tokens, a prompt's full blocks cached in a chain from
its start, the least recently used evicted first, and after each change one
`KVEventBatch` on a PUB socket, `[topic, seq (8 bytes, big-endian), msgpack batch]`,
with a ROUTER replay socket answering `["", start]` with the buffered batches from
`start` and a `seq` of -1. Events are encoded as vLLM 0.32 does (`encoding="map"`:
maps with a `type`) or as earlier releases did (`"array"`). Block hashes are its own
(blake2b, bytes), unrelated to the router's keys, as vLLM's are.

`FakeVLLM(kv_cache=...)` serves one: each inference request's prompt (its token ids, or
`fake_tokenize` of its text) goes through `serve`, which says how many tokens hit.
Tests can also publish by hand (`publish`), skip sequence numbers (`skip`) or restart
the publisher's numbering (`restart`), to drive the router's gap, replay and wipe paths.
Everything binds 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict, deque
from typing import Any

import msgspec
import zmq
import zmq.asyncio

END_SEQ = (-1).to_bytes(8, "big", signed=True)
VOCAB = 30_000


def fake_tokenize(text: str) -> list[int]:
    """A stable stand-in for a tokenizer: one id per whitespace-separated word."""
    return [int.from_bytes(hashlib.blake2b(w.encode(), digest_size=4).digest(), "big") % VOCAB + 1
            for w in text.split()]


def fake_chat_tokens(messages: list[dict[str, Any]]) -> list[int]:
    """A chat's ids: each message as `<role> content`, as a template would lay them out."""
    words: list[str] = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        words += [f"<{message.get('role')}>", str(content or "")]
    return fake_tokenize(" ".join(words))


class FakePrefixCache:
    def __init__(self, num_blocks: int, block_size: int, *, encoding: str = "map",
                 buffer_steps: int = 10_000, topic: str = "") -> None:
        if encoding not in ("map", "array"):
            raise ValueError(f"encoding is map or array, not {encoding!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.encoding = encoding
        self.topic = topic.encode()
        self.blocks: OrderedDict[bytes, None] = OrderedDict()  # hash -> (), LRU first
        self.seq = 0  # the next batch's number
        self.published = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._context = zmq.asyncio.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._replay = self._context.socket(zmq.ROUTER)
        for socket in (self._pub, self._replay):
            socket.setsockopt(zmq.LINGER, 0)
        self.port = self._pub.bind_to_random_port("tcp://127.0.0.1")
        self.replay_port = self._replay.bind_to_random_port("tcp://127.0.0.1")
        self._replays: asyncio.Task[None] | None = None
        self.replay_requests = 0
        self.answer_replays = True  # False: replay requests are read and never answered

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def sources(self) -> dict[str, Any]:
        """What vLLM's GET /kv_event_sources answers for one engine (a wildcard host, as
        vLLM reports `tcp://*:port`)."""
        return {"0": {"enable_kv_cache_events": True, "publisher": "zmq",
                      "endpoint": f"tcp://*:{self.port}",
                      "replay_endpoint": f"tcp://*:{self.replay_port}",
                      "buffer_steps": self._buffer.maxlen, "hwm": 100_000,
                      "max_queue_size": 100_000, "topic": self.topic.decode()}}

    def start(self) -> None:
        if self._replays is None:
            self._replays = asyncio.create_task(self._serve_replays(), name="fake-kv-replay")

    async def aclose(self) -> None:
        if self._replays is not None:
            self._replays.cancel()
            await asyncio.gather(self._replays, return_exceptions=True)
        self._context.destroy(linger=0)

    # --- the cache --------------------------------------------------------------------

    def hashes(self, tokens: list[int]) -> list[bytes]:
        """This fake's own hashes of a prompt's full blocks (chained, as vLLM's)."""
        out: list[bytes] = []
        parent = b""
        size = self.block_size
        for start in range(0, len(tokens) - size + 1, size):
            digest = hashlib.blake2b(parent, digest_size=16)
            digest.update(repr(tokens[start:start + size]).encode())
            parent = digest.digest()
            out.append(parent)
        return out

    def hit_tokens(self, tokens: list[int]) -> int:
        hits = 0
        for h in self.hashes(tokens):
            if h not in self.blocks:
                break
            hits += 1
        return hits * self.block_size

    def serve(self, tokens: list[int], hashes: list[bytes] | None = None) -> int:
        """Run a prompt through the cache: the tokens that hit, from its start; its
        blocks become the most recently used, new ones are stored (evicting the least
        recently used), and one batch of events says what changed. `hashes`: the
        prompt's `hashes(tokens)`, when the caller kept them."""
        if hashes is None:
            hashes = self.hashes(tokens)
        hits = 0
        for h in hashes:
            if h not in self.blocks:
                break
            hits += 1
        for h in hashes[:hits]:
            self.blocks.move_to_end(h)
        new = hashes[hits:][: self.num_blocks]
        removed: list[bytes] = []
        while len(self.blocks) + len(new) > self.num_blocks and self.blocks:
            oldest, _ = self.blocks.popitem(last=False)
            removed.append(oldest)
        for h in new:
            self.blocks[h] = None
        events: list[dict[str, Any]] = []
        if removed:
            events.append(self.removed_event(removed))
        if new:
            size = self.block_size
            events.append(self.stored_event(
                new, hashes[hits - 1] if hits else None,
                tokens[hits * size:(hits + len(new)) * size]))
        if events:
            self.publish(events)
        return hits * self.block_size

    # --- events -----------------------------------------------------------------------

    def stored_event(self, hashes: list[bytes], parent: bytes | None, tokens: list[int],
                     **extra: Any) -> dict[str, Any]:
        return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                "token_ids": tokens, "block_size": self.block_size, "lora_id": None,
                "medium": "GPU", "lora_name": None, **extra}

    def removed_event(self, hashes: list[bytes]) -> dict[str, Any]:
        return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}

    def clear(self) -> None:
        self.blocks.clear()
        self.publish([{"type": "AllBlocksCleared"}])

    def encode(self, events: list[dict[str, Any]]) -> bytes:
        if self.encoding == "array":
            order = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids",
                                     "block_size", "lora_id", "medium"),
                     "BlockRemoved": ("block_hashes", "medium"), "AllBlocksCleared": ()}
            events = [[e["type"], *(e[name] for name in order[e["type"]])]  # type: ignore[misc]
                      for e in events]
        return msgspec.msgpack.encode([time.time(), events, 0])

    def publish(self, events: list[dict[str, Any]], *, send: bool = True) -> int:
        """One batch under the next sequence number; `send=False` only buffers it (for
        replay), as if the live message were lost."""
        seq = self.seq
        self.seq += 1
        payload = self.encode(events)
        self._buffer.append((seq, payload))
        if send:
            self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
            self.published += 1
        return seq

    def restart(self) -> None:
        """A new engine: numbering from 0, an empty cache and an empty replay buffer."""
        self.blocks.clear()
        self.seq = 0
        self._buffer.clear()

    def send_raw(self, frames: list[bytes]) -> None:
        self._pub.send_multipart(frames)

    async def _serve_replays(self) -> None:
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                continue
            self.replay_requests += 1
            if not self.answer_replays:
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    await self._replay.send_multipart(
                        [client, b"", self.topic, seq.to_bytes(8, "big"), payload])
            await self._replay.send_multipart([client, b"", b"", END_SEQ, b""])
