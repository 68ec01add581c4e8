"""What tokenizing a prompt costs kv_aware, two ways, measured in one run.

    .venv/bin/python -m scripts.bench_tokenize            # about 2 minutes
    .venv/bin/python -m scripts.bench_tokenize --tokens 1024,8192 --repeats 5
    .venv/bin/python -m scripts.bench tokenize            # the same, from the one command

kv_aware needs a prompt's token ids exactly as vLLM makes them. Two ways to get them:

- `server`: `POST /tokenize` on a vLLM server of the model (what the router does): exact
  by construction (vLLM's own tokenizer and chat template), at the price of a round trip
  and of decoding the ids' JSON in the router.
- `local`: the model's fast tokenizer (`tokenizers`) in the router's process, and for a
  chat the model's template rendered by `transformers` as vLLM renders it: no round trip,
  but the router would carry the tokenizer, the template engine and their versions, and
  every template quirk vLLM handles would have to be matched.

For prompts of each length in `--tokens` (a completion's text, and a chat of a system
prompt and one turn of that size), it reports the median wall time of each way and the
router's own CPU time per request for `server` (the HTTP call and the decoding), on a
real vLLM CPU server with the tiny test model (`VLLM_ALLOW_LONG_MAX_MODEL_LEN` lets
/tokenize take prompts longer than the model; nothing is computed). It also checks that
both ways give the same ids.

What it leaves out: the routing itself (kv_aware's block keys, index and scoring:
`python -m scripts.bench overhead --kv-aware` measures those), and tokenizers and
templates other than the tiny test model's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from scripts.benchkit import REPO, write_json
from testbed import tiny_model
from testbed.vllm_cpu import DEFAULT_MODEL_DIR, SERVED_MODEL_NAME, run_server, server_spec

SYLLABLES = ("ka", "lo", "min", "tor", "e", "sa", "ven", "du", "ri", "po", "an", "qua")


def say(message: str) -> None:
    print(f"[bench_tokenize] {message}", file=sys.stderr, flush=True)


def text_of(tokenizer: Any, tokens: int, rng: random.Random) -> str:
    """The fewest words whose text is at least `tokens` tokens long (by the model's own
    tokenizer)."""
    words: list[str] = []
    while len(tokenizer.encode(" ".join(words))) < tokens:
        words += ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3)))
                  for _ in range(max(16, tokens // 4))]
    low, high = 1, len(words)  # bisect on the number of words
    while low < high:
        middle = (low + high) // 2
        if len(tokenizer.encode(" ".join(words[:middle]))) >= tokens:
            high = middle
        else:
            low = middle + 1
    return " ".join(words[:low])


def median_ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1000, 3)


async def measure(url: str, model_dir: Path, lengths: list[int], repeats: int) -> list[dict[str, Any]]:
    from transformers import AutoTokenizer  # installed with vLLM; not a router dependency

    hf = AutoTokenizer.from_pretrained(str(model_dir))
    rng = random.Random(0)
    rows = []
    async with httpx.AsyncClient(timeout=120) as client:
        for tokens in lengths:
            text = text_of(hf, tokens, rng)
            messages = [{"role": "system", "content": text[: len(text) // 2]},
                        {"role": "user", "content": text[len(text) // 2:]}]
            for shape, body in (("completion", {"prompt": text}),
                                ("chat", {"messages": messages, "add_generation_prompt": True})):
                server_wall, server_cpu, local_wall = [], [], []
                server_ids: list[int] = []
                for _ in range(repeats):
                    wall, cpu = time.perf_counter(), time.process_time()
                    r = await client.post(f"{url}/tokenize", json={"model": SERVED_MODEL_NAME, **body})
                    r.raise_for_status()
                    server_ids = json.loads(r.content)["tokens"]
                    server_wall.append(time.perf_counter() - wall)
                    server_cpu.append(time.process_time() - cpu)
                    wall = time.perf_counter()
                    if shape == "chat":
                        rendered: Any = hf.apply_chat_template(
                            messages, add_generation_prompt=True, tokenize=True)
                        if hasattr(rendered, "keys"):  # newer transformers: a BatchEncoding
                            rendered = rendered["input_ids"]
                        local_ids = list(rendered)
                    else:
                        local_ids = hf.encode(text)
                    local_wall.append(time.perf_counter() - wall)
                row = {"tokens": len(server_ids), "shape": shape,
                       "server_ms": median_ms(server_wall),
                       "server_router_cpu_ms": median_ms(server_cpu),
                       "local_ms": median_ms(local_wall),
                       "same_ids": list(local_ids) == server_ids,
                       "local_minus_server_ids": len(local_ids) - len(server_ids),
                       "first_difference": next(
                           (i for i, (a, b) in enumerate(zip(local_ids, server_ids, strict=False))
                            if a != b), None)}
                say(str(row))
                rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench_tokenize", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1024,8192,32768",
                        help="prompt lengths, comma-separated")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", type=Path, default=REPO / "bench-results" / "bench_tokenize.json")
    args = parser.parse_args(argv)
    lengths = [int(t) for t in args.tokens.split(",") if t]
    tiny_model.build(DEFAULT_MODEL_DIR)
    spec = server_spec("decode", connector=None, max_model_len=max(lengths) + 64,
                       extra_env={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"})
    say(f"starting a vLLM CPU server of the tiny model on {spec.url}")
    with run_server(spec) as server:
        rows = asyncio.run(measure(server.url, DEFAULT_MODEL_DIR, lengths, args.repeats))
    result = {"machine_cpus": os.cpu_count(), "rows": rows}
    write_json(args.out, result)
    print(f"{'tokens':>7} {'shape':10} {'server ms':>10} {'router CPU ms':>14} {'local ms':>9} same")
    for r in rows:
        print(f"{r['tokens']:>7} {r['shape']:10} {r['server_ms']:>10} "
              f"{r['server_router_cpu_ms']:>14} {r['local_ms']:>9} {r['same_ids']}")
    say(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
