"""Tiny, randomly initialised models of other families than Llama, built with no download:
the KV-cache layouts a P/D connector must move besides a dense model's.

    python -m testbed.tiny_families FAMILY OUT_DIR [--force]

Families (`FAMILIES`):

- `gemma3`: Gemma 3 text (`Gemma3ForCausalLM`), one sliding-window layer (a 64-token
  window) and one full-attention layer: two KV-cache groups under vLLM's hybrid
  allocator, the window shorter than a prompt, so the sliding group holds only the
  prompt's last blocks.
- `deepseek_v2`: DeepSeek-V2 (`DeepseekV2ForCausalLM`), multi-head latent attention
  (MLA) with DeepSeek's latent size (`kv_lora_rank` 512 + `qk_rope_head_dim` 64, what
  vLLM's CPU MLA kernels take), dense MLPs; vLLM CPU serves MLA with block size 16.
- `granitemoehybrid`: Granite 4 hybrid (`GraniteMoeHybridForCausalLM`), one Mamba-2 layer
  and one attention layer, dense MLPs: a model with Mamba state besides its KV.

Each shares the tokenizer of `testbed.tiny_model` (the same byte-level BPE, vocabulary
4096, chat template) and its size (hidden 128, 2 layers, 4 heads), float32, under a fixed
seed, so builds are deterministic. A marker file records the recipe; building again into
a complete directory with the same recipe does nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from testbed import tiny_model
from testbed.staging import staged

# Bump when anything below changes what gets written, so cached builds are rebuilt.
RECIPE_VERSION = 1
MARKER_NAME = ".tiny-family-complete"
SLIDING_WINDOW = 64  # Gemma 3's window: shorter than a test prompt (and than a block)
MLA_KV_LORA_RANK = 512  # DeepSeek's latent size: vLLM CPU's MLA kernels take this one
MLA_ROPE_HEAD_DIM = 64

_COMMON: dict[str, Any] = {
    "vocab_size": tiny_model.VOCAB_SIZE,
    "hidden_size": tiny_model.HIDDEN_SIZE,
    "intermediate_size": tiny_model.INTERMEDIATE_SIZE,
    "num_hidden_layers": tiny_model.NUM_LAYERS,
    "num_attention_heads": tiny_model.NUM_HEADS,
    "max_position_embeddings": tiny_model.MAX_POSITIONS,
    # As the tiny Llama's: greedy output depends clearly on the context.
    "initializer_range": tiny_model.INITIALIZER_RANGE,
}

# Per family: the config class's name in transformers, the model class's, and the fields
# on top of _COMMON.
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "num_key_value_heads": tiny_model.NUM_KV_HEADS,
        "head_dim": tiny_model.HEAD_DIM,
        "query_pre_attn_scalar": tiny_model.HEAD_DIM,
        "sliding_window": SLIDING_WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
        "tie_word_embeddings": True,
    }),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", {
        "num_key_value_heads": tiny_model.NUM_HEADS,
        "kv_lora_rank": MLA_KV_LORA_RANK,
        "qk_rope_head_dim": MLA_ROPE_HEAD_DIM,
        "q_lora_rank": None,
        "qk_nope_head_dim": 32,
        "v_head_dim": 32,
        "head_dim": MLA_ROPE_HEAD_DIM,
        # Every layer dense: MLA is what this family is here for.
        "first_k_dense_replace": tiny_model.NUM_LAYERS,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "moe_intermediate_size": 64,
        "tie_word_embeddings": False,
    }),
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", {
        "num_key_value_heads": tiny_model.NUM_KV_HEADS,
        "layer_types": ["mamba", "attention"],
        "mamba_n_heads": 8,
        "mamba_d_head": 32,
        "mamba_n_groups": 1,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_chunk_size": 64,
        "num_local_experts": 0,
        "shared_intermediate_size": tiny_model.INTERMEDIATE_SIZE,
        "position_embedding_type": "rope",
        "tie_word_embeddings": False,
    }),
}


def _recipe(family: str) -> dict[str, object]:
    return {"recipe_version": RECIPE_VERSION, "family": family,
            "tokenizer": tiny_model.RECIPE_VERSION, "seed": tiny_model.SEED,
            **_COMMON, **FAMILIES[family][2]}


def is_built(family: str, out_dir: Path) -> bool:
    """True if `out_dir` holds a complete build of `family` with the current recipe."""
    try:
        return bool(json.loads((out_dir / MARKER_NAME).read_text()) == _recipe(family))
    except (OSError, ValueError):
        return False


def _build_model(family: str, out_dir: Path) -> None:
    import torch
    import transformers
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    config_name, model_name, fields = FAMILIES[family]
    tokenizer = PreTrainedTokenizerFast.from_pretrained(out_dir)
    config_cls: Callable[..., Any] = getattr(transformers, config_name)
    config = config_cls(
        **_COMMON, **fields,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(tiny_model.SEED)
    model = getattr(transformers, model_name)(config).to(torch.float32)
    # Plain defaults, so servers sample greedily when asked for temperature 0.
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(out_dir, safe_serialization=True)


def build(family: str, out_dir: str | os.PathLike[str], *, force: bool = False) -> Path:
    """Build the tiny `family` model into `out_dir` (skipped if already built); return its
    path. Built in a sibling temporary directory renamed into place, like the tiny model."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {family!r}")
    target = Path(out_dir).resolve()
    if not force and is_built(family, target):
        return target
    with staged(target) as staging:
        tiny_model._build_tokenizer(staging)
        _build_model(family, staging)
        (staging / MARKER_NAME).write_text(json.dumps(_recipe(family), sort_keys=True))
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m testbed.tiny_families",
        description="Build a tiny random model of another family than Llama (same "
                    "tokenizer and size as testbed.tiny_model), offline and deterministic. "
                    "Serve it with `--model OUT_DIR --served-model-name tiny`.")
    parser.add_argument("family", choices=sorted(FAMILIES))
    parser.add_argument("out_dir", help="directory to build into (created if missing)")
    parser.add_argument("--force", action="store_true",
                        help="rebuild even if a complete build is there")
    args = parser.parse_args(argv)
    already = not args.force and is_built(args.family, Path(args.out_dir))
    path = build(args.family, args.out_dir, force=args.force)
    print(f"{'already built' if already else 'built'}: {path} "
          f"(sha256 {tiny_model.fingerprint(path)[:16]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
