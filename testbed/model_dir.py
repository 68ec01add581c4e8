"""The emulated model's directory: the tiny model cut smaller, with a changed config.json.

    config.json: architectures = ["EmulatedLlamaForCausalLM"]
                 testbed_gpu_profile = "<profile name>"
                 max_position_embeddings = MAX_POSITIONS (the tiny model has 1,024)
                 and the smaller shape of `SLICE`, with `layers` decoder layers

and the tokenizer's `model_max_length` raised to match. The weights are a slice of the
tiny model's (`slice_weights`): its first layer, its first attention heads and the
first rows of its MLP, the vocabulary and embeddings whole. Each forward pass must
compute in well under the profile's time, or the emulated "GPU" runs at the CPU's
pace: measured on the 2-core CI machine (one server, alone), the whole tiny model's
prefill took 49% of llama8b-h100's time at 1,024 tokens, 74% at 2,048 and 1.06-1.77x
at 4,096-8,192 (steps ran long), its attention quadratic on one core; the slice takes
13%, 17%, 27% and 46%, and every step keeps time. It is still a real model with real
KV: a plain server of this directory gives the same tokens as an emulated one, so
pull, push and local stay checkable against one server. Rotary embeddings need no
trained positions, so the longer context needs no other change.

Layers: one by default (the shape above). `build(..., layers=N)` with N > 1 gives N
layers of the same cut shape but one attention head (`shape`; the KV, 1 head of 32, is
the same), so that the emulated forward can end each layer at its share of the
profile's time (`testbed.model`) and vLLM's per-layer KV hooks fire as on a GPU: the
tiny model's own layers (it has 2) are cut as above, and every layer past them gets
random weights like the tiny model's (normal, standard deviation INITIALIZER_RANGE,
norms of ones) from a generator seeded with SEED and the layer's index, so the
directory is the same on every machine. Each layer costs its real compute again,
mostly attention, quadratic in the prompt, and the CPU attention kernel takes head
dimensions of 32 and up, so one head is the cheapest layer there is: measured on the
2-core machine (one server alone, llama8b-h100), 8 layers of 2 heads computed a 1,024 /
4,096 / 8,192-token prefill in 1.2 / 2.4 / 4.0x the profile's time; steps that run
long are flagged by the benchmark (the layers then end late, after their compute).

The directory is built next to the tiny one, once per profile; a marker records what it
was built from, and building again from the same tiny model and profile does nothing.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

from safetensors.numpy import load_file, save_file

from testbed.plugin import ARCHITECTURE
from testbed.profiles import get_profile
from testbed.staging import staged

RECIPE_VERSION = 3
MAX_POSITIONS = 32768  # 16,384-token prompts and their answers fit, with room
MARKER_NAME = ".testbed-model-complete"
PROFILE_FIELD = "testbed_gpu_profile"  # also read by testbed.model
WEIGHTS = "model.safetensors"
SEED = 2026  # the extra layers' weights (module docstring)
INITIALIZER_RANGE = 0.1  # as the tiny model's (testbed.tiny_model)
# The emulated model's shape, cut from the tiny model's (module docstring); the layer
# count is `build`'s `layers` (1 by default).
SLICE = {
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 64,
}


def shape(layers: int = 1) -> dict[str, int]:
    """The emulated model's config fields for `layers` layers: `SLICE`, and one attention
    head when there are several layers (module docstring)."""
    if layers < 1:
        raise ValueError(f"the emulated model needs at least one layer, got {layers}")
    if layers == 1:
        return dict(SLICE)
    return {**SLICE, "num_hidden_layers": layers, "num_attention_heads": 1}


def slice_weights(weights: dict[str, Any], config: dict[str, Any],
                  layers: int | None = None) -> dict[str, Any]:
    """The tiny model's tensors (name -> array) cut to `shape(layers)` (by default
    SLICE's): layers past the count dropped; q/k/v projections keep their first heads'
    rows, o_proj the matching columns; the MLP keeps its first `intermediate_size`
    units. Layers past the tiny model's own are generated (`extra_layer`)."""
    cut_shape = shape(SLICE["num_hidden_layers"] if layers is None else layers)
    layers = cut_shape["num_hidden_layers"]
    head_dim = int(config["head_dim"])
    q_rows = cut_shape["num_attention_heads"] * head_dim
    kv_rows = cut_shape["num_key_value_heads"] * head_dim
    units = cut_shape["intermediate_size"]
    cut: dict[str, Any] = {}
    for name, tensor in weights.items():
        if name.startswith("model.layers."):
            if int(name.split(".")[2]) >= layers:
                continue
            if name.endswith("q_proj.weight"):
                tensor = tensor[:q_rows]
            elif name.endswith(("k_proj.weight", "v_proj.weight")):
                tensor = tensor[:kv_rows]
            elif name.endswith("o_proj.weight"):
                tensor = tensor[:, :q_rows]
            elif name.endswith(("gate_proj.weight", "up_proj.weight")):
                tensor = tensor[:units]
            elif name.endswith("down_proj.weight"):
                tensor = tensor[:, :units]
        cut[name] = tensor.copy()  # contiguous, as safetensors writes it
    own = int(config["num_hidden_layers"])
    template = {name.split(".", 3)[3]: tensor for name, tensor in cut.items()
                if name.startswith("model.layers.0.")}
    for index in range(own, layers):
        cut.update(extra_layer(index, template))
    return cut


