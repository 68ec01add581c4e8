"""Build a tiny, randomly initialised Llama model that vLLM can serve, with no download.

    python -m testbed.tiny_model OUT_DIR [--force]

The result is deterministic: the tokenizer is a byte-level BPE trained with `tokenizers`
on procedurally generated text (a fixed pseudo-random generator over fixed syllables,
so it does not depend on files that differ between machines), and the weights come from
`LlamaForCausalLM` initialised under a fixed seed. The directory holds safetensors
weights, `config.json`, `generation_config.json` and the tokenizer files, so

    python -m vllm.entrypoints.openai.api_server --model OUT_DIR --served-model-name tiny

loads it. A marker file records the build recipe; building again into a complete
directory with the same recipe does nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from testbed.staging import staged

# Bump when anything below changes what gets written, so cached builds are rebuilt.
RECIPE_VERSION = 2
MARKER_NAME = ".tiny-model-complete"

VOCAB_SIZE = 4096
HIDDEN_SIZE = 128
INTERMEDIATE_SIZE = 256
NUM_LAYERS = 2
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 32
MAX_POSITIONS = 1024
SEED = 1234
# Larger than Llama's 0.02, so a random model's greedy output depends clearly on its
# context: then wrong or missing KV changes the tokens, which is what e2e tests check.
INITIALIZER_RANGE = 0.1

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN]

# A deliberately simple template: every turn is "<|role|>\ncontent\n".
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_ONSETS = [
    "",
    *[
        "b",
        "c",
        "d",
        "f",
        "g",
        "h",
        "k",
        "l",
        "m",
        "n",
        "p",
        "r",
        "s",
        "t",
        "v",
        "w",
        "z",
        "br",
        "ch",
        "cl",
        "dr",
        "fl",
        "gr",
        "pl",
        "sh",
        "st",
        "th",
        "tr",
    ],
]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "io", "ou", "y"]
_CODAS = ["", "", "", *["n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck"]]
_COMMON = [
    "the",
    "a",
    "of",
    "to",
    "and",
    "in",
    "is",
    "that",
    "it",
    "for",
    "on",
    "with",
    "as",
    "was",
    "be",
    "by",
    "this",
    "are",
    "from",
    "or",
    "user",
    "assistant",
    "system",
    "prefill",
    "decode",
    "token",
    "cache",
    "router",
    "request",
]
_PUNCT = [".", ".", ".", ",", "?", "!", ";", ":"]


class _Lcg:
    """A 64-bit linear congruential generator: fixed output on every Python version."""

    def __init__(self, seed: int) -> None:
        self._state = seed & 0xFFFFFFFFFFFFFFFF

    def below(self, n: int) -> int:
        self._state = (self._state * 6364136223846793005 + 1442695040888963407) & (
            0xFFFFFFFFFFFFFFFF
        )
        return (self._state >> 33) % n

    def choice(self, items: list[str]) -> str:
        return items[self.below(len(items))]


def corpus(lines: int = 20000, seed: int = SEED) -> Iterator[str]:
    """Yield deterministic pseudo-English lines: made-up words, common words, digits."""
    rng = _Lcg(seed)
    lexicon = []
    for _ in range(6000):
        syllables = 1 + rng.below(3)
        word = "".join(
            rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables)
        )
        lexicon.append(word)
    for _ in range(lines):
        words = []
        for _ in range(4 + rng.below(14)):
            roll = rng.below(10)
            if roll < 4:
                words.append(rng.choice(_COMMON))
            elif roll < 9:
                # Zipf-like: favour the front of the lexicon.
                words.append(lexicon[rng.below(1 + rng.below(len(lexicon)))])
            else:
                words.append(str(rng.below(10000)))
        sentence = " ".join(words)
        yield sentence[0].upper() + sentence[1:] + rng.choice(_PUNCT)


def sample_text(seed: int, *, lines: int = 6) -> str:
    """Pseudo-English from the tokenizer's own domain; distinct seeds give distinct text."""
    return " ".join(corpus(lines=lines, seed=seed))


def _recipe() -> dict[str, object]:
    return {
        "recipe_version": RECIPE_VERSION,
        "vocab_size": VOCAB_SIZE,
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": INTERMEDIATE_SIZE,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": MAX_POSITIONS,
        "seed": SEED,
        "initializer_range": INITIALIZER_RANGE,
    }


def is_built(out_dir: Path) -> bool:
    """True if `out_dir` holds a complete build made with the current recipe."""
    marker = out_dir / MARKER_NAME
    try:
        return bool(json.loads(marker.read_text()) == _recipe())
    except (OSError, ValueError):
        return False


def _build_tokenizer(out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(
            f"tokenizer has {tokenizer.get_vocab_size()} tokens, expected {VOCAB_SIZE}: "
            "the corpus is too small for that many merges"
        )
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    # Completions prompts get a BOS like a real Llama tokenizer; the chat template writes
    # its own, and vLLM renders chat prompts with add_special_tokens=False.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    wrapped = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=MAX_POSITIONS,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
    wrapped.save_pretrained(out_dir)


def _build_model(out_dir: Path) -> None:
    import torch
    from transformers import (
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )

    tokenizer = PreTrainedTokenizerFast.from_pretrained(out_dir)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=INITIALIZER_RANGE,
        tie_word_embeddings=False,
        dtype="float32",
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]  # float32
    # Plain defaults, so servers sample greedily when asked for temperature 0.
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(out_dir, safe_serialization=True)


def build(out_dir: str | os.PathLike[str], *, force: bool = False) -> Path:
    """Build the tiny model into `out_dir` (skipped if already built); return its path.

    The build happens in a sibling temporary directory that is renamed into place, so a
    crash never leaves a half-written model that looks complete.
    """
    target = Path(out_dir).resolve()
    if not force and is_built(target):
        return target
    with staged(target) as staging:
        _build_tokenizer(staging)
        _build_model(staging)
        (staging / MARKER_NAME).write_text(json.dumps(_recipe(), sort_keys=True))
    return target


def fingerprint(out_dir: str | os.PathLike[str]) -> str:
    """SHA-256 over the weights and tokenizer: equal fingerprints mean equal models."""
    digest = hashlib.sha256()
    root = Path(out_dir)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        digest.update(name.encode())
        digest.update((root / name).read_bytes())
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m testbed.tiny_model",
        description=(
            "Build a tiny random Llama model (vocab 4096, hidden 128, 2 layers, 4 heads, "
            "2 KV heads) with a locally trained byte-level BPE tokenizer and a chat "
            "template. Deterministic and offline. Serve it with "
            "`--model OUT_DIR --served-model-name tiny`."
        ),
    )
    parser.add_argument("out_dir", help="directory to build into (created if missing)")
    parser.add_argument(
        "--force", action="store_true", help="rebuild even if a complete build is there"
    )
    args = parser.parse_args(argv)
    already = not args.force and is_built(Path(args.out_dir))
    path = build(args.out_dir, force=args.force)
    state = "already built" if already else "built"
    print(f"{state}: {path} (sha256 {fingerprint(path)[:16]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
