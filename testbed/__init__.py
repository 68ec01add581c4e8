"""The tests' and benchmarks' tooling (not the product; its own distribution, see
pyproject.toml here): what the tests, the benchmarks and the demo run against.

- Servers: `fake_vllm` (an emulated vLLM server: canned answers, delays, injected
  faults, vLLM's push and pull legs) with `fake_kv_cache` (a prefix cache publishing
  vLLM's KV events, and vLLM's /tokenize); `vllm_cpu` (real vLLM servers on CPU: a P/D
  pair or one server, `python -m testbed.vllm_cpu pair --help`).
- Models: `tiny_model` (the tiny Llama the tests serve, built offline) and
  `tiny_families` (a sliding-window, an MLA and a Mamba hybrid one).
- `pd_protocol`: the legs and `kv_transfer_params` of stock vLLM P/D, and parsing its
  metrics and answers.
- The GPU regime: the tiny Llama served by real vLLM on CPU with each forward pass
  lasting as long as a named GPU profile says (`profiles`): it computes for real, then
  sleeps the rest, so the host is free while the "GPU" works. `model` is the emulated
  model class, `plugin` registers it with vLLM, `model_dir` derives its model directory
  from the tiny model's, `clock` times the steps and records them.
"""
