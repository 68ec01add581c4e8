"""The words of a pick (`proxy.pool.balance`): what a pick knows of the request, and the
three roles of a policy's pipeline: scorers, a chooser, and hooks told of the choice."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import msgspec

if TYPE_CHECKING:
    from proxy.pool.endpoints import Endpoint
    from proxy.pool.kv.blocks import PromptBlocks


class PickRequest(msgspec.Struct, frozen=True):
    """What a pick knows of the request: its prompt's prefix (prefix_affinity) and its
    token blocks (kv_aware). (A frozen dataclass took 0.2 us to build, on every pick.)"""

    key: str | None = None
    prompt: PromptBlocks | None = None


class Scorer(Protocol):
    def scores(self, candidates: Sequence[Endpoint], request: PickRequest,
               now: float) -> list[float]:
        """One cost per candidate, lower is better."""
        ...


class Chooser(Protocol):
    def choose(self, candidates: Sequence[Endpoint], costs: list[float]) -> Endpoint: ...


class AfterPick(Protocol):
    def picked(self, chosen: Endpoint, request: PickRequest, now: float) -> None: ...
