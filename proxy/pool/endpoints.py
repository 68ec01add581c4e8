"""Upstream endpoints and the two clusters (prefill, decode) that hold them.

An `Endpoint` record holds all the live state of one vLLM server: requests in flight,
health, its last error and recent latency, the models it serves, the load its /metrics
reported, and for a P its KV coordinates (configured, or learned by a probe; for a
data-parallel P, each rank's, in `DataParallelRanks`). A
`Cluster` picks the endpoint for a leg: it filters (healthy, serves the model, not
ejected, can do the mode), then its `Balancer` picks. `lease()` counts a request in
flight and always gives it back.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from time import monotonic
from typing import TYPE_CHECKING, Protocol

import msgspec

from proxy.config import Ejection, EndpointConfig, Mode, resolve_secret
from proxy.errors import NoHealthyEndpoint
from proxy.pool.load import LoadReport
from proxy.pool.outlier import OutlierRecord
from proxy.protocol import PrefillCoordinates

if TYPE_CHECKING:
    from proxy.pool.kv.blocks import PromptBlocks

BOTH_MODES = frozenset({Mode.PULL, Mode.PUSH})
DEFAULT_EJECTION = Ejection()
LATENCY_SMOOTHING = 0.2  # weight of a new sample in an endpoint's recent latency


class ClusterName(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class Endpoint:
    _models: list[str] | None
    _transfer_modes: list[Mode] | None

    def __init__(
        self, config: EndpointConfig, cluster: ClusterName, ejection: Ejection = DEFAULT_EJECTION,
        *, api_key: str | None = None, number: int = 0,
    ) -> None:
        self.config = config
        self.url = config.url.rstrip("/")
        self.cluster = cluster
        # The cluster as metrics, logs and errors spell it, read on every leg (an enum's
        # `.value` is two Python calls in 3.11: scripts.bench_path --calls)
        self.cluster_label: str = cluster.value
        # How clients are told of it ("prefill server <name>"): its configured name, else
        # its number in its cluster (never its URL: see show_upstream_urls).
        self.name = config.name or str(number)
        # The bearer token this server wants (vLLM's --api-key): its own, else its
        # cluster's (unless its config says `cluster_key: false`).
        self.api_key = resolve_secret(config.api_key) or (api_key if config.cluster_key else None)
        self.in_flight = 0
        # Prompt tokens its leases say it is computing or about to (kv_aware's queue).
        self.pending_tokens = 0
        self.healthy = True  # until a check or a failed connection says otherwise
        self._checks_against = 0  # active checks in a row that disagree with `healthy`
        self.draining = config.drain  # takes no new request; running ones finish
        self.outlier = OutlierRecord(ejection)  # passive ejection after failures in a row
        self.last_error: str | None = None
        self.recent_latency: float | None = None  # seconds, moving average of its legs
        self.load: LoadReport | None = None  # from its /metrics (load_aware balancing)
        # For a D: its streamed answers' inter-token latency and the local prompts it is
        # computing, as the local budget weighs them (`proxy.flow.learn.LocalBudget`).
        self.streams = DecodeStreams()
        # Models learned from its /v1/models; None until known (the config may say).
        self.learned_models: frozenset[str] | None = None
        # For a P: coordinates learned from a probe or a P answer; None until known.
        self.learned_coordinates: PrefillCoordinates | None = None
        # For a data-parallel P (its answers say so): every rank's coordinates, learned by
        # probes pinned to each rank and by its answers; None for a P of one engine.
        self.learned_ranks: DataParallelRanks | None = None
        # `coordinates` as last computed, with the config and learned coordinates it
        # came from: it is read on every request (and per candidate when a pick filters by
        # mode), and building it each time was 1-2% of the router's CPU per request.
        self._coordinates: tuple[EndpointConfig, PrefillCoordinates | None,
                                 PrefillCoordinates | None] | None = None

    def __repr__(self) -> str:
        return f"Endpoint({self.cluster.value} {self.url}, in_flight={self.in_flight})"

    @property
    def coordinates(self) -> PrefillCoordinates | None:
        """This P's coordinates: configured fields win over learned ones. Configured
        coordinates with no `transfer_modes` are taken to mean both modes."""
        c, learned = self.config, self.learned_coordinates
        memo = self._coordinates
        if memo is not None and memo[0] is c and memo[1] is learned:
            return memo[2]  # frozen structs: the same inputs give the same answer
        coordinates = self._coordinates_of(c, learned)
        self._coordinates = (c, learned, coordinates)
        return coordinates

    @staticmethod
    def _coordinates_of(c: EndpointConfig,
                        learned: PrefillCoordinates | None) -> PrefillCoordinates | None:
        if c.has_coordinates:
            assert c.engine_id and c.side_channel_host and c.side_channel_port  # has_coordinates
            base = PrefillCoordinates(
                engine_id=c.engine_id,
                host=c.side_channel_host,
                port=c.side_channel_port,
                tp_size=learned.tp_size if learned else 1,
                transfer_modes=learned.transfer_modes if learned else BOTH_MODES,
                push_host=learned.push_host if learned else None,
                push_port=learned.push_port if learned else None,
            )
        elif learned is not None:
            base = learned
        else:
            return None
        return msgspec.structs.replace(
            base,
            tp_size=c.tp_size or base.tp_size,
            push_port=c.push_port or base.push_port,
            push_host=base.push_host or (c.side_channel_host if c.push_port else None),
            transfer_modes=frozenset(c.transfer_modes) if c.transfer_modes else base.transfer_modes,
        )

    @property
    def data_parallel_ranks(self) -> DataParallelRanks | None:
        """The ranks a push to this P is pinned among; None when a push goes unpinned (a P
        of one engine, or configured coordinates, which name one engine)."""
        return None if self.config.has_coordinates else self.learned_ranks

    def rank_coordinates(self, rank: int) -> PrefillCoordinates | None:
        """Rank `rank`'s coordinates (None while unknown), with this server's configured
        `tp_size`, `transfer_modes` and `push_port` (rank 0's: rank r's is r above it, as
        the connector offsets it)."""
        ranks = self.learned_ranks
        learned = ranks.get(rank) if ranks is not None else None
        if learned is None:
            return None
        c = self.config
        return msgspec.structs.replace(
            learned,
            tp_size=c.tp_size or learned.tp_size,
            push_port=c.push_port + rank if c.push_port else learned.push_port,
            push_host=learned.push_host or (c.side_channel_host if c.push_port else None),
            transfer_modes=frozenset(c.transfer_modes) if c.transfer_modes
            else learned.transfer_modes,
        )

    @property
    def config(self) -> EndpointConfig:
        """Its settings; membership replaces them (drain, a reload)."""
        return self._config

    @config.setter
    def config(self, config: EndpointConfig) -> None:
        self._config = config
        # What each request's pick reads (`serves`, `can`), as plain fields: a msgspec
        # struct's field is a generic attribute lookup from compiled code.
        self._models = config.models
        self._transfer_modes = config.transfer_modes

    def can(self, mode: Mode) -> bool:
        """True unless this server is known not to do `mode`: configured transfer_modes,
        or for a P its learned coordinates (unknown: maybe). Any D can do `local` (it
        computes the prompt itself)."""
        if mode is Mode.LOCAL:
            return True
        if self._transfer_modes:
            return mode in self._transfer_modes
        known = self.coordinates
        return known is None or mode in known.transfer_modes

    @property
    def models(self) -> frozenset[str] | None:
        """The models it serves: configured, else learned; None while unknown."""
        if self.config.models is not None:
            return frozenset(self.config.models)
        return self.learned_models

    def serves(self, model: str) -> bool:
        """True unless it is known not to serve `model` (on every request's path: no
        set is built here)."""
        if self._models is not None:
            return model in self._models
        return self.learned_models is None or model in self.learned_models

    def record_check(self, passed: bool, *, healthy_after: int, unhealthy_after: int) -> bool:
        """Count one active health check; True when it changed `healthy` (it takes
        `unhealthy_after` failures in a row to go down, `healthy_after` passes to come back)."""
        if passed == self.healthy:
            self._checks_against = 0
            return False
        self._checks_against += 1
        if self._checks_against < (healthy_after if passed else unhealthy_after):
            return False
        self.healthy = passed
        self._checks_against = 0
        return True

    def mark_down(self, why: str) -> bool:
        """Down at once (a refused connection); True when it was up."""
        was_up = self.healthy
        self.healthy = False
        self._checks_against = 0
        self.last_error = why
        return was_up

    def observe_latency(self, seconds: float) -> None:
        previous = self.recent_latency
        self.recent_latency = seconds if previous is None else (
            previous + LATENCY_SMOOTHING * (seconds - previous))


class DecodeStreams:
    """One D's streamed answers, as the local budget sees them.

    The inter-token latency (ITL) of one stream is the time from its first SSE event to
    its last, over the gaps between its token events: two clock reads per stream, none
    per chunk. A stream is *clean* when no local prompt was being computed on this D at
    any moment of it (none in flight at its first event, none begun before its last).
    Two moving averages: `clean_itl` over clean streams, `recent_itl` over all."""

    __slots__ = ("clean_itl", "local_prefills", "local_started", "recent_itl")

    def __init__(self) -> None:
        self.local_prefills = 0  # local requests sent to this D that have no first byte yet
        self.local_started = 0  # local requests ever sent here (a stream compares it)
        self.clean_itl: float | None = None  # seconds
        self.recent_itl: float | None = None

    def local_begin(self) -> None:
        self.local_prefills += 1
        self.local_started += 1

    def local_end(self) -> None:
        self.local_prefills -= 1

    def observe(self, itl: float, *, clean: bool, smoothing: float) -> None:
        """Count one stream's mean inter-token latency, seconds."""
        recent = self.recent_itl
        self.recent_itl = itl if recent is None else recent + smoothing * (itl - recent)
        if clean:
            base = self.clean_itl
            self.clean_itl = itl if base is None else base + smoothing * (itl - base)


