"""The workers' control channel: how one worker of `--workers N` reaches the others.

Each worker (see `proxy.workers`) keeps its own router: its own clusters, health checks,
ejections, retry budget, auto mode's measurements and metrics. Two things must still show
or change the whole router, whichever worker a client reaches:

- `GET /metrics`: the worker that takes the scrape asks every other worker for its
  exposition, adds a `worker="i"` label to every sample and merges the families into one
  exposition (`merge_expositions`). A worker that does not answer within
  `timeouts.health` is left out, and `pdproxy_worker_up{worker}` says so (0); the scrape
  never waits longer than that.
- the admin API: the worker that takes a call applies it (`admin.apply`) and then
  forwards it to every other worker, which applies it too but forwards nothing; the answer
  comes once all have answered, or is an error naming each worker that failed.

Why a `worker` label, not prometheus-client's multiprocess mode: several of our metrics
are read when scraped (each endpoint's in-flight count and health, the requests in
flight), which multiprocess mode cannot share between processes, and per-worker series
keep what each worker saw (its health view, its ejections) apart; `sum without (worker)`
gives the router's total.

The channel: each worker listens on a unix socket `worker-<i>.sock` in a directory made
for this run by the supervisor with mode 0700, so only the router's own user can reach it.
One request per connection, each way one frame: a 4-byte big-endian length, then a
msgpack `ControlEnvelope` (request) or `ControlReply` (answer).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from prometheus_client import generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from proxy.api.admin import AdminCall, apply
from proxy.config import EndpointConfig
from proxy.errors import RouterError

if TYPE_CHECKING:
    from proxy.flow.router import Router

logger = logging.getLogger("pdproxy.control")

# History: 1: metrics and admin calls.
CONTROL_VERSION = 1
MAX_FRAME_BYTES = 64 * 1024 * 1024  # a large pool's exposition is a few MB at most
_LENGTH = struct.Struct(">I")


class MetricsQuery(msgspec.Struct, frozen=True, tag="metrics"):
    """Ask a worker for its own Prometheus exposition."""


class AdminApply(msgspec.Struct, frozen=True, tag="admin"):
    """Ask a worker to apply an admin call (already authorized by the worker that took it)."""

    call: AdminCall


class ServersQuery(msgspec.Struct, frozen=True, tag="servers"):
    """Ask a worker for its servers (`Servers`): a restarted worker takes them, so that
    the admin API's changes made before it started are not lost on it."""


class Servers(msgspec.Struct, frozen=True):
    prefill: list[EndpointConfig]
    decode: list[EndpointConfig]


ControlRequest = MetricsQuery | AdminApply | ServersQuery


class ControlEnvelope(msgspec.Struct, frozen=True):
    version: int
    request: ControlRequest


class ControlReply(msgspec.Struct, frozen=True):
    status: int  # HTTP status of the local answer
    body: bytes  # exposition text, or JSON (an answer or an OpenAI-shaped error)


class WorkerError(RouterError):
    """502: an admin change reached some workers and failed (or got no answer) on others."""

    status = 502
    error_type = "worker_error"


_envelope_decoder = msgspec.msgpack.Decoder(ControlEnvelope)
_reply_decoder = msgspec.msgpack.Decoder(ControlReply)


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    (size,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"control frame of {size} bytes is over {MAX_FRAME_BYTES}")
    return await reader.readexactly(size)


def _frame(message: msgspec.Struct) -> bytes:
    payload = msgspec.msgpack.encode(message)
    return _LENGTH.pack(len(payload)) + payload


def socket_path(directory: Path, index: int) -> Path:
    return directory / f"worker-{index}.sock"


