"""Which KV hand-over a request gets: the mode policy.

The request's `X-KV-Transfer-Mode` header wins over the configured mode, for the modes
`client_modes` lets clients ask for (`Router.handle` refuses others with 400). `local`
is always possible: any D can compute a prompt itself, and no P is used (a D over its
inter-token latency budget gets it as a pull instead: `Router.handle`). `auto` picks pull
when the chosen pair cannot push; when it can do both, the router's `ModeLearner`
(`proxy.flow.learn`) picks the one measured faster for prompts of this length, and without
one (`auto.learn: false`) push. With `auto.local`, local is a third candidate of the
learner's (whatever the pair can do), within D's inter-token latency budget. When the
asked mode is impossible for the chosen servers the other one is used, and the decision
says why (the response header and a metric tell the client and the operator).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final, final

from proxy.config import Mode
from proxy.flow.learn import PAIR_MODES
from proxy.protocol import PrefillCoordinates


@final
class ModeDecision:
    """The mode a request runs as (`used`: pull, push or local, never auto), what was
    asked (`requested`) and why (`reason`). A plain class compiled with the request path
    (its fields are C field reads; a msgspec struct's were generic lookups) with `Final`
    fields: read-only once made."""

    def __init__(self, *, requested: Mode, used: Mode, reason: str) -> None:
        self.requested: Final = requested
        self.used: Final = used  # PULL, PUSH or LOCAL, never AUTO
        self.reason: Final = reason

    def __repr__(self) -> str:
        return (f"ModeDecision(requested={self.requested.value}, used={self.used.value}, "
                f"reason={self.reason!r})")

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, ModeDecision) and self.requested is other.requested
                and self.used is other.used and self.reason == other.reason)

    def __hash__(self) -> int:
        return hash((self.requested, self.used, self.reason))

    @property
    def is_fallback(self) -> bool:
        """The client (or config) asked for a definite mode and got the other one."""
        return self.requested is not Mode.AUTO and self.requested is not self.used


def decide_mode(
    requested: Mode,
    coordinates: PrefillCoordinates | None,
    *,
    decode_can_push: bool = True,
    learned: Callable[[Sequence[Mode]], tuple[Mode, str]] | None = None,
    auto_local: bool = False,
) -> ModeDecision:
    """Pick the mode for a request, given what is known about its P and whether its D
    can take a push. `learned(candidates)` answers `auto` when more than one mode is
    possible: the pair can do both pull and push, or `auto_local` (auto may choose
    local) adds local to what the pair can do.

    `coordinates` is None when the P's engine id and side channel are not known (no
    probe answered yet): push is then impossible."""
    if requested is Mode.LOCAL:
        return ModeDecision(requested=requested, used=Mode.LOCAL, reason="requested")
    if requested is Mode.AUTO and auto_local and learned is not None:
        pair = (Mode.PULL,) if coordinates is None else tuple(
            mode for mode in PAIR_MODES if mode in coordinates.transfer_modes
            and (decode_can_push or mode is not Mode.PUSH))
        used, reason = learned((*(pair or (Mode.PULL,)), Mode.LOCAL))
        return ModeDecision(requested=requested, used=used, reason=reason)
    if coordinates is None:
        if requested is Mode.PULL:
            return ModeDecision(requested=requested, used=Mode.PULL, reason="requested")
        return ModeDecision(requested=requested, used=Mode.PULL, reason="prefill_coordinates_unknown")

    modes = coordinates.transfer_modes  # a struct's field: read once
    can_push = Mode.PUSH in modes and decode_can_push
    can_pull = Mode.PULL in modes
    cannot_push = "decode_cannot_push" if Mode.PUSH in modes else "prefill_cannot_push"
    if requested is Mode.PULL:
        if can_pull:
            return ModeDecision(requested=requested, used=Mode.PULL, reason="requested")
        return ModeDecision(requested=requested, used=Mode.PUSH, reason="prefill_cannot_pull")
    if requested is Mode.PUSH:
        if can_push:
            return ModeDecision(requested=requested, used=Mode.PUSH, reason="requested")
        return ModeDecision(requested=requested, used=Mode.PULL, reason=cannot_push)
    if can_push and can_pull and learned is not None:
        used, reason = learned(PAIR_MODES)
        return ModeDecision(requested=requested, used=used, reason=reason)
    if can_push:
        return ModeDecision(requested=requested, used=Mode.PUSH, reason="auto_pair_can_push")
    return ModeDecision(requested=requested, used=Mode.PULL, reason="auto_pair_cannot_push")
