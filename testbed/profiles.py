"""GPU profiles: how long one forward pass of a real model on a real GPU would last.

The emulated model (`testbed.model`) runs the tiny test Llama for real, then sleeps
until a profile's time for that step has passed. A profile is a model architecture
(from its published config), a GPU (from its datasheet), a tensor-parallel degree and
two efficiency factors, and turns a step's shape into seconds with a roofline:

    step time = max(compute time, memory time)

    compute time = FLOPs / (tp x peak dense BF16 FLOP/s x mfu)
        FLOPs  = 2 x matmul parameters x new tokens        (one multiply-add per weight)
               + 4 x layers x heads x head_dim x attended  (QK^T and AV, causal)
        attended = for each request, its new tokens x the positions each one attends
                   to: new x context_before + new x (new + 1) / 2

    memory time = bytes / (tp x HBM bandwidth x hbm_share)
        bytes  = matmul parameters x bytes per weight      (every weight read once)
               + KV bytes per token x context read         (each request's whole KV)

A prefill of n tokens is one request of n new tokens (compute-bound from a few hundred
tokens on); a decode step of batch b is b requests of one new token each
(memory-bound: the weights plus every sequence's KV). "Matmul parameters" leaves out
the input embedding, which is gathered, not multiplied. `mfu` (model FLOPs
utilisation) and `hbm_share` (achieved share of peak HBM bandwidth) are stated
assumptions, not measurements: each profile says why it picked them.

What this leaves out: kernel launch gaps and CUDA graphs, the host's own time (real
here: vLLM's scheduler runs on this machine's CPU), communication between
tensor-parallel ranks except through the lower efficiency factors of TP profiles,
quantisation, speculative decoding, and prefix caching's effect on the GPU (a cached
prefix is simply not computed, as in vLLM).

Pure Python (no torch, no vLLM): the benchmark and the unit tests import it as is.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec

BF16_BYTES = 2


class GpuSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One GPU's datasheet figures."""

    name: str
    bf16_dense_flops: float  # peak dense BF16 tensor-core FLOP/s (no sparsity)
    hbm_bytes_per_s: float  # peak HBM bandwidth
    hbm_bytes: float  # memory size
    source: str


class ModelSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A decoder-only transformer's architecture, as its published config states it."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool = False
    weight_bytes: int = BF16_BYTES  # per parameter
    kv_bytes: int = BF16_BYTES  # per KV element
    source: str

    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer's matmuls: Q, K, V, O and the gated MLP."""
        q_and_o = 2 * self.hidden_size * self.num_heads * self.head_dim
        k_and_v = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        mlp = 3 * self.hidden_size * self.intermediate_size
        return q_and_o + k_and_v + mlp

    @property
    def matmul_params(self) -> int:
        """Every multiplied weight: the layers and the LM head (not the input embedding,
        a gather; norms are negligible and left out)."""
        return self.num_layers * self.layer_params + self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        """All parameters (norms left out), to check against the model card's size."""
        embedding = 0 if self.tied_embeddings else self.vocab_size * self.hidden_size
        return self.matmul_params + embedding

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token in every layer, over all ranks."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_bytes


class StepShape(msgspec.Struct, frozen=True):
    """One request's share of a forward pass: `new` tokens computed now after
    `context` tokens already in its KV cache (a decode is new=1)."""

    new: int
    context: int = 0


