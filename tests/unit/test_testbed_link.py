"""The emulated link (testbed.link): the rate's scaling from the profiles' KV sizes,
the `tc` commands it runs, and what it refuses without root or tc; the layered
model's pacing (testbed.clock) and its model directory (testbed.model_dir). The
shaping itself, on a real `lo`, is tests/integration/test_emulated_link.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from testbed import link, model_dir
from testbed.clock import (
    TIME_SCALE_ENV,
    TIME_SCALE_FILE_ENV,
    StepClock,
    TimeScale,
    time_scale,
    write_time_scale,
)
from testbed.profiles import StepShape, get_profile
from tests.unit.tiny_dirs import fake_tiny_model

P8 = get_profile("llama8b-h100")
P70 = get_profile("llama70b-h100x8")


def test_kv_bytes_per_token_of_the_emulated_and_profiled_models() -> None:
    # 8 layers x K and V x 1 KV head x 32 x float32.
    assert link.kv_bytes_per_token(model_dir.shape(8) | {"head_dim": 32}) == 8 * 2 * 32 * 4
    # The formula on Llama 3 8B's config, bfloat16: the profile's own number.
    llama8b = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
               "hidden_size": 4096}
    assert link.kv_bytes_per_token(llama8b, dtype_bytes=2) == P8.kv_bytes_per_token


def test_the_rate_scales_so_that_transfer_over_prefill_is_the_real_pairs() -> None:
    emulated = 2048
    rate = link.scaled_rate_bps(25.0, emulated, P8.kv_bytes_per_token)
    assert rate == pytest.approx(25e9 / 64) == pytest.approx(390.625e6)
    assert link.scaled_rate_bps(400.0, emulated, P8.kv_bytes_per_token) == pytest.approx(6.25e9)
    assert link.scaled_rate_bps(25.0, emulated, P70.kv_bytes_per_token) == pytest.approx(
        25e9 * 2048 / 327680)
    # The emulated model's 8,192-token KV over the scaled rate takes exactly as long as
    # the profiled model's over the real link.
    real = 8192 * P8.kv_bytes_per_token * 8 / 25e9
    assert link.transfer_s(8192, emulated, rate) == pytest.approx(real)
    assert real == pytest.approx(0.3436, rel=1e-3)
    with pytest.raises(ValueError):
        link.scaled_rate_bps(0, emulated, P8.kv_bytes_per_token)


def test_links_are_named_and_none_is_unshaped() -> None:
    assert {name: item.gbps for name, item in link.LINKS.items()} == {
        "rdma400": 400.0, "eth100": 100.0, "eth25": 25.0, "none": None}
    with pytest.raises(ValueError, match="eth25"):
        link.get_link("eth10")


def test_the_data_ports_are_one_aligned_block_below_the_ephemeral_range() -> None:
    ports = link.DATA_PORTS
    assert len(ports) == 64 and ports.stop <= 32768
    assert all(port & link.PORT_MASK == link.PORT_BASE for port in ports)
    assert not any(port & link.PORT_MASK == link.PORT_BASE for port in (ports.start - 1,
                                                                       ports.stop))
    env = link.ucx_env()
    assert env == {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo",
                   "UCX_TCP_PORT_RANGE": f"{ports.start}-{ports.stop - 1}"}


def test_the_tc_commands() -> None:
    rate = 390.625e6
    commands = link.apply_commands(rate)
    assert commands[0] == ["tc", "qdisc", "add", "dev", "lo", "root", "handle", "7a26:", "htb"]
    cls = commands[1]
    assert cls[:9] == ["tc", "class", "add", "dev", "lo", "parent", "7a26:", "classid",
                       "7a26:1"]
    assert cls[cls.index("rate") + 1] == cls[cls.index("ceil") + 1] == "390625000bit"
    # The bucket: a millisecond of the rate, but never less than two 64 KiB packets.
    assert int(cls[cls.index("burst") + 1]) == link.MIN_BURST_BYTES
    big = link.apply_commands(6.25e9)[1]
    assert int(big[big.index("burst") + 1]) == int(6.25e9 / 8 * 0.001)
    filters = commands[2:]
    assert [f[f.index("match") + 1:f.index("flowid")] for f in filters] == [
        ["ip", "sport", "29696", "0xffc0"], ["ip", "dport", "29696", "0xffc0"]]
    assert all(f[-2:] == ["flowid", "7a26:1"] and "u32" in f for f in filters)
    assert link.change_command(rate)[:3] == ["tc", "class", "change"]
    assert link.clear_command() == ["tc", "qdisc", "del", "dev", "lo", "root", "handle",
                                    "7a26:"]


def test_without_root_or_tc_it_says_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(link.LinkError, match="`tc` tool"):
        link.require_tc()
    monkeypatch.setattr("shutil.which", lambda name: "/sbin/tc")
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    with pytest.raises(link.LinkError, match="root"):
        link.require_tc()
    with pytest.raises(link.LinkError, match="root"):
        with link.shaped(1e6):
            pass


def test_the_cli_prints_the_rates(capsys: pytest.CaptureFixture[str]) -> None:
    assert link.main(["rates", "--profile", "llama8b-h100", "--layers", "8"]) == 0
    out = capsys.readouterr().out
    assert "eth25" in out and "390.6 Mb/s" in out and "6250.0 Mb/s" in out and "EMULATED" in out
    with pytest.raises(SystemExit) as exit_info:
        link.main(["--help"])
    assert exit_info.value.code == 0
    assert "leaves out" in capsys.readouterr().out


# Layer pacing ------------------------------------------------------------------------


def test_layers_end_at_their_share_of_the_step() -> None:
    now = [10.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    clock = StepClock(now=lambda: now[0], sleep=sleep)
    planned = clock.plan(10.0, 0.080, [StepShape(1024)])
    assert [planned.layer_deadline(i, 8) for i in range(8)] == pytest.approx(
        [10.0 + 0.010 * (i + 1) for i in range(8)])
    assert planned.layer_deadline(7, 8) == planned.deadline
    ends = []
    for index in range(8):
        now[0] += 0.002  # the layer's own compute
        clock.pace(planned.layer_deadline(index, 8))
        ends.append(now[0])
    assert ends == pytest.approx([10.010 + 0.010 * i for i in range(8)])
    assert clock.wait(planned) == pytest.approx(10.080)
    # A layer whose compute overran does not sleep; the next ones catch up.
    planned = clock.plan(now[0] + 1.0, 0.040, [StepShape(1024)])
    now[0] += 1.0 + 0.025
    assert clock.pace(planned.layer_deadline(0, 4)) == 0.0
    assert clock.pace(planned.layer_deadline(2, 4)) == pytest.approx(0.005)
    with pytest.raises(ValueError):
        planned.layer_deadline(4, 4)


def test_an_overlapped_steps_layers_start_where_the_previous_step_ended() -> None:
    now = [0.0]
    clock = StepClock(now=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    end = clock.wait(clock.plan(0.0, 0.010, [StepShape(100)]))
    now[0] += 0.003
    planned = clock.plan(now[0], 0.006, [StepShape(1, 100)])
    assert planned.overlapped
    assert planned.layer_deadline(0, 2) == pytest.approx(end + 0.003)


def test_the_time_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TIME_SCALE_ENV, raising=False)
    assert time_scale() == 1.0
    monkeypatch.setenv(TIME_SCALE_ENV, "3")
    assert time_scale() == 3.0
    monkeypatch.setenv(TIME_SCALE_ENV, "-1")
    with pytest.raises(ValueError, match=TIME_SCALE_ENV):
        time_scale()


def test_the_time_scale_file_is_read_again_when_it_changes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "scale"
    monkeypatch.setenv(TIME_SCALE_ENV, "2")
    monkeypatch.setenv(TIME_SCALE_FILE_ENV, str(path))
    scale = TimeScale.from_env()
    assert scale.current() == 2.0  # no file yet: the environment's
    write_time_scale(path, 3.0)
    assert scale.current() == 3.0
    path.write_text("nonsense")
    assert scale.current() == 3.0  # a bad value keeps the last good one
    write_time_scale(path, 1.5)
    assert scale.current() == 1.5
    with pytest.raises(ValueError):
        write_time_scale(path, 0.0)


# The layered model directory ----------------------------------------------------------


def test_a_layered_model_directory(tmp_path: Path) -> None:
    tiny = fake_tiny_model(tmp_path)
    built = model_dir.build(tiny, "llama8b-h100", layers=8)
    assert built == tmp_path / "gpu-model-llama8b-h100-8layers"
    config = json.loads((built / "config.json").read_text())
    assert config["num_hidden_layers"] == 8 and config["num_attention_heads"] == 1
    assert config["num_key_value_heads"] == 1
    assert link.model_kv_bytes_per_token(built) == 2048
    weights = load_file(str(built / "model.safetensors"))
    tiny_weights = load_file(str(tiny / "model.safetensors"))
    for index in range(8):
        prefix = f"model.layers.{index}."
        assert weights[prefix + "self_attn.q_proj.weight"].shape == (32, 128)
        assert weights[prefix + "self_attn.k_proj.weight"].shape == (32, 128)
        assert weights[prefix + "self_attn.o_proj.weight"].shape == (128, 32)
        assert weights[prefix + "mlp.down_proj.weight"].shape == (128, 64)
    # The tiny model's own two layers cut from it, the others generated, reproducibly.
    np.testing.assert_array_equal(weights["model.layers.1.self_attn.k_proj.weight"],
                                  tiny_weights["model.layers.1.self_attn.k_proj.weight"][:32])
    generated = weights["model.layers.5.mlp.up_proj.weight"]
    assert 0.05 < float(generated.std()) < 0.15
    assert not np.array_equal(generated, weights["model.layers.6.mlp.up_proj.weight"])
    np.testing.assert_array_equal(weights["model.layers.5.input_layernorm.weight"],
                                  np.ones(128, dtype=np.float32))
    again = model_dir.build(tiny, "llama8b-h100", out_dir=tmp_path / "again", layers=8)
    np.testing.assert_array_equal(load_file(str(again / "model.safetensors"))[
        "model.layers.5.mlp.up_proj.weight"], generated)
    # One layer stays the default, and its own directory.
    assert model_dir.build(tiny, "llama8b-h100") == tmp_path / "gpu-model-llama8b-h100"
    with pytest.raises(ValueError, match="at least one layer"):
        model_dir.build(tiny, "llama8b-h100", layers=0)


def test_one_process_holds_the_link_at_a_time(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(link, "HOLDER_PATH", tmp_path / "holder.pid")
    assert link.holder() is None
    link.hold()
    assert link.holder() == os.getpid()
    link.release()
    assert link.holder() is None
    (tmp_path / "holder.pid").write_text("1")  # a live process (init)
    with pytest.raises(link.LinkError, match="in use by process 1"):
        link.hold()
    (tmp_path / "holder.pid").write_text("999999999")  # no such process: a leftover
    link.hold()
    assert link.holder() == os.getpid()
