"""The GPU-regime testbed holds its profile on real vLLM: one server of the emulated
model (`testbed`, profile llama8b-h100), alone on the machine.

The emulation keeps time only while the model's own compute (the tiny model cut to one
layer, see `testbed.model_dir`) fits inside the step it emulates, and that compute runs
at this machine's speed. So the test calibrates first: it measures the compute of a
prefill of each length in `LENGTHS`, and of the same prompt's cache hit, and tests the
longest whose prefill stays within `COMPUTE_BUDGET` of its step and whose cache hit within
`CACHE_HIT_BUDGET` of its own (printed, with the budgets). The README states the machine
this needs: one where a prefill of one of these lengths, its cache hit, and a decode step
fit their budgets; on a slower one the test fails, saying so.

- Prefill, at the calibrated length: every prefill step within 10% of its target, its
  compute within the step. The same prompts again (their prefix cached, one block
  computed): each step ends at its target or, where the host's compute of that block
  ran past it, with the compute (their median within 10%, each within `HOST_SLACK_S`:
  a short step that wakes late by the host's scheduling). End to end, the time to first
  token of a fresh prompt less that of the same prompt sent again within 10% of the
  profile's difference between the two steps (or `HOST_SLACK_S`, if more). Both pay the
  same host work for the prompt (the server's HTTP, reading and hashing the token ids,
  scheduling), at this CPU's speed, which the emulation leaves out (see
  docs/benchmarks.md): the difference is the emulated GPU time alone, on any machine.
- Decode: the period of the server's decode steps within 10% of the profile's step
  time for that batch and context, the gaps between streamed tokens as this client
  reads them within 10% or `HOST_SLACK_S` (the host's scheduling); a decode
  step's compute within the budget (lower quartile: a one-token forward's wall time also
  counts what else its core ran, see the test).

The step records come from the server's step log (`testbed.clock`). Like every e2e
test, a server that does not start fails the test; nothing here skips.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from testbed.clock import StepRecord, read_step_log
from testbed.profiles import get_profile
from testbed.vllm_cpu import (
    GPU_MAX_MODEL_LEN,
    GPU_REGIME_ARGS,
    ServerStartError,
    VllmServer,
    gpu_model_dir,
    run_server,
    server_spec,
)
from tests.e2e.conftest import LOG_DIR, PAIR_START_TIMEOUT_S, PairManager

pytestmark = pytest.mark.e2e

PROFILE = get_profile("llama8b-h100")
# The prompt lengths the prefill test may use: the calibration picks the longest whose
# compute fits COMPUTE_BUDGET here. From 1,024 tokens on, the model's compute grows faster
# with the prompt than the profile's time (CPU attention), and its share with it.
LENGTHS = (512, 1024, 2048, 4096)
# The share of a step the model's own compute may take: the rest, slept, absorbs its
# jitter and whatever else the machine's cores run meanwhile.
COMPUTE_BUDGET = 0.5
# A cache hit's step is short (the weights' read, about 5.7 ms at any length), near the
# model's fixed cost per forward on a slow host: its compute may take more of it. Past
# its step a step lasts its compute, which the end-to-end difference then holds.
CACHE_HIT_BUDGET = 0.8
CALIBRATION_ROUNDS = 3  # prompts measured per length, after one to warm up
ROUNDS = 8  # fresh prompts of the calibrated length, each sent twice
DECODE_PROMPT, DECODE_TOKENS = 512, 48
TOLERANCE = 0.10
# The end-to-end difference also holds the host's own work for the tokens a fresh prompt
# computes and its cache hit does not (preparing the step's inputs, outside the emulated
# step, at this CPU's speed): 1.6 ms for 384 tokens on the slowest VM seen, over 10% of a
# 512-token prompt's 10 ms. It may run over by 10% or by this, whichever is more.
HOST_SLACK_S = 0.002
FIRST_TOKEN_ID = 3  # below: the tiny tokenizer's special tokens
VOCAB = 4096


@pytest.fixture(scope="module")
def gpu_server(pair_manager: PairManager, tiny_model: Any) -> Iterator[VllmServer]:
    """One plain server (no connector) of the emulated model; any pair is stopped
    first, so that nothing else competes for the cores."""
    pair_manager.close()
    try:
        spec = server_spec(
            "decode",
            connector=None,
            model_dir=gpu_model_dir(PROFILE.name, tiny_model),
            log_dir=LOG_DIR,
            name="gpu-regime",
            extra_args=GPU_REGIME_ARGS,
            max_model_len=GPU_MAX_MODEL_LEN,
        )
        with run_server(spec, start_timeout_s=PAIR_START_TIMEOUT_S) as server:
            yield server
    except ServerStartError as exc:
        pytest.fail(f"starting the emulated-GPU server failed: {exc}", pytrace=False)


@pytest.fixture(scope="module")
def prefill_tokens(gpu_server: VllmServer) -> int:
    """The longest of `LENGTHS` whose prefill's own compute (the median of a few prompts)
    fits COMPUTE_BUDGET of its step on this machine, and whose cache hit's (the same
    prompt again: one block computed over the cached rest) fits CACHE_HIT_BUDGET of its
    step. Each length is measured: the fresh share is not monotonic (at the shortest the
    model's fixed costs weigh most), and a cache hit's grows with its context while its
    step (the weights' read) stays about the same."""
    rng = random.Random(15)
    fresh: dict[int, float] = {}
    again: dict[int, float] = {}
    with httpx.Client(timeout=httpx.Timeout(60.0)) as client:
        for tokens in LENGTHS:
            _ttft(client, gpu_server.url, _prompt(tokens, rng))  # a first one pays one-offs
            since = time.time()
            for _ in range(CALIBRATION_ROUNDS):
                prompt = _prompt(tokens, rng)
                _ttft(client, gpu_server.url, prompt)
                _ttft(client, gpu_server.url, prompt)  # from the prefix cache
            records = _steps(gpu_server, since)
            steps, hits = _fresh(records, tokens), _cache_hits(records, tokens)
            assert len(steps) == CALIBRATION_ROUNDS, f"one-step prefills of {tokens} tokens"
            assert len(hits) == CALIBRATION_ROUNDS, f"prefills of {tokens} tokens' cache hits"
            fresh[tokens], again[tokens] = _median_share(steps), _median_share(hits)
    fitting = [tokens for tokens in LENGTHS
               if fresh[tokens] <= COMPUTE_BUDGET and again[tokens] <= CACHE_HIT_BUDGET]
    measured = ", ".join(f"{tokens} tokens {fresh[tokens]:.0%} ({again[tokens]:.0%})"
                         for tokens in LENGTHS)
    print(f"calibration: the model's own compute per prefill step, and in brackets per "
          f"cache hit's step (medians of {CALIBRATION_ROUNDS}): {measured}; budgets "
          f"{COMPUTE_BUDGET:.0%} and {CACHE_HIT_BUDGET:.0%} of the step")
    assert fitting, (
        f"this machine's compute of a prefill, or of its cache hit, takes over "
        f"{COMPUTE_BUDGET:.0%} (a cache hit {CACHE_HIT_BUDGET:.0%}) of its emulated step at "
        f"every length ({measured}): it is slower than the README's minimum for the "
        "GPU-regime tests")
    print(f"testing {max(fitting)}-token prompts")
    return max(fitting)


def _prompt(tokens: int, rng: random.Random) -> list[int]:
    """Fresh random token ids: exactly `tokens` of them, never in the prefix cache."""
    return [rng.randrange(FIRST_TOKEN_ID, VOCAB) for _ in range(tokens)]


def _ttft(client: httpx.Client, url: str, prompt: list[int]) -> float:
    """Seconds for a one-token completion: its time to first token."""
    started = time.perf_counter()
    resp = client.post(f"{url}/v1/completions", json={
        "model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0})
    elapsed = time.perf_counter() - started
    resp.raise_for_status()
    return elapsed


def _steps(server: VllmServer, since: float) -> list[StepRecord]:
    return [r for r in read_step_log(server.spec.step_log_path) if r.at >= since]


def _fresh(records: list[StepRecord], tokens: int) -> list[StepRecord]:
    """The one-step prefills of fresh `tokens`-token prompts."""
    return [r for r in records if r.prefill_tokens == tokens]


def _cache_hits(records: list[StepRecord], tokens: int) -> list[StepRecord]:
    """The prefills of `tokens`-token prompts sent again: their prefix from the cache."""
    return [r for r in records if r.context_tokens == tokens and 1 < r.prefill_tokens < tokens]


def _median_share(steps: list[StepRecord]) -> float:
    return statistics.median(step.compute_s / step.target_s for step in steps)


def _within(measured: float, expected: float, what: str, slack_s: float = 0.0) -> None:
    """`measured` within TOLERANCE of `expected`, or within `slack_s` if that is more."""
    allowed = max(TOLERANCE * expected, slack_s)
    slack = f", or {slack_s * 1e3:g} ms if more" if slack_s else ""
    assert abs(measured - expected) <= allowed, (
        f"{what}: measured {measured * 1e3:.2f} ms, profile {expected * 1e3:.2f} ms "
        f"({measured / expected:.3f}x, allowed +-{allowed * 1e3:.2f} ms: {TOLERANCE:.0%}{slack})")


def test_prefill_lasts_as_long_as_the_profile_says(gpu_server: VllmServer,
                                                    prefill_tokens: int) -> None:
    long = prefill_tokens
    rng = random.Random(16)
    with httpx.Client(timeout=httpx.Timeout(60.0)) as client:
        warm = _prompt(long, rng)  # warm-up: first requests pay one-off costs
        _ttft(client, gpu_server.url, warm)
        _ttft(client, gpu_server.url, warm)
        since = time.time()
        fresh: list[float] = []
        again: list[float] = []
        for _ in range(ROUNDS):
            prompt = _prompt(long, rng)
            fresh.append(_ttft(client, gpu_server.url, prompt))
            again.append(_ttft(client, gpu_server.url, prompt))  # from the prefix cache
    records = _steps(gpu_server, since)
    steps, cached = _fresh(records, long), _cache_hits(records, long)
    assert len(steps) == ROUNDS, f"expected {ROUNDS} one-step prefills of {long} tokens"
    assert len(cached) == ROUNDS, f"expected {ROUNDS} prefills of {long} tokens' cache hits"
    new = {r.prefill_tokens for r in cached}
    assert len(new) == 1, f"the same prompt again computed {new} tokens"
    again_s = PROFILE.prefill_s(min(new), cached=long - min(new))
    expected = PROFILE.prefill_s(long) - again_s
    measured = statistics.median(fresh) - statistics.median(again)
    shares = [step.compute_s / step.target_s for step in steps]
    print(f"TTFT of a fresh {long}-token prompt less that of the same prompt again "
          f"({min(new)} tokens computed): {measured * 1e3:.2f} ms, profile "
          f"{expected * 1e3:.2f} ms (TTFTs {statistics.median(fresh) * 1e3:.2f} and "
          f"{statistics.median(again) * 1e3:.2f} ms, profile {PROFILE.prefill_s(long) * 1e3:.2f}"
          f" and {again_s * 1e3:.2f} ms: the rest is the host's)")
    print(f"{long}-token prefill: compute {statistics.median(shares):.0%} of its step "
          f"(median), at most {max(shares):.0%}")
    for step in steps:
        _within(step.step_s, step.target_s, f"a {long}-token prefill step")
        assert step.target_s == pytest.approx(PROFILE.prefill_s(long), rel=1e-6)
    # Where a cache hit's compute runs past its step (see CACHE_HIT_BUDGET) the clock
    # adds nothing and the step lasts the compute: the emulation cannot be faster than
    # the host. The calibration judged the share from 3 cache hits; on a VM with noisy
    # neighbours the 8 here ran at 1.5 times it, so how many ran past is printed, not held.
    overran = [step for step in cached if step.compute_s > step.target_s]
    print(f"{len(cached)} cache-hit prefills: compute {_median_share(cached):.0%} of the "
          f"step (median); {len(overran)} ran past their step on this host's compute")
    # A cache hit's step is short (5.7 ms): one that sleeps to its deadline and wakes
    # late by the host's scheduling runs over 10% (0.8 ms once in 8, on a CI VM with
    # noisy neighbours). Each is held within HOST_SLACK_S of its end, their median
    # within 10%.
    ends = [max(step.target_s, step.compute_s) for step in cached]
    for step, end in zip(cached, ends, strict=True):
        assert step.target_s == pytest.approx(again_s, rel=1e-6)
        _within(step.step_s, end, f"a prefill of {long} tokens' cache hit (its deadline, "
                "or its compute past it)", slack_s=HOST_SLACK_S)
    _within(statistics.median(step.step_s for step in cached), statistics.median(ends),
            f"the median of a prefill of {long} tokens' cache hits")
    assert max(shares) < 1, f"a {long}-token prefill's compute took {max(shares):.0%}"
    _within(measured, expected, f"TTFT of {long} fresh tokens less TTFT of the same again",
            slack_s=HOST_SLACK_S)


def test_decode_steps_last_as_long_as_the_profile_says(gpu_server: VllmServer) -> None:
    rng = random.Random(17)
    arrivals: list[float] = []
    since = time.time()
    body = {"model": "tiny", "prompt": _prompt(DECODE_PROMPT, rng),
            "max_tokens": DECODE_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=httpx.Timeout(60.0)) as client, client.stream(
            "POST", f"{gpu_server.url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data:") and line.strip() != "data: [DONE]":
                arrivals.append(time.perf_counter())
    assert len(arrivals) >= DECODE_TOKENS, f"{len(arrivals)} events for {DECODE_TOKENS} tokens"
    gaps = [later - earlier for earlier, later in zip(arrivals[1:], arrivals[2:], strict=False)]
    expected = PROFILE.decode_step_s(1, DECODE_PROMPT + DECODE_TOKENS // 2)
    decodes = [r for r in _steps(gpu_server, since) if r.decodes == 1 and r.requests == 1]
    assert len(decodes) >= DECODE_TOKENS - 2, f"{len(decodes)} decode steps recorded"
    periods = [r.gap_s + r.step_s for r in decodes[1:] if r.gap_s is not None]
    # A decode step's forward (one token) lasts well under a millisecond, so its wall
    # time also counts whatever else the core ran meanwhile: the server's API process
    # streams each token and this client reads it, on the same 2 cores. That is the
    # host's time, not the model's; the lower quartile is the model's own (the median
    # was seen at 10% in one run and 21% in another, on an otherwise quiet machine).
    shares = sorted(r.compute_s / r.target_s for r in decodes)
    share = statistics.quantiles(shares, n=4)[0]
    print(f"decode: median gap {statistics.median(gaps) * 1e3:.2f} ms, median step period "
          f"{statistics.median(periods) * 1e3:.2f} ms, profile {expected * 1e3:.2f} ms; "
          f"compute {share:.0%} of a step (lower quartile; median "
          f"{statistics.median(shares):.0%}), budget {COMPUTE_BUDGET:.0%}")
    assert share <= COMPUTE_BUDGET, (
        f"the model's decode step took {share:.0%} of its emulated time, over the "
        f"{COMPUTE_BUDGET:.0%} budget: this machine is slower than the README's minimum for "
        "the GPU-regime tests")
    # The steps' period is the emulation's own and held to 10%. The gaps are this
    # client's: each token also waits on the host's scheduling of the server's API
    # process and of this client, on the same 2 cores (a median gap 1.12x the profile's
    # 5.6 ms step was seen once with the steps' period on time), so they get
    # HOST_SLACK_S, as a cache hit's step does.
    _within(statistics.median(periods), expected, "median period of decode steps")
    _within(statistics.median(gaps), expected, "median gap between streamed tokens",
            slack_s=HOST_SLACK_S)
