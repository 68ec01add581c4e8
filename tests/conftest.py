"""Shared test helpers: the router served for real (uvicorn on a free port) in the test's
own event loop, so that HTTP, streaming and client disconnects behave as in production."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from proxy.api.app import create_app, serving
from proxy.config import ConfigSource, RouterConfig, build_config

T = TypeVar("T")
POLL_S = 0.01  # how often `until` and `until_sync` look again


@contextlib.asynccontextmanager
async def serve_router(
    source: ConfigSource | None = None, /, **config: Any
) -> AsyncIterator[tuple[str, Any]]:
    """Run the router on 127.0.0.1 (a free port); yield (base URL, the FastAPI app).
    With `source`, its config file is watched (and `config` is ignored)."""
    values: dict[str, Any] = {"health": {"interval": 0}, "timeouts": {"health": 10.0}, **config}
    router_config: RouterConfig = source.load() if source else build_config(values, {})
    app = create_app(router_config, source)
    async with serving(app, name="test-router") as (url, _server):
        yield url, app


async def until(condition: Callable[[], Any], what: str, timeout: float = 5.0, *,
                poll: float = POLL_S) -> Any:
    """Poll `condition()` every `poll` seconds (10 ms) until it is truthy (an async
    condition's result is awaited) and return what it returned; fail naming `what` after
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        await asyncio.sleep(poll)


def until_sync(condition: Callable[[], T], what: str, timeout: float = 5.0) -> T:
    """`until` for a test that runs no event loop (threads, processes): poll `condition()`
    every 10 ms until it is truthy and return what it returned; fail naming `what` after
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(POLL_S)


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    """Tests marked `vllm_next` run vLLM 0.33's own code. Where the installed vLLM is
    older they are deselected (said in the summary), not skipped: there
    `tests/integration/test_vllm_next.py` runs them with 0.33's code on the path."""
    marked = [item for item in items if item.get_closest_marker("vllm_next")]
    if not marked:
        return
    import vllm  # only when such a test was collected: its module imports vLLM anyway
    from packaging.version import Version

    if Version(vllm.__version__).release[:2] >= (0, 33):
        return
    config.hook.pytest_deselected(items=marked)
    items[:] = [item for item in items if not item.get_closest_marker("vllm_next")]
