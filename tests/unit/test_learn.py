"""Auto mode's learning, on synthetic TTFTs: settings are checked; prompts fall in the
right bucket; while learning the modes take turns (push first); then the faster mode
gets all but the `explore` share; buckets learn apart; the average follows a change.
With local: three candidates take turns, and D's inter-token latency budget (measured by
`ItlWatchedResponse`) keeps local away from a D whose streams it slows too much."""

from __future__ import annotations

import asyncio
import collections
import random
import types
from typing import cast

import msgspec
import pytest
from starlette.types import Message

from proxy.config import AutoSettings, EndpointConfig, Mode
from proxy.errors import UpstreamConnectError
from proxy.flow.exchange import Exchange
from proxy.flow.learn import LocalBudget, ModeLearner
from proxy.flow.local import ItlWatchedResponse
from proxy.flow.relay import Downstream
from proxy.pool.endpoints import ClusterName, Endpoint

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
    with pytest.raises(ValueError, match="only pull, push and local"):
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


# --- local: a third candidate, within D's inter-token latency budget -------------------

LOCAL = Mode.LOCAL
THREE = (PUSH, PULL, LOCAL)


def test_local_settings_default_off_and_are_checked() -> None:
    settings = AutoSettings()
    assert (settings.local, settings.local_itl_budget) == (False, 1.25)
    with pytest.raises(ValueError, match="auto.local_itl_budget must be >= 1"):
        AutoSettings(local=True, local_itl_budget=0.9)
    with pytest.raises(ValueError, match="auto.local needs auto.learn"):
        AutoSettings(local=True, learn=False)
    assert learner().local_budget is None, "no ITL bookkeeping unless local is on"
    assert learner(local=True).local_budget is not None


def test_three_candidates_take_turns_push_pull_local_then_the_fastest_wins() -> None:
    learn = learner(local=True, min_samples=4, explore=0.0)
    ttft = {PUSH: 0.3, PULL: 0.2, LOCAL: 0.1}
    chosen = []
    for _ in range(3 * 4):
        mode, reason = learn.choose(0, candidates=THREE)
        assert reason == "auto_learning"
        chosen.append(mode)
        learn.observe(mode, 0, ttft[mode])
    assert chosen[:3] == [PUSH, PULL, LOCAL]
    assert collections.Counter(chosen) == {PUSH: 4, PULL: 4, LOCAL: 4}
    assert learn.choose(0, candidates=THREE) == (LOCAL, "auto_faster_local")


def test_a_request_that_cannot_be_measured_gets_the_first_candidate_until_learned() -> None:
    learn = learner(local=True, min_samples=1)
    assert learn.choose(0, measured=False, candidates=THREE) == (PUSH, "auto_not_learned_yet")
    assert learn.choose(0, measured=False, candidates=(PULL, LOCAL)) == (
        PULL, "auto_not_learned_yet")


def test_explore_spreads_over_both_slower_candidates() -> None:
    learn = learner(seed=5, local=True, min_samples=1, explore=0.3)
    for mode, ttft in ((PUSH, 0.3), (PULL, 0.2), (LOCAL, 0.1)):
        learn.observe(mode, 0, ttft)
    counts = collections.Counter(learn.choose(0, candidates=THREE) for _ in range(3000))
    assert set(counts) == {(LOCAL, "auto_faster_local"), (PUSH, "auto_explore"),
                           (PULL, "auto_explore")}
    # each slower one: Binomial(3000, 0.15), mean 450, sd ~20
    assert 350 <= counts[PUSH, "auto_explore"] <= 550
    assert 350 <= counts[PULL, "auto_explore"] <= 550


