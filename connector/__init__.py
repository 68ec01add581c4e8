"""Our vLLM KV connector: one NIXL connector that does pull and push per request.

vLLM loads it with `"kv_connector": "NixlDualConnector", "kv_connector_module_path":
"connector"` (see `connector.connector`). The pieces, each its own module:

- `messages`: the push side channel's typed wire messages and their codec.
- `registry`: P's registry, matching D's registrations with finished prefills.
- `channel`: the side channel's ZMQ sockets and threads, on P and on D.
- `config`: our keys in `kv_connector_extra_config`, checked at start.
- `keys`: CURVE keys that authenticate the side channel (`python -m connector.keys DIR`).
- `scheduler`, `worker`, `metadata`: the vLLM connector halves and what passes between.
- `early`, `wake`: sockets from P's channel to P's worker, and from D's workers to a
  pausing D scheduler.
- `progress`: how vLLM's NIXL agent makes progress (an event-driven thread by default).
- `pages`: the KV cache's page size.

`messages`, `registry`, `channel`, `config` and `keys` do not import vLLM; the class itself is
imported on first use, so they stay cheap to import and test.
"""

from typing import Any

__all__ = ["NixlDualConnector"]


def __getattr__(name: str) -> Any:
    if name == "NixlDualConnector":
        from connector.connector import NixlDualConnector

        return NixlDualConnector
    raise AttributeError(f"module 'connector' has no attribute {name!r}")