class WorkerGroup:
    """This worker's place among `count` workers, and its control listener.

    Made in the worker process before the app; the app's lifespan starts the listener
    with the router (`start`) and closes it after the router stopped serving (`aclose`),
    so that the other workers can reach this one for as long as it has a router."""

    def __init__(self, index: int, count: int, directory: Path, *, timeout: float,
                 restarted: bool = False) -> None:
        if not 0 <= index < count:
            raise ValueError(f"worker index {index} out of range for {count} workers")
        self.index = index
        self.count = count
        self.restarted = restarted  # a restart: take the others' servers when it starts
        self.directory = directory
        self.timeout = timeout  # seconds: the longest wait for the other workers (timeouts.health)
        self._router: Router | None = None  # set by start(), for the listener's answers
        self._server: asyncio.AbstractServer | None = None  # owned: closed by aclose()

    @property
    def peers(self) -> list[int]:
        return [i for i in range(self.count) if i != self.index]

    async def start(self, router: Router) -> None:
        self._router = router
        path = socket_path(self.directory, self.index)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # left by this worker's previous process
        self._server = await asyncio.start_unix_server(self._serve, path=os.fspath(path))
        if self.restarted:
            await self._take_servers(router)

    async def _take_servers(self, router: Router) -> None:
        """A restarted worker read the config file as it is now; the others may have
        added, removed or drained servers since, through the admin API. Take the servers
        of the first worker that answers (within `timeout`), before serving."""
        replies = await self._ask_peers(ServersQuery())
        for index, reply in sorted(replies.items()):
            if isinstance(reply, str) or reply.status != 200:
                continue
            servers = msgspec.msgpack.decode(reply.body, type=Servers)
            changes = router.membership.match(servers.prefill, servers.decode)
            logger.info("worker %d restarted: took worker %d's servers (%s)", self.index,
                        index, ", ".join(changes) or "no change")
            return
        logger.warning(
            "worker %d restarted and no other worker gave it their servers (%s): it serves "
            "the config file's, without admin API changes made before it started", self.index,
            "; ".join(f"worker {i}: {r if isinstance(r, str) else f'status {r.status}'}"
                      for i, r in sorted(replies.items())))

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            socket_path(self.directory, self.index).unlink()

    # --- the listener: this worker's own answers ----------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(self.timeout):
                envelope = _envelope_decoder.decode(await _read_frame(reader))
                writer.write(_frame(self._answer(envelope)))
                await writer.drain()
        except (OSError, EOFError, ValueError, msgspec.DecodeError, TimeoutError) as exc:
            logger.warning("control channel: a request failed: %r", exc)
        except Exception:  # one bad request must not go unlogged; the listener goes on
            logger.exception("control channel: unexpected error")
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    def _answer(self, envelope: ControlEnvelope) -> ControlReply:
        router = self._router
        if router is None:
            return ControlReply(503, b"not started")
        if envelope.version != CONTROL_VERSION:
            return ControlReply(400, f"control version {envelope.version}, this worker speaks "
                                     f"{CONTROL_VERSION}".encode())
        request = envelope.request
        if isinstance(request, MetricsQuery):
            return ControlReply(200, router.metrics.render())
        if isinstance(request, ServersQuery):
            return ControlReply(200, msgspec.msgpack.encode(Servers(*router.membership.servers())))
        try:
            status, answer = apply(router, request.call)
        except RouterError as exc:
            return ControlReply(exc.status, exc.body())
        return ControlReply(status, msgspec.json.encode(answer))

    # --- asking the others -----------------------------------------------------------

    async def _ask(self, index: int, request: ControlRequest) -> ControlReply:
        reader, writer = await asyncio.open_unix_connection(
            os.fspath(socket_path(self.directory, index)))
        try:
            writer.write(_frame(ControlEnvelope(CONTROL_VERSION, request)))
            await writer.drain()
            return _reply_decoder.decode(await _read_frame(reader))
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def _ask_peers(self, request: ControlRequest) -> dict[int, ControlReply | str]:
        """Every other worker's reply, or why there is none, within `timeout` seconds."""

        async def one(index: int) -> ControlReply | str:
            try:
                async with asyncio.timeout(self.timeout):
                    return await self._ask(index, request)
            except TimeoutError:
                return f"no answer within {self.timeout:g} s (timeouts.health)"
            except (OSError, EOFError, ValueError, msgspec.DecodeError) as exc:
                return f"unreachable ({exc.__class__.__name__}: {exc})"

        async with asyncio.TaskGroup() as group:
            tasks = {i: group.create_task(one(i), name=f"control-ask-worker-{i}")
                     for i in self.peers}
        return {i: task.result() for i, task in tasks.items()}

    async def metrics(self, local: bytes) -> bytes:
        """The whole router's exposition: this worker's `local` and every other's."""
        texts: dict[int, str | None] = {self.index: local.decode()}
        for index, reply in (await self._ask_peers(MetricsQuery())).items():
            if isinstance(reply, str) or reply.status != 200:
                why = reply if isinstance(reply, str) else f"status {reply.status}"
                logger.warning("metrics: worker %d left out of this scrape: %s", index, why)
                texts[index] = None
            else:
                texts[index] = reply.body.decode()
        return merge_expositions(texts)

    async def spread(self, call: AdminCall, answer: dict[str, Any]) -> dict[str, Any]:
        """Forward an admin call applied here (its `answer`) to every other worker.

        A GET gathers each worker's view under "workers"; a change answers once every
        worker applied it, else raises `WorkerError` naming those that did not."""
        replies = await self._ask_peers(AdminApply(call))
        if call.method == "GET":
            views: dict[int, dict[str, Any]] = {self.index: answer}
            for index, reply in replies.items():
                if isinstance(reply, str):
                    views[index] = {"error": reply}
                elif reply.status != 200:
                    views[index] = {"error": _error_message(reply.body)}
                else:
                    views[index] = msgspec.json.decode(reply.body)
            return {**answer, "worker": self.index,
                    "workers": [{"worker": i, **views[i]} for i in sorted(views)]}
        failed = {}
        for index, reply in replies.items():
            if isinstance(reply, str):
                failed[index] = reply
            elif reply.status >= 400:
                failed[index] = _error_message(reply.body)
        if failed:
            applied = sorted({self.index, *(set(replies) - set(failed))})
            raise WorkerError(
                f"{call.method} {call.path} applied on worker(s) "
                f"{', '.join(map(str, applied))}, failed on "
                + "; ".join(f"worker {i}: {why}" for i, why in sorted(failed.items())))
        return {**answer, "workers": list(range(self.count))}


