"""A directory like the tiny test model's (config, random weights of its shapes cut to a
16-row vocabulary, tokenizer config, build marker), for tests of what is built from it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file


def random_tiny_weights(seed: int) -> dict[str, np.ndarray]:
    """The tiny model's tensor names and shapes (2 layers, 4 heads of 32, 2 KV heads,
    hidden 128, MLP 256, vocabulary 4,096 cut to 16 rows), random values."""
    rng = np.random.default_rng(seed)
    shapes = {"lm_head.weight": (16, 128), "model.embed_tokens.weight": (16, 128),
              "model.norm.weight": (128,)}
    for layer in range(2):
        prefix = f"model.layers.{layer}."
        shapes.update({
            prefix + "input_layernorm.weight": (128,),
            prefix + "post_attention_layernorm.weight": (128,),
            prefix + "self_attn.q_proj.weight": (128, 128),
            prefix + "self_attn.k_proj.weight": (64, 128),
            prefix + "self_attn.v_proj.weight": (64, 128),
            prefix + "self_attn.o_proj.weight": (128, 128),
            prefix + "mlp.gate_proj.weight": (256, 128),
            prefix + "mlp.up_proj.weight": (256, 128),
            prefix + "mlp.down_proj.weight": (128, 256),
        })
    return {name: rng.standard_normal(shape).astype(np.float32)
            for name, shape in shapes.items()}


def fake_tiny_model(tmp_path: Path) -> Path:
    tiny = tmp_path / "tiny-model"
    tiny.mkdir()
    (tiny / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 1024,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 32, "hidden_size": 128, "intermediate_size": 256}))
    save_file(random_tiny_weights(0), str(tiny / "model.safetensors"))
    (tiny / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 1024}))
    (tiny / ".tiny-model-complete").write_text("{}")
    return tiny
