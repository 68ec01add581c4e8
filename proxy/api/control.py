"""The workers' control channel: how one worker of `--workers N` reaches the others.

Each worker (see `proxy.workers`) keeps its own router: its own clusters, health checks,
ejections, retry budget, auto mode's measurements and metrics. Three things must still
show or change the whole router, whichever worker a client reaches:

- `GET /metrics`: the worker that takes the scrape asks every other worker for its
  exposition, adds a `worker="i"` label to every sample and merges the families into one
  exposition (`merge_expositions`). A worker that does not answer within
  `timeouts.health` is left out, and `pdproxy_worker_up{worker}` says so (0); the scrape
  never waits longer than that.
- the servers: an admin API change, and a change of the config file (watched, or read
  again on SIGHUP), is made by one worker for all, one change at a time. That worker
  takes the workers' lock (an flock in the supervisor's directory), applies the change
  (`admin.apply`, or the file's server lists), writes the servers that result to the
  workers' state file with the change's number (`ServerState`), and forwards it to every
  other worker (the admin call, or "take the state") before it lets the lock go: every
  worker applies the changes in the same order. The answer comes once all have answered,
  or is an error naming each worker that failed; a worker that missed a change (or got
  one out of turn) takes the state file's servers instead, and so does every worker at
  its next heartbeat when it is behind.
- a (re)started worker takes the state file's servers before it serves: no restart
  loses an admin change, even when every worker died. Unless the config file changed
  since the last change (and is watched): then the file is newest, and this worker
  applies it for all, as a watcher would. The file lives as long as the supervisor's
  directory (mode 0600 in a 0700 directory: it holds the servers' api_key settings).
  Servers that Kubernetes discovery found are not in it: each worker finds them itself.

Why a `worker` label, not prometheus-client's multiprocess mode: several of our metrics
are read when scraped (each endpoint's in-flight count and health, the requests in
flight), which multiprocess mode cannot share between processes, and per-worker series
keep what each worker saw (its health view, its ejections) apart; `sum without (worker)`
gives the router's total.

The channel: each worker listens on a unix socket `worker-<i>.sock` in a directory made
for this run by the supervisor with mode 0700, so only the router's own user can reach it.
One request per connection, each way one frame: a 4-byte big-endian length, then a
msgpack `ControlEnvelope` (request) or `ControlReply` (answer). The supervisor uses it too,
for heartbeats (`heartbeat_frame`, `read_reply`): a worker whose event loop is stuck
answers none.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import struct
from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from prometheus_client import generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from proxy.api.admin import AdminCall, Answer, apply
from proxy.config import EndpointConfig
from proxy.errors import RouterError

if TYPE_CHECKING:
    from proxy.flow.router import Router
    from proxy.pool.membership import ConfigWatcher, Stamp

logger = logging.getLogger("pdproxy.control")

# History: 1: metrics and admin calls. 2: heartbeats; changes numbered and ordered through
# the workers' state file (`SyncTo`), which replaced asking a peer for its servers.
CONTROL_VERSION = 2
MAX_FRAME_BYTES = 64 * 1024 * 1024  # a large pool's exposition is a few MB at most
_LENGTH = struct.Struct(">I")
STATE_FILE = "servers.state"
LOCK_FILE = "servers.lock"
LOCK_POLL_S = 0.005  # how often a change waiting for the workers' lock tries again


class MetricsQuery(msgspec.Struct, frozen=True, tag="metrics"):
    """Ask a worker for its own Prometheus exposition."""


class AdminApply(msgspec.Struct, frozen=True, tag="admin"):
    """Ask a worker to apply an admin call (already authorized by the worker that took
    it): a change, numbered `seq` in the state file, or a read (`seq` None)."""

    call: AdminCall
    seq: int | None = None


class SyncTo(msgspec.Struct, frozen=True, tag="sync"):
    """The state file holds change `seq`: take its servers (a config file applied)."""

    seq: int


class Heartbeat(msgspec.Struct, frozen=True, tag="heartbeat"):
    """The supervisor's: an answer shows that this worker's event loop runs."""


ControlRequest = MetricsQuery | AdminApply | SyncTo | Heartbeat


class ControlEnvelope(msgspec.Struct, frozen=True):
    version: int
    request: ControlRequest


class ControlReply(msgspec.Struct, frozen=True):
    status: int  # HTTP status of the local answer
    body: bytes  # exposition text, or JSON (an answer or an OpenAI-shaped error)


class ServerState(msgspec.Struct, frozen=True):
    """The workers' servers after their last change (the state file): those of the
    config file and the admin API, with `drain` saying whether each drains."""

    seq: int  # the change's number: one more than the one before
    config_stamp: tuple[float, int] | None  # the config file these follow (mtime, size)
    prefill: list[EndpointConfig]
    decode: list[EndpointConfig]


class WorkerError(RouterError):
    """502: an admin change reached some workers and failed (or got no answer) on others,
    or could not be made (the workers' lock stayed taken)."""

    status = 502
    error_type = "worker_error"


_envelope_decoder = msgspec.msgpack.Decoder(ControlEnvelope)
_reply_decoder = msgspec.msgpack.Decoder(ControlReply)
_state_decoder = msgspec.msgpack.Decoder(ServerState)


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    (size,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"control frame of {size} bytes is over {MAX_FRAME_BYTES}")
    return await reader.readexactly(size)


def _frame(message: msgspec.Struct) -> bytes:
    payload = msgspec.msgpack.encode(message)
    return _LENGTH.pack(len(payload)) + payload


def heartbeat_frame() -> bytes:
    """The supervisor's heartbeat request, framed."""
    return _frame(ControlEnvelope(CONTROL_VERSION, Heartbeat()))


def read_reply(data: bytes) -> ControlReply | None:
    """The reply framed in `data`, the bytes read so far; None while it is incomplete.
    Raises ValueError (or msgspec.DecodeError) for a frame that is not a reply."""
    if len(data) < _LENGTH.size:
        return None
    (size,) = _LENGTH.unpack_from(data)
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"control frame of {size} bytes is over {MAX_FRAME_BYTES}")
    if len(data) < _LENGTH.size + size:
        return None
    return _reply_decoder.decode(data[_LENGTH.size:_LENGTH.size + size])


