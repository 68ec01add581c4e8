"""The layered emulated model (testbed: `model_dir.build(layers=8)`) on real vLLM: its
tokens equal a plain server's of the same weights, and each of its layers ends at its
share of the step's profile time, which is what lets a connector's per-layer hook
(`save_kv_layer`) fire through the step as on a GPU.

Two servers at once, one per core: the emulated model (profile llama8b-h100, 8 layers,
`TESTBED_TIME_SCALE` 4 so that the layers' own compute stays well inside their share on
any machine the README allows) and the same directory served as vLLM's plain
`LlamaForCausalLM`. Any pair is stopped first. A server that does not start fails the
test; nothing here skips.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from testbed.clock import TIME_SCALE_ENV, StepRecord, read_step_log
from testbed.profiles import get_profile
from testbed.vllm_cpu import (
    GPU_MAX_MODEL_LEN,
    GPU_REGIME_ARGS,
    ServerStartError,
    VllmServer,
    gpu_model_dir,
    run_servers,
    server_spec,
)
from tests.e2e.conftest import PAIR_START_TIMEOUT_S, PairManager

pytestmark = pytest.mark.e2e

PROFILE = get_profile("llama8b-h100")
LAYERS = 8
SCALE = 4.0
PACING_TOKENS = 1024


@pytest.fixture(scope="module")
def layered_servers(pair_manager: PairManager, tiny_model: Any,
                    tmp_path_factory: pytest.TempPathFactory,
                    ) -> Iterator[tuple[VllmServer, VllmServer]]:
    pair_manager.close()
    emulated_dir = gpu_model_dir(PROFILE.name, tiny_model, layers=LAYERS)
    plain_dir = tmp_path_factory.mktemp("plain") / "model"
    log_dir = tmp_path_factory.mktemp("layered-logs")  # its step log: this test's alone
    shutil.copytree(emulated_dir, plain_dir)
    config = json.loads((plain_dir / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    (plain_dir / "config.json").write_text(json.dumps(config))
    specs = [
        server_spec("prefill", connector=None, model_dir=emulated_dir, log_dir=log_dir,
                    name="layered", extra_args=GPU_REGIME_ARGS,
                    max_model_len=GPU_MAX_MODEL_LEN, extra_env={TIME_SCALE_ENV: str(SCALE)}),
        server_spec("decode", connector=None, model_dir=plain_dir, log_dir=log_dir,
                    name="layered-plain", extra_args=GPU_REGIME_ARGS,
                    max_model_len=GPU_MAX_MODEL_LEN),
    ]
    try:
        with run_servers(specs, start_timeout_s=PAIR_START_TIMEOUT_S) as (emulated, plain):
            yield emulated, plain
    except ServerStartError as exc:
        pytest.fail(f"starting the layered servers failed: {exc}", pytrace=False)


def _complete(url: str, prompt: list[int], max_tokens: int) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text[:300]
    text: str = resp.json()["choices"][0]["text"]
    return text


def test_its_tokens_equal_a_plain_servers(
        layered_servers: tuple[VllmServer, VllmServer]) -> None:
    emulated, plain = layered_servers
    rng = random.Random(26)
    for tokens in (64, 700, 2100):
        prompt = [rng.randrange(10, 4096) for _ in range(tokens)]
        assert _complete(emulated.url, prompt, 12) == _complete(plain.url, prompt, 12), tokens


def test_each_layer_ends_at_its_share_of_the_step(
        layered_servers: tuple[VllmServer, VllmServer]) -> None:
    emulated, _ = layered_servers
    rng = random.Random(27)
    _complete(emulated.url, [rng.randrange(10, 4096) for _ in range(PACING_TOKENS)], 1)
    since = time.time()
    _complete(emulated.url, [rng.randrange(10, 4096) for _ in range(PACING_TOKENS)], 1)
    steps: list[StepRecord] = [
        r for r in read_step_log(Path(emulated.spec.step_log_path))
        if r.at >= since and r.prefill_tokens == PACING_TOKENS]
    assert len(steps) == 1, steps
    step = steps[0]
    target = PROFILE.prefill_s(PACING_TOKENS) * SCALE
    assert step.target_s == pytest.approx(target)
    assert not step.overlapped  # an idle engine: its layers count from the step's start
    assert step.compute_s < 0.7 * target, "the layers' own compute must fit their shares"
    assert step.layer_ends_s is not None and len(step.layer_ends_s) == LAYERS
    for index, end in enumerate(step.layer_ends_s):
        expected = target * (index + 1) / LAYERS
        assert end == pytest.approx(expected, abs=0.003 + 0.05 * target / LAYERS), (
            index, step.layer_ends_s)
    assert step.step_s == pytest.approx(target, rel=0.05)
