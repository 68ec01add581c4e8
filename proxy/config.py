"""The router's configuration: typed, immutable values, validated when built.

A config file (YAML or TOML) and the command-line flags fill the same `RouterConfig`;
flags given on the command line win over the file. `configs/example.yaml` documents
every field.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import re
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal
from urllib.parse import urlsplit

import msgspec
import yaml

from proxy.choices import MissingKVParams as MissingKVParams
from proxy.choices import Mode as Mode
from proxy.choices import Policy as Policy
from proxy.choices import PushRecovery as PushRecovery

MASK = "***"  # how a secret shows in a config's repr


def _masked(value: Any) -> Any:
    """A secret as a repr shows it: an "env:NAME" reference as it is (it names a
    variable, not the secret), any other value masked."""
    if isinstance(value, list):
        return [_masked(item) for item in value]
    if value is None or (isinstance(value, str) and value.startswith("env:")):
        return value
    return MASK


class Settings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A config type whose repr (and str, and rich's pretty print) masks the fields named
    in `secret_fields`: a config printed in a log, a traceback or a debugger shows no key."""

    secret_fields: ClassVar[frozenset[str]] = frozenset()

    def _shown(self) -> Iterator[tuple[str, Any]]:
        for name in self.__struct_fields__:
            value = getattr(self, name)
            yield name, _masked(value) if name in self.secret_fields else value

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={value!r}" for name, value in self._shown())
        return f"{type(self).__name__}({fields})"

    def __rich_repr__(self) -> list[tuple[str, Any]]:
        return list(self._shown())


