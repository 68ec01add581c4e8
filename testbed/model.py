"""`EmulatedLlamaForCausalLM`: vLLM's Llama, whose forward pass lasts as long as a GPU
profile says.

It is vLLM's own `LlamaForCausalLM` (real weights, real KV cache, real tokens: its
output equals a plain server's), and after each forward it sleeps until the profile's
time for that step has passed (`testbed.clock`), so the host's CPU is free while the
"GPU" works, as on a GPU server. The step's shape (each request's new tokens and the
context it attends to) comes from the attention metadata of vLLM's forward context.

With several decoder layers (`testbed.model_dir`, `layers`), each layer ends at its
share of the step's time (a forward hook per layer sleeps to `Planned.layer_deadline`),
so that vLLM's per-layer KV hooks (`save_kv_layer`) fire through the step as they would
on a GPU, not all at its start; the servers run eager (`--enforce-eager`), so the hooks
run as Python between the layers. `TESTBED_TIME_SCALE` (or the file named by
`TESTBED_TIME_SCALE_FILE`, read again when it changes; testbed.clock) multiplies every
step's time: an emulated GPU that many times slower.

The profile is named by the model's config.json, field `testbed_gpu_profile` (see
`testbed.model_dir`). vLLM imports this module only in the processes that load the
model, through the lazy registration in `testbed.plugin`.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.sequence import IntermediateTensors

from testbed.clock import Planned, StepClock, StepLog, StepRecord, TimeScale
from testbed.model_dir import PROFILE_FIELD
from testbed.profiles import Profile, StepShape, get_profile


def step_shapes() -> list[StepShape] | None:
    """Each scheduled request's new tokens and prior context in the running forward,
    from its attention metadata; None outside a real step (no metadata, e.g. a
    profiling run)."""
    if not is_forward_context_available():
        return None
    metadata = get_forward_context().attn_metadata
    if not isinstance(metadata, dict) or not metadata:
        return None
    first = next(iter(metadata.values()))  # every layer's metadata has the same requests
    starts = getattr(first, "query_start_loc", None)
    seq_lens = getattr(first, "seq_lens", None)
    if starts is None or seq_lens is None:
        return None
    bounds: list[int] = starts.tolist()
    lengths: list[int] = seq_lens.tolist()
    shapes = []
    for index, length in enumerate(lengths[: len(bounds) - 1]):
        new = bounds[index + 1] - bounds[index]
        if new > 0:
            shapes.append(StepShape(new, length - new))
    return shapes


class _Step:
    """The running forward's plan, for the layers' hooks."""

    def __init__(self, planned: Planned, started: float) -> None:
        self.planned = planned
        self.started = started
        self.slept = 0.0
        self.layer_ends: list[float] = []


class EmulatedLlamaForCausalLM(LlamaForCausalLM):
    """Llama whose forward lasts as long as its GPU profile's step (module docstring)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", **kwargs: Any) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        name = getattr(vllm_config.model_config.hf_config, PROFILE_FIELD, None)
        if not isinstance(name, str):
            raise ValueError(
                f"the emulated model's config.json needs a {PROFILE_FIELD!r} field naming "
                "its GPU profile (build the model directory with testbed.model_dir)"
            )
        self.profile: Profile = get_profile(name)
        self._clock = StepClock()
        self._scale = TimeScale.from_env()  # testbed.clock.TIME_SCALE_ENV
        self._log = StepLog.from_env()
        self._pid = os.getpid()
        self._step: _Step | None = None
        layers = list(getattr(self.model, "layers", ()))
        self._layers = len(layers)
        if self._layers > 1:
            for index, layer in enumerate(layers):
                layer.register_forward_hook(self._layer_hook(index))

    def _layer_hook(self, index: int) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            step = self._step
            if step is None:
                return
            step.slept += self._clock.pace(step.planned.layer_deadline(index, self._layers))
            step.layer_ends.append(time.perf_counter() - step.started)

        return hook

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        started = time.perf_counter()
        shapes = step_shapes()
        if shapes is None:
            return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds)
        target = self.profile.step_s(shapes) * self._scale.current()
        planned = self._clock.plan(started, target, shapes)
        step = self._step = _Step(planned, started)
        try:
            output = super().forward(input_ids, positions, intermediate_tensors, inputs_embeds)
        finally:
            self._step = None
        computed = time.perf_counter() - step.slept  # the compute alone, layers' sleeps out
        ended = self._clock.wait(planned)
        if self._log is not None:
            prefills = [shape for shape in shapes if shape.new > 1 or shape.context == 0]
            self._log.write(StepRecord(
                at=time.time(),
                pid=self._pid,
                requests=len(shapes),
                prefill_tokens=sum(shape.new for shape in prefills),
                decodes=len(shapes) - len(prefills),
                context_tokens=sum(shape.context + shape.new for shape in shapes),
                target_s=target,
                compute_s=computed - started,
                gap_s=planned.gap_s,
                overlapped=planned.overlapped,
                step_s=ended - started,
                layer_ends_s=step.layer_ends or None,
            ))  # fmt: skip
        return output
