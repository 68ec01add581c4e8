"""What crosses each hop, typed: one module per hop.

- `http_params`: router <-> servers, the HTTP legs' `kv_transfer_params`
  (`KVTransferParams`) and header names: the one contract between the router and the
  connector.
- `side_channel`: D <-> P over ZMQ, the push side channel's messages (register, ack,
  nack, abort...) and their codec.
- `step`: scheduler -> workers each engine step (`PushStep`), and workers -> scheduler
  (`PushReport`).

`http_params` and `side_channel` do not import vLLM (the router imports them); `step`
does (it extends vLLM's worker metadata). Nothing here imports P's or D's side.
"""
