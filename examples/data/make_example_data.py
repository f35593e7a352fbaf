"""Writes the small inputs the README's commands use (seeded, so the files are reproducible):

- ``tokens.json``   — one prompt as a JSON list of token ids (``kvpolicy keys``);
- ``ns.json``       — a Namespace, as ``Namespace.to_dict()`` writes it (``kvpolicy keys --namespace``);
- ``requests.jsonl`` — 40 token-id requests sharing a 1,024-token system prompt, into which the
  assembler writes a 16-token "Today is <date> <time>" line after the first 48 tokens — the time
  changes every third request, so everything after it misses (``kvpolicy diagnose`` finds it).

    python examples/data/make_example_data.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from kvpolicy.keys import Namespace

HERE = Path(__file__).resolve().parent


def main() -> None:
    rng = random.Random(7)
    (HERE / "tokens.json").write_text(json.dumps([rng.randrange(32000) for _ in range(100)]) + "\n")
    ns = Namespace(model_id="meta-llama/Llama-3.1-8B-Instruct", model_revision="main", tokenizer_version="llama3",
                   kv_dtype="bf16", block_size_tokens=16, tenant="acme")
    (HERE / "ns.json").write_text(json.dumps(ns.to_dict(), indent=1) + "\n")
    system = [rng.randrange(32000) for _ in range(1024)]
    lines = []
    for i in range(40):
        prompt = list(system)
        prompt[48:48] = [31000 + ((i // 3) * 7 + j) % 997 for j in range(16)]  # the time line, new every third request
        prompt += [rng.randrange(32000) for _ in range(rng.randrange(20, 120))]
        lines.append(json.dumps({"request_id": f"r{i}", "timestamp": round(i * 1.5, 3), "tokens": prompt}))
    (HERE / "requests.jsonl").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