def test_over_budget_the_fastest_local_gives_way_to_the_next_fastest() -> None:
    learn = learner(local=True, min_samples=2, explore=1.0)  # explore whenever it may
    for mode, ttft in ((PUSH, 0.3), (PULL, 0.2), (LOCAL, 0.1)):
        feed(learn, 0, mode, ttft, 2)
    over = [learn.choose(0, candidates=THREE, local_within_budget=False) for _ in range(200)]
    assert LOCAL not in {mode for mode, _ in over}, "no local, not even to explore"
    assert set(over) == {(PUSH, "auto_explore")}, "the only other one is pull's explore share"
    learn = learner(local=True, min_samples=2, explore=0.0)
    for mode, ttft in ((PUSH, 0.3), (PULL, 0.2), (LOCAL, 0.1)):
        feed(learn, 0, mode, ttft, 2)
    assert learn.choose(0, candidates=THREE, local_within_budget=False) == (
        PULL, "auto_itl_budget")
    assert learn.choose(0, candidates=(PULL, LOCAL), local_within_budget=False) == (
        PULL, "auto_itl_budget")
    assert learn.choose(0, candidates=THREE) == (LOCAL, "auto_faster_local"), "back in budget"


def test_over_budget_a_slower_local_changes_nothing() -> None:
    learn = learner(local=True, min_samples=1, explore=0.0)
    for mode, ttft in ((PUSH, 0.1), (PULL, 0.2), (LOCAL, 0.3)):
        learn.observe(mode, 0, ttft)
    assert learn.choose(0, candidates=THREE, local_within_budget=False) == (
        PUSH, "auto_faster_push")


def test_over_budget_local_takes_no_learning_turn() -> None:
    learn = learner(local=True, min_samples=3)
    chosen = [learn.choose(0, candidates=THREE, local_within_budget=False)[0] for _ in range(6)]
    assert collections.Counter(chosen) == {PUSH: 3, PULL: 3}
    assert learn.choose(0, candidates=THREE)[0] is LOCAL, "its turn comes once within budget"


def test_snapshot_lists_local_only_when_auto_may_choose_it() -> None:
    assert {r["mode"] for r in learner(bucket_edges=[]).snapshot()} == {"push", "pull"}
    learn = learner(local=True, bucket_edges=[])
    learn.observe(LOCAL, 0, 0.05)
    rows = {r["mode"]: r for r in learn.snapshot()}
    assert set(rows) == {"push", "pull", "local"}
    assert (rows["local"]["avg_ms"], rows["local"]["samples"]) == (50.0, 1)


def decode_server(port: int = 1) -> Endpoint:
    return Endpoint(EndpointConfig(url=f"http://127.0.0.1:{port}"), ClusterName.DECODE)


def budget(ratio: float = 1.5, smoothing: float = 0.5) -> LocalBudget:
    return LocalBudget(AutoSettings(local=True, local_itl_budget=ratio, smoothing=smoothing))


def test_a_decode_server_without_a_clean_stream_gets_no_local_request() -> None:
    b, d = budget(), decode_server()
    assert not b.allows(d), "nothing measured"
    b.of(d).observe(0.010, clean=False, smoothing=b.smoothing)
    assert not b.allows(d), "only streams slowed by local prompts: no baseline"
    b.of(d).observe(0.010, clean=True, smoothing=b.smoothing)
    assert b.allows(d)


def test_the_budget_is_a_ratio_over_the_clean_itl_and_corrects_itself() -> None:
    b, d = budget(ratio=1.5, smoothing=0.5), decode_server()
    streams = b.of(d)
    streams.observe(0.010, clean=True, smoothing=b.smoothing)  # clean 10 ms, recent 10 ms
    streams.observe(0.018, clean=False, smoothing=b.smoothing)  # recent 14 ms: 1.4x
    assert b.allows(d)
    streams.observe(0.030, clean=False, smoothing=b.smoothing)  # recent 22 ms: 2.2x
    assert not b.allows(d)
    assert b.snapshot([d]) == [{"decode": d.url, "clean_itl_ms": 10.0, "recent_itl_ms": 22.0,
                             "local_prefills": 0, "within_budget": False}]
    # no local request now: D's streams are clean, and the recent ITL comes back
    streams.observe(0.010, clean=True, smoothing=b.smoothing)  # recent 16 ms: 1.6x
    assert not b.allows(d)
    streams.observe(0.010, clean=True, smoothing=b.smoothing)  # recent 13 ms: 1.3x
    assert b.allows(d)


