"""What P's side and D's side both use.

- `channel_thread`: one owned side-channel thread, its wake-up pipe, the engine's typed
  events for it, bounded waits.
- `ipc`: private IPC socket addresses on this host (D's wake-up, P's early WRITEs).
- `keys`: CURVE keys that authenticate the side channel
  (`python -m connector.shared.keys DIR`).
- `tp_plan`: which ranks WRITE which heads when P's and D's tensor-parallel sizes differ.
- `progress`: how vLLM's NIXL agent makes progress (an event-driven thread by default).
- `pages`: the KV cache's page size.
"""
