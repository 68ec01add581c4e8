"""The dual connector's own settings, read from `kv_connector_extra_config`.

    --kv-transfer-config '{"kv_connector": "NixlDualConnector",
                           "kv_connector_module_path": "connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"push_port": 5700}}'

Only the keys below are ours; every other key in `kv_connector_extra_config` is left to
vLLM's NIXL code (for example `kv_lease_duration`, the pull lease). Values are checked
when the server starts, so a typo fails the start with a clear message, not a request.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import msgspec

from connector.shared.keys import (
    ClientKeys,
    KeyFileError,
    ServerKeys,
    load_allowed,
    load_key_pair,
    load_public_key,
)

MAX_PORT = 65535
MAX_PAUSE = 0.05  # push_wait_pause: longer would hold up the engine's other work
CPU_PAUSE = 0.01  # push_wait_pause on a CPU server, unless set
# max_pending_per_peer: well above one D's requests in flight (vLLM's max_num_seqs).
DEFAULT_MAX_PENDING_PER_PEER = 4096
# max_pending: all peers together, four D servers at their limit.
DEFAULT_MAX_PENDING = 16384
# max_peers: D's sockets to P servers at once. Each is a ZMQ socket in the side channel's
# own context, which holds at most 1023; the limit leaves room below that.
DEFAULT_MAX_PEERS = 256
MAX_PEERS_LIMIT = 1000

# How a server's NIXL agent makes progress (`nixl_progress_thread`; connector/shared/progress.py).
ProgressMode = Literal["event", "off", "spin"]

# Whether P writes a push layer by layer (`push_layers`).
PushLayers = Literal["auto", "on", "off"]
# Below this many prompt tokens, "auto" writes a push whole: there is little transfer to
# hide, and layered WRITEs lost to whole push at 256 tokens on the fast emulated links
# while winning or tying from 1,024 on every link measured with Llama 3 8B's 32 layers
# (docs/benchmarks.md, the emulated regime). With 70B's 80 layers on 400 Gb/s RDMA they
# won only from 8,192 (on 25 and 100 Gb/s from 1,024): raise it for such a pair.
DEFAULT_PUSH_LAYERS_MIN_TOKENS = 1024

# The keys this module owns inside kv_connector_extra_config.
KEYS = (
    "push_port",
    "push_host",
    "registration_ttl",
    "unclaimed_ttl",
    "ack_timeout",
    "ping_interval",
    "peer_timeout",
    "write_lease",
    "write_timeout",
    "stats_interval",
    "pull_fallback_ttl",
    "fault_injection",
    "nixl_progress_thread",
    "push_wait_pause",
    "early_write",
    "push_layers",
    "push_layers_min_tokens",
    "max_pending_per_peer",
    "max_pending",
    "max_peers",
    "curve_secret_key_file",
    "curve_allowed_keys",
    "curve_server_key_file",
)
CURVE_KEYS = ("curve_secret_key_file", "curve_allowed_keys", "curve_server_key_file")


class ConfigError(ValueError):
    """A bad value in kv_connector_extra_config for the dual connector."""


class DualConfig(msgspec.Struct, frozen=True, kw_only=True):
    # P's push side channel (ZMQ) listens here; D connects to the one each P advertises
    # in its answers. Required: no port is derived by hashing or offsets, so an operator
    # always knows which port to open. Plus the data-parallel index, like vLLM's own
    # side-channel port.
    push_port: int
    # Address P advertises to D for its push side channel, and binds. None: vLLM's
    # VLLM_NIXL_SIDE_CHANNEL_HOST (the host its NIXL handshake listener advertises).
    push_host: str | None = None
    # P: how long a registration waits for P's prefill (registration_ttl), and a finished
    # prefill for D's registration (unclaimed_ttl), before both are dropped (seconds).
    registration_ttl: float = 120.0
    unclaimed_ttl: float = 120.0
    # D: how long to wait for P's Ack to a registration (and for P's answer to an Abort)
    # before giving up on the push and recomputing the prompt locally.
    ack_timeout: float = 5.0
    # D: while it waits on a P, it pings that P this often, and gives up on every push
    # from it when P has said nothing for peer_timeout (P died or is unreachable).
    ping_interval: float = 1.0
    peer_timeout: float = 3.0
    # P: the write lease (docs/ARCHITECTURE.md, section 5). P starts a WRITE into a D's
    # blocks only within write_lease of that D's last grant (D grants with its
    # registrations and its pings, pinging at least three times per write_lease), and is
    # done with it (posted, or cancelled) write_timeout after that lease ends; D, when it
    # gives up on a push without P's word, frees the blocks only after both have passed.
    # Longer: a WRITE may take longer, and D holds given-up blocks longer.
    write_lease: float = 3.0
    write_timeout: float = 10.0
    # At most this often, a log line with the push counts (when they changed).
    stats_interval: float = 30.0
    # P: when a push's WRITE fails, P keeps the prompt's blocks this long for D to read
    # them instead, like a pull (seconds). 0: P frees them at once and D computes the
    # prompt itself.
    pull_fallback_ttl: float = 30.0
    # P: honour `"fail_write": true` in a push request's kv_transfer_params by failing
    # its WRITE on purpose, before it starts. For tests and failure drills; leave off.
    fault_injection: bool = False
    # How this server's NIXL agent makes progress (connector/shared/progress.py): "event", NIXL's
    # progress thread woken by the transport's events, idle at no cost, so a peer's
    # transfer never waits for this server's next engine step; "off", no thread (vLLM
    # polls every engine step, our poller between steps while a push is in flight);
    # "spin", NIXL's default as vLLM builds it, a thread that spins a whole core for as
    # long as the server runs.
    nixl_progress_thread: ProgressMode = "event"
    # D: while its engine has nothing to run and only waits for pushes, each engine step
    # pauses this long (seconds). vLLM steps a waiting engine back to back, which keeps
    # about half a core busy on a CPU server for as long as P computes the prompt: CPU
    # that the server's other work, or P's prefill where the two share cores, could use.
    # D's workers end a pause as soon as a push's notification arrives (connector/decode/wake.py).
    # None (the default): CPU_PAUSE on CPU servers, 0 (no pause, as vLLM does) on GPU
    # ones, whose forward pass does not need that CPU.
    push_wait_pause: float | None = None
    # P: WRITE a push right after the forward pass that completes its prompt, when D has
    # registered by the end of that pass, instead of at the start of the next step, after
    # sampling, the output's processing and the next schedule. Servers whose KV NIXL
    # reads where the forward writes it: on CPU at once, on a GPU once a CUDA event says
    # the forward's kernels have written it (connector/prefill/fence.py; its waits tested
    # on a GPU without vLLM, tests/gpu); every tensor-parallel worker is told
    # (connector/prefill/early.py). A KV
    # cache copied to a host buffer is copied only after the pass, pipeline stages end
    # their passes apart, and context-parallel ranks are not told: those servers always
    # WRITE at the next step.
    early_write: bool = True
    # P: write a push's KV layer by layer while the forward pass computes the prompt
    # (progressive push, connector/prefill/layers.py), when D registered before that pass
    # reached the layer: "auto" for prompts of at least push_layers_min_tokens tokens,
    # "on" for every push, "off" never. A request's kv_transfer_params `push_layers`
    # (the router's X-KV-Push-Layers header, or its learned choice) overrides "auto" and
    # "on"; "off" refuses it: an operator who turns layers off on P keeps them off,
    # whatever a router asks. "on" asks vLLM for piecewise
    # CUDA graphs on a GPU (a full graph replays the pass without the per-layer hook).
    # Needs early WRITEs (`early_write`) and a model whose KV every layer writes
    # through vLLM's per-layer hook (not Mamba state, one KV cache group); elsewhere,
    # and when D registers late, the push is written whole.
    push_layers: PushLayers = "auto"
    push_layers_min_tokens: int = DEFAULT_PUSH_LAYERS_MIN_TOKENS
    # P: at most this many live push registrations from one peer (its CURVE key, else its
    # ZMQ identity); more are refused (`NACK over_limit`) and that D recomputes.
    max_pending_per_peer: int = DEFAULT_MAX_PENDING_PER_PEER
    # P: at most this many live push registrations from all peers together (without
    # CURVE, every new ZMQ identity is a new peer: this is what bounds a flood of them).
    max_pending: int = DEFAULT_MAX_PENDING
    # D: at most this many sockets to P servers at once (an LRU). One with no push in
    # flight is closed when its P proved unreachable, after a minute unused, or to make
    # room; a push to one more P while every socket has pushes in flight is computed here.
    max_peers: int = DEFAULT_MAX_PEERS
    # Authentication of the push side channel (ZMQ CURVE; connector/shared/keys.py makes keys).
    # All three, or none (then anyone who reaches the push port is trusted, and the
    # server logs a warning at start):
    # - curve_secret_key_file: this server's key pair (a `.key_secret` file): P's push
    #   port serves with it, and D connects to P's with it;
    # - curve_allowed_keys: the public keys P accepts (D servers', and the router's for
    #   its abandons): a directory of `*.key` files, or a list of files; others are
    #   refused and counted;
    # - curve_server_key_file: the P servers' public key (a `.key` file), that D checks P
    #   by. Every P a D pushes from must hold that key pair: in a pool, give the P servers
    #   the same pair.
    curve_secret_key_file: str | None = None
    curve_allowed_keys: str | list[str] | None = None
    curve_server_key_file: str | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.push_port <= MAX_PORT:
            raise ConfigError(f"push_port must be in 1..{MAX_PORT}, got {self.push_port}")
        if self.push_host is not None and not self.push_host:
            raise ConfigError("push_host must be a non-empty host name or address")
        for name in ("registration_ttl", "unclaimed_ttl", "ack_timeout", "ping_interval",
                     "peer_timeout", "write_lease", "write_timeout", "stats_interval"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a finite number of seconds > 0, got {value}")
        if not (math.isfinite(self.pull_fallback_ttl) and self.pull_fallback_ttl >= 0):
            raise ConfigError("pull_fallback_ttl must be a finite number of seconds >= 0 "
                              f"(0 turns the fallback to pull off), got {self.pull_fallback_ttl}")
        pause = self.push_wait_pause
        if pause is not None and not (math.isfinite(pause) and 0 <= pause <= MAX_PAUSE):
            raise ConfigError(f"push_wait_pause must be in 0..{MAX_PAUSE} seconds "
                              f"(0 turns the pause off), got {pause}")
        if self.push_layers_min_tokens < 0:
            raise ConfigError("push_layers_min_tokens must be >= 0, got "
                              f"{self.push_layers_min_tokens}")
        for name in ("max_pending_per_peer", "max_pending"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 1 <= self.max_peers <= MAX_PEERS_LIMIT:
            raise ConfigError(f"max_peers must be in 1..{MAX_PEERS_LIMIT} (ZMQ's sockets "
                              f"per context), got {self.max_peers}")
        given = [name for name in CURVE_KEYS if getattr(self, name)]
        if given and len(given) != len(CURVE_KEYS):
            missing = [name for name in CURVE_KEYS if name not in given]
            raise ConfigError(
                f"side-channel authentication needs {', '.join(CURVE_KEYS)} together; "
                f"missing: {', '.join(missing)}")
        if self.peer_timeout <= self.ping_interval:
            raise ConfigError(
                f"peer_timeout ({self.peer_timeout}) must be longer than ping_interval "
                f"({self.ping_interval}), or a live P would be taken for dead"
            )

    def wait_pause(self, on_cpu: bool) -> float:
        """`push_wait_pause`, or its default for this kind of server."""
        if self.push_wait_pause is not None:
            return self.push_wait_pause
        return CPU_PAUSE if on_cpu else 0.0

    def writes_layers(self, asked: bool | None, prompt_tokens: int) -> bool:
        """Whether a push of `prompt_tokens` is written layer by layer, by the request's
        choice (`asked`, None: none) or this config; `off` here refuses a request's `on`."""
        if self.push_layers == "off":
            return False
        if asked is not None:
            return asked
        if self.push_layers == "auto":
            return prompt_tokens >= self.push_layers_min_tokens
        return self.push_layers == "on"

    def writes_early(self, fenced: bool, world_size: int, tensor_parallel_size: int) -> bool:
        """Whether P WRITEs right after the forward that completes a prompt: `fenced`,
        its WRITEs can wait for the pass's KV (`vllm_compat.fence_device`), and its
        workers are its tensor-parallel ranks only (no pipeline stages, whose passes end
        apart, nor context-parallel ranks: the early sockets are per TP rank)."""
        return self.early_write and fenced and world_size == tensor_parallel_size

    @property
    def authenticated(self) -> bool:
        """Whether the side channel is authenticated (CURVE keys are configured)."""
        return self.curve_secret_key_file is not None

    def curve_keys(self) -> tuple[ServerKeys, ClientKeys] | None:
        """The keys for P's push port and for D's connections to P's, read from their
        files; None without authentication. Raises ConfigError naming a bad file."""
        if self.curve_secret_key_file is None or self.curve_allowed_keys is None \
                or self.curve_server_key_file is None:
            return None
        try:
            pair = load_key_pair(self.curve_secret_key_file)
            allowed = load_allowed(self.curve_allowed_keys)
            server = load_public_key(self.curve_server_key_file)
        except KeyFileError as exc:
            raise ConfigError(f"bad side-channel key: {exc}") from exc
        return ServerKeys(pair, allowed), ClientKeys(pair, server)

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> DualConfig:
        """Our keys from `kv_connector_extra_config`; raise ConfigError with the reason."""
        ours = {key: value for key, value in (extra or {}).items() if key in KEYS}
        if isinstance(ours.get("nixl_progress_thread"), bool):
            raise ConfigError(
                "nixl_progress_thread is one of \"event\", \"off\", \"spin\" "
                "(it was a boolean once: false is now \"off\", true \"spin\")"
            )
        if "push_port" not in ours:
            raise ConfigError(
                "NixlDualConnector needs kv_connector_extra_config.push_port: the port of "
                "this server's push side channel (each P and D server its own)"
            )
        try:
            return msgspec.convert(ours, cls, strict=False)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"bad NixlDualConnector setting: {exc}") from exc
