"""The ``kvpolicy`` command: the parser, and ``main``. Each command family lives in its own module
(:mod:`.model`, :mod:`.traces`, :mod:`.events`, :mod:`.planning`, :mod:`.simulate`, :mod:`.measure`); what they share
is in :mod:`._common`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from ..errors import ConfigError, KVPolicyError
from ..gguf import KV_CACHE_TYPES
from ._common import (DEFAULT_PREFIXES, MAX_BLOCK_TOKENS, MAX_CAPACITY_BLOCKS, MAX_PROMPT_TOKENS, MAX_REPLICAS, MAX_SEED, MAX_THREADS,
    _Parser, _add_sweep_args, _add_trace_args, _block_size, _bytes_per_token_int, _capacities, _gib, _ints_upto,
    _non_negative_float, _policy_list, _pool_capacity, _port, _positive_float, _reference_model_args, _replicas,
    _seed, _token_lengths)
from .events import _cmd_ingest_events, _cmd_lookup
from .measure import _cmd_profile, _cmd_serve_reference
from .model import _cmd_keys, _cmd_size
from .planning import _cmd_diagnose, _cmd_plan_warmup
from .simulate import _cmd_compare
from .traces import _cmd_analyze, _cmd_breakeven, _cmd_evict_bench, _cmd_publish_bench, _cmd_sglang_bench


# --------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    from ..data import bundled_configs

    from .. import __version__

    p = _Parser(prog="kvpolicy", description="Prefix KV-cache policy for LLM serving.")
    p.add_argument("--version", action="version", version=f"kvpolicy {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    s = sub.add_parser("size", help="KV bytes per token and per prefix from a model config (and a measured profile)")
    s.add_argument("--config", default=None, help=f"HF config.json path, or a bundled name: {', '.join(sorted(bundled_configs()))}")
    s.add_argument("--gguf", default=None, help="a GGUF model file (llama.cpp): the geometry from its metadata, tensors not read")
    s.add_argument("--cache-type-k", choices=sorted(KV_CACHE_TYPES), default="f16", help="llama.cpp's K cache type (--gguf; default f16)")
    s.add_argument("--cache-type-v", choices=sorted(KV_CACHE_TYPES), default="f16", help="llama.cpp's V cache type (--gguf; default f16)")
    s.add_argument("--kv-dtype", default=None, help="KV element format override (fp8, bf16, fp16, fp32); default: the config's torch_dtype")
    s.add_argument("--block-size", type=_block_size, default=16, help="block size in tokens (default 16)")
    s.add_argument("--prefix-tokens", type=_token_lengths, default=list(DEFAULT_PREFIXES), help="comma-separated prefix lengths (default 4096,16384,32768,65536)")
    s.add_argument("--profile", default=None, help="measured profile CSV: prefix_tokens,kv_bytes,cold_prefill_ms,local_hit_ttft_ms")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.set_defaults(func=_cmd_size)

    k = sub.add_parser("keys", help="block keys of a token sequence (kvpolicy or vLLM-compatible)")
    k.add_argument("tokens", help="JSON file holding a list of token ids")
    k.add_argument("--scheme", choices=["keyed", "fast", "vllm-sha256", "vllm-sha256-cbor"], default="keyed")
    k.add_argument("--block-size", type=_block_size, required=True)
    k.add_argument("--namespace", default=None, help="namespace JSON (kvpolicy schemes); default: an unspecified-model namespace")
    k.add_argument("--secret-hex", default=None, help="deployment secret as hex (visible in ps and shell history: prefer --secret-file or env KVPOLICY_SECRET_HEX)")
    k.add_argument("--secret-file", default=None, help="file holding the deployment secret as hex (one line)")
    k.add_argument("--cache-salt", default=None)
    k.add_argument("--lora-name", default=None)
    k.add_argument("--lora-path", default=None)
    k.add_argument("--json", action="store_true")
    k.set_defaults(func=_cmd_keys)

    ie = sub.add_parser("ingest-events", help="feed the shared directory from a vLLM / SGLang pod's KV events (a sidecar; runs until stopped)")
    ie.add_argument("--endpoint", required=True, help="the engine's KV event PUB socket, e.g. tcp://vllm-0:5557 (vLLM: --kv-events-config endpoint)")
    ie.add_argument("--replay-endpoint", default=None, help="its replay socket (e.g. tcp://vllm-0:5558): gaps in the sequence are fetched again")
    ie.add_argument("--ranks", type=_ints_upto(MAX_REPLICAS), default=1, help="data-parallel ranks: rank r publishes on PORT + r (default 1)")
    ie.add_argument("--topic", default="", help="topic prefix to subscribe to (default: every topic)")
    ie.add_argument("--directory", required=True, help="redis://HOST:PORT/DB (or rediss://), or 'memory' for a dry run that only counts")
    ie.add_argument("--tenant", required=True, help="the tenant whose namespace these blocks live in")
    ie.add_argument("--holder", required=True, help="this engine's name in the directory (rank r of several: HOLDER-dpR)")
    ie.add_argument("--namespace", default=None, help="namespace JSON of the deployment (as for kvpolicy keys); default: an unspecified-model namespace")
    ie.add_argument("--block-size", type=_block_size, required=True, help="the engine's block size in tokens")
    ie.add_argument("--scheme", choices=["keyed", "fast"], default="keyed")
    ie.add_argument("--secret-hex", default=None, help="deployment secret as hex (visible in ps: prefer --secret-file or env KVPOLICY_SECRET_HEX)")
    ie.add_argument("--secret-file", default=None, help="file holding the deployment secret as hex (one line)")
    ie.add_argument("--verify", choices=["sha256", "sha256_cbor"], default=None,
                    help="check each stored block's engine hash against vLLM's own hashing of its tokens (the engine's --prefix-caching-hash-algo)")
    ie.add_argument("--verify-hash-seed", default=None, metavar="SEED",
                    help="the engine's PYTHONHASHSEED, if it sets one: vLLM roots every hash chain in it, so --verify refuses every block without it")
    ie.add_argument("--on-gap", choices=["forget", "keep"], default="forget",
                    help="batches lost and not in the replay socket may have removed blocks: forget what this engine was known to "
                         "hold (default), or keep it and only count them")
    ie.add_argument("--config", default=None, help="model config.json or bundled name, for the bytes a block holds (default llama-3-8b)")
    ie.add_argument("--kv-dtype", default=None)
    ie.add_argument("--bytes-per-token", type=_bytes_per_token_int, default=None)
    ie.add_argument("--stats-every-s", type=_positive_float, default=30.0, help="print a JSON stats line this often (default 30)")
    ie.add_argument("--max-seconds", type=_positive_float, default=None, help="stop after this long (default: run until SIGINT / SIGTERM)")
    ie.add_argument("--json", default=None, metavar="OUT", help="write the final stats as JSON")
    ie.add_argument("--verbose", "-v", action="store_true", help="log each refused batch or event (default: counted in the stats lines only)")
    ie.set_defaults(func=_cmd_ingest_events)

    lk = sub.add_parser("lookup", help="what the shared directory holds of one prompt: its keys, the leading run a request matches, who holds each block")
    lk.add_argument("tokens", help="JSON file holding a list of token ids (the prompt)")
    lk.add_argument("--directory", required=True, help="redis://HOST:PORT/DB (or rediss://); 'memory': an empty one (the keys alone)")
    lk.add_argument("--tenant", required=True)
    lk.add_argument("--block-size", type=_block_size, required=True)
    lk.add_argument("--namespace", default=None, help="the deployment's namespace JSON (as for kvpolicy keys and ingest-events)")
    lk.add_argument("--scheme", choices=["keyed", "fast"], default="keyed")
    lk.add_argument("--secret-hex", default=None, help="deployment secret as hex (visible in ps: prefer --secret-file or env KVPOLICY_SECRET_HEX)")
    lk.add_argument("--secret-file", default=None, help="file holding the deployment secret as hex (one line)")
    lk.add_argument("--lora-name", default=None, help="the request's LoRA adapter (its blocks carry it, as vLLM's events do)")
    lk.add_argument("--cache-salt", default=None, help="the request's cache salt (on its first block, as vLLM's events put it)")
    lk.add_argument("--all", action="store_true", help="list every block, not only the matched run and the block it stops at")
    lk.add_argument("--json", default=None, metavar="OUT")
    lk.set_defaults(func=_cmd_lookup)

    a = sub.add_parser("analyze", help="what a trace says before anyone buys a cache: reuse, MRC, replicas, byte flows, verdict")
    _add_trace_args(a)
    a.add_argument("--capacities-blocks", type=_capacities, default=None, help="MRC capacities in blocks (default: powers of two up to the distinct blocks)")
    a.add_argument("--replicas", type=_replicas, default=8)
    a.add_argument("--routing", choices=["random", "round-robin", "prefix-affinity"], default="round-robin", help="how the current deployment routes (default round-robin)")
    a.add_argument("--affinity-blocks", type=_ints_upto(MAX_BLOCK_TOKENS), default=4, help="prefix-affinity hashes the first k full blocks (default 4)")
    a.add_argument("--local-kv-gib", type=_gib, default=32.0, help="physical KV cache per replica in GiB (default 32; minus the decode/reserved/fragmentation shares below = 20.8 GiB for prefixes)")
    a.add_argument("--decode-share", type=_non_negative_float, default=0.25, help="share of it held by active decodes (default 0.25)")
    a.add_argument("--reserved-share", type=_non_negative_float, default=0.05, help="reserved share (default 0.05)")
    a.add_argument("--fragmentation-share", type=_non_negative_float, default=0.05, help="fragmentation share (default 0.05)")
    a.add_argument("--json", default=None, metavar="OUT", help="write the full report as JSON")
    a.add_argument("--plot", default=None, metavar="DIR", help="write PNG figures (needs matplotlib)")
    a.add_argument("--quiet", "-q", "--no-progress", dest="no_progress", action="store_true", help="no progress on stderr (default: a progress bar on a terminal, one line per finished unit elsewhere)")
    a.set_defaults(func=_cmd_analyze)

    b = sub.add_parser("breakeven", help="remote load vs recompute per prefix length, and the break-even prefix")
    b.add_argument("--config", default=None, help="model config.json or bundled name (default llama-3-8b)")
    b.add_argument("--kv-dtype", default=None)
    b.add_argument("--bytes-per-token", type=_bytes_per_token_int, default=None)
    b.add_argument("--profile", required=True, help="measured profile CSV (prefix_tokens,kv_bytes,cold_prefill_ms,local_hit_ttft_ms)")
    b.add_argument("--allow-mismatch", action="store_true", help="use a --profile whose measured KV bytes/token differs from the model's by more than 10%%")
    b.add_argument("--bandwidth-gbps", type=_positive_float, required=True, help="useful bandwidth under contention, Gbit/s (10^9 bits)")
    for flag, default, what in (("--lookup-ms", 0.5, "hash + metadata lookup"), ("--queue-ms", 0.0, "waiting for link/staging/server"),
                                ("--stage-ms", 0.0, "copy through CPU memory"), ("--install-ms", 0.0, "placing blocks into the cache"),
                                ("--dispatch-ms", 0.0, "recompute dispatch overhead"), ("--interference-ms-per-gb", 0.5, "time stolen from active requests per GB loaded")):
        b.add_argument(flag, type=_non_negative_float, default=default, help=f"{what} (default {default})")
    b.add_argument("--margin", type=_positive_float, default=0.8, help="load iff T_remote + T_interf < margin x T_recompute (default 0.8)")
    b.add_argument("--block-size", type=_block_size, default=16)
    b.add_argument("--prefix-tokens", type=_token_lengths, default=[1024, 4096, 16384, 32768, 65536])
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=_cmd_breakeven)

    e = sub.add_parser("evict-bench", help="replay a trace through eviction policies, with Belady and the infinite cache beside them")
    _add_trace_args(e)
    e.add_argument("--capacities-blocks", type=_capacities, default=None, help="capacities in blocks (default: 1/64, 1/16, 1/4, 1/2 of the distinct blocks)")
    e.add_argument("--policies", type=_policy_list, default=["lru", "fifo", "lfu", "ttl", "s3fifo", "sieve", "arc", "gdsf", "reuse-distance", "hit-density", "adaptive", "lrb", "belady"],
                   help="comma-separated (default: lru,fifo,lfu,ttl,s3fifo,sieve,arc,gdsf,reuse-distance,hit-density,adaptive,lrb,belady; also belady-bypass; "
                        "and your own: MODULE:CLASS or PATH.py:CLASS, an EvictionPolicy subclass built as CLASS(capacity_bytes, clock=clock))")
    e.add_argument("--judge-second-half", action="store_true",
                   help="a held-out split: every policy runs over the whole trace but only the second half's requests are scored")
    e.add_argument("--json", default=None, metavar="OUT")
    e.add_argument("--quiet", "-q", "--no-progress", dest="no_progress", action="store_true", help="no progress on stderr (default: a progress bar on a terminal, one line per finished unit elsewhere)")
    _add_sweep_args(e)
    e.set_defaults(func=_cmd_evict_bench)

    from ..integrations.sglang_bench import DEFAULT_STRATEGIES as SGLANG_BENCH_STRATEGIES

    sg = sub.add_parser("sglang-bench", help="which eviction strategy to run in SGLang: a trace through SGLang's radix-cache eviction loop, "
                                             "SGLang's LRU and LFU beside kvpolicy's strategies and Belady")
    _add_trace_args(sg, model=False)  # block hits: no model's bytes in them
    sg.add_argument("--capacities-blocks", type=_capacities, default=None,
                    help="capacities in blocks, one token per block (default: 1/64 and 1/16 of the distinct blocks)")
    sg.add_argument("--strategies", type=_policy_list, default=list(SGLANG_BENCH_STRATEGIES),
                    help=f"comma-separated (default: {','.join(SGLANG_BENCH_STRATEGIES)}; also kvpolicy-gdsf, kvpolicy-lru, kvpolicy-lfu)")
    sg.add_argument("--sglang-own", action="store_true",
                    help="replay through the installed SGLang's own RadixCache (default: kvpolicy's stand-in of its loop, SGLang's tree shape)")
    sg.add_argument("--json", default=None, metavar="OUT")
    sg.add_argument("--quiet", "-q", "--no-progress", dest="no_progress", action="store_true", help="no progress on stderr")
    sg.set_defaults(func=_cmd_sglang_bench)

    pb = sub.add_parser("publish-bench", help="bytes each publish policy writes vs bytes re-read by other replicas, beside the oracle")
    _add_trace_args(pb)
    pb.add_argument("--policies", type=_policy_list, default=["all", "never", "threshold-2", "threshold-3", "threshold-4", "boundary", "reuse-aware", "structure-aware",
                                                             "dueling"],
                    help="comma-separated; compose with + (e.g. boundary+reuse-aware); your own filter: MODULE:CLASS or PATH.py:CLASS")
    pb.add_argument("--replicas", type=_replicas, default=8)
    pb.add_argument("--routing", choices=["random", "round-robin", "prefix-affinity"], default="round-robin")
    pb.add_argument("--pool-capacity-blocks", type=_pool_capacity, default="compare",
                    help="blocks the LRU pool holds: a positive int, 'compare' (default: the pool kvpolicy compare gives the trace, a "
                         "quarter of its distinct blocks) or 'infinite' (where issue #20's goals were measured)")
    pb.add_argument("--profile", default=None, help="measured profile CSV for recompute seconds (default: an order-of-magnitude model)")
    pb.add_argument("--allow-mismatch", action="store_true", help="use a --profile whose measured KV bytes/token differs from the model's by more than 10%%")
    pb.add_argument("--write-gbps", type=_positive_float, default=100.0, help="pool write bandwidth for the reuse-aware cost (default 100)")
    pb.add_argument("--judge-second-half", action="store_true",
                    help="a held-out split: every filter learns over the whole trace but only writes and re-reads of the second half's requests count")
    pb.add_argument("--json", default=None, metavar="OUT")
    pb.add_argument("--quiet", "-q", "--no-progress", dest="no_progress", action="store_true", help="no progress on stderr (default: a progress bar on a terminal, one line per finished unit elsewhere)")
    _add_sweep_args(pb)
    pb.set_defaults(func=_cmd_publish_bench)

    w = sub.add_parser("plan-warmup", help="schedule loads of measured hot prefixes into new replicas within caps and bandwidth")
    w.add_argument("source", nargs="?", default=None, help="trace (JSONL) or HOT.json; default: a built-in synthetic preset")
    w.add_argument("--preset", default="mixed")
    w.add_argument("--seed", type=_seed, default=0)
    w.add_argument("--block-size", type=_block_size, default=None)
    w.add_argument("--config", default=None)
    w.add_argument("--kv-dtype", default=None)
    w.add_argument("--bytes-per-token", type=_bytes_per_token_int, default=None)
    w.add_argument("--profile", default=None, help="measured profile CSV for recompute seconds")
    w.add_argument("--allow-mismatch", action="store_true", help="use a --profile whose measured KV bytes/token differs from the model's by more than 10%%")
    w.add_argument("--replicas", type=_replicas, required=True)
    w.add_argument("--window-s", type=_positive_float, required=True)
    w.add_argument("--bandwidth-gbps", type=_positive_float, required=True, help="useful link bandwidth, Gbit/s")
    w.add_argument("--current-load-gbps", type=_non_negative_float, default=0.0)
    w.add_argument("--max-loads-per-replica", type=_ints_upto(MAX_THREADS), default=2)
    w.add_argument("--max-loads-pool", type=_ints_upto(MAX_REPLICAS * MAX_THREADS), default=8)
    w.add_argument("--min-access-count", type=_ints_upto(MAX_SEED, low=0), default=2, help="only prefixes used by at least this many requests are planned")
    w.add_argument("--max-prefixes", type=_ints_upto(10**6), default=64)
    w.add_argument("--readiness-share", type=_non_negative_float, default=0.9)
    w.add_argument("--json", action="store_true")
    w.set_defaults(func=_cmd_plan_warmup)

    from ..sim import POLICY_SETS, ROUTERS

    cp = sub.add_parser("compare", help="simulate a cluster: kvpolicy beside vllm-like, sglang-like, lmcache-like, recompute-only and the oracle")
    _add_trace_args(cp)
    cp.add_argument("--scenario", choices=["steady", "scale-out", "spike", "degraded", "all"], default="all", help="load view (default all)")
    cp.add_argument("--policies", type=_policy_list, default=None, help=f"comma-separated policy sets (default {','.join(POLICY_SETS)}); your own: PATH.py:NAME or MODULE:NAME naming a kvpolicy.sim.PolicySet")
    cp.add_argument("--profile", default=None, help="measured profile CSV for prefill times (default: an order-of-magnitude model)")
    cp.add_argument("--allow-overload", action="store_true", help="simulate even when the offered prefill load exceeds the cluster's capacity with an infinite cache")
    cp.add_argument("--allow-mismatch", action="store_true", help="use a --profile whose measured KV bytes/token differs from the model's by more than 10%%")
    cp.add_argument("--replicas", type=_replicas, default=8)
    cp.add_argument("--router", choices=list(ROUTERS), default="round-robin", help="request router (default round-robin)")
    cp.add_argument("--local-kv-gib", type=_gib, default=28.0, help="local KV per replica, GiB, after reserved and fragmentation (default 28 = analyze's 32 GiB physical less 5%%+5%%, rounded); running decodes pin their blocks in it during the run, so no decode share is taken off up front")
    cp.add_argument("--storage-nodes", type=_replicas, default=4)
    cp.add_argument("--pool-share", type=_non_negative_float, default=0.25, help="pool capacity as a share of the trace's distinct KV bytes (default 0.25)")
    cp.add_argument("--node-gbps", type=_non_negative_float, default=40.0, help="useful bandwidth per storage node, Gbit/s (default 40)")
    cp.add_argument("--replica-gbps", type=_non_negative_float, default=40.0, help="useful NIC bandwidth per replica, Gbit/s (default 40)")
    cp.add_argument("--stage-gbps", type=_positive_float, default=None, help="staging copy through CPU memory, Gbit/s (default: direct path)")
    cp.add_argument("--failure-rate", type=_non_negative_float, default=0.0, help="probability a transfer fails outside degradation windows (default 0)")
    cp.add_argument("--timeout-rate", type=_non_negative_float, default=0.0, help="probability a transfer hangs until it times out (default 0)")
    cp.add_argument("--compute-factor", type=_positive_float, default=1.0,
                    help="the replicas' real prefill over the profile's, which kvpolicy's controller is given as its prior and "
                         "learns from the prefills it times (default 1; 2: GPUs twice as slow as profiled; 0.5: twice as fast)")
    cp.add_argument("--link-prior-factor", type=_positive_float, default=1.0,
                    help="kvpolicy's controller's prior for the links' bandwidth over the real one; it learns B_eff from the "
                         "transfers it admits (default 1; 4: it is told links 4x faster than they are)")
    cp.add_argument("--controller-scope", choices=["cluster", "replica"], default=None,
                    help="kvpolicy's admission controller: one for the cluster (the preset: it hears every replica) or one per "
                         "replica, as an engine process embeds it")
    cp.add_argument("--prefill-slots", type=_ints_upto(MAX_THREADS), default=1, help="concurrent prefills per replica (default 1)")
    cp.add_argument("--decode-tokens-per-s", type=_positive_float, default=30.0, help="decode rate per request (default 30)")
    cp.add_argument("--judge-second-half", action="store_true",
                    help="a held-out split: every set learns over the whole trace, only the second half's requests (and bytes "
                         "written from its start) are counted")
    cp.add_argument("--json", default=None, metavar="OUT", help="write every run as JSON")
    cp.add_argument("--plot", default=None, metavar="DIR", help="write PNG figures (needs matplotlib)")
    cp.add_argument("--quiet", "-q", "--no-progress", dest="no_progress", action="store_true", help="no progress on stderr (default: a progress bar on a terminal, one line per finished unit elsewhere)")
    _add_sweep_args(cp)
    cp.set_defaults(func=_cmd_compare)

    pr = sub.add_parser("profile", help="measure bytes/token, cold prefill, local-hit TTFT and remote load on an engine (the reference engine by default)")
    pr.add_argument("--lengths", type=_token_lengths, default=[1024, 2048, 4096, 8192], help="prefix lengths in tokens (default 1024,2048,4096,8192)")
    pr.add_argument("--concurrency", type=_ints_upto(MAX_THREADS, many=True), default=[1, 4], help="concurrency levels (default 1,4; 1 is always measured)")
    pr.add_argument("--repeats", type=_ints_upto(10**5), default=5, help="runs per measurement alone (default 5)")
    pr.add_argument("--tail-tokens", type=_ints_upto(MAX_PROMPT_TOKENS), default=16, help="new tokens after the prefix (default 16)")
    _reference_model_args(pr)
    pr.add_argument("--seed", type=_seed, default=0)
    pr.add_argument("--out", default=None, metavar="CSV", help="write the profile CSV (prefix_tokens,kv_bytes,cold_prefill_ms,local_hit_ttft_ms,...)")
    pr.add_argument("--json", action="store_true", help="print the report as JSON")
    pr.add_argument("--plot", default=None, metavar="DIR")
    pr.add_argument("--quiet", "-q", "--no-progress", dest="no_progress", action="store_true", help="no progress on stderr (default: a progress bar on a terminal, one line per finished unit elsewhere)")
    pr.add_argument("--gguf", default=None, metavar="FILE", help="profile llama.cpp (llama-cpp-python) running this GGUF model in-process "
                                                                  "instead; with --openai-url, the served model's file (its KV bytes)")
    pr.add_argument("--threads", type=_ints_upto(MAX_THREADS), default=2, help="with --gguf: llama.cpp threads per context (default 2)")
    pr.add_argument("--openai-url", default=None, metavar="URL", help="profile an OpenAI-compatible server (vLLM, SGLang, TGI, kvpolicy serve-reference) instead")
    pr.add_argument("--model", default=None, help="with --openai-url: the served model's name")
    pr.add_argument("--config", default=None, help="with --openai-url: model config for KV bytes when the server's /metrics does not give them")
    pr.add_argument("--kv-dtype", default=None)
    pr.add_argument("--bytes-per-token", type=_bytes_per_token_int, default=None, help="with --openai-url: KV bytes per token instead of --config")
    pr.add_argument("--prompt-format", choices=["ids", "text"], default="ids",
                    help="with --openai-url: send token ids (default) or text of one-token words, counted by the server's tokenizer "
                         "(llama-cpp-python's server takes text only)")
    pr.add_argument("--api-key-env", default=None, metavar="VAR", help="with --openai-url: environment variable holding the API key")
    pr.set_defaults(func=_cmd_profile)

    sr = sub.add_parser("serve-reference", help="serve the reference engine over an OpenAI-compatible HTTP API (for kvpolicy profile --openai-url)")
    sr.add_argument("--host", default="127.0.0.1")
    sr.add_argument("--port", type=_port, default=8000)
    sr.add_argument("--model-name", default="kvpolicy-reference")
    sr.add_argument("--capacity-blocks", type=_ints_upto(MAX_CAPACITY_BLOCKS), default=16384)
    _reference_model_args(sr)
    sr.add_argument("--verbose", action="store_true", help="log every request")
    sr.set_defaults(func=_cmd_serve_reference)

    dg = sub.add_parser("diagnose", help="find misses caused by nondeterministic prompt assembly; explain one request's misses")
    dg.add_argument("trace", help="token trace (JSONL with raw token ids)")
    dg.add_argument("--block-size", type=_block_size, default=None, help="block size in tokens (default 16)")
    dg.add_argument("--min-shared", type=_non_negative_float, default=0.8, help="share of content a request must share with an earlier one (default 0.8)")
    dg.add_argument("--request", default=None, help="explain this request: its id, or #N for the N-th request (from 0) when several share an id")
    dg.add_argument("--capacity-blocks", type=_ints_upto(MAX_CAPACITY_BLOCKS), default=None, help="with --request: replay an LRU cache of this size to find evictions")
    dg.add_argument("--sort", action="store_true")
    dg.add_argument("--skip-bad-lines", action="store_true")
    dg.add_argument("--json", default=None, metavar="OUT")
    dg.set_defaults(func=_cmd_diagnose)
    return p


def _check_outputs(args: argparse.Namespace) -> None:
    """Refuse an output path that cannot be written before any work is done (not after a long run)."""
    for flag in ("json", "out", "plot"):
        v = getattr(args, flag, None)
        if not isinstance(v, str) or not v:
            continue
        p = Path(v)
        parent = p.parent
        if not parent.is_dir():
            raise ConfigError(f"--{flag}", f"{v}: cannot write there ({parent} is not a directory)")
        if flag == "plot" and p.exists() and not p.is_dir():
            raise ConfigError("--plot", f"{v}: is a file, expected a directory for the plots")
        if flag != "plot" and p.is_dir():
            raise ConfigError(f"--{flag}", f"{v}: is a directory, expected a file")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error, already printed on one line (2)
        return exc.code if isinstance(exc.code, int) else 2
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        _check_outputs(args)
        return int(args.func(args))
    except KVPolicyError as exc:
        print(f"kvpolicy {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except UnicodeDecodeError as exc:  # a binary or non-UTF-8 file where text was expected
        print(f"kvpolicy {args.command}: error: a file is not UTF-8 text ({exc.reason} at byte {exc.start})", file=sys.stderr)
        return 2
    except OSError as exc:  # a directory where a file was expected, a missing or unreadable file, a full disk
        where = f"{exc.filename}: " if getattr(exc, "filename", None) else ""
        print(f"kvpolicy {args.command}: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # pragma: no cover - e.g. `kvpolicy keys ... | head`
        return 0
    except MemoryError:
        print(f"kvpolicy {args.command}: error: not enough memory for these settings (a capacity, length or count too large?)", file=sys.stderr)
        return 2