def _error_message(body: bytes) -> str:
    try:
        return str(msgspec.json.decode(body)["error"]["message"])
    except (msgspec.DecodeError, KeyError, TypeError):
        return body.decode(errors="replace")[:200]


# --- the merged exposition -----------------------------------------------------------


class _Families:
    """A collector of ready-made families, for `generate_latest`."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def merge_expositions(texts: dict[int, str | None]) -> bytes:
    """One Prometheus text exposition from each worker's (index -> text; None: the worker
    did not answer): every sample gets `worker="<index>"`, families of the same name are
    merged (in the order first seen), and `pdproxy_worker_up{worker}` says which workers
    are in it."""
    merged: dict[str, Metric] = {}
    up = GaugeMetricFamily("pdproxy_worker_up",
                           "1 when this scrape includes the worker's metrics, 0 when the "
                           "worker did not answer in time (timeouts.health)",
                           labels=["worker"])
    for index in sorted(texts):
        text = texts[index]
        up.add_metric([str(index)], 0 if text is None else 1)
        if text is None:
            continue
        label = str(index)
        for family in text_string_to_metric_families(text):
            target = merged.get(family.name)
            if target is None:
                target = merged[family.name] = Metric(family.name, family.documentation,
                                                      family.type, family.unit)
            target.samples += [sample._replace(labels={**sample.labels, "worker": label})
                               for sample in family.samples]
    return generate_latest(_Families([*merged.values(), up]))