class Profile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A model on a GPU (or `tp` GPUs with tensor parallelism), and how well it uses them."""

    name: str
    model: ModelSpec
    gpu: GpuSpec
    tp: int = 1
    mfu: float  # achieved share of peak FLOP/s in compute-bound steps
    hbm_share: float  # achieved share of peak HBM bandwidth in memory-bound steps
    rationale: str  # why these efficiency factors

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one token takes over the whole model (all TP ranks together)."""
        return self.model.kv_bytes_per_token

    def flops(self, shapes: Iterable[StepShape]) -> float:
        m = self.model
        new = attended = 0
        for shape in shapes:
            new += shape.new
            attended += shape.new * shape.context + shape.new * (shape.new + 1) // 2
        attention = 4 * m.num_layers * m.num_heads * m.head_dim * attended
        return 2.0 * m.matmul_params * new + attention

    def bytes_read(self, shapes: Iterable[StepShape]) -> float:
        context = sum(shape.context + shape.new for shape in shapes)
        return float(
            self.model.matmul_params * self.model.weight_bytes
            + self.kv_bytes_per_token * context
        )

    def compute_s(self, shapes: Sequence[StepShape]) -> float:
        return self.flops(shapes) / (self.tp * self.gpu.bf16_dense_flops * self.mfu)

    def memory_s(self, shapes: Sequence[StepShape]) -> float:
        return self.bytes_read(shapes) / (self.tp * self.gpu.hbm_bytes_per_s * self.hbm_share)

    def step_s(self, shapes: Sequence[StepShape]) -> float:
        """Seconds of one forward pass over these requests (0 for an empty step)."""
        if not shapes or all(shape.new <= 0 for shape in shapes):
            return 0.0
        return max(self.compute_s(shapes), self.memory_s(shapes))

    def prefill_s(self, tokens: int, cached: int = 0) -> float:
        """A prompt of `tokens` new tokens alone in its step (after `cached` prefix hits)."""
        return self.step_s([StepShape(tokens, cached)])

    def decode_step_s(self, batch: int, context: int) -> float:
        """One decode step of `batch` sequences, each with `context` tokens of KV."""
        return self.step_s([StepShape(1, context - 1)] * batch) if batch > 0 else 0.0

    def describe(self) -> str:
        """The profile, its formulas' inputs and its public sources, for benchmarks to print."""
        m, g = self.model, self.gpu
        lines = [
            f"profile {self.name}: {m.name} on {self.tp} x {g.name}"
            + (f" (tensor parallel {self.tp})" if self.tp > 1 else ""),
            f"  model: {m.num_layers} layers, hidden {m.hidden_size}, MLP "
            f"{m.intermediate_size}, {m.num_heads} heads / {m.num_kv_heads} KV heads of "
            f"{m.head_dim}, vocab {m.vocab_size}; {m.total_params / 1e9:.2f} B parameters, "
            f"{m.matmul_params / 1e9:.2f} B multiplied per token, "
            f"{m.weight_bytes} bytes each; KV {self.kv_bytes_per_token} bytes per token",
            f"  GPU: {g.bf16_dense_flops / 1e12:.0f} TFLOP/s dense BF16, "
            f"{g.hbm_bytes_per_s / 1e12:.2f} TB/s HBM, {g.hbm_bytes / 1e9:.0f} GB",
            f"  efficiency: MFU {self.mfu:.2f}, HBM share {self.hbm_share:.2f} ({self.rationale})",
            "  prefill 1,024 / 8,192 tokens: "
            f"{self.prefill_s(1024) * 1e3:.1f} / {self.prefill_s(8192) * 1e3:.1f} ms; "
            "decode step batch 1 / 32 at 1,024 context: "
            f"{self.decode_step_s(1, 1024) * 1e3:.2f} / {self.decode_step_s(32, 1024) * 1e3:.2f} ms",
            f"  sources: {m.source}; {g.source}",
        ]
        return "\n".join(lines)


H100_SXM = GpuSpec(
    name="H100 SXM5 80GB",
    bf16_dense_flops=989.4e12,
    hbm_bytes_per_s=3.35e12,
    hbm_bytes=80e9,
    source=(
        "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM: BF16 tensor core 1,979 "
        "TFLOPS with sparsity, so 989 dense; GPU memory 80 GB; bandwidth 3.35 TB/s)"
    ),
)

LLAMA3_8B = ModelSpec(
    name="Llama 3 8B",
    num_layers=32,
    hidden_size=4096,
    intermediate_size=14336,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    vocab_size=128256,
    source=(
        "meta-llama/Meta-Llama-3-8B config.json and model card (32 layers, hidden 4096, "
        "intermediate 14336, 32 heads, 8 KV heads, vocab 128256, untied embeddings, "
        "bfloat16; 8.03 B parameters)"
    ),
)

LLAMA3_70B = ModelSpec(
    name="Llama 3 70B",
    num_layers=80,
    hidden_size=8192,
    intermediate_size=28672,
    num_heads=64,
    num_kv_heads=8,
    head_dim=128,
    vocab_size=128256,
    source=(
        "meta-llama/Meta-Llama-3-70B config.json and model card (80 layers, hidden 8192, "
        "intermediate 28672, 64 heads, 8 KV heads, vocab 128256, untied embeddings, "
        "bfloat16; 70.6 B parameters)"
    ),
)

PROFILES: dict[str, Profile] = {
    profile.name: profile
    for profile in (
        Profile(
            name="llama8b-h100",
            model=LLAMA3_8B,
            gpu=H100_SXM,
            mfu=0.5,
            hbm_share=0.8,
            rationale=(
                "assumed: large BF16 GEMMs reach 60-75% of peak on H100, a whole "
                "prefill with its norms, rotary and attention about half; decode's "
                "weight streaming reaches about 80% of peak bandwidth"
            ),
        ),
        Profile(
            name="llama70b-h100x8",
            model=LLAMA3_70B,
            gpu=H100_SXM,
            tp=8,
            mfu=0.4,
            hbm_share=0.6,
            rationale=(
                "assumed: as llama8b-h100, lowered for tensor parallelism: two "
                "all-reduces per layer over NVLink stall each rank's GEMMs and "
                "weight reads, and each rank's shards are 8 times smaller"
            ),
        ),
    )
}


def get_profile(name: str) -> Profile:
    """The named profile; a clear error naming the known ones otherwise."""
    try:
        return PROFILES[name]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise ValueError(f"unknown GPU profile {name!r}; known profiles: {known}") from None