class DataParallelRanks:
    """The engines of a data-parallel P (vLLM's `--data-parallel-size`), one URL for all:
    each rank's coordinates and the pushes in flight on each. A push is pinned to the rank
    `pick` chooses among those whose coordinates are known: fewest pushes in flight, equals
    in turn (a simple choice: it counts this router's pushes only, not P's pulls or other
    routers' requests, which vLLM balances among the ranks itself)."""

    __slots__ = ("size", "_known", "_in_flight", "_turn")

    def __init__(self, size: int | None) -> None:
        self.size = size  # how many ranks P has; None until the probes found out
        self._known: dict[int, PrefillCoordinates] = {}  # rank -> its coordinates
        self._in_flight: dict[int, int] = {}  # rank -> pushes pinned to it now
        self._turn = 0  # where the next tie starts

    def __repr__(self) -> str:
        return f"DataParallelRanks(size={self.size}, known={sorted(self._known)})"

    def get(self, rank: int) -> PrefillCoordinates | None:
        return self._known.get(rank)

    def learn(self, coordinates: PrefillCoordinates) -> PrefillCoordinates | None:
        """Record a rank's coordinates (its `dp_rank`); returns what was known before."""
        rank = coordinates.dp_rank
        if rank is None or rank < 0 or (self.size is not None and rank >= self.size):
            raise ValueError(f"rank {rank!r} is not one of {self.size} data-parallel ranks")
        previous = self._known.get(rank)
        self._known[rank] = coordinates
        return previous

    def missing(self) -> list[int] | None:
        """The ranks not known yet; None while the number of ranks is unknown."""
        if self.size is None:
            return None
        return [r for r in range(self.size) if r not in self._known]

    def pick(self) -> int | None:
        """The rank for the next push: among known ranks, fewest in flight, ties in turn;
        None when no rank is known."""
        known = sorted(self._known)
        if not known:
            return None
        start = self._turn % len(known)
        self._turn += 1
        turn = known[start:] + known[:start]
        return min(turn, key=lambda r: self._in_flight.get(r, 0))

    def lease(self, rank: int) -> RankLease:
        """`with ranks.lease(rank):` counts one push in flight on `rank` for the block."""
        return RankLease(self._in_flight, rank)

    def rows(self) -> list[tuple[int, PrefillCoordinates, int]]:
        """Each known rank, its coordinates and the pushes in flight on it, by rank."""
        return [(r, c, self._in_flight.get(r, 0)) for r, c in sorted(self._known.items())]

    def snapshot(self) -> dict[str, object]:
        """For `/admin/endpoints` and logs: the size and each known rank's coordinates."""
        return {
            "size": self.size,
            "ranks": [
                {"rank": r, "engine_id": c.engine_id, "side_channel": f"{c.host}:{c.port}",
                 "push_port": c.push_port, "pushes_in_flight": in_flight}
                for r, c, in_flight in self.rows()
            ],
            "missing": self.missing(),
        }


