"""The GPU-regime testbed's arithmetic: profile formulas, the step clock, the model
directory and the plugin's registration (no vLLM server; the e2e test checks the
emulation itself in tests/e2e/test_gpu_regime.py)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from testbed import model_dir
from testbed.clock import STEP_LOG_ENV, StepClock, StepLog, StepRecord, read_step_log
from testbed.plugin import ARCHITECTURE, MODEL_CLASS
from testbed.profiles import PROFILES, StepShape, get_profile
from tests.unit.tiny_dirs import fake_tiny_model, random_tiny_weights

ROOT = Path(__file__).resolve().parents[2]
P8 = get_profile("llama8b-h100")
P70 = get_profile("llama70b-h100x8")


def test_the_models_match_their_model_cards() -> None:
    assert P8.model.total_params == pytest.approx(8.03e9, rel=0.005)
    assert P70.model.total_params == pytest.approx(70.6e9, rel=0.005)
    # K and V, every layer, 8 KV heads of 128, bfloat16.
    assert P8.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072
    assert P70.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2 == 327680


def test_prefill_is_compute_bound_with_a_quadratic_attention_term() -> None:
    m, n = P8.model, 1024
    flops = 2 * m.matmul_params * n + 4 * m.num_layers * m.num_heads * m.head_dim * (
        n * (n + 1) // 2)
    assert P8.prefill_s(n) == pytest.approx(flops / (989.4e12 * 0.5))
    assert P8.prefill_s(n) > P8.memory_s([StepShape(n)])
    # Linear in the matmuls, plus attention's square: doubling more than doubles.
    assert 2 * P8.prefill_s(4096) < P8.prefill_s(8192) < 2.2 * P8.prefill_s(4096)
    # A cached prefix is not computed again, but is attended to.
    assert P8.prefill_s(512, cached=512) < P8.prefill_s(1024)
    assert P8.prefill_s(512, cached=512) > P8.prefill_s(512)


def test_decode_is_memory_bound_weights_plus_kv() -> None:
    m = P8.model
    weights = m.matmul_params * 2
    one = P8.decode_step_s(1, 1024)
    assert one == pytest.approx((weights + 1024 * P8.kv_bytes_per_token) / (3.35e12 * 0.8))
    assert 5e-3 < one < 7e-3  # streaming 15 GB of weights
    batch = P8.decode_step_s(32, 1024)
    assert batch == pytest.approx(
        (weights + 32 * 1024 * P8.kv_bytes_per_token) / (3.35e12 * 0.8))
    assert P8.decode_step_s(1, 8192) > one
    assert P8.decode_step_s(0, 1024) == 0.0


def test_a_tiny_prefill_costs_the_weight_read_and_empty_steps_nothing() -> None:
    assert P8.prefill_s(1) == pytest.approx(P8.memory_s([StepShape(1)]))
    assert P8.step_s([]) == 0.0
    mixed = [StepShape(2048), *[StepShape(1, 1000)] * 16]
    assert P8.step_s(mixed) == max(P8.compute_s(mixed), P8.memory_s(mixed))
    assert P8.step_s(mixed) > P8.prefill_s(2048)


def test_tensor_parallel_divides_the_work_over_its_gpus() -> None:
    m = P70.model
    weights_per_gpu = m.matmul_params * 2 / 8
    assert P70.decode_step_s(1, 1) == pytest.approx(
        (weights_per_gpu + P70.kv_bytes_per_token / 8) / (3.35e12 * 0.6))
    assert P70.prefill_s(1024) == pytest.approx(
        P70.flops([StepShape(1024)]) / (8 * 989.4e12 * 0.4))


def test_profiles_print_their_sources_and_unknown_names_fail_clearly() -> None:
    for profile in PROFILES.values():
        text = profile.describe()
        assert profile.name in text
        assert "datasheet" in text and "config.json" in text and "MFU" in text
    with pytest.raises(ValueError, match="llama8b-h100"):
        get_profile("nope")


def test_an_idle_step_lasts_its_target_from_its_start() -> None:
    now = [100.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    clock = StepClock(now=lambda: now[0], sleep=sleep)
    now[0] += 0.002  # real compute
    planned = clock.plan(100.0, 0.030, [StepShape(1024)])
    assert not planned.overlapped and planned.gap_s is None
    assert clock.wait(planned) == pytest.approx(100.030)
    assert slept == [pytest.approx(0.028)]

    # Long after: idle again, the whole target.
    now[0] = 200.0
    planned = clock.plan(200.0, 0.010, [StepShape(1, 1024)])
    assert not planned.overlapped and planned.gap_s == pytest.approx(99.97)
    assert clock.wait(planned) == pytest.approx(200.010)


def test_a_busy_engines_steps_hide_the_host_gap_but_not_a_slower_host() -> None:
    now = [0.0]
    clock = StepClock(now=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    end = clock.wait(clock.plan(0.0, 0.010, [StepShape(100)]))
    # Decodes of that request: the host spends 3 ms between forwards, less than the
    # 6 ms step, so steps end 6 ms apart, as with asynchronous scheduling on a GPU.
    for context in range(100, 103):
        now[0] += 0.003
        planned = clock.plan(now[0], 0.006, [StepShape(1, context)])
        assert planned.overlapped and planned.gap_s == pytest.approx(0.003)
        new_end = clock.wait(planned)
        assert new_end - end == pytest.approx(0.006)
        end = new_end
    # A host gap of 8 ms is not hidden: the step lasts its own 6 ms after it.
    now[0] += 0.008
    planned = clock.plan(now[0], 0.006, [StepShape(1, 103)])
    assert not planned.overlapped
    end = clock.wait(planned)
    # Nor is the gap before a step of new requests only (the engine was idle between a
    # client's requests), however short; a new request beside a decode is overlapped.
    now[0] += 0.002
    planned = clock.plan(now[0], 0.030, [StepShape(1000)])
    assert not planned.overlapped
    end = clock.wait(planned)
    now[0] += 0.002
    assert clock.plan(now[0], 0.040, [StepShape(1000), StepShape(1, 1000)]).overlapped


def test_a_step_whose_compute_overran_does_not_sleep() -> None:
    now = [0.0]
    slept: list[float] = []
    clock = StepClock(now=lambda: now[0], sleep=slept.append)
    now[0] = 0.050
    assert clock.wait(clock.plan(0.0, 0.030, [StepShape(1024)])) == 0.050
    assert slept == []


def test_step_records_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "logs" / "p.steps.jsonl"
    monkeypatch.delenv(STEP_LOG_ENV, raising=False)
    assert StepLog.from_env() is None
    monkeypatch.setenv(STEP_LOG_ENV, str(path))
    log = StepLog.from_env()
    assert log is not None
    record = StepRecord(at=1.0, pid=7, requests=2, prefill_tokens=1024, decodes=1,
                        context_tokens=1100, target_s=0.03, compute_s=0.004, gap_s=None,
                        overlapped=False, step_s=0.0301)
    log.write(record)
    with open(path, "ab") as f:
        f.write(b'{"at": 2.0, "pid"')  # a line a writer is still writing
    assert read_step_log(path) == [record]


def test_the_model_directory_names_the_architecture_and_profile(tmp_path: Path) -> None:
    tiny = fake_tiny_model(tmp_path)
    built = model_dir.build(tiny, "llama8b-h100")
    assert built == tmp_path / "gpu-model-llama8b-h100"
    config = json.loads((built / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURE]
    assert config[model_dir.PROFILE_FIELD] == "llama8b-h100"
    assert config["max_position_embeddings"] == model_dir.MAX_POSITIONS >= 9216
    assert json.loads((built / "tokenizer_config.json").read_text())[
        "model_max_length"] == model_dir.MAX_POSITIONS
    assert not (built / ".tiny-model-complete").exists()
    # The weights: the tiny model's, cut to one layer, 2 heads, 1 KV head, 64 MLP units.
    assert {key: config[key] for key in model_dir.SLICE} == model_dir.SLICE
    tiny_weights, cut = load_file(str(tiny / "model.safetensors")), load_file(
        str(built / "model.safetensors"))
    assert not any(name.startswith("model.layers.1.") for name in cut)
    layer = "model.layers.0."
    expected = {
        "self_attn.q_proj.weight": tiny_weights[layer + "self_attn.q_proj.weight"][:64],
        "self_attn.k_proj.weight": tiny_weights[layer + "self_attn.k_proj.weight"][:32],
        "self_attn.v_proj.weight": tiny_weights[layer + "self_attn.v_proj.weight"][:32],
        "self_attn.o_proj.weight": tiny_weights[layer + "self_attn.o_proj.weight"][:, :64],
        "mlp.gate_proj.weight": tiny_weights[layer + "mlp.gate_proj.weight"][:64],
        "mlp.up_proj.weight": tiny_weights[layer + "mlp.up_proj.weight"][:64],
        "mlp.down_proj.weight": tiny_weights[layer + "mlp.down_proj.weight"][:, :64],
        "input_layernorm.weight": tiny_weights[layer + "input_layernorm.weight"],
    }
    for name, tensor in expected.items():
        np.testing.assert_array_equal(cut[layer + name], tensor, err_msg=name)
    for name in ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"):
        np.testing.assert_array_equal(cut[name], tiny_weights[name], err_msg=name)
    # Built once: a second build leaves it alone; a changed tiny model rebuilds it.
    stamp = (built / "config.json").stat().st_mtime_ns
    assert model_dir.build(tiny, "llama8b-h100") == built
    assert (built / "config.json").stat().st_mtime_ns == stamp
    save_file(random_tiny_weights(1), str(tiny / "model.safetensors"))
    model_dir.build(tiny, "llama8b-h100")
    np.testing.assert_array_equal(load_file(str(built / "model.safetensors"))["lm_head.weight"],
                                  random_tiny_weights(1)["lm_head.weight"])
    with pytest.raises(ValueError, match="unknown GPU profile"):
        model_dir.build(tiny, "nope")


def test_the_plugin_is_the_testbeds_own_and_registers_only_its_architecture() -> None:
    # Declared by the testbed's distribution, which only the test environment installs...
    testbed = tomllib.loads((ROOT / "testbed" / "pyproject.toml").read_text())
    assert testbed["project"]["entry-points"]["vllm.general_plugins"] == {
        "pd_proxy_testbed": "testbed.plugin:register"}
    assert testbed["tool"]["setuptools"]["packages"] == ["testbed"]
    # ... and not by the product: pd-proxy registers no vLLM plugin and ships no testbed.
    product = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert not [group for group in product["project"].get("entry-points", {})
                if group.startswith("vllm.")]
    shipped = product["tool"]["setuptools"]["packages"]["find"]["include"]
    assert not [pattern for pattern in shipped if pattern.startswith("testbed")]
    from vllm import ModelRegistry as registry

    from testbed.plugin import register

    before = dict(registry.models)

    register()
    register()  # vLLM may load a plugin more than once
    added = {arch: model for arch, model in registry.models.items() if arch not in before}
    assert set(added) <= {ARCHITECTURE}
    lazy = registry.models[ARCHITECTURE]  # imported only when a model names it
    assert f"{getattr(lazy, 'module_name', '')}:{getattr(lazy, 'class_name', '')}" == MODEL_CLASS
    assert {arch: registry.models[arch] for arch in before} == before
