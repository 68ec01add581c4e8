"""The router's choices by name: the transfer modes, the balancing policies, and what to
do when P's answer falls short. Enums, read by every request's compiled code.

A module of their own, compiled with the request path (`pyproject.toml`): compiled code
reads a member of an enum defined in a compiled module as a constant, and one defined in
an interpreted module through its class's `__getattr__` (Python 3.11's `EnumType`), at
each use. Measured with a loop compiled by mypyc: 61 ns against 9 ns per read, and the
request path read about 30 of them per request (`Mode.PULL`, `Mode.AUTO`, ...).
`proxy.config`, whose settings use them, gives them under its own name too.
"""

from __future__ import annotations

import enum


class Mode(str, enum.Enum):
    """How the KV cache travels from P to D."""

    PULL = "pull"  # P first, then D READs P's blocks
    PUSH = "push"  # P and D at once; P WRITEs into D's blocks
    LOCAL = "local"  # no P: D computes the prompt itself (conditional disaggregation)
    AUTO = "auto"  # the mode measured faster for the prompt's length (see proxy.flow.learn)


class Policy(str, enum.Enum):
    """How a cluster picks an endpoint (see `proxy.pool.balance`)."""

    ROUND_ROBIN = "round_robin"
    LEAST_OUTSTANDING = "least_outstanding"
    POWER_OF_TWO = "power_of_two"
    PREFIX_AFFINITY = "prefix_affinity"
    LOAD_AWARE = "load_aware"
    KV_AWARE = "kv_aware"


class MissingKVParams(str, enum.Enum):
    """What to do when P answers without `kv_transfer_params` (pull mode)."""

    ERROR = "error"  # answer 502: D would silently recompute the whole prompt
    RECOMPUTE = "recompute"  # send D the plain request, and count it


class PushRecovery(str, enum.Enum):
    """What to do when a push's P leg fails before D sent the client a byte."""

    PULL = "pull"  # redo the request as a pull on another P (none left: D recomputes)
    RECOMPUTE = "recompute"  # send D the plain request: D computes the prompt itself
    ERROR = "error"  # answer the client with P's error (502/504)
