"""Key building speed against a vLLM-style reference, side by side in one run.

Hashes a 131,072-token prompt with B = 16 and prints tokens/s and the ratio to
the reference (sha256 over pickle of ``(parent, tuple(block_tokens), None)`` per
block, chained — what vLLM's ``sha256`` prefix hashing does). Targets: fast ≥ 30×,
keyed ≥ 5×, the vLLM projection no slower than the reference. Also: extending a
128K-token chain by one block must cost O(block), not O(prompt).

    python benchmarks/bench_keys.py [--tokens 131072] [--block-size 16] [--json OUT]
"""

from __future__ import annotations

import argparse
import hashlib
import pickle
import sys

import numpy as np
from _common import add_check_flag, report_targets, best_of, print_table, write_json

from kvpolicy.keys import BlockHasher, Namespace, vllm_block_hashes


def reference_vllm_style(tokens: list[int], block_size: int) -> list[bytes]:
    parent = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=pickle.HIGHEST_PROTOCOL)).digest()
    out = []
    for i in range(len(tokens) // block_size):
        block = tuple(tokens[i * block_size : (i + 1) * block_size])
        parent = hashlib.sha256(pickle.dumps((parent, block, None), protocol=pickle.HIGHEST_PROTOCOL)).digest()
        out.append(parent)
    return out


def hashlib_over_kernel_encoding(toks: np.ndarray, B: int) -> list[bytes]:
    """The alternative to the hand-written SHA-256 kernel: the same precomputed per-token
    pickle encoding, each block's message spliced in Python and hashed by hashlib (OpenSSL)."""
    from kvpolicy.keys import _sha256
    from kvpolicy.keys.vllm import vllm_none_hash

    n = toks.size // B
    buf, off = _sha256.encode_uints(toks[: n * B], 0)
    body, offs = buf.tobytes(), off.tolist()
    c, d = (b"\x94(", b"t\x94N\x87\x94.") if B > 3 else (None, None)
    assert c is not None, "block sizes <= 3 use a different tuple opcode"
    h, out, sha = vllm_none_hash("sha256"), [], hashlib.sha256
    for b in range(n):
        mid = b"C" + bytes((len(h),)) + h + c + body[offs[b * B]:offs[(b + 1) * B]] + d
        h = sha(b"\x80\x05\x95" + len(mid).to_bytes(8, "little") + mid).digest()
        out.append(h)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_check_flag(ap)
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    n, B = args.tokens, args.block_size
    rng = np.random.default_rng(args.seed)
    toks_np = rng.integers(0, 150_000, n).astype(np.uint32)
    toks_list = toks_np.tolist()
    ns = Namespace(model_id="bench", model_revision="r", tokenizer_version="t", kv_dtype="bf16", block_size_tokens=B)
    keyed = BlockHasher(ns, "keyed", secret=bytes(range(32)))
    fast = BlockHasher(ns, "fast")

    # the projection must agree with the reference before it is timed
    assert vllm_block_hashes(toks_np, B, "sha256") == reference_vllm_style(toks_list, B) == hashlib_over_kernel_encoding(toks_np, B)

    cases = {
        "reference (vLLM-style sha256/pickle)": lambda: reference_vllm_style(toks_list, B),
        "fast": lambda: fast.hash_blocks(toks_np),
        "keyed (BLAKE2b-128, secret)": lambda: keyed.hash_blocks(toks_np),
        "fast, from a Python list": lambda: fast.hash_blocks(toks_list),
        "keyed, from a Python list": lambda: keyed.hash_blocks(toks_list),
        "vllm projection sha256": lambda: vllm_block_hashes(toks_np, B, "sha256"),
        "  same encoding, hashlib per block": lambda: hashlib_over_kernel_encoding(toks_np, B),
        "vllm projection sha256_cbor": lambda: vllm_block_hashes(toks_np, B, "sha256_cbor"),
    }
    secs = {name: best_of(fn, repeats=args.repeats) for name, fn in cases.items()}
    ref = secs["reference (vLLM-style sha256/pickle)"]
    rows = []
    results = []
    for name, s in secs.items():
        rows.append([name, f"{s * 1e3:.3f}", f"{n / s / 1e6:.1f}", f"{ref / s:.2f}x"])
        results.append({"case": name, "seconds": s, "tokens_per_s": n / s, "speedup_vs_reference": ref / s})
    print(f"Hashing a {n:,}-token prompt, block size {B} ({n // B:,} blocks); median of {args.repeats} after warmup\n")
    print_table(["case", "ms", "Mtok/s", "vs reference"], rows)

    # incremental: extend a full-length chain by one block vs rehash from scratch
    ext_rows = []
    ext = {}
    for label, h in (("fast", fast), ("keyed", keyed)):
        chain = h.chain()
        chain.extend(toks_np[: n - B])
        last_block = toks_np[n - B :]

        def extend_one(chain=chain, last_block=last_block) -> None:
            c = chain.hasher.chain()
            c._last, c._n_blocks = chain.last_key, chain.num_blocks  # same state, fresh object
            c.extend(last_block)

        t_ext = best_of(extend_one, repeats=args.repeats * 3)
        t_full = best_of(lambda h=h: h.hash_blocks(toks_np), repeats=args.repeats)
        ext[label] = {"extend_one_block_s": t_ext, "rehash_prompt_s": t_full, "ratio": t_full / t_ext}
        ext_rows.append([label, f"{t_ext * 1e6:.1f}", f"{t_full * 1e6:.1f}", f"{t_full / t_ext:.0f}x"])
    print(f"\nExtending a {n - B:,}-token chain by one {B}-token block (O(block)) vs hashing the whole prompt (O(prompt))\n")
    print_table(["scheme", "extend us", "from scratch us", "ratio"], ext_rows)

    targets = {
        "fast >= 30x": secs["fast"] and ref / secs["fast"] >= 30,
        "keyed >= 5x": ref / secs["keyed (BLAKE2b-128, secret)"] >= 5,
        "vllm sha256 projection >= 1x": ref / secs["vllm projection sha256"] >= 1.0,
    }
    rc = report_targets(targets, args.check)
    path = write_json("bench_keys", {"tokens": n, "block_size": B, "results": results, "extend": ext, "targets": targets}, args.json)
    print(f"wrote {path}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
