"""Our vLLM KV connector: one NIXL connector that does pull and push per request.

vLLM loads it with `"kv_connector": "NixlDualConnector", "kv_connector_module_path":
"connector"` (see `connector.connector`). Laid out by role and by side, each floor
importing only the floors below it (tests/unit/test_layers.py checks it):

- `connector`: the facade vLLM loads; it forwards each call to its role.
- `scheduler`, `worker`: the two roles vLLM runs it in, each a thin composition of a P
  half and a D half (vLLM's pull code is their base).
- `prefill/`: P's side: the registry, P's side-channel thread, early WRITEs, P's records
  (in the scheduler and in the worker), and P's halves of the two roles.
- `decode/`: D's side: D's side-channel thread, D's records, the wake-up of a pausing
  scheduler, and D's halves of the two roles. `prefill/` and `decode/` never import
  each other.
- `protocol/`: what crosses each hop: `http_params` (the router's `kv_transfer_params`),
  `side_channel` (D <-> P over ZMQ), `step` (scheduler -> workers, and back).
- `shared/`: what both sides use: the channel thread, IPC sockets, CURVE keys
  (`python -m connector.shared.keys DIR`), the tp plan, the agent's progress, pages.
- `config`: our keys in `kv_connector_extra_config`, checked at start.
- `vllm_compat`: every vLLM name the others use, and the check that the installed vLLM
  is one this connector supports (the only module that imports `vllm`).

`protocol.side_channel`, `protocol.http_params`, `prefill.registry`, the channel modules,
`config` and `shared.keys` do not import vLLM (the router imports `side_channel`,
`http_params` and `keys`); the class itself is imported on first use, so they stay cheap
to import and test.
"""

from typing import Any

__all__ = ["NixlDualConnector"]


def __getattr__(name: str) -> Any:
    if name == "NixlDualConnector":
        from connector.connector import NixlDualConnector

        return NixlDualConnector
    raise AttributeError(f"module 'connector' has no attribute {name!r}")