def socket_path(directory: Path, index: int) -> Path:
    return directory / f"worker-{index}.sock"


class WorkerGroup:
    """This worker's place among `count` workers, its control listener, and its part in
    the workers' shared state (the module's docstring).

    Made in the worker process before the app; the app's lifespan starts the listener
    with the router (`start`) and closes it after the router stopped serving (`aclose`),
    so that the other workers can reach this one for as long as it has a router."""

    def __init__(self, index: int, count: int, directory: Path, *, timeout: float) -> None:
        if not 0 <= index < count:
            raise ValueError(f"worker index {index} out of range for {count} workers")
        self.index = index
        self.count = count
        self.directory = directory
        self.timeout = timeout  # seconds: the longest wait for the other workers (timeouts.health)
        self.seq = -1  # the last change of the state file this worker has (-1: none yet)
        self._state_seen: tuple[int, int, int] | None = None  # the state file last read
        self._router: Router | None = None  # set by start(), for the listener's answers
        self._server: asyncio.AbstractServer | None = None  # owned: closed by aclose()

    @property
    def peers(self) -> list[int]:
        return [i for i in range(self.count) if i != self.index]

    @property
    def router(self) -> Router:
        if self._router is None:
            raise RuntimeError("the worker group is not started")
        return self._router

    async def start(self, router: Router) -> None:
        self._router = router
        if router.watcher is not None:
            router.watcher.apply_change = self._apply_file
        path = socket_path(self.directory, self.index)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # left by this worker's previous process
        self._server = await asyncio.start_unix_server(self._serve, path=os.fspath(path))
        await self._join()

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            socket_path(self.directory, self.index).unlink()

    # --- the shared state ---------------------------------------------------------

    async def _join(self) -> None:
        """Before serving: take the workers' servers from the state file (the first
        worker ever writes it), or apply the config file for all when it changed since
        the last change and is watched."""
        watcher = self.router.watcher
        async with self._locked():
            state = self._read_state()
            if state is None:
                self._write_state(None, watcher.seen if watcher is not None else None)
                return
            if watcher is not None and watcher.interval > 0 and state.config_stamp != watcher.seen:
                await self._apply_file_locked(watcher, state, force=True)
                return
            self._take(state)
            logger.info("worker %d took the workers' servers (change %d)", self.index, state.seq)

    async def _apply_file(self, force: bool) -> list[str] | None:
        """The config file changed (or `force`: SIGHUP): apply its server lists for every
        worker, unless another worker already did (`ConfigWatcher.apply_change`)."""
        watcher = self.router.watcher
        assert watcher is not None  # only a watcher calls this
        async with self._locked():
            return await self._apply_file_locked(watcher, self._read_state(), force=force)

    async def _apply_file_locked(self, watcher: ConfigWatcher, state: ServerState | None, *,
                                 force: bool) -> list[str] | None:
        stamp = watcher.seen = watcher.stamp()  # the file as it is now
        self._take(state)
        if not force and state is not None and state.config_stamp == stamp:
            return None  # another worker applied this file for every worker
        changes = watcher.read_and_apply()
        if changes is None:
            return None  # refused: nothing changed
        seq = self._write_state(state, stamp)
        failed = self._failures(await self._ask_peers(SyncTo(seq)))
        if failed:
            logger.warning("config %s applied here, not yet on %s", watcher.path, "; ".join(
                f"worker {i}: {why}" for i, why in sorted(failed.items())))
        return changes

    async def admin(self, call: AdminCall) -> Answer:
        """An admin call taken by this worker, applied on every worker. A GET answers
        this worker's view plus every worker's under "workers"; a change is made under
        the workers' lock (one at a time, in one order everywhere) and answers once every
        worker applied it, else raises `WorkerError` naming those that did not."""
        router = self.router
        if call.method == "GET":
            status, answer = apply(router, call)
            return status, self._views(answer, await self._ask_peers(AdminApply(call)))
        async with self._locked():
            state = self._read_state()
            self._take(state)
            status, answer = apply(router, call)  # refused (raises): nothing to forward
            watcher = router.watcher
            stamp = state.config_stamp if state is not None else (
                watcher.seen if watcher is not None else None)
            seq = self._write_state(state, stamp)
            failed = self._failures(await self._ask_peers(AdminApply(call, seq)))
        if failed:
            applied = sorted({self.index, *(set(self.peers) - set(failed))})
            raise WorkerError(
                f"{call.method} {call.path} applied on worker(s) "
                f"{', '.join(map(str, applied))}, failed on "
                + "; ".join(f"worker {i}: {why}" for i, why in sorted(failed.items()))
                + " (a worker that missed it takes the workers' servers at its next heartbeat)")
        return status, {**answer, "workers": list(range(self.count))}

    def _views(self, answer: dict[str, Any], replies: dict[int, ControlReply | str]
               ) -> dict[str, Any]:
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

    @staticmethod
    def _failures(replies: dict[int, ControlReply | str]) -> dict[int, str]:
        return {i: reply if isinstance(reply, str) else _error_message(reply.body)
                for i, reply in replies.items()
                if isinstance(reply, str) or reply.status >= 400}

    @contextlib.asynccontextmanager
    async def _locked(self) -> AsyncIterator[None]:
        """Hold the workers' lock: one change at a time among every worker (and every
        task of this one). A change holds it for its own apply and at most `timeout` of
        forwarding, so a wait past twice that is given up (WorkerError)."""
        fd = os.open(self.directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 2 * self.timeout
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if loop.time() >= deadline:
                        raise WorkerError(
                            f"another change held the workers' lock for over "
                            f"{2 * self.timeout:g} s: try again") from None
                    await asyncio.sleep(LOCK_POLL_S)
            yield
        finally:
            os.close(fd)  # lets the lock go

    def _read_state(self) -> ServerState | None:
        path = self.directory / STATE_FILE
        try:
            data = path.read_bytes()
            stat = os.stat(path)
        except FileNotFoundError:
            return None
        self._state_seen = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        try:
            return _state_decoder.decode(data)
        except (msgspec.DecodeError, ValueError) as exc:
            logger.error("the workers' state file %s does not read (%s): ignored", path, exc)
            return None

    def _write_state(self, previous: ServerState | None, stamp: Stamp | None) -> int:
        """Write this worker's servers as the next change after `previous`; its number."""
        seq = previous.seq + 1 if previous is not None else 0
        prefill, decode = self.router.membership.servers()
        path = self.directory / STATE_FILE
        part = path.with_name(f"{STATE_FILE}.{self.index}")
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(msgspec.msgpack.encode(ServerState(seq, stamp, prefill, decode)))
        os.replace(part, path)  # readers see the old file or the new, never a part
        self.seq = seq
        return seq

    def _take(self, state: ServerState | None) -> None:
        """Catch up with the state file: its servers, when it has changes this worker
        lacks."""
        if state is None or state.seq <= self.seq:
            return
        changes = self.router.membership.match(state.prefill, state.decode)
        self.seq = state.seq
        if changes:
            logger.info("worker %d took the workers' servers (change %d): %s", self.index,
                        state.seq, ", ".join(changes))

    def _catch_up(self) -> None:
        """Take the state file's servers if it changed since last read and no change is
        being made now (that change is forwarded here in turn)."""
        path = self.directory / STATE_FILE
        try:
            stat = os.stat(path)
        except FileNotFoundError:
            return
        if (stat.st_ino, stat.st_mtime_ns, stat.st_size) == self._state_seen:
            return
        fd = os.open(self.directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return  # a change is being made: it comes here, or the next beat takes it
            self._take(self._read_state())
        finally:
            os.close(fd)

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
        if isinstance(request, Heartbeat):
            self._catch_up()
            return ControlReply(200, b"")
        if isinstance(request, MetricsQuery):
            return ControlReply(200, router.metrics.render())
        if isinstance(request, SyncTo):
            if request.seq > self.seq:
                self._take(self._read_state())
            return ControlReply(200, b"{}")
        return self._admin_apply(router, request)

    def _admin_apply(self, router: Router, request: AdminApply) -> ControlReply:
        """A change in turn is applied; one this worker has already is not; after a gap
        (a change missed), the state file's servers are taken instead (they include
        this one)."""
        seq = request.seq
        if seq is not None and seq != self.seq + 1:
            if seq > self.seq:
                self._take(self._read_state())
            if seq <= self.seq:
                return ControlReply(200, b"{}")
        try:
            status, answer = apply(router, request.call)
        except RouterError as exc:
            if seq is not None:  # not as the others: take the state file's servers
                self._take(self._read_state())
            return ControlReply(exc.status, exc.body())
        if seq is not None:
            self.seq = seq
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
