"""D's side of a push: what a decode server does to receive P's WRITE.

- `channel`: D's side-channel thread (`DecodeChannel`): a socket per P, D's
  registrations and their deadlines, and what it tells D's engine (`PushFailure`).
- `registered`: D's scheduler's record of each push it registered with a P.
- `incoming`: D's worker's record of each push it receives.
- `wake`: D's workers wake D's pausing scheduler when a push lands.
- `scheduler_side`, `worker_side`: D's halves of the connector's scheduler and worker.

Nothing here imports `connector.prefill`: what both sides use is in `connector.shared`
and `connector.protocol`.
"""
