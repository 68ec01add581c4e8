"""The emulated model's directory: the tiny model cut smaller, with a changed config.json.

    config.json: architectures = ["EmulatedLlamaForCausalLM"]
                 testbed_gpu_profile = "<profile name>"
                 max_position_embeddings = MAX_POSITIONS (the tiny model has 1,024)
                 and the smaller shape of `SLICE`

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

RECIPE_VERSION = 2
MAX_POSITIONS = 16384  # 8,192-token prompts and their answers fit, with room
MARKER_NAME = ".testbed-model-complete"
PROFILE_FIELD = "testbed_gpu_profile"  # also read by testbed.model
WEIGHTS = "model.safetensors"
# The emulated model's shape, cut from the tiny model's (module docstring).
SLICE = {
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 64,
}


def slice_weights(weights: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """The tiny model's tensors (name -> array) cut to `SLICE`: layers past its count
    dropped; q/k/v projections keep their first heads' rows, o_proj the matching
    columns; the MLP keeps its first `intermediate_size` units."""
    head_dim = int(config["head_dim"])
    q_rows = SLICE["num_attention_heads"] * head_dim
    kv_rows = SLICE["num_key_value_heads"] * head_dim
    units = SLICE["intermediate_size"]
    cut: dict[str, Any] = {}
    for name, tensor in weights.items():
        if name.startswith("model.layers."):
            if int(name.split(".")[2]) >= SLICE["num_hidden_layers"]:
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
    return cut


def _recipe(tiny_dir: Path, profile: str) -> dict[str, object]:
    return {
        "recipe_version": RECIPE_VERSION,
        "profile": profile,
        "max_positions": MAX_POSITIONS,
        "tiny_config": json.loads((tiny_dir / "config.json").read_text()),
        "tiny_weights_sha256": hashlib.sha256((tiny_dir / WEIGHTS).read_bytes()).hexdigest(),
        "slice": SLICE,
    }


def default_dir(tiny_dir: Path, profile: str) -> Path:
    return Path(tiny_dir).resolve().parent / f"gpu-model-{profile}"


def build(tiny_dir: Path, profile: str, out_dir: Path | None = None) -> Path:
    """Derive the emulated model for `profile` from the built tiny model in `tiny_dir`;
    return its directory (`out_dir`, by default beside the tiny model)."""
    get_profile(profile)  # an unknown name fails here, not in the server
    tiny_dir = Path(tiny_dir).resolve()
    target = Path(out_dir or default_dir(tiny_dir, profile)).resolve()
    recipe = _recipe(tiny_dir, profile)
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
        save_file(slice_weights(weights, config), str(staging / WEIGHTS),
                  metadata={"format": "pt"})
        config.update(
            architectures=[ARCHITECTURE],
            max_position_embeddings=MAX_POSITIONS,
            **SLICE,
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
