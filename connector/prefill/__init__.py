"""P's side of a push: what a prefill server does to WRITE its KV into D's blocks.

- `registry`: P's registry, matching D's registrations with finished prefills (a pure
  state machine).
- `channel`: P's side-channel thread (`PrefillChannel`), which owns the registry, and
  what it tells P's engine (`StartWrite`, `FreeBlocks`).
- `early`: the socket from P's channel thread straight to P's worker, for early WRITEs.
- `prompts`: P's scheduler's record of each push request computing its prompt.
- `outgoing`: P's worker's record of each push it WRITEs.
- `scheduler_side`, `worker_side`: P's halves of the connector's scheduler and worker.

Nothing here imports `connector.decode`: what both sides use is in `connector.shared`
and `connector.protocol`.
"""
