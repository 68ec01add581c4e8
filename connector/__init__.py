"""Our vLLM KV connector: one NIXL connector that does pull and push per request.

vLLM loads it with `"kv_connector": "NixlDualConnector", "kv_connector_module_path":
"connector"` (see `connector.connector`). The pieces, each its own module:

- `messages`: the push side channel's typed wire messages and their codec.
- `wire`: the HTTP legs' `kv_transfer_params` (typed, `KVTransferParams`) and header
  names: the one contract between the router and the connector.
- `registry`: P's registry, matching D's registrations with finished prefills.
- `channel`: the side channel's ZMQ sockets and threads: `prefill_channel` (P's),
  `decode_channel` (D's), and what both share, `channel_thread`.
- `config`: our keys in `kv_connector_extra_config`, checked at start.
- `keys`: CURVE keys that authenticate the side channel (`python -m connector.keys DIR`).
- `scheduler`, `worker`, `metadata`: the vLLM connector halves and what passes between.
- `push_requests`: the scheduler's record of each push request, with its state, on P
  and on D.
- `early`, `wake`: sockets from P's channel to P's worker, and from D's workers to a
  pausing D scheduler.
- `progress`: how vLLM's NIXL agent makes progress (an event-driven thread by default).
- `pages`: the KV cache's page size.
- `vllm_compat`: every vLLM name the others use, and the check that the installed vLLM
  is one this connector supports (the only module that imports `vllm`).

`messages`, `wire`, `registry`, the channel modules, `config` and `keys` do not import
vLLM (the router imports `messages`, `wire` and `keys`); the class itself is imported on
first use, so they stay cheap to import and test.
"""

from typing import Any

__all__ = ["NixlDualConnector"]


def __getattr__(name: str) -> Any:
    if name == "NixlDualConnector":
        from connector.connector import NixlDualConnector

        return NixlDualConnector
    raise AttributeError(f"module 'connector' has no attribute {name!r}")