def test_a_busier_decode_server_raises_its_clean_itl_too() -> None:
    """More streams make every token slower, local or not: that is not local's cost."""
    b, d = budget(ratio=1.25, smoothing=1.0), decode_server()
    b.of(d).observe(0.010, clean=True, smoothing=b.smoothing)
    b.of(d).observe(0.040, clean=True, smoothing=b.smoothing)
    assert b.allows(d)


def test_local_prompts_are_counted_per_decode_server_and_only_measured_ones_are_shown() -> None:
    b, d1, d2, d3 = budget(), decode_server(1), decode_server(2), decode_server(3)
    b.of(d1).local_begin()
    assert (b.of(d1).local_prefills, b.of(d1).local_started) == (1, 1)
    assert b.of(d2).local_prefills == 0
    b.of(d1).local_end()
    assert (b.of(d1).local_prefills, b.of(d1).local_started) == (0, 1)
    b.of(d2).observe(0.010, clean=True, smoothing=b.smoothing)
    # the rows of the Ds it is given (a cluster's members now) that took a local request or
    # had a stream measured: d3 neither
    assert [row["decode"] for row in b.snapshot([d1, d2, d3])] == [d1.url, d2.url]
    assert [row["decode"] for row in b.snapshot([d2])] == [d2.url]


# --- what the router measures for the budget (proxy.flow.local.ItlWatchedResponse) ----------

TOKEN_EVENT = b'data: {"choices": [{"text": "x"}]}\n\n'


async def watched_answer(b: LocalBudget, d: Endpoint, chunks: list[bytes], *, status: int = 200,
                         local: bool = False, fail: bool = False,
                         hang: bool = False) -> list[Message]:
    """Run a flow that answers `chunks` (the last one with the end) through an
    ItlWatchedResponse; return the ASGI messages sent."""
    sent: list[Message] = []

    async def flow(down: Downstream) -> None:
        if fail:
            raise UpstreamConnectError("refused", endpoint=d.url, cluster="decode")
        if hang:  # D computes for ever
            await asyncio.Event().wait()
        await down.start(status, "text/event-stream")
        for chunk in chunks[:-1]:
            await down.write(chunk)
        await down.end(chunks[-1])

    async def send(message: Message) -> None:
        sent.append(message)

    async def receive() -> Message:
        await asyncio.Event().wait()  # the client never leaves
        raise AssertionError

    exchange = cast(Exchange, types.SimpleNamespace(decode_endpoint=d))
    response = ItlWatchedResponse(flow, streaming=True, headers=[], done=lambda *_: None,
                                  exchange=exchange, budget=b, local=local)
    await response({"type": "http"}, receive, send)
    return sent


async def test_a_whole_stream_gives_one_clean_itl_sample() -> None:
    b, d = budget(), decode_server()
    await watched_answer(b, d, [TOKEN_EVENT, TOKEN_EVENT, TOKEN_EVENT + b"data: [DONE]\n\n"])
    streams = b.of(d)
    assert streams.recent_itl is not None and streams.recent_itl == streams.clean_itl


@pytest.mark.parametrize(("chunks", "status"), [
    ([TOKEN_EVENT, TOKEN_EVENT, TOKEN_EVENT], 200),  # cut short: no [DONE]
    ([TOKEN_EVENT, b"data: [DONE]\n\n"], 200),  # one token: no gap to measure
    ([b'{"error": {}}'], 500),
], ids=["no-done", "one-token", "error-status"])
async def test_streams_that_say_nothing_of_d_pace_are_not_measured(chunks: list[bytes],
                                                                   status: int) -> None:
    b, d = budget(), decode_server()
    await watched_answer(b, d, chunks, status=status)
    assert b.of(d).recent_itl is None


async def test_a_stream_during_a_local_prompt_is_not_clean() -> None:
    b, d = budget(), decode_server()
    b.of(d).local_begin()  # another request's local prompt, being computed
    await watched_answer(b, d, [TOKEN_EVENT, TOKEN_EVENT, b"data: [DONE]\n\n"])
    assert b.of(d).recent_itl is not None and b.of(d).clean_itl is None


