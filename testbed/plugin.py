"""vLLM general plugin: registers the emulated model's architecture, and nothing else.

vLLM calls `register()` in each of its processes (entry point group
`vllm.general_plugins` in testbed/pyproject.toml: the testbed's own distribution, which
only the test environment installs, never pd-proxy). The registration is lazy (a
"module:Class" string): nothing is imported until a model directory names the
architecture, so the plugin changes nothing for any other model. Set `VLLM_PLUGINS` to a
list without `pd_proxy_testbed` to keep vLLM from loading it at all.
"""

from __future__ import annotations

ARCHITECTURE = "EmulatedLlamaForCausalLM"
MODEL_CLASS = f"testbed.model:{ARCHITECTURE}"


def register() -> None:
    from vllm import ModelRegistry

    ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)  # idempotent