class RankLease:
    """A push in flight on one rank of a data-parallel P, always given back."""

    __slots__ = ("_counts", "_rank")

    def __init__(self, counts: dict[int, int], rank: int) -> None:
        self._counts = counts
        self._rank = rank

    def __enter__(self) -> int:
        self._counts[self._rank] = self._counts.get(self._rank, 0) + 1
        return self._rank

    def __exit__(self, *exc_info: object) -> None:
        self._counts[self._rank] -= 1


class Picker(Protocol):
    """Picks one of a cluster's candidates, already filtered (`proxy.pool.balance`'s
    `Balancer`). `told_of_every_pick`: whether it must see a pick it has no choice in,
    a lone candidate (kv_aware credits the server and records its prediction)."""

    told_of_every_pick: bool

    def pick(self, candidates: Sequence[Endpoint], key: str | None = None,
             prompt: PromptBlocks | None = None) -> Endpoint: ...


class Cluster:
    def __init__(
        self,
        name: ClusterName,
        configs: list[EndpointConfig],
        balancer: Picker,
        ejection: Ejection = DEFAULT_EJECTION,
        *,
        api_key: str | None = None,
        on_add: Callable[[Endpoint], None] = lambda endpoint: None,
    ) -> None:
        self.name = name
        self.ejection = ejection
        self._api_key = api_key  # the cluster's bearer token for servers without their own
        self._on_add = on_add  # told of every member, first and added (credentials)
        self._joined = 0  # members so far: the next one's number
        # Replaced, never changed in place: a reader holding the old list is unaffected.
        self.endpoints = [self._member(c) for c in configs]
        self.balancer = balancer
        self._picks_lone = not balancer.told_of_every_pick  # a lone candidate, here

    def _member(self, config: EndpointConfig) -> Endpoint:
        self._joined += 1
        endpoint = Endpoint(config, self.name, self.ejection, api_key=self._api_key,
                            number=self._joined)
        self._on_add(endpoint)
        return endpoint

    def find(self, url: str) -> Endpoint | None:
        url = url.rstrip("/")
        return next((e for e in self.endpoints if e.url == url), None)

    def add(self, config: EndpointConfig) -> Endpoint:
        endpoint = self._member(config)
        self.endpoints = [*self.endpoints, endpoint]
        return endpoint

    def remove(self, endpoint: Endpoint) -> None:
        """Out of the cluster; requests already on it finish (their leases hold it)."""
        self.endpoints = [e for e in self.endpoints if e is not endpoint]

    def pick(
        self,
        *,
        exclude: Endpoint | None = None,
        key: str | None = None,
        mode: Mode | None = None,
        model: str | None = None,
        prompt: PromptBlocks | None = None,
    ) -> Endpoint:
        """Filter (healthy, not draining, not `exclude`, serving `model`, not ejected, and
        able to do `mode`), then the cluster's policy picks (see `proxy.pool.balance`; `key` is
        the prompt's prefix, for prefix affinity). Filters that would leave nobody are
        dropped, except the first ones: every healthy server ejected, or none known to do
        `mode` (the mode then falls back)."""
        # One pass (on every leg's path: three list comprehensions took twice as long)
        now = monotonic()
        candidates: list[Endpoint] = []  # healthy, serving `model`, not ejected
        ejected: list[Endpoint] = []  # healthy and serving `model`, but ejected
        for e in self.endpoints:
            if not e.healthy or e.draining or e is exclude:
                continue
            if model is not None and not e.serves(model):
                continue
            if e.outlier.ejected(now):
                ejected.append(e)
            else:
                candidates.append(e)
        if not candidates:
            if not ejected:
                raise self._none_healthy(exclude, model)
            candidates = ejected  # every one ejected: ejection filters no one out
        # A lone candidate is picked whether or not it can do `mode` (the mode then
        # falls back): it is not asked, on the usual leg's path of one server a cluster.
        if mode is not None and mode is not Mode.LOCAL and len(candidates) > 1:
            able = [e for e in candidates if e.can(mode)]
            if able:
                candidates = able
        if len(candidates) == 1 and self._picks_lone:  # no choice, nothing to tell
            return candidates[0]  # (1,750 instructions a pick less, callgrind)
        return self.balancer.pick(candidates, key, prompt)

    def _none_healthy(self, exclude: Endpoint | None, model: str | None) -> NoHealthyEndpoint:
        """Why a pick found no server: none healthy (and not draining), or none of those
        serves `model`."""
        if model is not None and any(e.healthy and not e.draining and e is not exclude
                                     for e in self.endpoints):
            return NoHealthyEndpoint(
                f"no healthy {self.name.value} server serves the model `{model}`")
        return NoHealthyEndpoint(
            f"no healthy {self.name.value} server: none of {len(self.endpoints)} is "
            "healthy and not draining")

    def in_flight(self) -> int:
        return sum(e.in_flight for e in self.endpoints)
