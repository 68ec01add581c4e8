"""What kv_aware decodes of a server's answers, as msgspec structs checked in C.

Interpreted, not compiled with the request path (`tests/unit/test_compiled.py` checks
that no compiled module decodes into a struct of its own): mypyc keeps a class's
annotations as the types it compiles to, so a struct defined in a compiled module has
`list` for `list[int]` and `type` for `int | None`, and msgspec then checks next to
nothing. A /tokenize answer with ids that are not integers passed the decode that way and
failed later, on the request's path, instead of as a failed call scored by load.
"""

from __future__ import annotations

import msgspec


class TokenizeAnswer(msgspec.Struct):
    """What the router reads of vLLM's /tokenize answer (checked in C: the ids' type)."""

    tokens: list[int]
