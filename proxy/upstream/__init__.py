"""Talking to vLLM: the upstream client (`client`) on our HTTP/1.1 connection pool
(`http11`), and the router's side of P's push side channel (`sidechannel`).

Imports only the ground (`errors`, `config`)."""
