"""KV-aware routing: where each server's prefix cache holds which blocks of a prompt.

- `events`: vLLM's KV event batches decoded (both encodings vLLM has shipped).
- `blocks`: the router's own chained keys of a prompt's token blocks.
- `index`: `KvIndex`, every server's cached blocks under those keys, kept from its events,
  with gaps, wipes and bounds handled; a pure state machine, no I/O.
- `tokens`: a request's token ids, exactly as vLLM makes them.
- `subscriber`: the ZMQ subscriptions that feed the index (imported only when a cluster
  balances `kv_aware`: it needs pyzmq).
"""
