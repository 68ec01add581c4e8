"""The served model names: configured, or learned from the upstreams' /v1/models.

Each listing also records on every endpoint the models it serves (`learned_models`), so
that a request for a model goes only to the servers that have it (`Cluster.pick`).
Servers may also be given their `models` in the config; those are not asked.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from proxy.errors import NotFound, Overloaded, UpstreamError
from proxy.pool.endpoints import Endpoint
from proxy.task_scope import own_exception_state
from proxy.upstream.client import UpstreamClient

logger = logging.getLogger("pdproxy.models")

REFRESH_AT_MOST_EVERY_S = 5.0


# What an upstream's /v1/models may put in the router's own listing: at most this many
# models per server, names of at most this many characters, and only these fields of a
# card (vLLM's: the OpenAI card plus root, parent and max_model_len).
MAX_MODELS_PER_SERVER = 256
MAX_MODEL_NAME_CHARS = 256
CARD_FIELDS = ("id", "object", "created", "owned_by", "root", "parent", "max_model_len")


class ModelCatalog:
    """Which models the router serves. A request for an unknown name refreshes the list
    (at most every few seconds) before it is refused with 404."""

    def __init__(
        self,
        configured: list[str],
        endpoints: Callable[[], list[Endpoint]],  # the current ones, at each refresh
        client: UpstreamClient,
        *,
        timeout: float,
    ) -> None:
        self._configured = list(configured)
        self._endpoints = endpoints
        self._client = client
        self._timeout = timeout
        self._cards: dict[str, dict[str, Any]] = {}
        self._refreshed_at = float("-inf")
        self._refreshing: asyncio.Task[None] | None = None

    async def names(self) -> list[str]:
        await self._refresh_if_stale()
        return self._configured or list(self._cards)

    async def listing(self) -> dict[str, Any]:
        """The /v1/models answer: the union of what the upstreams serve."""
        await self._refresh_if_stale()
        if self._configured:
            cards = [_card(n) for n in self._configured]
        else:
            cards = list(self._cards.values())
        return {"object": "list", "data": cards}

    async def aclose(self) -> None:
        if self._refreshing is not None:
            self._refreshing.cancel()
            await asyncio.gather(self._refreshing, return_exceptions=True)

    def serves(self, model: str) -> bool:
        """Whether `model` is known to be served, without asking the upstreams."""
        if self._configured:
            return model in self._configured
        return model in self._cards

    async def require(self, model: str) -> None:
        """Refuse (404) a model not served, after refreshing the upstreams' list once."""
        if self.serves(model):
            return
        if not self._configured:
            await self._refresh_if_stale()
            if model in self._cards:
                return
        raise NotFound(f"The model `{model}` does not exist.", param="model")

    async def _refresh_if_stale(self) -> None:
        """Refresh from the upstreams unless done lately; concurrent callers share one."""
        if self._configured:
            return
        if self._refreshing is None:
            if time.monotonic() - self._refreshed_at < REFRESH_AT_MOST_EVERY_S:
                return
            self._refreshing = asyncio.create_task(own_exception_state(self._refresh()),
                                                   name="refresh-models")
        task = self._refreshing
        try:
            await asyncio.shield(task)
        finally:
            if task.done() and self._refreshing is task:
                self._refreshing = None

    async def _refresh(self) -> None:
        endpoints = self._endpoints()
        answers = await asyncio.gather(*(own_exception_state(self._fetch(e)) for e in endpoints))
        self._refreshed_at = time.monotonic()
        cards: dict[str, dict[str, Any]] = {}
        for endpoint, answer in zip(endpoints, answers, strict=True):
            for name in endpoint.config.models or ():
                cards.setdefault(name, _card(name))
            for card in answer or ():
                cards.setdefault(card["id"], card)
        if cards:
            self._cards = cards

    async def _fetch(self, endpoint: Endpoint) -> list[dict[str, Any]] | None:
        """The model cards `endpoint` lists (and records the names on it); None when it
        could not be asked, or its models are configured."""
        if endpoint.config.models is not None:
            return None
        try:
            answer = await self._client.get_json(
                f"{endpoint.url}/v1/models",
                endpoint=endpoint.url,
                cluster=endpoint.cluster.value,
                timeout=self._timeout,
            )
        except (UpstreamError, Overloaded) as exc:  # Overloaded: the control lane is full
            logger.warning("cannot list models of %s: %s", endpoint.url, exc)
            return None
        data = answer.get("data") if isinstance(answer, dict) else None
        if not isinstance(data, list):
            return None
        cards = [_bounded(c) for c in data[:MAX_MODELS_PER_SERVER]
                 if isinstance(c, dict) and isinstance(c.get("id"), str)
                 and 0 < len(c["id"]) <= MAX_MODEL_NAME_CHARS]
        if len(data) > MAX_MODELS_PER_SERVER:
            logger.warning("%s lists %d models; only its first %d are served",
                           endpoint.url, len(data), MAX_MODELS_PER_SERVER)
        endpoint.learned_models = frozenset(c["id"] for c in cards)
        return cards


def _card(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "owned_by": "pd-proxy"}


def _bounded(card: dict[str, Any]) -> dict[str, Any]:
    """What of an upstream's model card clients are shown: the OpenAI card's own fields,
    when they are plain scalars (a server cannot pass anything else on through us)."""
    return {key: card[key] for key in CARD_FIELDS
            if key in card and isinstance(card[key], str | int | float | bool | None)
            and not (isinstance(card[key], str) and len(card[key]) > MAX_MODEL_NAME_CHARS)}