def extra_layer(index: int, template: dict[str, Any]) -> dict[str, Any]:
    """Layer `index`'s tensors, shaped as `template`'s (a cut layer's, names without
    the "model.layers.N." prefix): norms of ones, every matrix normal with standard
    deviation INITIALIZER_RANGE from a generator seeded with (SEED, index)."""
    import numpy as np

    rng = np.random.default_rng([SEED, index])
    layer = {}
    for name in sorted(template):
        like = template[name]
        if name.endswith("layernorm.weight"):
            tensor = np.ones(like.shape, dtype=like.dtype)
        else:
            tensor = (rng.standard_normal(like.shape) * INITIALIZER_RANGE).astype(like.dtype)
        layer[f"model.layers.{index}.{name}"] = tensor
    return layer


def _recipe(tiny_dir: Path, profile: str, layers: int) -> dict[str, object]:
    return {
        "recipe_version": RECIPE_VERSION,
        "profile": profile,
        "layers": layers,
        "seed": SEED,
        "max_positions": MAX_POSITIONS,
        "tiny_config": json.loads((tiny_dir / "config.json").read_text()),
        "tiny_weights_sha256": hashlib.sha256((tiny_dir / WEIGHTS).read_bytes()).hexdigest(),
        "slice": shape(layers),
    }


def default_dir(tiny_dir: Path, profile: str, layers: int = 1) -> Path:
    suffix = "" if layers == 1 else f"-{layers}layers"
    return Path(tiny_dir).resolve().parent / f"gpu-model-{profile}{suffix}"


def build(tiny_dir: Path, profile: str, out_dir: Path | None = None, layers: int = 1) -> Path:
    """Derive the emulated model for `profile` with `layers` decoder layers from the
    built tiny model in `tiny_dir`; return its directory (`out_dir`, by default beside
    the tiny model)."""
    get_profile(profile)  # an unknown name fails here, not in the server
    if layers < 1:
        raise ValueError(f"the emulated model needs at least one layer, got {layers}")
    tiny_dir = Path(tiny_dir).resolve()
    target = Path(out_dir or default_dir(tiny_dir, profile, layers)).resolve()
    recipe = _recipe(tiny_dir, profile, layers)
    try:
        if json.loads((target / MARKER_NAME).read_text()) == recipe:
            return target
    except (OSError, ValueError):
        pass
    with staged(target) as staging:
        for item in tiny_dir.iterdir():
            if item.is_file() and not item.name.startswith(".") and item.name != WEIGHTS:
                shutil.copy2(item, staging / item.name)
        config = json.loads((tiny_dir / "config.json").read_text())
        weights = load_file(str(tiny_dir / WEIGHTS))
        save_file(slice_weights(weights, config, layers), str(staging / WEIGHTS),
                  metadata={"format": "pt"})
        config.update(
            architectures=[ARCHITECTURE],
            max_position_embeddings=MAX_POSITIONS,
            **shape(layers),
            **{PROFILE_FIELD: profile},
        )
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        tokenizer_config = staging / "tokenizer_config.json"
        if tokenizer_config.exists():
            settings = json.loads(tokenizer_config.read_text())
            settings["model_max_length"] = MAX_POSITIONS
            tokenizer_config.write_text(json.dumps(settings, indent=2, sort_keys=True))
        (staging / MARKER_NAME).write_text(json.dumps(recipe, sort_keys=True))
    return target
