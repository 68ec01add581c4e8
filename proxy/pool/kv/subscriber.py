"""The router's subscriptions to every server's vLLM KV events, feeding `KvIndex`.

`KvEventSubscriber` owns one task per event publisher (a server, or one data-parallel
rank of it) and one background round (`Periodic`) that finds publishers:

- a server's `kv_events` (and `kv_events_replay`) in the config win;
- otherwise `GET /kv_event_sources` (vLLM 0.32+) lists its publishers per rank, each
  with the endpoint it binds; a wildcard host (`*`, `0.0.0.0`, `::`) means the server's
  own host. A server that lists none (events off, an older vLLM) is logged once and
  asked again at the next round; until then the policy scores it by load alone.
- a server that left the clusters takes its tasks and its index entries with it.

Each source's task connects a SUB socket, replays what the publisher still buffers
(from its batch 0, so blocks cached before the router started are known), then hands
every message to its `SourceIndex`.
When the index finds batches missing (`NeedReplay`), the task asks the publisher's
replay socket (a DEALER to vLLM's ROUTER: `["", start]`, answered by
`["", topic, seq, payload]` frames up to a `seq` of -1) within `replay_timeout`;
what a replay cannot deliver is `lost`.

A lost connection (a restarted server, a network blink, or ZMQ dropping the publisher
for an oversized message, after which ZMQ itself never reconnects) ends that
subscription; the task subscribes again after a backoff (0.1 s, doubled up to 5 s) and
replays what it missed.

Bad input costs the sender, never the router: a message over `max_event_bytes` is
dropped by ZMQ itself (`MAXMSGSIZE`), the socket queues at most `RECEIVE_HWM`
messages, garbage is counted and dropped, and the task yields to the event loop every
`BATCH` messages, so a flood cannot starve requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import msgspec
import zmq
import zmq.asyncio

from proxy.config import KvAware
from proxy.errors import Overloaded, UpstreamError
from proxy.metrics import RouterMetrics
from proxy.pool.endpoints import Endpoint
from proxy.pool.kv.events import EventBatch, Malformed, decode_batch
from proxy.pool.kv.index import REPLAY_WINDOW, KvIndex, NeedReplay, SourceIndex
from proxy.pool.periodic import Periodic
from proxy.upstream.client import UpstreamClient

logger = logging.getLogger("pdproxy.kv")

BATCH = 64  # messages handled before the task yields to the event loop
RECEIVE_HWM = 10_000  # messages a SUB socket queues before ZMQ drops (then: a gap)
END_SEQ = -1  # the replay's last frame
RESUBSCRIBE_MIN_S = 0.1  # after a lost connection, the first wait before subscribing again
RESUBSCRIBE_MAX_S = 5.0  # ... doubled each time it is lost again at once, up to this
_WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]")


class Publisher(msgspec.Struct, frozen=True):
    """One KV event publisher: its PUB endpoint, replay endpoint and topic."""

    rank: int
    endpoint: str
    replay: str | None = None
    topic: str = ""


def publishers_from_sources(server_url: str, sources: object) -> list[Publisher]:
    """What a vLLM's `/kv_event_sources` answer lists: `{rank: KVEventsConfig}`, with
    wildcard hosts replaced by the server's own host. Publishers that are off or not ZMQ
    are skipped; a malformed answer lists none."""
    if not isinstance(sources, dict):
        return []
    host = urlsplit(server_url).hostname or "127.0.0.1"
    found = []
    for rank, config in sources.items():
        if not isinstance(config, dict) or not config.get("enable_kv_cache_events"):
            continue
        endpoint = config.get("endpoint")
        if config.get("publisher", "zmq") != "zmq" or not isinstance(endpoint, str):
            continue
        replay = config.get("replay_endpoint")
        try:
            found.append(Publisher(
                rank=int(rank), endpoint=_on_host(endpoint, host),
                replay=_on_host(replay, host) if isinstance(replay, str) else None,
                topic=str(config.get("topic") or "")))
        except ValueError:
            continue
    return sorted(found, key=lambda p: p.rank)


def _on_host(endpoint: str, host: str) -> str:
    """`tcp://*:5557` on `host` is `tcp://host:5557`; other endpoints are kept."""
    scheme, sep, rest = endpoint.partition("://")
    if scheme != "tcp" or not sep:
        return endpoint
    bound, _, port = rest.rpartition(":")
    if bound in _WILDCARD_HOSTS:
        bound = f"[{host}]" if ":" in host else host
    return f"tcp://{bound}:{port}"


class KvEventSubscriber:
    def __init__(
        self,
        index: KvIndex,
        endpoints: Callable[[], list[Endpoint]],  # the servers to follow, at each round
        client: UpstreamClient,
        metrics: RouterMetrics,
        settings: KvAware,
        *,
        timeout: float,
    ) -> None:
        self.index = index
        self._endpoints = endpoints
        self._client = client
        self._metrics = metrics
        self._settings = settings
        self._timeout = timeout
        self._context = zmq.asyncio.Context()
        self._tasks: dict[tuple[str, int], asyncio.Task[None]] = {}  # (url, rank) -> task
        self._publishers: dict[str, list[Publisher]] = {}  # url -> its publishers
        self._silent: set[str] = set()  # urls that listed no publisher (logged once)
        self._rounds = Periodic("kv-events", settings.discovery_interval, self.reconcile,
                                at_once=True)

    def start(self) -> None:
        self._rounds.start()

    async def aclose(self) -> None:
        await self._rounds.aclose()
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        self._context.destroy(linger=0)

    async def reconcile(self) -> None:
        """One round: follow new servers, drop those that left, and bound each server's
        index by its KV cache's blocks once its /metrics said how many."""
        endpoints = {e.url: e for e in self._endpoints()}
        for url in list(self._publishers):
            if url not in endpoints:
                self._drop(url)
        for endpoint in endpoints.values():
            blocks = endpoint.load.num_blocks if endpoint.load is not None else None
            if blocks:
                for source in self.index.sources(endpoint.url):
                    source.max_blocks = min(self._settings.max_blocks_per_server, blocks)
        await asyncio.gather(*(self._follow(e) for e in endpoints.values()
                               if e.url not in self._publishers))

    async def _follow(self, endpoint: Endpoint) -> None:
        publishers = await self._discover(endpoint)
        if not publishers:
            return
        self._publishers[endpoint.url] = publishers
        self._silent.discard(endpoint.url)
        for publisher in publishers:
            source = self.index.source(endpoint.url, publisher.rank)
            key = (endpoint.url, publisher.rank)
            self._tasks[key] = asyncio.create_task(
                self._run(source, publisher), name=f"kv-events {endpoint.url} rank {publisher.rank}")
        logger.info("%s %s: following KV events at %s", endpoint.cluster.value, endpoint.url,
                    ", ".join(p.endpoint for p in publishers))

    async def _discover(self, endpoint: Endpoint) -> list[Publisher]:
        c = endpoint.config
        if c.kv_events:
            return [Publisher(rank=0, endpoint=c.kv_events, replay=c.kv_events_replay)]
        why = "it lists no KV event publisher (start vLLM with --kv-events-config)"
        try:
            sources = await self._client.get_json(
                f"{endpoint.url}/kv_event_sources", endpoint=endpoint.url,
                cluster=endpoint.cluster.value, timeout=self._timeout)
            found = publishers_from_sources(endpoint.url, sources)
        except (UpstreamError, Overloaded) as exc:
            found, why = [], f"GET /kv_event_sources failed: {exc}"
        if not found and endpoint.url not in self._silent:
            self._silent.add(endpoint.url)
            self._metrics.kv_fallbacks.labels(endpoint.cluster.value, "no_publisher").inc()
            logger.warning("%s %s: no KV events, so kv_aware scores it by load alone: %s",
                           endpoint.cluster.value, endpoint.url, why)
        return found

    def _drop(self, url: str) -> None:
        for key in [k for k in self._tasks if k[0] == url]:
            self._tasks.pop(key).cancel()
        self._publishers.pop(url, None)
        self._silent.discard(url)
        self.index.forget(url)
        self._metrics.forget_endpoint(url)  # its series, which its tasks may have renewed

    # --- one source -------------------------------------------------------------------

    async def _run(self, source: SourceIndex, publisher: Publisher) -> None:
        """Subscribe, and subscribe again whenever the connection is lost: ZMQ does not
        reconnect after it dropped a peer for an oversized message, and what the
        publisher sent meanwhile is replayed (an idle publisher would send nothing that
        shows the gap)."""
        backoff = RESUBSCRIBE_MIN_S
        while True:
            started = time.monotonic()
            await self._subscribe(source, publisher)
            if time.monotonic() - started > RESUBSCRIBE_MAX_S:
                backoff = RESUBSCRIBE_MIN_S  # it held a while: not a loop of failures
            logger.warning("%s rank %d: lost the KV event publisher %s; subscribing again "
                           "in %.1f s", source.url, source.rank, publisher.endpoint, backoff)
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, RESUBSCRIBE_MAX_S)

    async def _subscribe(self, source: SourceIndex, publisher: Publisher) -> None:
        """One subscription, until its connection drops."""
        socket = self._context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, self._settings.max_event_bytes)
        socket.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        socket.setsockopt(zmq.SUBSCRIBE, publisher.topic.encode())
        monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        socket.connect(publisher.endpoint)
        lock = asyncio.Lock()  # the live loop and a replay, one at a time
        live = asyncio.create_task(self._live(source, publisher, socket, lock))
        try:
            async with lock:  # blocks cached before (or while it was away) from the replay
                if source.last_seq is None or source.last_seq < 0:
                    await self._catch_up(source, publisher)
                else:
                    await self._replay(source, publisher, source.last_seq + 1, upto=None)
            await monitor.recv_multipart()  # until the connection drops
        finally:
            live.cancel()
            await asyncio.gather(live, return_exceptions=True)
            socket.disable_monitor()
            monitor.close(linger=0)
            socket.close(linger=0)

    async def _live(self, source: SourceIndex, publisher: Publisher,
                    socket: zmq.asyncio.Socket, lock: asyncio.Lock) -> None:
        handled = 0
        while True:
            frames = await socket.recv_multipart()
            async with lock:
                try:
                    await self._handle(source, publisher, frames)
                except Exception:  # one bad message never ends the subscription
                    logger.exception("%s rank %d: a KV event batch failed", source.url,
                                     source.rank)
            handled += 1
            if handled % BATCH == 0:
                await asyncio.sleep(0)  # a flood must not starve requests

    async def _handle(self, source: SourceIndex, publisher: Publisher, frames: list[bytes]) -> None:
        message = self._parse(source, frames)
        if message is None:
            return
        seq, batch = message
        outcome = source.accept(seq, batch)
        if isinstance(outcome, NeedReplay):
            await self._replay(source, publisher, outcome.start, upto=seq)
            outcome = source.accept(seq, batch)
        self._count(source, outcome)

    def _parse(self, source: SourceIndex, frames: list[bytes]) -> tuple[int, EventBatch] | None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self._garbage(source, "frames")
            return None
        seq = int.from_bytes(frames[1], "big", signed=True)
        try:
            batch = decode_batch(frames[2])
        except Malformed:
            self._garbage(source, "malformed")
            return None
        if seq < 0:
            self._garbage(source, "sequence")
            return None
        return seq, batch

    def _garbage(self, source: SourceIndex, why: str) -> None:
        self._metrics.kv_events_dropped.labels(source.url, why).inc()

    def _count(self, source: SourceIndex, outcome: object) -> None:
        name = type(outcome).__name__.lower()
        self._metrics.kv_event_batches.labels(source.url, name).inc()
        wiped = getattr(outcome, "wiped", None)
        if wiped is not None:
            logger.warning("%s rank %d: KV index wiped (%s)", source.url, source.rank, wiped)
        if source.last_event_ts is not None:
            self._metrics.kv_event_lag.labels(source.url).set(
                max(0.0, time.time() - source.last_event_ts))

    async def _catch_up(self, source: SourceIndex, publisher: Publisher) -> None:
        """At subscription: replay what the publisher still has from its first batch, so
        blocks stored before the router started are known. Live batches queued meanwhile
        are recognised as duplicates. Without a replay socket only later blocks are known
        (said once in the log). A replay that did not answer leaves the server unknown:
        its next live batch asks again."""
        if publisher.replay is None:
            logger.warning("%s rank %d: its KV events have no replay socket, so blocks it "
                           "cached before now are unknown to the router (set vLLM's "
                           "replay_endpoint)", source.url, source.rank)
            source.start_empty()
            return
        batches, complete = await self._fetch_replay(source, publisher, 0)
        if not batches:
            if complete:  # the publisher has published nothing yet
                source.start_empty()
            return
        self._metrics.kv_replays.labels(source.url).inc()
        if batches[0][0] > 0:
            source.lost(batches[0][0])
        for seq, batch in batches:
            self._count(source, source.accept(seq, batch, replayed=True))

    async def _replay(self, source: SourceIndex, publisher: Publisher, start: int, *,
                      upto: int | None) -> None:
        """Fetch batches from `start` from the replay socket and apply them; what it
        cannot give before `upto` (the live message's number; None: after a reconnect,
        none known missing) is lost."""
        self._metrics.kv_replays.labels(source.url).inc()
        batches = (await self._fetch_replay(source, publisher, start))[0] if publisher.replay \
            else []
        if not batches and upto is None:
            return
        first = batches[0][0] if batches else upto
        assert first is not None
        if first > start:
            logger.warning("%s rank %d: KV event batches %d-%d could not be replayed",
                           source.url, source.rank, start, first - 1)
            source.lost(first)
        for seq, batch in batches:
            self._count(source, source.accept(seq, batch, replayed=True))

    async def _fetch_replay(self, source: SourceIndex, publisher: Publisher,
                            start: int) -> tuple[list[tuple[int, EventBatch]], bool]:
        """The batches from `start` in order without holes, and whether the publisher
        said it had no more (False: the replay timed out)."""
        assert publisher.replay is not None
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, self._settings.max_event_bytes)
        batches: list[tuple[int, EventBatch]] = []
        complete = False
        try:
            socket.connect(publisher.replay)
            await socket.send_multipart([b"", start.to_bytes(8, "big")])
            async with asyncio.timeout(self._settings.replay_timeout):
                while len(batches) <= REPLAY_WINDOW:
                    frames = await socket.recv_multipart()
                    if len(frames) == 4 and len(frames[2]) == 8 and int.from_bytes(
                            frames[2], "big", signed=True) == END_SEQ:
                        complete = True
                        break
                    message = self._parse(source, frames[1:]) if len(frames) == 4 else None
                    if message is not None and message[0] >= start:
                        batches.append(message)
        except TimeoutError:
            logger.warning("%s rank %d: the KV event replay from %d timed out after %.1f s "
                           "with %d batches", source.url, source.rank, start,
                           self._settings.replay_timeout, len(batches))
        finally:
            socket.close(linger=0)
        batches.sort(key=lambda m: m[0])
        # Keep the run without holes from the first one: past a hole, the live stream's
        # own gap detection asks again.
        run = batches[:1]
        for seq, batch in batches[1:]:
            if seq == run[-1][0] + 1:
                run.append((seq, batch))
            elif seq > run[-1][0] + 1:
                break
        return run, complete
