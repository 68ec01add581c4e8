"""Live membership: servers added, removed or drained while the router runs.

Two ways in, one set of operations (`Membership`):
- the admin API (`proxy.api.admin`): add, remove, drain one server;
- the config file, watched (`ConfigWatcher`): when it changes, or on SIGHUP (`reload`),
  it is read and validated again; a bad file is refused with a log line and the running
  config kept; a good one has its `prefill` and `decode` lists applied (servers added,
  removed, or replaced when their settings changed; `drain: true` drains a server in
  place). Other settings need a restart, and the log says which.

Removing a server takes it out of picking at once; requests already on it finish (each
holds its endpoint). Draining keeps it listed and checked but gives it no new request:
remove it once `in_flight` is 0 (GET /admin/endpoints shows it). Once a removed server
has no request left and no cluster has its URL again, what the router kept for it
elsewhere (connection pools, credentials, metric series) is dropped (`forget`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec

from connector.protocol import http_params as wire
from proxy.config import EndpointConfig, RouterConfig
from proxy.errors import Conflict, NotFound
from proxy.pool.endpoints import BOTH_MODES, Cluster, ClusterName, Endpoint
from proxy.pool.periodic import Periodic
from proxy.pool.probe import CoordinateProber

logger = logging.getLogger("pdproxy.membership")

LEAVING_INTERVAL = 1.0  # seconds between two looks at removed servers still busy
Stamp = tuple[float, int]  # a file's modification time and size


class Membership:
    """Adds, removes and drains the two clusters' servers; a removed P's coordinates
    are forgotten by `prober`, and every removed server's state by `forget` (its URL)
    once no request is on it. `start` and `aclose` own the loop that waits for those."""

    def __init__(self, prefill: Cluster, decode: Cluster, prober: CoordinateProber, *,
                 forget: Callable[[str], None] = lambda url: None) -> None:
        self._prefill = prefill
        self._decode = decode
        self._prober = prober
        self._forget = forget
        # Servers that Kubernetes discovery added and owns (`proxy.pool.discovery`): a watched
        # config file's lists leave them alone.
        self.discovered: set[Endpoint] = set()
        # Removed servers whose state is not dropped yet (requests still on them).
        self._leaving: list[Endpoint] = []
        self._leaving_rounds = Periodic("removed servers", LEAVING_INTERVAL, self._leaving_round)

    def start(self) -> None:
        self._leaving_rounds.start()

    async def aclose(self) -> None:
        await self._leaving_rounds.aclose()

    def cluster(self, name: ClusterName) -> Cluster:
        return self._prefill if name is ClusterName.PREFILL else self._decode

    def endpoint(self, name: ClusterName, url: str) -> Endpoint:
        found = self.cluster(name).find(url)
        if found is None:
            raise NotFound(f"no {name.value} server {url}")
        return found

    def add(self, name: ClusterName, config: EndpointConfig) -> Endpoint:
        if self.cluster(name).find(config.url) is not None:
            raise Conflict(f"{name.value} server {config.url} is already a member")
        endpoint = self.cluster(name).add(config)
        logger.info("%s server %s added", name.value, endpoint.url)
        return endpoint

    def remove(self, name: ClusterName, url: str, *, allow_last: bool = False) -> Endpoint:
        """Out of its cluster. The last server stays unless `allow_last` (discovery: a
        cluster whose pods are all gone is empty, and /health says so)."""
        endpoint = self.endpoint(name, url)
        if len(self.cluster(name).endpoints) == 1 and not allow_last:
            raise Conflict(f"{url} is the last {name.value} server: add another first")
        self._drop(endpoint)
        logger.info("%s server %s removed (%d requests still on it finish)", name.value,
                    endpoint.url, endpoint.in_flight)
        return endpoint

    def drain(self, name: ClusterName, url: str, draining: bool = True) -> Endpoint:
        """Drain a server or take it back; its config says so too, so that a config file
        applied later (its `drain`) and the workers' shared servers compare with it."""
        endpoint = self.endpoint(name, url)
        endpoint.draining = draining
        endpoint.config = msgspec.structs.replace(endpoint.config, drain=draining)
        logger.info("%s server %s %s (%d in flight)", name.value, endpoint.url,
                    "draining" if draining else "taking requests again", endpoint.in_flight)
        return endpoint

    def apply(self, new: RouterConfig) -> list[str]:
        """Make the clusters match a new config's server lists; return what changed."""
        return self.match(new.prefill, new.decode)

    def servers(self) -> tuple[list[EndpointConfig], list[EndpointConfig]]:
        """The servers of each cluster as configs, prefill then decode, `drain` saying
        whether each drains now; not those discovery owns (each router finds them)."""
        def configs(cluster: Cluster) -> list[EndpointConfig]:
            return [msgspec.structs.replace(e.config, drain=e.draining)
                    for e in cluster.endpoints if e not in self.discovered]

        return configs(self._prefill), configs(self._decode)

    def match(self, prefill: list[EndpointConfig], decode: list[EndpointConfig]) -> list[str]:
        """Make the clusters hold these servers (discovery's aside); return what changed.
        A server whose config differs only in `drain` is kept, drained or not."""
        changes = []
        for name, wanted in ((ClusterName.PREFILL, prefill), (ClusterName.DECODE, decode)):
            cluster = self.cluster(name)
            wanted_by_url = {c.url.rstrip("/"): c for c in wanted}
            for endpoint in list(cluster.endpoints):
                if endpoint in self.discovered:
                    continue  # the pods decide these, not the file
                config = wanted_by_url.get(endpoint.url)
                if config is not None and config.drain != endpoint.config.drain and (
                    msgspec.structs.replace(config, drain=endpoint.config.drain) == endpoint.config
                ):  # only `drain` changed: keep the server, its counts and what was learned
                    endpoint.config = config
                    self.drain(name, endpoint.url, config.drain)
                    changes.append(f"{name.value} {'drain' if config.drain else 'undrain'} "
                                   f"{endpoint.url}")
                elif config is None or config != endpoint.config:
                    self._drop(endpoint)
                    changes.append(f"{name.value} -{endpoint.url}")
            for url, config in wanted_by_url.items():
                if cluster.find(url) is None:
                    cluster.add(config)
                    changes.append(f"{name.value} +{url}")
        return changes

    def _drop(self, endpoint: Endpoint) -> None:
        """Out of its cluster; a P's learned coordinates are forgotten with it, the rest
        of its state once it is idle (`retire`)."""
        self.cluster(endpoint.cluster).remove(endpoint)
        if endpoint.cluster is ClusterName.PREFILL:
            self._prober.forget(endpoint)
        self._leaving.append(endpoint)
        self.retire()

    def retire(self) -> None:
        """Drop the state of each removed server that has no request left, unless a
        cluster has its URL again (added back, or a member of the other cluster): that
        state is then the member's."""
        members = {e.url for e in self._prefill.endpoints + self._decode.endpoints}
        busy = []
        for endpoint in self._leaving:
            if endpoint.url in members:
                continue
            if endpoint.in_flight:
                busy.append(endpoint)
                continue
            self._forget(endpoint.url)
            logger.debug("%s server %s: its state dropped", endpoint.cluster.value, endpoint.url)
        self._leaving = busy

    async def _leaving_round(self) -> None:
        if self._leaving:
            self.retire()

    def describe(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [_describe(e, now) for e in self._prefill.endpoints + self._decode.endpoints]


def _describe(e: Endpoint, now: float) -> dict[str, Any]:
    models = e.models
    load = e.load
    return {
        "cluster": e.cluster.value,
        "url": e.url,
        "healthy": e.healthy,
        "draining": e.draining,
        "ejected": e.outlier.ejected(now),
        "in_flight": e.in_flight,
        "models": sorted(models) if models is not None else None,
        wire.TRANSFER_MODES: sorted(m.value for m in BOTH_MODES if e.can(m)),  # unknown: both
        "recent_latency_ms": round(e.recent_latency * 1000, 1) if e.recent_latency else None,
        "load": None if load is None else {"waiting": load.waiting, "running": load.running,
                                           "kv_cache_usage": load.kv_cache_usage,
                                           "age_s": round(now - load.at, 1)},
        "last_error": e.last_error,
        # A data-parallel P: its size and each rank's coordinates (None for one engine).
        "data_parallel": None if e.learned_ranks is None else e.learned_ranks.snapshot(),
    }


class ConfigWatcher:
    """Polls the config file every `interval` seconds (0: never) and applies a changed,
    valid one; `reload` reads and applies it now, changed or not (SIGHUP).

    A worker of `--workers N` applies a change through the workers' shared state
    (`proxy.api.control.WorkerGroup` sets `apply_change`), so that every worker applies
    it once and in the same order as the admin API's changes."""

    def __init__(self, path: Path, load: Callable[[], RouterConfig], membership: Membership,
                 running: RouterConfig, *, interval: float) -> None:
        self.path = path
        self.interval = interval  # seconds between two looks at the file (0: never)
        self._load = load
        self._membership = membership
        self._running = running
        self.seen = self.stamp()  # the file as last read
        self.apply_change: Callable[[bool], Awaitable[list[str] | None]] = self._apply_here
        self._rounds = Periodic(f"config watcher ({path})", interval, self._check_round)
        self._reload: asyncio.Task[None] | None = None  # owned: aclose ends it

    def start(self) -> None:
        self._rounds.start()

    async def aclose(self) -> None:
        await self._rounds.aclose()
        if self._reload is not None:
            self._reload.cancel()
            await asyncio.gather(self._reload, return_exceptions=True)
            self._reload = None

    def stamp(self) -> Stamp | None:
        try:
            stat = os.stat(self.path)
        except OSError:
            return None
        return stat.st_mtime, stat.st_size

    async def _check_round(self) -> None:
        await self.check()

    async def check(self, *, force: bool = False) -> list[str] | None:
        """Re-read the file if it changed (or `force`); None when nothing was applied."""
        stamp = self.stamp()
        if stamp == self.seen and not force:
            return None
        self.seen = stamp
        return await self.apply_change(force)

    def reload(self) -> None:
        """Read the file and apply it now, changed or not (SIGHUP), in the background;
        a reload asked for while one runs is that one."""
        if self._reload is None or self._reload.done():
            self._reload = asyncio.create_task(self._reload_now(), name="config-reload")

    async def _reload_now(self) -> None:
        logger.info("config %s: reloading (SIGHUP)", self.path)
        try:
            await self.check(force=True)
        except Exception:  # a reload that fails is logged; the running config stays
            logger.exception("config %s: the reload failed", self.path)

    async def _apply_here(self, force: bool) -> list[str] | None:
        return self.read_and_apply()

    def read_and_apply(self) -> list[str] | None:
        """Read the file and apply its server lists; None when it is refused."""
        try:
            new = self._load()
        except (OSError, ValueError) as exc:
            logger.error("config %s refused, the running config stays: %s", self.path, exc)
            return None
        changes = self._membership.apply(new)
        ignored = [f for f in new.__struct_fields__ if f not in ("prefill", "decode")
                   and getattr(new, f) != getattr(self._running, f)]
        logger.info("config %s re-read: %s", self.path, ", ".join(changes) or "no server changed")
        if ignored:
            logger.warning("config %s: %s changed; these take effect at the next restart",
                           self.path, ", ".join(ignored))
        return changes
