"""The emulated model's directory: the tiny model's files with a changed config.json.

    config.json: architectures = ["EmulatedLlamaForCausalLM"]
                 testbed_gpu_profile = "<profile name>"
                 max_position_embeddings = MAX_POSITIONS (the tiny model has 1,024)

and the tokenizer's `model_max_length` raised to match. The weights are the tiny
model's, byte for byte: a plain server of this directory (or of the tiny model, for
prompts within its 1,024 positions) gives the same tokens. Rotary embeddings need no
trained positions, so the longer context is the same model.

The directory is built next to the tiny one, once per profile; a marker records what it
was built from, and building again from the same tiny model and profile does nothing.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from testbed.plugin import ARCHITECTURE
from testbed.profiles import get_profile

RECIPE_VERSION = 1
MAX_POSITIONS = 16384  # 8,192-token prompts and their answers fit, with room
MARKER_NAME = ".testbed-model-complete"
PROFILE_FIELD = "testbed_gpu_profile"  # also read by testbed.model


def _recipe(tiny_dir: Path, profile: str) -> dict[str, object]:
    return {
        "recipe_version": RECIPE_VERSION,
        "profile": profile,
        "max_positions": MAX_POSITIONS,
        "tiny_config": json.loads((tiny_dir / "config.json").read_text()),
        "tiny_weights_bytes": (tiny_dir / "model.safetensors").stat().st_size,
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
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        staging.chmod(0o755)
        for item in tiny_dir.iterdir():
            if item.is_file() and not item.name.startswith("."):
                shutil.copy2(item, staging / item.name)
        config = json.loads((tiny_dir / "config.json").read_text())
        config.update(
            architectures=[ARCHITECTURE],
            max_position_embeddings=MAX_POSITIONS,
            **{PROFILE_FIELD: profile},
        )
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        tokenizer_config = staging / "tokenizer_config.json"
        if tokenizer_config.exists():
            settings = json.loads(tokenizer_config.read_text())
            settings["model_max_length"] = MAX_POSITIONS
            tokenizer_config.write_text(json.dumps(settings, indent=2, sort_keys=True))
        (staging / MARKER_NAME).write_text(json.dumps(recipe, sort_keys=True))
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target
