from __future__ import annotations

import pytest

from proxy.config import Mode
from proxy.modes import decide_mode
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
