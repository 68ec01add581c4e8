"""A task's own exception state, for coroutines compiled by mypyc.

CPython gives every coroutine its own "exception being handled" (`sys.exc_info()`), put
aside when it suspends. A coroutine compiled by mypyc has none of its own: one that
suspends inside an `except` or a `finally` block (an `await` there, or in an `async
with`'s exit while an exception passes) leaves its exception as the thread's meanwhile,
and a `finally` can leave it there for good. Another task that catches an exception
then saves it as the state to restore, and restores it later. From then on every
exception raised outside a handler takes it as its `__context__`. Measured: after one
request retried on another server (a flow awaits the second leg in the handler of the
first's error), every later upstream error carried that request's refused connection in
place of what the HTTP parser's callback had raised, and the router answered the wrong
error.

`own_exception_state(coroutine)` runs a compiled coroutine under one interpreted frame,
whose exception state is the task's own: whatever the compiled code leaves there stays
with the task and goes with it. Every task whose coroutine is compiled starts through it.
This module must stay interpreted (`tests/unit/test_compiled.py` checks it is not in
`pyproject.toml`'s `compiled` list).
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def own_exception_state(coroutine: Awaitable[T]) -> T:
    return await coroutine
