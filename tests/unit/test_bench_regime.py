"""The regime benchmark's arithmetic (scripts.bench_regime), no server: its options,
the emulated link's rate per profile, the two floors, and the summary of a case with
progressive push (the share of whole push's transfer it hides)."""

from __future__ import annotations

import pytest

from scripts import bench_regime as bench
from testbed.profiles import get_profile

P8 = get_profile("llama8b-h100")


def test_quick_and_default_options() -> None:
    quick = bench.parse_args(["--quick"])
    assert quick.profiles == ("llama8b-h100",) and quick.links == ("eth25",)
    assert quick.prompts == (1024, 8192) and quick.loads == ("idle",) and quick.no_stock
    assert quick.modes == ("pull", "push", "progressive", "local")
    full = bench.parse_args([])
    assert full.profiles == ("llama8b-h100", "llama70b-h100x8")
    assert full.links == ("rdma400", "eth100", "eth25")
    assert full.prompts == (1024, 4096, 8192, 16384) and full.layers is None  # the profile's
    chosen = bench.parse_args(["--quick", "--modes", "pull,progressive", "--links",
                               "rdma400,none", "--prompts", "4096"])
    assert chosen.modes == ("pull", "progressive") and chosen.links == ("rdma400", "none")
    assert chosen.prompts == (4096,)
    with pytest.raises(SystemExit):
        bench.parse_args(["--modes", "pull,teleport"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--links", "eth10"])


def test_modes_send_their_headers() -> None:
    assert bench.ROUTER_MODE["progressive"] == bench.ROUTER_MODE["push"] == "push"
    assert bench.MODE_HEADERS["progressive"] == {"X-KV-Push-Layers": "on"}
    assert bench.MODE_HEADERS["push"] == {"X-KV-Push-Layers": "off"}


def test_link_rates_and_floors() -> None:
    args = bench.parse_args(["--quick"])
    rate = bench.link_rate("eth25", P8, 2048)
    assert rate.rate_bps == pytest.approx(390.625e6)
    assert rate.transfer_s(8192) == pytest.approx(8192 * P8.kv_bytes_per_token * 8 / 25e9)
    assert bench.link_rate("none", P8, 2048).transfer_s(8192) == 0.0
    floor = bench.floor_s(P8, bench.Case("idle", 8192, 1, "eth25"), rate, args)
    assert floor["prefill_s"] == pytest.approx(P8.prefill_s(8192))
    assert floor["floor_s"] == pytest.approx(floor["prefill_s"] + floor["d_step_s"])
    assert floor["floor_paid_s"] == pytest.approx(floor["floor_s"] + rate.transfer_s(8192))
    # Layer by layer on eth25 the link is the bound: the transfer (343.6 ms) outlasts the
    # prefill (284.1), so at best it hides prefill / transfer of it.
    transfer, prefill = rate.transfer_s(8192), floor["prefill_s"]
    assert transfer > prefill
    assert floor["floor_progressive_s"] == pytest.approx(transfer + floor["d_step_s"])
    assert floor["best_hidden_share"] == pytest.approx(prefill / transfer)
    assert 0.82 < floor["best_hidden_share"] < 0.83
    # On rdma400 the last layer's KV crosses before the step ends: all of it hidden.
    fast = bench.link_rate("rdma400", P8, 2048)
    quick = bench.floor_s(P8, bench.Case("idle", 8192, 1, "rdma400"), fast, args)
    assert prefill * 7 / 8 + fast.transfer_s(8192) / 8 < prefill
    assert quick["floor_progressive_s"] == pytest.approx(quick["floor_s"])
    assert quick["best_hidden_share"] == pytest.approx(1.0)
    # Slowed down: the GPU and the link alike, so every part stretches by the factor.
    slow = bench.floor_s(P8, bench.Case("idle", 8192, 1, "eth25"), rate, args, 3.0)
    for name, value in floor.items():
        assert slow[name] == pytest.approx(value if name == "best_hidden_share"
                                           else 3 * value), name
    assert rate.shaped_bps(3.0) == pytest.approx(390.625e6 / 3)


def test_auto_slowdown_keeps_the_compute_within_its_share() -> None:
    assert bench.parse_args(["--quick"]).slowdown == "auto"
    assert bench.parse_args(["--slowdown", "2.5"]).slowdown == 2.5
    with pytest.raises(SystemExit):
        bench.parse_args(["--slowdown", "0"])
    assert bench.auto_slowdown(0.5) == 1.0
    assert bench.auto_slowdown(0.8) == 1.0
    assert bench.auto_slowdown(0.81) == 1.5
    assert bench.auto_slowdown(2.4) == 3.0  # 2.4 / 0.8 = 3.0 exactly
    assert bench.auto_slowdown(2.5) == 3.5


def test_the_summary_of_a_case_with_progressive_push() -> None:
    args = bench.parse_args(["--quick", "--modes", "pull,push,progressive,local"])
    rate = bench.link_rate("eth25", P8, 2048)
    case = bench.Case("idle", 8192, 1, "eth25")
    floor = bench.floor_s(P8, case, rate, args)
    transfer = floor["transfer_s"]
    steps = {"steps": 4, "long_steps": 0, "prefill_steps": 1,
             "prefill_compute_over_target_max": 0.5,
             "prefill_compute_over_target_median": 0.5, "decode_step_ms_median": None,
             "decode_target_ms_median": None, "decode_period_ms_median": None}
    paid = floor["floor_paid_s"]
    result = {"case": {"load": "idle", "prompt_tokens": 8192, "concurrency": 1,
                       "link": "eth25"}, "key": case.key,
              "ttft_s": {"pull": [paid + 0.05] * 3, "push": [paid + 0.02] * 3,
                         "progressive": [paid + 0.02 - 0.9 * transfer] * 3,
                         "local": [floor["local_floor_s"] + 0.01] * 3},
              "steps": {"P": steps, "D": steps}, "d_itl": None,
              "link_bytes": 3 * 8192 * 2048, "kv_bytes_transferred": 3 * 8192 * 2048}
    (row,) = bench.summarize(P8, [result], {}, {"eth25": rate}, args)
    assert row["slowdown"] == 1.0
    assert row["progressive_hidden_share"] == pytest.approx(0.9)
    assert row["modes"]["push"]["over_paid_floor_ms"] == pytest.approx(20.0)
    assert row["modes"]["push"]["overhead_ms"] == pytest.approx(20.0 + transfer * 1e3)
    assert row["host_path_ms"] == pytest.approx(10.0)
    assert row["flag"] is None
    lines = bench.target_check([row])
    assert any(line.startswith("progressive hides >= 80%") and "met" in line for line in lines)
    assert any(line.startswith("progressive never slower") and "met" in line for line in lines)
    assert any(line.startswith("progressive <= 0.6x pull") for line in lines)


def test_learned_has_its_router_learn_per_prompt_length_one_link_and_load_a_run() -> None:
    """learned: the router learns layers or whole (auto.push_layers: learn), each of the
    run's prompt lengths, and the warm-up's, in a bucket of its own."""
    import yaml

    from proxy.config import build_config
    from proxy.flow.learn import ModeLearner
    from proxy.protocol import CHARS_PER_TOKEN

    assert bench.router_config(bench.parse_args(["--quick"])) == bench.REGIME_ROUTER_CONFIG
    args = bench.parse_args(["--quick", "--modes", "push,progressive,learned",
                             "--prompts", "1024,4096,8192"])
    config = build_config({**yaml.safe_load(bench.router_config(args)),
                           "prefill": ["http://127.0.0.1:1"], "decode": ["http://127.0.0.1:2"]}, {})
    auto = config.auto
    assert auto.push_layers == "learn" and auto.explore == 0
    assert auto.min_samples == bench.LEARN_SAMPLES
    assert config.timeouts.first_token == 3600  # the regime's own waits kept
    learner = ModeLearner(auto)
    buckets = [learner.bucket(n * CHARS_PER_TOKEN)
               for n in (bench.WARM_PROMPT_TOKENS, 1024, 4096, 8192)]
    assert len(set(buckets)) == 4, buckets
    for other in (["--links", "eth25,eth100"], ["--loads", "idle,busy"],
                  ["--concurrency", "1,4"], ["--prompts", "256,1024"]):
        with pytest.raises(SystemExit):
            bench.parse_args(["--quick", "--modes", "push,learned", *other])