class KvAware(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """kv_aware balancing (see `proxy.pool.kv`): each server's vLLM KV events say which
    blocks its prefix cache holds, and a candidate's cost, in prompt tokens of work, is

        token_weight x (prompt tokens it does not hold) + its queued work

    For P, token_weight is 1 (a missed token is computed) and its queued work is the
    prompt tokens this router's legs compute there, plus tokens_per_request per unit of
    what only its /metrics show (waiting_weight x waiting + kv_cache_weight x KV cache
    usage). For D, token_weight is `decode_token_weight` (a missed token's KV is sent,
    cheaper than computing it) and its queued work is tokens_per_request x load_aware's
    score (its work is decoding)."""

    tokens_per_request: float = 1024.0  # one request queued ahead, in prompt tokens of time
    # true: tokens_per_request is only the start: it follows the moving average of the
    # prompt tokens the requests this router sends to P compute (their predicted misses).
    calibrate: bool = True
    decode_token_weight: float = 0.25
    # After a request is routed, its servers count its blocks as held this long (s), so a
    # burst of one prefix goes to one place before the events arrive.
    credit_s: float = 10.0
    # The block size assumed for a server before its events said (vLLM's default: 16).
    block_size: int = 16
    discovery_interval: float = 10.0  # s between looks for new servers' event publishers
    replay_timeout: float = 2.0  # s: one replay of missed batches from a publisher
    max_blocks_per_server: int = 1 << 20  # the index's bound per publisher
    max_event_bytes: int = 16 * 1024 * 1024  # a larger event message is dropped
    tokenize_timeout: float = 2.0  # s: POST /tokenize to a server of the request's model
    # The ids and block keys of prompts seen lately are kept, up to this many tokens in all
    # (8 bytes a token, plus the keys), so a prompt sent again is neither tokenized nor
    # hashed again; 0: no cache.
    tokenize_cache_tokens: int = 1 << 21

    def __post_init__(self) -> None:
        for name in ("tokens_per_request", "decode_token_weight", "credit_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"balance.kv_aware.{name} must be >= 0")
        for name in ("discovery_interval", "replay_timeout", "tokenize_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"balance.kv_aware.{name} must be > 0")
        if self.block_size < 1:
            raise ValueError("balance.kv_aware.block_size must be >= 1")
        if self.tokenize_cache_tokens < 0:
            raise ValueError("balance.kv_aware.tokenize_cache_tokens must be >= 0")
        if self.max_blocks_per_server < 1 or self.max_event_bytes < 1024:
            raise ValueError("balance.kv_aware.max_blocks_per_server must be >= 1 and "
                             "max_event_bytes >= 1024")


class Balance(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Balancing, per cluster. prefix_affinity suits P (its prefix cache); D's work is
    decoding, so least_outstanding suits it."""

    prefill: Policy = Policy.LEAST_OUTSTANDING
    decode: Policy = Policy.LEAST_OUTSTANDING
    prefix_chars: int = 256  # prefix_affinity: how much of the prompt's start is hashed
    load_factor: float = 1.25  # prefix_affinity: skip a server above this x mean in flight
    # load_aware: each server's vLLM /metrics is scraped this often (seconds), and its
    # score is in_flight + waiting_weight x waiting + kv_cache_weight x KV cache usage (0..1).
    scrape_interval: float = 1.0
    waiting_weight: float = 1.0
    kv_cache_weight: float = 4.0

    kv_aware: KvAware = KvAware()

    def __post_init__(self) -> None:
        if self.prefix_chars < 1:
            raise ValueError(f"balance.prefix_chars must be >= 1, got {self.prefix_chars!r}")
        if not self.load_factor >= 1.0:
            raise ValueError(f"balance.load_factor must be >= 1, got {self.load_factor!r}")
        if not self.scrape_interval > 0:
            raise ValueError(f"balance.scrape_interval must be > 0, got {self.scrape_interval!r}")
        if self.waiting_weight < 0 or self.kv_cache_weight < 0:
            raise ValueError("balance.waiting_weight and kv_cache_weight must be >= 0")

    @property
    def uses(self) -> frozenset[Policy]:
        return frozenset((self.prefill, self.decode))


class HealthChecks(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Active health checks: GET /health on every server (see `proxy.pool.health`)."""

    interval: float = 5.0  # seconds between two rounds (0 = off)
    unhealthy_threshold: int = 2  # failed checks in a row that take a server out
    healthy_threshold: int = 2  # passed checks in a row that bring it back

    def __post_init__(self) -> None:
        if self.interval < 0:
            raise ValueError(f"health.interval must be >= 0, got {self.interval!r}")
        if self.unhealthy_threshold < 1 or self.healthy_threshold < 1:
            raise ValueError("health.unhealthy_threshold and healthy_threshold must be >= 1")


class Ejection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Passive outlier ejection (see `proxy.pool.outlier`)."""

    consecutive_failures: int = 5  # failed legs in a row that eject a server (0 = off)
    base_seconds: float = 5.0  # first ejection's length; doubled at each further one
    max_seconds: float = 120.0  # the longest one ejection lasts, however often doubled

    def __post_init__(self) -> None:
        if self.consecutive_failures < 0:
            raise ValueError("ejection.consecutive_failures must be >= 0")
        if not 0 < self.base_seconds <= self.max_seconds:
            raise ValueError("ejection needs 0 < base_seconds <= max_seconds")


class RetryBudgetConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Retries within the last `window_s` seconds: at most `ratio` x requests, plus
    `min_per_window` (see `proxy.pool.retry`; counted in tenths of the window, so a
    request or retry leaves it between 0.9 and 1 `window_s` after it)."""

    ratio: float = 0.2
    min_per_window: int = 10
    window_s: float = 10.0

    def __post_init__(self) -> None:
        if self.ratio < 0 or self.min_per_window < 0 or self.window_s <= 0:
            raise ValueError("retry_budget needs ratio >= 0, min_per_window >= 0, window_s > 0")


# auto.push_layers: who decides whether a push is written layer by layer.
PushLayersPolicy = Literal["connector", "learn"]


def _default_bucket_edges() -> list[int]:
    return [256, 1024, 4096, 16384]


class AutoSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How `auto` mode learns which mode is faster (see `proxy.flow.learn`)."""

    learn: bool = True  # false: auto is just "push when the pair can", and P decides layers
    explore: float = 0.05  # share of requests sent to the slower mode, to keep measuring it
    min_samples: int = 8  # TTFTs each mode needs in a bucket before the faster one is chosen
    smoothing: float = 0.2  # weight of a new TTFT in the moving average
    # Prompt length in characters: n chars fall in the first bucket whose edge is > n,
    # or in the last, open bucket. Empty: one bucket for all prompts.
    bucket_edges: list[int] = msgspec.field(default_factory=_default_bucket_edges)
    # Auto may also choose local (D computes the prompt, no P) where it is measured
    # fastest, but only on a D whose recent inter-token latency is at most
    # local_itl_budget x its latency measured with no local prompt in flight there.
    local: bool = False
    local_itl_budget: float = 1.25
    # With local and kv_aware on D: a request whose D already holds all but at most this
    # many of its prompt's tokens (by the KV index) goes local at once, unless that D is
    # over its ITL budget: computing a short rest on D beats P plus the hand-off
    # (conditional disaggregation by cache). 0: off.
    local_cached_tokens: int = 256
    # Whether a push is written layer by layer (progressive push) or whole, for a request
    # whose client did not say (X-KV-Push-Layers on or off): "learn" (the default) has
    # the router learn per bucket which is faster, as it learns modes, and tell P per
    # request; "connector" leaves it to P's connector (its push_layers setting: by
    # default, layers from push_layers_min_tokens tokens). Applies to every push, in auto
    # mode or not; a push whose bucket has not learned yet and that is not measured (not
    # streamed) is left to the connector, and so is every push with `learn: false` (the
    # router learns nothing then). A P whose connector has push_layers: off writes whole
    # whatever the router asks.
    push_layers: PushLayersPolicy = "learn"

    def __post_init__(self) -> None:
        if self.local and not self.learn:
            raise ValueError("auto.local needs auto.learn: true (local is chosen where measured fastest)")
        if not self.local_itl_budget >= 1.0:
            raise ValueError(
                f"auto.local_itl_budget must be >= 1 (a ratio), got {self.local_itl_budget!r}")
        if self.local_cached_tokens < 0:
            raise ValueError("auto.local_cached_tokens must be >= 0")
        if not 0.0 <= self.explore <= 1.0:
            raise ValueError(f"auto.explore must be within 0..1, got {self.explore!r}")
        if self.min_samples < 1:
            raise ValueError(f"auto.min_samples must be >= 1, got {self.min_samples!r}")
        if not 0.0 < self.smoothing <= 1.0:
            raise ValueError(f"auto.smoothing must be > 0 and <= 1, got {self.smoothing!r}")
        edges = self.bucket_edges
        if any(edge <= 0 for edge in edges) or any(a >= b for a, b in itertools.pairwise(edges)):
            raise ValueError(
                f"auto.bucket_edges must be positive and strictly increasing, got {edges!r}")


class Auth(Settings, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Credentials. A value "env:NAME" is read from the environment variable NAME."""

    secret_fields = frozenset({"prefill_api_key", "decode_api_key", "client_api_keys"})

    # prefill_api_key to every P, decode_api_key to every D, as
    # "Authorization: Bearer <key>" (vLLM's --api-key); an
    # endpoint's own api_key wins. Env PDPROXY_PREFILL_API_KEY / PDPROXY_DECODE_API_KEY.
    prefill_api_key: str | None = None
    decode_api_key: str | None = None
    # When set, the inference routes and /v1/models need "Authorization: Bearer <key>"
    # with one of these (401 otherwise). Env PDPROXY_CLIENT_API_KEYS, comma-separated.
    client_api_keys: list[str] = []

    def __post_init__(self) -> None:  # an "env:NAME" unset, or any key blank, fails here
        require_secret("prefill_api_key", self.prefill_api_key)
        require_secret("decode_api_key", self.decode_api_key)
        for index, key in enumerate(self.client_api_keys):
            require_secret(f"client_api_keys[{index}]", key)


def resolve_secret(value: str | None) -> str | None:
    """A configured secret: "env:NAME" reads the variable NAME (unset: an error)."""
    if value is None or not value.startswith("env:"):
        return value
    name = value[4:]
    if name not in os.environ:
        raise ValueError(f"the environment variable {name} (named by {value!r}) is not set")
    return os.environ[name]


CLIENT_KEYS_VARIABLE = "PDPROXY_CLIENT_API_KEYS"


def environment_client_keys() -> list[str]:
    """The client keys PDPROXY_CLIENT_API_KEYS lists (comma-separated; unset: none). A
    blank one is an error, as in auth.client_api_keys."""
    if CLIENT_KEYS_VARIABLE not in os.environ:
        return []
    keys = [key.strip() for key in os.environ[CLIENT_KEYS_VARIABLE].split(",")]
    if not all(keys):
        raise ValueError(f"{CLIENT_KEYS_VARIABLE} has an empty key (it is a comma-separated "
                         "list of keys): give the keys, or unset it")
    return keys


def require_secret(field: str, value: str | None) -> None:
    """A configured key must not be empty or blank, once "env:NAME" is read: a key that
    silently vanished would leave a route open, or a server without its credentials."""
    if value is not None and not (resolve_secret(value) or "").strip():
        read = f" (the environment variable {value[4:]})" if value.startswith("env:") else ""
        raise ValueError(f"{field} is empty{read}: give the key, or leave {field} out")


class PushChannel(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The router's own word to P's push side channels (our connector's `push_port`):
    after a push's D leg failed or the client left, the router abandons the transfer so
    that P frees the prompt's blocks at once instead of after its `unclaimed_ttl`.
    With CURVE keys on the connectors (`python -m connector.shared.keys`), the router needs its
    key pair (its public key among P's `curve_allowed_keys`) and P's public key."""

    abandon: bool = True  # false: send no abandons (P frees the blocks after unclaimed_ttl)
    curve_secret_key_file: str | None = None  # the router's .key_secret file
    curve_server_key_file: str | None = None  # the P servers' public .key file

    def __post_init__(self) -> None:
        if (self.curve_secret_key_file is None) != (self.curve_server_key_file is None):
            raise ValueError("push_channel.curve_secret_key_file and curve_server_key_file "
                             "go together")


class Timeouts(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Time limits in seconds, one per phase of a P/D request."""

    connect: float = 5.0  # opening a TCP connection to an upstream
    prefill: float = 120.0  # P's whole answer (it computes the prompt and one token)
    first_token: float = 300.0  # D's first byte from sending D its request (a non-streamed answer: all of it)
    stream_idle: float = 60.0  # longest silence between two chunks of D's answer
    probe: float = 30.0  # a probe of a P's KV coordinates
    health: float = 2.0  # one active health check
    # Waiting for a free upstream connection under limits.max_connections; past it the
    # request is refused with 503 and Retry-After (counted as pool_timeout).
    pool: float = 5.0
    # A client that accepts no bytes of its answer this long is disconnected and its
    # upstream legs closed (a slow client that still reads is left alone).
    client_stall: float = 60.0
    # A client's request head and body must arrive within this, or it is disconnected.
    client_request: float = 30.0
    # Keep-alive connections to upstreams idle longer than this are closed, not reused:
    # keep it below the servers' own keep-alive (uvicorn's default is 5 s).
    upstream_idle: float = 4.0

    def __post_init__(self) -> None:
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if value <= 0:
                raise ValueError(f"timeouts.{name} must be > 0 seconds, got {value!r}")


class Limits(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Bounds on what the router takes and holds: request bodies, upstream connections,
    requests in flight, slow clients and the size of upstream answers."""

    max_body_bytes: int = 8 * 1024 * 1024  # larger request bodies are refused with 413
    max_connections: int = 1024  # open upstream connections for requests (0 = no limit)
    # Connections for health checks, probes, model lists and /metrics scrapes: a budget
    # of their own, so they never queue behind user traffic (0 = no limit).
    control_connections: int = 64
    # Inference requests in flight at once; over it new ones get 503 with Retry-After at
    # once. None: twice max_connections (every upstream connection busy, and as many
    # requests again reading their bodies or waiting up to timeouts.pool for one);
    # 0: no limit.
    max_in_flight: int | None = None
    # Bytes per second a client must accept of its answer while the router waits on it
    # (its buffers full), measured over every timeouts.client_stall of waiting; below
    # it the client is cut (slow_read) and its upstream legs closed. 0: only a client
    # that accepts nothing is cut (stall).
    client_min_read_rate: int = 1024
    # An upstream answer's status line and headers larger than this are a broken answer.
    max_upstream_header_bytes: int = 64 * 1024
    # A whole upstream answer (P's, a non-streamed D's, an error's body, a probe's, a
    # model list) larger than this is a broken answer: 502, its connection closed.
    max_upstream_body_bytes: int = 32 * 1024 * 1024
    # One SSE event of D's stream larger than this (or one that never ends) ends the
    # stream as a broken answer: 502 before the first byte, an SSE error event after.
    max_upstream_event_bytes: int = 1024 * 1024
    # The data-parallel ranks of one P the router probes and pushes to, at most: a P
    # that says it has more is used through its first this many.
    max_dp_ranks: int = 64

    def __post_init__(self) -> None:
        if self.max_body_bytes <= 0:
            raise ValueError(f"limits.max_body_bytes must be > 0, got {self.max_body_bytes!r}")
        for name in ("max_connections", "control_connections", "max_in_flight",
                     "client_min_read_rate"):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(f"limits.{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("max_upstream_header_bytes", "max_upstream_body_bytes",
                     "max_upstream_event_bytes"):
            if getattr(self, name) < 1024:
                raise ValueError(f"limits.{name} must be >= 1024, got {getattr(self, name)!r}")
        if self.max_dp_ranks < 1:
            raise ValueError(f"limits.max_dp_ranks must be >= 1, got {self.max_dp_ranks!r}")

    @property
    def in_flight_cap(self) -> int:
        """The inference requests served at once, at most (0: no limit): max_in_flight,
        else twice max_connections."""
        if self.max_in_flight is not None:
            return self.max_in_flight
        return 2 * self.max_connections


class EndpointConfig(Settings, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One vLLM server. For a P, its KV coordinates may be given here; they win over
    what a probe learns (a probe is then not needed)."""

    secret_fields = frozenset({"api_key"})

    url: str  # its base URL, http(s)://host:port, without a path
    # How error messages name it to clients ("prefill server <name>"); None: its number
    # in its cluster, in the order servers joined ("prefill server 2"). Never its URL,
    # unless show_upstream_urls.
    name: str | None = None
    # The model names it serves; None: learned from its /v1/models.
    models: list[str] | None = None
    # Takes no new request while true; running ones finish (a watched config file can
    # drain a server this way before removing it).
    drain: bool = False
    # A P's KV coordinates, as a probe would learn them: its vLLM engine id, its NIXL side
    # channel (side_channel_host, side_channel_port) and its tp_size. With the first three
    # given, the P is never probed.
    engine_id: str | None = None
    side_channel_host: str | None = None
    side_channel_port: int | None = None
    tp_size: int | None = None
    # kv_aware: its KV event publisher ("tcp://host:port"), and kv_events_replay its replay
    # socket's; unset: found at its GET /kv_event_sources (vLLM 0.32+).
    kv_events: str | None = None
    kv_events_replay: str | None = None
    # What its KV connector can do. For a P, learned from a probe when not given (both,
    # when its coordinates are given here); for a D, both unless given (a D without our
    # connector cannot take a push: say [pull]).
    transfer_modes: list[Mode] | None = None
    # Our connector's push side channel on this P (its kv_connector_extra_config
    # push_port); learned from P's answers when not given.
    push_port: int | None = None
    # Sent to this server as "Authorization: Bearer <key>" (vLLM's --api-key); wins over
    # the cluster's auth.prefill_api_key / decode_api_key. "env:NAME" reads a variable.
    api_key: str | None = None
    # Without its own api_key, send it the cluster's key (false: send it none).
    cluster_key: bool = True

    def __post_init__(self) -> None:
        validate_url(self.url)
        if self.name is not None and not (self.name.strip() and self.name.isprintable()
                                          and len(self.name) <= 64):
            raise ValueError(f"an endpoint's name must be 1-64 printable characters, got "
                             f"{self.name!r}")
        for name in ("side_channel_port", "push_port"):
            port = getattr(self, name)
            if port is not None and not 0 < port < 65536:
                raise ValueError(f"{name} out of range: {port!r}")
        if self.tp_size is not None and self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size!r}")
        require_secret("api_key", self.api_key)  # "env:NAME" unset, or a blank key: refused

    @property
    def has_coordinates(self) -> bool:
        return (
            self.engine_id is not None
            and self.side_channel_host is not None
            and self.side_channel_port is not None
        )


# Where `pip install 'pd-proxy[kubernetes]'` puts the Kubernetes client discovery uses.
KUBERNETES_CLIENT_MODULE = "kubernetes_asyncio"
# A Kubernetes namespace is a DNS label (RFC 1123).
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


class KubernetesDiscoveryConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """P and D servers found as pods by label selectors (see `proxy.pool.discovery`): a pod
    joins its cluster when it is Running and Ready with an IP, as http://{podIP}:{port}."""

    namespace: str  # where the P and D pods are
    prefill_selector: str  # a label selector, e.g. "app=vllm,pd-role=prefill"
    decode_selector: str  # the same, for the D pods
    port: int = 8000  # the pods' vLLM HTTP port
    # A kubeconfig file; None: the pod's own service account (in-cluster).
    kubeconfig: str | None = None
    # The API server ends each watch after this many seconds (its timeoutSeconds); the
    # router then watches again from the last version (an event's or a bookmark's).
    watch_timeout: int = 300
    # A list page's whole limit, and a watch's connect limit (its reads may be silent
    # for watch_timeout plus this).
    request_timeout: float = 10.0
    # After a failed list or watch, a dropped watch or 410 Gone, the next list waits
    # backoff_base seconds, doubled each time up to backoff_max.
    backoff_base: float = 0.5
    backoff_max: float = 30.0
    # A list asks for this many pods a page (limit/continue); 0: the whole list at once.
    list_page_size: int = 500
    # Readiness hysteresis: a serving pod is drained once it has been seen not Ready for
    # drain_after seconds in a row, and a drained pod takes requests again once it has
    # been seen Ready for undrain_after seconds in a row (0: at once). A pod deleted,
    # terminating or finished is drained at once whatever these say.
    drain_after: float = 2.0
    undrain_after: float = 10.0

    def __post_init__(self) -> None:
        if not _NAMESPACE.fullmatch(self.namespace):
            raise ValueError(f"discovery.kubernetes.namespace is not a namespace name: "
                             f"{self.namespace!r}")
        for name in ("prefill_selector", "decode_selector"):
            if not getattr(self, name).strip():
                raise ValueError(f"discovery.kubernetes.{name} must be a non-empty label selector")
        if self.prefill_selector.strip() == self.decode_selector.strip():
            raise ValueError("discovery.kubernetes.prefill_selector and decode_selector are the "
                             "same: every pod would be both a P and a D")
        if not 0 < self.port < 65536:
            raise ValueError(f"discovery.kubernetes.port out of range: {self.port!r}")
        if self.watch_timeout < 1 or not self.request_timeout > 0:
            raise ValueError("discovery.kubernetes needs watch_timeout >= 1 and request_timeout > 0")
        if not 0 < self.backoff_base <= self.backoff_max:
            raise ValueError("discovery.kubernetes needs 0 < backoff_base <= backoff_max")
        if self.list_page_size < 0:
            raise ValueError(f"discovery.kubernetes.list_page_size must be >= 0, got "
                             f"{self.list_page_size!r}")
        if self.drain_after < 0 or self.undrain_after < 0:
            raise ValueError("discovery.kubernetes needs drain_after >= 0 and undrain_after >= 0")
        if importlib.util.find_spec(KUBERNETES_CLIENT_MODULE) is None:
            raise ValueError(f"discovery.kubernetes needs the {KUBERNETES_CLIENT_MODULE} package: "
                             "install pd-proxy with its kubernetes extra "
                             "(pip install 'pd-proxy[kubernetes]')")


class Discovery(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Servers found by the router itself, besides the static `prefill` and `decode`."""

    kubernetes: KubernetesDiscoveryConfig | None = None


def _installed(module: str) -> bool:
    """`module` can be imported (a dotted name whose package is missing: no)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


# Where `pip install 'pd-proxy[tracing]'` puts the OpenTelemetry SDK that tracing uses.
TRACING_SDK_MODULE = "opentelemetry.sdk"


class TracingConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """OpenTelemetry traces of each request (see `proxy.tracing`; the `tracing` extra).
    Where the spans go and which are kept come from the standard OTEL_* environment
    variables (OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_TRACES_SAMPLER, OTEL_SERVICE_NAME, ...)."""

    # A span per request, with a child per leg and the hand-off, exported over OTLP;
    # each leg carries a W3C `traceparent`, so vLLM's own spans join the trace.
    enabled: bool = False
    # Continue the trace a client's `traceparent` names; false: every request starts a
    # trace of its own (a router facing clients whose trace ids are not to be trusted).
    continue_client_traces: bool = True

    def __post_init__(self) -> None:
        if self.enabled and not _installed(TRACING_SDK_MODULE):
            raise ValueError(f"tracing.enabled needs the {TRACING_SDK_MODULE} package: install "
                             "pd-proxy with its tracing extra (pip install 'pd-proxy[tracing]')")


class WorkerSupervision(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How the supervisor of `--workers N` keeps its workers (see `proxy.workers`)."""

    # A worker that exits is started again after restart_backoff seconds, doubled for each
    # of its exits within restart_window, up to restart_backoff_max.
    restart_backoff: float = 0.5
    restart_backoff_max: float = 30.0
    # A worker that exits more than max_restarts times within restart_window seconds is
    # in a crash loop: the supervisor stops every worker and exits with status 4.
    max_restarts: int = 5
    restart_window: float = 60.0
    # The supervisor asks each serving worker for a heartbeat on its control socket every
    # heartbeat_interval seconds; a worker that answers none for heartbeat_timeout seconds
    # (alive but stuck) is killed and started again. heartbeat_interval 0: no heartbeats.
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 10.0

    def __post_init__(self) -> None:
        if not 0 < self.restart_backoff <= self.restart_backoff_max:
            raise ValueError("supervisor needs 0 < restart_backoff <= restart_backoff_max")
        if self.max_restarts < 0 or not self.restart_window > 0:
            raise ValueError("supervisor needs max_restarts >= 0 and restart_window > 0")
        if self.heartbeat_interval < 0 or (
                self.heartbeat_interval > 0 and not self.heartbeat_timeout > self.heartbeat_interval):
            raise ValueError("supervisor needs heartbeat_interval >= 0 and heartbeat_timeout > "
                             "heartbeat_interval")


def _default_client_modes() -> list[Mode]:
    return [Mode.PULL, Mode.PUSH, Mode.AUTO]


class RouterConfig(Settings, frozen=True, kw_only=True, forbid_unknown_fields=True):
    secret_fields = frozenset({"admin_token"})

    prefill: list[EndpointConfig] = []
    decode: list[EndpointConfig] = []
    # Servers found in Kubernetes, joining the static lists (which may then be empty).
    discovery: Discovery = Discovery()
    host: str = "127.0.0.1"  # the address to listen on (0.0.0.0: every interface)
    port: int = 8000  # the port to listen on
    mode: Mode = Mode.PULL
    # The modes a client may ask for with X-KV-Transfer-Mode; another is refused with 400
    # naming these (asking for `mode` itself is always allowed). Not local by default: a
    # local prompt skips P and is computed on D, between its other streams' tokens.
    client_modes: list[Mode] = msgspec.field(default_factory=_default_client_modes)
    # Served model names. Empty: learn them from the upstreams' /v1/models.
    models: list[str] = []
    missing_kv_params: MissingKVParams = MissingKVParams.ERROR
    push_recovery: PushRecovery = PushRecovery.PULL
    push_channel: PushChannel = PushChannel()
    auth: Auth = Auth()
    health: HealthChecks = HealthChecks()
    auto: AutoSettings = AutoSettings()
    probe_retry_interval: float = 10.0  # after a failed probe, wait this long to try again
    timeouts: Timeouts = Timeouts()
    limits: Limits = Limits()
    balance: Balance = Balance()
    ejection: Ejection = Ejection()
    retry_budget: RetryBudgetConfig = RetryBudgetConfig()
    # The admin API (/admin/endpoints: add, remove, drain servers) needs this token as
    # "Authorization: Bearer <token>"; without one it is off. Env PDPROXY_ADMIN_TOKEN.
    admin_token: str | None = None
    # Serve the admin API on its own "host:port" instead of the public listener (which
    # then has no /admin routes).
    admin_listen: str | None = None
    # A server added through the admin API may have its api_key read from the router's
    # environment ("env:NAME") only when NAME starts with this ("": any variable).
    admin_secret_env_prefix: str = "PDPROXY_ENDPOINT_KEY_"
    # A server added through the admin API without its own api_key gets its cluster's
    # (auth.prefill_api_key / decode_api_key) only when this is true.
    admin_inherit_cluster_key: bool = False
    # The admin API refuses servers at link-local or cloud metadata addresses
    # (169.254.0.0/16, fe80::/10, metadata.google.internal) unless this is true.
    admin_allow_link_local: bool = False
    # Error messages to clients name an upstream server ("decode server 2", or its
    # `name`) and leave out the transport's detail; true: they show its URL and the
    # detail, as the log does (which always has them).
    show_upstream_urls: bool = False
    # With --config FILE: re-read the file this often (seconds) and apply its server
    # lists when it changed (0 = never).
    config_watch_interval: float = 2.0
    shutdown_grace: int = 30  # seconds; on SIGTERM: stop accepting, let running requests finish this long
    log_level: str = "info"  # debug, info, warning, error or critical
    access_log: bool = False  # uvicorn's access log; the router logs one line per request
    # Processes serving the one port (see proxy.workers); 1: the router is this process.
    workers: int = 1
    # With workers > 1: restarts, crash loops and heartbeats (proxy.workers).
    supervisor: WorkerSupervision = WorkerSupervision()
    # OpenTelemetry traces of requests (the `tracing` extra).
    tracing: TracingConfig = TracingConfig()

    def __post_init__(self) -> None:
        discovered = self.discovery.kubernetes is not None  # the lists may start empty
        if not self.prefill and not discovered:
            raise ValueError("at least one prefill endpoint is needed (--prefill URL)")
        if not self.decode and not discovered:
            raise ValueError("at least one decode endpoint is needed (--decode URL)")
        if not 0 < self.port < 65536:
            raise ValueError(f"port out of range: {self.port!r}")
        if self.shutdown_grace < 0:
            raise ValueError(f"shutdown_grace must be >= 0, got {self.shutdown_grace!r}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers!r}")
        if self.admin_listen is not None:
            host, _, port = self.admin_listen.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"admin_listen must be host:port, got {self.admin_listen!r}")
        if self.log_level.lower() not in {"debug", "info", "warning", "error", "critical"}:
            raise ValueError(f"unknown log_level {self.log_level!r}")
        resolve_secret(self.admin_token)
        if not self.auth.client_api_keys:
            environment_client_keys()  # its blank keys are refused here too


@dataclass(frozen=True)
class ConfigSource:
    """Where the running config came from, to re-read it (`--config FILE` and flags)."""

    path: Path
    load: Callable[[], RouterConfig]


def validate_url(url: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in {"http", "https"} or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    if parts.path not in {"", "/"} or parts.query:
        raise ValueError(f"give the server's base URL without a path: {url!r}")


def read_config_file(path: Path) -> dict[str, Any]:
    """Read a YAML or TOML file into a plain mapping (validated later, as a whole)."""
    text = path.read_text()
    if path.suffix == ".toml":
        raw: Any = tomllib.loads(text)
    else:
        raw = yaml.safe_load(text) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: the top level must be a mapping")
    return raw


def build_config(file_values: dict[str, Any], overrides: dict[str, Any]) -> RouterConfig:
    """Merge a file's values with command-line overrides (which win) and validate."""
    merged = dict(file_values)
    for key, value in overrides.items():
        if value is None:
            continue
        section, _, field = key.partition(".")  # "balance.prefill": one key of a section
        if field:
            merged[section] = {**merged.get(section, {}), field: value}
        else:
            merged[key] = value
    for cluster in ("prefill", "decode"):
        merged[cluster] = [
            {"url": entry} if isinstance(entry, str) else entry
            for entry in merged.get(cluster, [])
        ]
    try:
        return msgspec.convert(merged, RouterConfig)
    except msgspec.ValidationError as exc:
        raise ValueError(f"invalid configuration: {exc}") from exc