async def test_a_local_requests_mark_ends_at_its_first_byte_or_its_failure() -> None:
    b, d = budget(), decode_server()
    await watched_answer(b, d, [TOKEN_EVENT, TOKEN_EVENT, b"data: [DONE]\n\n"], local=True)
    streams = b.of(d)
    assert (streams.local_prefills, streams.local_started) == (0, 1)
    assert streams.clean_itl is not None, "its own stream began after its prompt: clean"
    hung = asyncio.ensure_future(watched_answer(b, d, [TOKEN_EVENT], local=True, hang=True))
    async with asyncio.timeout(5):
        while streams.local_prefills == 0:
            await asyncio.sleep(0)
    hung.cancel()  # the router shuts down
    with pytest.raises(asyncio.CancelledError):
        await hung
    assert (streams.local_prefills, streams.local_started) == (0, 2)
    await watched_answer(b, d, [TOKEN_EVENT], local=True, fail=True)  # a 502 answer
    assert (streams.local_prefills, streams.local_started) == (0, 3)


# --- whether a push goes layer by layer (auto.push_layers: learn) -----------------------


def test_push_layers_are_learned_by_default_and_left_to_the_connector_when_asked() -> None:
    assert AutoSettings().push_layers == "learn"
    with pytest.raises(msgspec.ValidationError, match="push_layers"):
        msgspec.convert({"push_layers": "on"}, AutoSettings)
    assert learner().layers is not None
    assert learner(push_layers="connector").layers is None
    # Without learning (auto.learn: false) there is no learner at all: P's connector decides.
    assert AutoSettings(learn=False).push_layers == "learn"


def test_layers_take_turns_whole_first_then_the_faster_wins_each_bucket() -> None:
    learn = learner(push_layers="learn", min_samples=3, explore=0.0)
    layers = learn.layers
    assert layers is not None
    turns = [layers.choose(0, measured=True) for _ in range(4)]
    assert turns == [(False, "layers_learning"), (True, "layers_learning")] * 2
    # A request not measured takes no turn: it is left to P's connector until the bucket
    # has learned, and the next measured one still gets its turn.
    assert layers.choose(0, measured=False) == (None, "layers_not_learned_yet")
    assert layers.choose(0, measured=True) == (False, "layers_learning")
    assert layers.choose(0, measured=True) == (True, "layers_learning")
    for _ in range(3):
        layers.observe(False, 0, 0.300)  # whole: the transfer after the prefill
        layers.observe(True, 0, 0.200)  # by layer: most of it hidden
        layers.observe(True, 1, 0.090)  # a short prompt: the layers' posts cost more
        layers.observe(False, 1, 0.080)
    assert {layers.choose(0, measured=True) for _ in range(20)} == {(True, "layers_faster_on")}
    assert {layers.choose(1, measured=False) for _ in range(5)} == {(False, "layers_faster_off")}
    rows = {(row["bucket"], row["layers"]): row for row in layers.snapshot()}
    assert rows[0, True] == {"bucket": 0, "layers": True, "avg_ms": 200.0, "samples": 3}
    assert rows[2, False]["avg_ms"] is None and rows[2, False]["samples"] == 0


def test_layers_explore_the_slower_arm_and_follow_a_change() -> None:
    learn = learner(push_layers="learn", min_samples=2, explore=0.25, smoothing=0.5)
    layers = learn.layers
    assert layers is not None
    for _ in range(2):
        layers.observe(False, 0, 0.100)
        layers.observe(True, 0, 0.050)
    picks = collections.Counter(layers.choose(0, measured=True) for _ in range(400))
    assert set(picks) == {(True, "layers_faster_on"), (False, "layers_explore")}
    assert 60 < picks[False, "layers_explore"] < 140  # about a quarter
    for _ in range(4):  # layers got slow (a busier P, say): the average follows
        layers.observe(True, 0, 0.400)
    assert layers.choose(0, measured=False) == (False, "layers_faster_off")
    with pytest.raises(ValueError, match="finite number"):
        layers.observe(True, 0, float("nan"))
