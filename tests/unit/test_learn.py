"""Auto mode's learning, on synthetic TTFTs: settings are checked; prompts fall in the
right bucket; while learning the modes take turns (push first); then the faster mode
gets all but the `explore` share; buckets learn apart; the average follows a change."""

from __future__ import annotations

import collections
import random

import msgspec
import pytest

from proxy.config import AutoSettings, Mode
from proxy.learn import ModeLearner

PULL, PUSH = Mode.PULL, Mode.PUSH


def learner(seed: int = 1234, **settings: object) -> ModeLearner:
    return ModeLearner(msgspec.convert(settings, AutoSettings), random.Random(seed))


def feed(learn: ModeLearner, bucket: int, mode: Mode, ttft: float, times: int) -> None:
    for _ in range(times):
        learn.observe(mode, bucket, ttft)


@pytest.mark.parametrize(("settings", "message"), [
    ({"explore": -0.01}, "auto.explore must be within 0..1"),
    ({"explore": 1.5}, "auto.explore must be within 0..1"),
    ({"explore": float("nan")}, "auto.explore must be within 0..1"),
    ({"min_samples": 0}, "auto.min_samples must be >= 1"),
    ({"smoothing": 0.0}, "auto.smoothing must be > 0 and <= 1"),
    ({"smoothing": 1.01}, "auto.smoothing must be > 0 and <= 1"),
    ({"bucket_edges": [256, 256]}, "auto.bucket_edges must be positive and strictly increasing"),
    ({"bucket_edges": [1024, 256]}, "auto.bucket_edges must be positive and strictly increasing"),
    ({"bucket_edges": [0, 256]}, "auto.bucket_edges must be positive and strictly increasing"),
])
def test_bad_settings_are_refused_with_a_clear_message(settings: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AutoSettings(**settings)  # type: ignore[arg-type]
    with pytest.raises(msgspec.ValidationError, match=message):
        msgspec.convert(settings, AutoSettings)


def test_defaults_and_unknown_fields() -> None:
    settings = AutoSettings()
    assert (settings.explore, settings.min_samples, settings.smoothing) == (0.05, 8, 0.2)
    assert settings.bucket_edges == [256, 1024, 4096, 16384]
    assert AutoSettings().bucket_edges is not settings.bucket_edges, "no shared default list"
    AutoSettings(explore=0.0, smoothing=1.0, min_samples=1, bucket_edges=[])  # the limits are fine
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        msgspec.convert({"explor": 0.1}, AutoSettings)


@pytest.mark.parametrize(("chars", "bucket"), [
    (0, 0), (255, 0), (256, 1), (1023, 1), (1024, 2), (4095, 2), (4096, 3),
    (16383, 3), (16384, 4), (10**9, 4),
])
def test_a_prompt_falls_in_the_first_bucket_whose_edge_is_above_its_length(chars: int, bucket: int) -> None:
    assert learner().bucket(chars) == bucket


def test_no_edges_is_one_bucket() -> None:
    learn = learner(bucket_edges=[])
    assert {learn.bucket(n) for n in (0, 5000, 10**9)} == {0}
    assert learn.choose(0) == (PUSH, "auto_learning")


def test_while_learning_the_modes_take_turns_push_first_and_both_get_their_samples() -> None:
    min_samples = 8
    learn = learner(min_samples=min_samples)
    chosen = []
    for _ in range(2 * min_samples):
        mode, reason = learn.choose(0)
        assert reason == "auto_learning"
        chosen.append(mode)
        learn.observe(mode, 0, 0.100 if mode is PULL else 0.300)
    assert chosen[:2] == [PUSH, PULL], "push by default, then pull gets its turn at once"
    assert collections.Counter(chosen) == {PUSH: min_samples, PULL: min_samples}
    assert learn.choose(0) == (PULL, "auto_faster_pull"), "learned after 2 x min_samples requests"


def test_turns_are_kept_for_requests_in_flight_at_once() -> None:
    """TTFTs arrive after the requests are sent: a burst is still split evenly."""
    learn = learner()
    burst = [learn.choose(0)[0] for _ in range(10)]
    assert collections.Counter(burst) == {PUSH: 5, PULL: 5}


def test_a_mode_whose_ttfts_never_arrive_gets_no_more_than_half_the_learning_traffic() -> None:
    learn = learner()
    chosen = []
    for _ in range(100):
        mode, reason = learn.choose(0)
        chosen.append(mode)
        if mode is PUSH:  # every pull request fails before its first token
            learn.observe(mode, 0, 0.2)
    assert reason == "auto_learning", "pull has no samples: still learning"
    assert collections.Counter(chosen) == {PUSH: 50, PULL: 50}


def test_once_learned_the_faster_mode_gets_all_but_the_explore_share() -> None:
    learn = learner(seed=7, explore=0.05, min_samples=8)
    feed(learn, 2, PULL, 0.080, 8)
    feed(learn, 2, PUSH, 0.120, 8)
    draws = 2000
    counts = collections.Counter(learn.choose(2) for _ in range(draws))
    assert set(counts) == {(PULL, "auto_faster_pull"), (PUSH, "auto_explore")}
    # Binomial(2000, 0.05): mean 100, sd ~9.7; 60..140 is over 4 sd either side.
    assert 60 <= counts[PUSH, "auto_explore"] <= 140
    assert counts[PULL, "auto_faster_pull"] == draws - counts[PUSH, "auto_explore"]


def test_explore_share_follows_the_setting() -> None:
    learn = learner(seed=3, explore=0.5, min_samples=1)
    learn.observe(PUSH, 0, 0.1)
    learn.observe(PULL, 0, 0.2)
    explored = sum(learn.choose(0)[1] == "auto_explore" for _ in range(2000))
    assert 900 <= explored <= 1100  # Binomial(2000, 0.5): sd ~22


def test_explore_zero_never_explores() -> None:
    learn = learner(explore=0.0, min_samples=2)
    feed(learn, 0, PUSH, 0.05, 2)
    feed(learn, 0, PULL, 0.09, 2)
    assert {learn.choose(0) for _ in range(5000)} == {(PUSH, "auto_faster_push")}


def test_one_mode_short_of_min_samples_is_still_learning() -> None:
    learn = learner(min_samples=8)
    feed(learn, 0, PULL, 0.01, 100)
    feed(learn, 0, PUSH, 1.00, 7)
    assert learn.choose(0)[1] == "auto_learning"
    learn.observe(PUSH, 0, 1.0)
    assert learn.choose(0) == (PULL, "auto_faster_pull")


def test_a_tie_goes_to_push() -> None:
    learn = learner(explore=0.0, min_samples=1)
    learn.observe(PUSH, 0, 0.1)
    learn.observe(PULL, 0, 0.1)
    assert learn.choose(0) == (PUSH, "auto_faster_push")


def test_buckets_learn_apart() -> None:
    learn = learner(explore=0.0)
    short, long = learn.bucket(100), learn.bucket(20000)
    feed(learn, short, PUSH, 0.030, 8)
    feed(learn, short, PULL, 0.050, 8)
    feed(learn, long, PUSH, 0.900, 8)
    feed(learn, long, PULL, 0.400, 8)
    assert learn.choose(short) == (PUSH, "auto_faster_push")
    assert learn.choose(long) == (PULL, "auto_faster_pull")
    assert learn.choose(learn.bucket(2000)) == (PUSH, "auto_learning"), "no data there yet"


def test_the_average_follows_a_change() -> None:
    learn = learner(explore=0.0, smoothing=0.2)
    feed(learn, 1, PULL, 0.100, 8)
    feed(learn, 1, PUSH, 0.300, 8)
    assert learn.choose(1) == (PULL, "auto_faster_pull")
    learn.observe(PULL, 1, 1.000)  # pull turns slow: 0.1 -> 0.28, still below push
    assert learn.choose(1) == (PULL, "auto_faster_pull"), "one slow sample is smoothed out"
    flipped_after = None
    for n in range(2, 20):
        learn.observe(PULL, 1, 1.000)
        if learn.choose(1)[0] is PUSH:
            flipped_after = n
            break
    assert flipped_after == 2  # 0.1 + 0.9 x (1 - 0.8^2) = 0.424 > 0.3


def test_the_first_sample_sets_the_average() -> None:
    learn = learner(smoothing=0.2)
    learn.observe(PULL, 0, 0.5)
    learn.observe(PULL, 0, 1.5)
    assert {(r["bucket"], r["mode"]): r["avg_ms"] for r in learn.snapshot()}[0, "pull"] == 700.0


def test_observe_refuses_auto_and_bad_times_and_takes_mode_names() -> None:
    learn = learner(min_samples=1)
    with pytest.raises(ValueError, match="only pull and push"):
        learn.observe(Mode.AUTO, 0, 0.1)
    for bad in (float("nan"), float("inf"), -0.1):
        with pytest.raises(ValueError, match="TTFT"):
            learn.observe(PULL, 0, bad)
    learn.observe("pull", 0, 0.1)
    learn.observe("push", 0, 0.2)
    assert learn.choose(0)[0] is PULL


def test_snapshot_lists_every_bucket_and_mode() -> None:
    learn = learner(bucket_edges=[256, 1024])
    feed(learn, 1, PUSH, 0.25, 3)
    rows = learn.snapshot()
    assert len(rows) == 3 * 2
    by_key = {(r["bucket"], r["mode"]): r for r in rows}
    assert by_key[1, "push"] == {"bucket": 1, "min_chars": 256, "max_chars": 1024,
                                 "mode": "push", "avg_ms": 250.0, "samples": 3}
    assert by_key[2, "pull"] == {"bucket": 2, "min_chars": 1024, "max_chars": None,
                                 "mode": "pull", "avg_ms": None, "samples": 0}
    assert by_key[0, "pull"]["min_chars"] == 0


def test_a_request_that_cannot_be_measured_takes_no_turn_and_gets_push_until_learned() -> None:
    learn = learner(min_samples=2, explore=1.0)  # explore on every measured request
    assert [learn.choose(0, measured=False) for _ in range(5)] == [
        (Mode.PUSH, "auto_not_learned_yet")] * 5
    assert learn.choose(0)[0] is Mode.PUSH  # the first learning turn: nothing was counted
    feed(learn, 0, Mode.PUSH, 0.3, 2)
    feed(learn, 0, Mode.PULL, 0.1, 2)
    assert learn.choose(0, measured=False) == (Mode.PULL, "auto_faster_pull")  # never explores
