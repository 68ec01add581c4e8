"""How vLLM's NIXL agent makes progress: the `nixl_progress_thread` setting.

A NIXL transfer moves only while something progresses the UCX workers at both of its
ends. On CPU (and over TCP) that takes a round trip: a WRITE's or READ's flush is
answered by the peer's agent, and only then is the notification sent. vLLM builds its
agent with NIXL's progress thread at NIXL's default, which polls without a pause: a
whole core per server for the server's whole life, busy or idle. vLLM has no setting
for it. The three modes:

- `"event"` (the default): NIXL's progress thread, asleep in `poll()` on the UCX
  worker's event file descriptor, woken as soon as a message arrives for the agent (a
  peer's flush, a notification), and at least every `EVENT_WAIT_US` (NIXL's own safety
  net for a missed wake-up). Idle, it costs nothing; busy, a peer's transfer completes
  without waiting for this server's next engine step. That matters most for pull: D's
  READ from a P in the middle of a long forward pass used to wait for P's next step.
- `"off"`: no progress thread. vLLM polls at each engine step, and the connector's
  poller thread keeps a push moving between steps.
- `"spin"`: NIXL's default, as vLLM builds it.

vLLM's worker builds its agent's config from the `nixl_agent_config` name in its module,
and NIXL's Python API fixes the thread's wait (`pthrDelay`) at 0: for as long as vLLM's
constructor runs (`agent_progress`), the first is swapped for one that asks for the mode,
and NIXL's binding config class for one that keeps our wait; both are put back after.
In `"event"` and `"off"` modes the agent also asks for NIXL's reader/writer locking:
several threads call it (vLLM's handshakes, the engine, the connector's poller), and
without the progress thread UCX is only made safe for that with it.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import partial
from types import ModuleType
from typing import Any

from connector.config import ProgressMode
from connector.vllm_compat import nixl_base_worker as base_worker

logger = logging.getLogger("vllm.pd_connector.progress")

EVENT_WAIT_US = 100_000  # the event thread's longest sleep without a wake-up (0.1 s)
CONFIG_NAME = "nixl_agent_config"  # the name vLLM's worker builds its agent config with


@contextmanager
def agent_progress(mode: ProgressMode) -> Iterator[None]:
    """While vLLM's worker is built inside this block, it builds its NIXL agent with
    progress `mode`."""
    if mode != "spin" and not hasattr(base_worker, CONFIG_NAME):
        logger.warning("this vLLM builds its NIXL agent differently: NIXL's progress "
                       "thread stays as NIXL sets it (it may spin a core)")
    factory = getattr(base_worker, CONFIG_NAME, None)
    if mode == "spin" or factory is None:  # None: NIXL is missing, and vLLM says so itself
        yield
        return
    api = importlib.import_module(factory.__module__)
    swap = _event_config_swap(api) if mode == "event" else None
    if mode == "event" and swap is None:
        logger.warning("this NIXL builds its agent config differently: no event-driven "
                       "progress thread, the agent runs without one (as with \"off\")")
    setattr(base_worker, CONFIG_NAME, partial(
        factory, enable_prog_thread=swap is not None,
        sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW))
    try:
        with swap or nullcontext():
            yield
    finally:
        setattr(base_worker, CONFIG_NAME, factory)
    logger.info("NIXL agent built %s", "with an event-driven progress thread (wakes on the "
                f"transport's events, at least every {EVENT_WAIT_US / 1e6:g} s)"
                if swap is not None else "without a progress thread")


def _event_config_swap(api: ModuleType) -> AbstractContextManager[None] | None:
    """A block in which NIXL's binding config class is a subclass that keeps the progress
    thread's wait at EVENT_WAIT_US, whatever NIXL's Python API sets; None when this NIXL
    has no such class."""
    bindings: Any = getattr(api, "nixlBind", None)
    config_type = getattr(bindings, "nixlAgentConfig", None)
    if config_type is None or not hasattr(config_type(), "pthrDelay"):
        return None

    class EventDrivenConfig(config_type):  # type: ignore[misc, valid-type]
        def __setattr__(self, name: str, value: Any) -> None:
            super().__setattr__(name, EVENT_WAIT_US if name == "pthrDelay" else value)

    @contextmanager
    def swapped() -> Iterator[None]:
        bindings.nixlAgentConfig = EventDrivenConfig
        try:
            yield
        finally:
            bindings.nixlAgentConfig = config_type

    return swapped()
