"""A GPU-regime testbed for vLLM on CPU (test and benchmark tooling, not the product).

The tiny test Llama, served by real vLLM on CPU, with each forward pass lasting as long
as a named GPU profile says (`profiles`): it computes for real, then sleeps the rest, so
the host is free while the "GPU" works. `model` is the emulated model class,
`plugin` registers it with vLLM, `model_dir` derives its model directory from the tiny
model's, `clock` times the steps and records them.
"""
