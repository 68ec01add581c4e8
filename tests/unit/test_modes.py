from __future__ import annotations

from collections.abc import Sequence

import pytest

from proxy.config import Mode
from proxy.flow.modes import decide_mode
from proxy.protocol import PrefillCoordinates

PULL, PUSH, AUTO = Mode.PULL, Mode.PUSH, Mode.AUTO


def coords(*modes: Mode) -> PrefillCoordinates:
    return PrefillCoordinates(engine_id="e", host="h", port=1, transfer_modes=frozenset(modes))


# (name, requested, P's coordinates, used, reason, is_fallback)
CASES = [
    ("pull asked, nothing known", PULL, None, PULL, "requested", False),
    ("push asked, coordinates unknown", PUSH, None, PULL, "prefill_coordinates_unknown", True),
    ("auto, coordinates unknown", AUTO, None, PULL, "prefill_coordinates_unknown", False),
    ("push asked, P can both", PUSH, coords(PULL, PUSH), PUSH, "requested", False),
    ("push asked, P pull-only", PUSH, coords(PULL), PULL, "prefill_cannot_push", True),
    ("pull asked, P push-only", PULL, coords(PUSH), PUSH, "prefill_cannot_pull", True),
    ("pull asked, P can both", PULL, coords(PULL, PUSH), PULL, "requested", False),
    ("auto, P can push", AUTO, coords(PULL, PUSH), PUSH, "auto_pair_can_push", False),
    ("auto, P pull-only", AUTO, coords(PULL), PULL, "auto_pair_cannot_push", False),
]


@pytest.mark.parametrize("name,requested,known,used,reason,fallback", CASES, ids=[c[0] for c in CASES])
def test_decide_mode(name: str, requested: Mode, known: PrefillCoordinates | None, used: Mode,
                     reason: str, fallback: bool) -> None:
    decision = decide_mode(requested, known)
    assert (decision.used, decision.reason, decision.is_fallback) == (used, reason, fallback)


@pytest.mark.parametrize(("requested", "used", "reason"), [
    (PUSH, PULL, "decode_cannot_push"),
    (AUTO, PULL, "auto_pair_cannot_push"),
    (PULL, PULL, "requested"),
])
def test_a_decode_server_that_cannot_push_makes_the_pair_pull(requested: Mode, used: Mode,
                                                               reason: str) -> None:
    decision = decide_mode(requested, coords(PULL, PUSH), decode_can_push=False)
    assert (decision.used, decision.reason) == (used, reason)


LOCAL = Mode.LOCAL


@pytest.mark.parametrize("known", [None, coords(PULL), coords(PUSH), coords(PULL, PUSH)],
                         ids=["nothing known", "P pull-only", "P push-only", "P can both"])
@pytest.mark.parametrize("decode_can_push", [True, False])
def test_local_asked_is_always_possible(known: PrefillCoordinates | None,
                                        decode_can_push: bool) -> None:
    """Any D can compute a prompt: whatever P and D can hand over, local is local."""
    decision = decide_mode(LOCAL, known, decode_can_push=decode_can_push, auto_local=True)
    assert (decision.used, decision.reason, decision.is_fallback) == (LOCAL, "requested", False)


# (name, P's coordinates, D can push, the candidates auto's learner is asked among)
AUTO_LOCAL_CASES = [
    ("P can both", coords(PULL, PUSH), True, (PUSH, PULL, LOCAL)),
    ("P can both, D cannot push", coords(PULL, PUSH), False, (PULL, LOCAL)),
    ("P pull-only", coords(PULL), True, (PULL, LOCAL)),
    ("P push-only", coords(PUSH), True, (PUSH, LOCAL)),
    ("coordinates unknown", None, True, (PULL, LOCAL)),
]


@pytest.mark.parametrize("name,known,decode_can_push,candidates", AUTO_LOCAL_CASES,
                         ids=[c[0] for c in AUTO_LOCAL_CASES])
def test_auto_with_local_asks_the_learner_among_what_the_pair_can_do_and_local(
        name: str, known: PrefillCoordinates | None, decode_can_push: bool,
        candidates: tuple[Mode, ...]) -> None:
    asked: list[tuple[Mode, ...]] = []

    def learned(among: Sequence[Mode]) -> tuple[Mode, str]:
        asked.append(tuple(among))
        return LOCAL, "auto_faster_local"

    decision = decide_mode(AUTO, known, decode_can_push=decode_can_push, learned=learned,
                           auto_local=True)
    assert asked == [candidates]
    assert (decision.used, decision.reason, decision.is_fallback) == (
        LOCAL, "auto_faster_local", False)


def test_auto_without_local_asks_the_learner_between_pull_and_push_only() -> None:
    asked: list[tuple[Mode, ...]] = []

    def learned(among: Sequence[Mode]) -> tuple[Mode, str]:
        asked.append(tuple(among))
        return PULL, "auto_faster_pull"

    assert decide_mode(AUTO, coords(PULL, PUSH), learned=learned).used is PULL
    assert asked == [(PUSH, PULL)]
    # a pair that can do one mode only: no learning, as before local existed
    assert decide_mode(AUTO, coords(PULL), learned=learned).reason == "auto_pair_cannot_push"
    assert len(asked) == 1
