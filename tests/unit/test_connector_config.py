"""The dual connector's settings: our keys from kv_connector_extra_config, checked at start."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import zmq.auth

from connector.config import CPU_PAUSE, MAX_PAUSE, ConfigError, DualConfig
from connector.shared.keys import load_key_pair, load_public_key
from connector.shared.keys import main as make_keys


def test_only_our_keys_are_read_and_the_defaults_fill_the_rest() -> None:
    config = DualConfig.from_extra_config({"push_port": 5700, "kv_lease_duration": 60})
    assert config.push_port == 5700
    assert config.push_host is None
    assert (config.registration_ttl, config.unclaimed_ttl) == (120.0, 120.0)
    assert (config.ack_timeout, config.ping_interval, config.peer_timeout) == (5.0, 1.0, 3.0)
    assert (config.pull_fallback_ttl, config.fault_injection) == (30.0, False)
    assert config.nixl_progress_thread == "event"
    assert config.push_wait_pause is None
    assert config.max_peers == 256
    assert (config.write_lease, config.write_timeout) == (3.0, 10.0)


@pytest.mark.parametrize("mode", ["event", "off", "spin"])
def test_each_progress_mode_is_accepted(mode: str) -> None:
    assert DualConfig.from_extra_config(
        {"push_port": 5700, "nixl_progress_thread": mode}).nixl_progress_thread == mode


def test_a_pull_fallback_ttl_of_zero_turns_the_fallback_off() -> None:
    assert DualConfig.from_extra_config(
        {"push_port": 5700, "pull_fallback_ttl": 0}).pull_fallback_ttl == 0


def test_a_push_wait_pause_up_to_the_limit_is_accepted() -> None:
    assert DualConfig.from_extra_config(
        {"push_port": 5700, "push_wait_pause": MAX_PAUSE}).push_wait_pause == MAX_PAUSE


def test_the_push_wait_pause_defaults_to_a_pause_on_cpu_only() -> None:
    default = DualConfig.from_extra_config({"push_port": 5700})
    assert (default.wait_pause(on_cpu=True), default.wait_pause(on_cpu=False)) == (CPU_PAUSE, 0.0)
    off = DualConfig.from_extra_config({"push_port": 5700, "push_wait_pause": 0})
    assert (off.wait_pause(on_cpu=True), off.wait_pause(on_cpu=False)) == (0.0, 0.0)
    set_ = DualConfig.from_extra_config({"push_port": 5700, "push_wait_pause": 0.01})
    assert set_.wait_pause(on_cpu=False) == 0.01


def test_early_writes_are_on_by_default_for_a_fenced_server_of_tensor_parallel_ranks() -> None:
    default = DualConfig.from_extra_config({"push_port": 5700})
    assert default.writes_early(fenced=True, world_size=1, tensor_parallel_size=1)
    assert default.writes_early(fenced=True, world_size=2, tensor_parallel_size=2)
    assert not default.writes_early(fenced=False, world_size=1, tensor_parallel_size=1)
    # pipeline stages or context-parallel ranks beside TP: not every worker is told
    assert not default.writes_early(fenced=True, world_size=4, tensor_parallel_size=2)
    off = DualConfig.from_extra_config({"push_port": 5700, "early_write": False})
    assert not off.writes_early(fenced=True, world_size=1, tensor_parallel_size=1)


def test_numbers_given_as_strings_are_accepted() -> None:
    config = DualConfig.from_extra_config({"push_port": "5700", "peer_timeout": "4.5"})
    assert (config.push_port, config.peer_timeout) == (5700, 4.5)


@pytest.mark.parametrize("extra", [None, {}, {"kv_lease_duration": 30}])
def test_push_port_is_required(extra: dict[str, Any] | None) -> None:
    with pytest.raises(ConfigError, match="push_port"):
        DualConfig.from_extra_config(extra)


@pytest.mark.parametrize(("extra", "named"), [
    pytest.param({"push_port": 0}, "push_port", id="port-zero"),
    pytest.param({"push_port": 70000}, "push_port", id="port-too-big"),
    pytest.param({"push_port": "http"}, "push_port", id="port-not-a-number"),
    pytest.param({"push_port": 5700, "push_host": ""}, "push_host", id="empty-host"),
    pytest.param({"push_port": 5700, "registration_ttl": 0}, "registration_ttl", id="ttl-zero"),
    pytest.param({"push_port": 5700, "unclaimed_ttl": float("inf")}, "unclaimed_ttl",
                 id="ttl-infinite"),
    pytest.param({"push_port": 5700, "ack_timeout": -1}, "ack_timeout", id="negative"),
    pytest.param({"push_port": 5700, "ping_interval": 2, "peer_timeout": 2}, "peer_timeout",
                 id="peer-timeout-not-above-ping"),
    pytest.param({"push_port": 5700, "stats_interval": 0}, "stats_interval", id="stats-zero"),
    pytest.param({"push_port": 5700, "pull_fallback_ttl": -1}, "pull_fallback_ttl",
                 id="pull-fallback-negative"),
    pytest.param({"push_port": 5700, "fault_injection": "maybe"}, "fault_injection",
                 id="fault-injection-not-a-bool"),
    pytest.param({"push_port": 5700, "nixl_progress_thread": "sometimes"},
                 "nixl_progress_thread", id="progress-thread-not-a-mode"),
    pytest.param({"push_port": 5700, "nixl_progress_thread": False},
                 'false is now "off"', id="progress-thread-an-old-boolean"),
    pytest.param({"push_port": 5700, "push_wait_pause": -0.001}, "push_wait_pause",
                 id="pause-negative"),
    pytest.param({"push_port": 5700, "push_wait_pause": 1}, "push_wait_pause",
                 id="pause-too-long"),
    pytest.param({"push_port": 5700, "max_pending_per_peer": 0}, "max_pending_per_peer",
                 id="pending-limit-zero"),
    pytest.param({"push_port": 5700, "max_pending": 0}, "max_pending must",
                 id="global-pending-limit-zero"),
    pytest.param({"push_port": 5700, "write_lease": 0}, "write_lease", id="no-lease"),
    pytest.param({"push_port": 5700, "write_timeout": float("inf")}, "write_timeout",
                 id="endless-write"),
    pytest.param({"push_port": 5700, "max_peers": 0}, "max_peers", id="peer-limit-zero"),
    pytest.param({"push_port": 5700, "max_peers": 1024}, "ZMQ's sockets per context",
                 id="peer-limit-past-zmqs"),
    pytest.param({"push_port": 5700, "curve_secret_key_file": "/k"},
                 "missing: curve_allowed_keys, curve_server_key_file", id="curve-partial"),
    pytest.param({"push_port": 5700, "curve_allowed_keys": 5}, "curve_allowed_keys",
                 id="curve-allowed-not-a-path"),
])
def test_a_bad_value_fails_the_start_naming_the_key(extra: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        DualConfig.from_extra_config(extra)


# --- side-channel authentication --------------------------------------------------------


def test_without_keys_the_side_channel_is_unauthenticated() -> None:
    config = DualConfig.from_extra_config({"push_port": 5700})
    assert config.max_pending_per_peer == 4096 and config.max_pending == 16384
    assert not config.authenticated and config.curve_keys() is None


@pytest.fixture
def key_dir(tmp_path: Path) -> Path:
    """Key pairs made by the helper: p (the P servers'), d (a D's), router; and the
    public keys P allows, in a directory of their own."""
    for name in ("p", "d", "router"):
        assert make_keys([str(tmp_path / "keys"), name]) == 0
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    for name in ("d", "router"):
        (allowed / f"{name}.key").write_bytes((tmp_path / "keys" / f"{name}.key").read_bytes())
    return tmp_path


def test_the_key_helper_makes_a_private_key_pair(key_dir: Path) -> None:
    secret = key_dir / "keys" / "p.key_secret"
    assert secret.stat().st_mode & 0o077 == 0, "readable by its owner only"
    pair = load_key_pair(str(secret))
    assert load_public_key(str(key_dir / "keys" / "p.key")) == pair.public


@pytest.mark.parametrize("as_list", [False, True], ids=["directory", "list"])
def test_keys_are_read_from_their_files(key_dir: Path, as_list: bool) -> None:
    keys = key_dir / "keys"
    allowed: str | list[str] = str(key_dir / "allowed")
    if as_list:
        allowed = [str(keys / "d.key"), str(keys / "router.key")]
    config = DualConfig.from_extra_config({
        "push_port": 5700, "curve_secret_key_file": str(keys / "p.key_secret"),
        "curve_allowed_keys": allowed, "curve_server_key_file": str(keys / "p.key")})
    loaded = config.curve_keys()
    assert config.authenticated and loaded is not None
    server, client = loaded
    assert server.pair == load_key_pair(str(keys / "p.key_secret")) == client.pair
    assert server.allowed == {load_public_key(str(keys / f"{n}.key")) for n in ("d", "router")}
    assert client.server_public == server.pair.public


@pytest.mark.parametrize(("change", "named"), [
    pytest.param({"curve_secret_key_file": "p.key"}, "no CURVE secret key", id="public-as-pair"),
    pytest.param({"curve_secret_key_file": "absent"}, "cannot read", id="missing-file"),
    pytest.param({"curve_allowed_keys": "empty"}, "no public key file", id="no-allowed-keys"),
    pytest.param({"curve_allowed_keys": "p.key"}, "not a directory", id="allowed-not-a-dir"),
    pytest.param({"curve_server_key_file": "garbled.key"}, "CURVE public key",
                 id="garbled-key"),
])
def test_a_bad_key_file_fails_the_start_naming_it(
    key_dir: Path, change: dict[str, str], named: str,
) -> None:
    keys = key_dir / "keys"
    (keys / "empty").mkdir()
    (keys / "garbled.key").write_text('metadata\ncurve\n    public-key = "short"\n')
    extra: dict[str, Any] = {
        "push_port": 5700, "curve_secret_key_file": str(keys / "p.key_secret"),
        "curve_allowed_keys": str(key_dir / "allowed"),
        "curve_server_key_file": str(keys / "p.key"),
        **{key: str(keys / value) for key, value in change.items()}}
    with pytest.raises(ConfigError, match=named) as caught:
        DualConfig.from_extra_config(extra).curve_keys()
    assert str(keys) in str(caught.value), "the bad file is named"


def test_key_files_are_made_by_zmq_certificates(tmp_path: Path) -> None:
    public, secret = zmq.auth.create_certificates(str(tmp_path), "x")
    assert load_key_pair(secret).public == load_public_key(public)


def test_only_push_layers_on_asks_vllm_for_piecewise_cuda_graphs() -> None:
    from connector.connector import NixlDualConnector

    asks = NixlDualConnector.requires_piecewise_for_cudagraph
    assert asks({"push_port": 5700, "push_layers": "on"})
    assert not asks({"push_port": 5700})  # auto: its prompts run outside full graphs
    assert not asks({"push_port": 5700, "push_layers": "off"})
    assert not asks({"push_layers": "on"})  # no push_port: the connector's start says so


def test_a_requests_push_layers_overrides_auto_and_on_but_never_off() -> None:
    """The router asks per request (X-KV-Push-Layers, or its learned choice); P's `off`
    is the operator's and stands."""
    auto, on, off = (DualConfig.from_extra_config({"push_port": 5700, "push_layers": value})
                     for value in ("auto", "on", "off"))
    small, large = auto.push_layers_min_tokens - 1, auto.push_layers_min_tokens
    assert [auto.writes_layers(None, small), auto.writes_layers(None, large)] == [False, True]
    assert auto.writes_layers(True, small) and not auto.writes_layers(False, large)
    assert on.writes_layers(None, small) and not on.writes_layers(False, large)
    assert not any(off.writes_layers(asked, large) for asked in (None, True, False))


def test_a_cpu_servers_writes_wait_on_nothing_but_go_on_the_fences_thread() -> None:
    from types import SimpleNamespace

    from connector.prefill.fence import CudaFence, ThreadFence, fence_for
    from connector.vllm_compat import fence_device

    assert fence_device(SimpleNamespace(kv_transfer_config=None)) == "cpu"  # type: ignore[arg-type]
    fence = fence_for("cpu")
    assert isinstance(fence, ThreadFence) and not isinstance(fence, CudaFence)
