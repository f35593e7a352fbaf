"""Seeded synthetic traces with controllable, realistic reuse.

A request's prompt is a stack of segments, shared content first::

    system prompt (per app) → [tool definitions (agent apps)] → [documents (RAG)]
    → session history (immutable, grows each turn) → new user message (unique)

* apps belong to tenants; tenants never share blocks (one namespace each);
* documents come from a pool with Zipf popularity;
* sessions are multi-turn: each turn appends the previous user message and the
  assistant's answer (and, for agents, a tool result) to the history;
* sessions start as a Poisson process with bursts (rate × ``burst_factor`` during
  bursts); turns follow after a think time.

Tokens are real arrays (seeded per segment), hashed into chained block keys with
kvpolicy's ``fast`` hasher, so traces are exact about prefix identity and can be
written as Mooncake JSONL or token JSONL. ``publish_boundary_tokens`` marks where
shared content ends and private history begins.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from .._validate import non_negative_int as _seed
from .._validate import positive_int as _pos_int
from .._validate import positive_number as _pos
from ..errors import ConfigError
from ..keys import BlockHasher, Namespace
from .model import Trace, canonicalize

KINDS = ("chat", "rag", "agent")
#: a session's mean number of turns, per kind (geometric)
TURNS_MEAN = {"chat": 4.0, "rag": 1.5, "agent": 8.0}


def _turns(v: Any) -> Any:
    """``turns_mean`` overrides the kinds it names; the others keep theirs (a dict naming only chat made RAG and agent
    sessions single-turn without a word)."""
    return {**TURNS_MEAN, **v} if isinstance(v, dict) else v
#: seconds a session waits per output token before its user starts thinking: the next turn comes
#: ``output_tokens × DECODE_S_PER_TOKEN + Exp(think_time_s)`` after the last one
DECODE_S_PER_TOKEN = 0.02


def _zipf_exponent(inst: Any, a: attrs.Attribute, v: Any) -> None:
    """A Zipf law over documents needs an exponent above 1 (at 1 or below its sum diverges: numpy refuses to draw it)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 1:
        raise ConfigError(a.name, f"must be a finite number > 1 (a Zipf exponent), got {v!r}")


def _range(inst: Any, a: attrs.Attribute, v: Any) -> None:
    if not (isinstance(v, tuple) and len(v) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in v) and 0 <= v[0] <= v[1]):
        raise ConfigError(a.name, f"must be a (min, max) pair of ints with 0 <= min <= max, got {v!r}")


@attrs.frozen
class SyntheticSpec:
    n_requests: int = attrs.field(default=4000, validator=_pos_int)
    block_size_tokens: int = attrs.field(default=64, validator=_pos_int)
    mix: tuple[tuple[str, float], ...] = (("chat", 0.5), ("rag", 0.3), ("agent", 0.2))
    rate_per_s: float = attrs.field(default=4.0, validator=_pos)
    burst_every_s: float = attrs.field(default=300.0, validator=_pos)
    burst_duration_s: float = attrs.field(default=30.0, validator=_pos)
    burst_factor: float = attrs.field(default=4.0, validator=_pos)
    n_tenants: int = attrs.field(default=3, validator=_pos_int)
    apps_per_kind: int = attrs.field(default=4, validator=_pos_int)
    system_prompt_tokens: tuple[int, int] = attrs.field(default=(500, 3000), validator=_range)
    tool_tokens: tuple[int, int] = attrs.field(default=(2000, 6000), validator=_range)
    n_docs: int = attrs.field(default=2000, validator=_pos_int)
    doc_zipf: float = attrs.field(default=1.1, validator=_zipf_exponent)
    doc_tokens: tuple[int, int] = attrs.field(default=(300, 2500), validator=_range)
    docs_per_request: tuple[int, int] = attrs.field(default=(1, 4), validator=_range)
    turns_mean: dict[str, float] = attrs.field(factory=lambda: dict(TURNS_MEAN), converter=_turns)
    user_tokens: tuple[int, int] = attrs.field(default=(20, 400), validator=_range)
    output_tokens: tuple[int, int] = attrs.field(default=(50, 600), validator=_range)
    tool_output_tokens: tuple[int, int] = attrs.field(default=(100, 1500), validator=_range)
    think_time_s: float = attrs.field(default=20.0, validator=_pos)
    vocab: int = attrs.field(default=128_000, validator=_pos_int)
    seed: int = attrs.field(default=0, validator=_seed)

    def __attrs_post_init__(self) -> None:
        pairs = self.mix if isinstance(self.mix, (tuple, list)) else ()
        if (not pairs or any(not (isinstance(p, (tuple, list)) and len(p) == 2) for p in pairs)
                or any(k not in KINDS or isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0 for k, w in pairs)
                or sum(w for _, w in pairs) <= 0):
            raise ConfigError("mix", f"must be (kind, weight) pairs over {KINDS} with positive total weight, got {self.mix!r}")
        if not isinstance(self.turns_mean, dict) or any(k not in KINDS for k in self.turns_mean) or any(
                isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 1 for v in self.turns_mean.values()):
            raise ConfigError("turns_mean", f"must map kinds of {KINDS} to a mean number of turns >= 1, got {self.turns_mean!r}")


PRESETS: dict[str, dict[str, Any]] = {
    "chat": {"mix": (("chat", 1.0),)},
    "rag": {"mix": (("rag", 1.0),)},
    "agent": {"mix": (("agent", 1.0),), "rate_per_s": 2.0},
    "mixed": {},
}


def preset(name: str, **overrides: Any) -> SyntheticSpec:
    if name not in PRESETS:
        raise ConfigError("preset", f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    return SyntheticSpec(**{**PRESETS[name], **overrides})


class _Segments:
    """Deterministic token arrays per segment key."""

    def __init__(self, seed: int, vocab: int) -> None:
        self.seed = seed
        self.vocab = vocab
        self.cache: dict[tuple[int, ...], np.ndarray] = {}

    def get(self, key: tuple[int, ...], length: int, cache: bool = True) -> np.ndarray:
        arr = self.cache.get(key) if cache else None
        if arr is None:
            arr = np.random.default_rng([self.seed, *key]).integers(0, self.vocab, length, dtype=np.uint32)
            if cache:
                self.cache[key] = arr
        return arr


def _arrivals(spec: SyntheticSpec, rng: np.random.Generator, n: int) -> np.ndarray:
    """n session start times: Poisson with bursts (thinning)."""
    lam_max = spec.rate_per_s * spec.burst_factor
    out: list[float] = []
    t = 0.0
    burst_start = rng.exponential(spec.burst_every_s)
    while len(out) < n:
        t += rng.exponential(1.0 / lam_max)
        while t > burst_start + spec.burst_duration_s:
            burst_start += spec.burst_duration_s + rng.exponential(spec.burst_every_s)
        lam = lam_max if burst_start <= t else spec.rate_per_s
        if rng.random() * lam_max < lam:
            out.append(t)
    return np.asarray(out)


def generate(spec: SyntheticSpec | str = "mixed", *, keep_tokens: bool = False) -> Trace:
    """Generate a trace from a spec (or a preset name)."""
    if isinstance(spec, str):
        spec = preset(spec)
    rng = np.random.default_rng(spec.seed)
    seg = _Segments(spec.seed, spec.vocab)
    kinds = [k for k, _ in spec.mix]
    weights = np.asarray([w for _, w in spec.mix], dtype=np.float64)
    weights /= weights.sum()
    # apps: (kind index, app index) -> tenant, system prompt length, tool length
    apps: dict[tuple[int, int], tuple[int, int, int]] = {}
    for ki, _ in enumerate(KINDS):
        for a in range(spec.apps_per_kind):
            apps[(ki, a)] = (
                int(rng.integers(0, spec.n_tenants)),
                int(rng.integers(spec.system_prompt_tokens[0], spec.system_prompt_tokens[1] + 1)),
                int(rng.integers(spec.tool_tokens[0], spec.tool_tokens[1] + 1)),
            )
    doc_len = rng.integers(spec.doc_tokens[0], spec.doc_tokens[1] + 1, spec.n_docs)
    mean_turns = float(sum(w * spec.turns_mean[k] for k, w in zip(kinds, weights)))
    n_sessions = int(np.ceil(spec.n_requests / max(mean_turns, 1.0) * 1.5)) + 8
    starts = _arrivals(attrs.evolve(spec, rate_per_s=spec.rate_per_s / max(mean_turns, 1.0)), rng, n_sessions)

    def rint(r: tuple[int, int]) -> int:
        return int(rng.integers(r[0], r[1] + 1))

    # plan every request: (time, session, kind, tenant, prompt segments, boundary, output)
    plans: list[tuple[float, int, int, int, list[np.ndarray], int, int]] = []
    for s_idx, t0 in enumerate(starts):
        kind = kinds[int(rng.choice(len(kinds), p=weights))]
        ki = KINDS.index(kind)
        app = int(rng.integers(0, spec.apps_per_kind))
        tenant, sys_len, tool_len = apps[(ki, app)]
        shared = [seg.get((1, ki, app), sys_len)]
        if kind == "agent":
            shared.append(seg.get((2, ki, app), tool_len))
        turns = 1 + int(rng.geometric(1.0 / spec.turns_mean[kind])) - 1 if spec.turns_mean[kind] > 1 else 1
        history: list[np.ndarray] = []
        t = float(t0)
        for turn in range(turns):
            segs = list(shared)
            if kind == "rag":
                k_docs = rint(spec.docs_per_request)
                docs = sorted({int(d) % spec.n_docs for d in rng.zipf(spec.doc_zipf, k_docs) - 1})
                segs += [seg.get((3, d), int(doc_len[d])) for d in docs]
            boundary = int(sum(x.size for x in segs))
            user = seg.get((4, s_idx, turn), rint(spec.user_tokens), cache=False)
            out_len = rint(spec.output_tokens)
            plans.append((t, s_idx, ki, tenant, segs + history + [user], boundary, out_len))
            answer = seg.get((5, s_idx, turn), out_len, cache=False)
            history = history + [user, answer]
            if kind == "agent":
                history.append(seg.get((6, s_idx, turn), rint(spec.tool_output_tokens), cache=False))
            t += out_len * DECODE_S_PER_TOKEN + rng.exponential(spec.think_time_s)
    plans.sort(key=lambda p: (p[0], p[1]))
    plans = plans[: spec.n_requests]
    if len(plans) < spec.n_requests:  # pragma: no cover - the 1.5× session margin makes this unreachable in practice
        raise ConfigError("n_requests", "generator produced too few requests; raise rate or turns")

    B = spec.block_size_tokens
    base_ns = Namespace(model_id="synthetic", model_revision="1", tokenizer_version="1", kv_dtype="bf16", block_size_tokens=B)
    hashers = {tn: BlockHasher(base_ns.evolve(tenant=f"tenant-{tn}"), "fast") for tn in range(spec.n_tenants)}
    key_ids: dict[bytes, int] = {}
    arrival, inp, outp, offsets_ids, partial, tenant_l, class_l, sess_l, bound_l = [], [], [], [], [], [], [], [], []
    toks_kept: list[np.ndarray] = []
    next_partial = 0
    for t, s_idx, ki, tenant, segs, boundary, out_len in plans:
        prompt = np.concatenate(segs)
        keys = hashers[tenant].hash_blocks(prompt)
        ids = []
        for k in keys:
            nid = key_ids.get(k)
            if nid is None:
                nid = len(key_ids)
                key_ids[k] = nid
            ids.append(nid)
        offsets_ids.append(ids)
        if prompt.size % B:
            partial.append(next_partial)
            next_partial += 1
        else:
            partial.append(-1)
        arrival.append(t)
        inp.append(prompt.size)
        outp.append(out_len)
        tenant_l.append(tenant)
        class_l.append(ki)
        sess_l.append(s_idx)
        bound_l.append(min(boundary, prompt.size))
        if keep_tokens:
            toks_kept.append(prompt)
    n = len(arrival)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum([len(x) for x in offsets_ids], out=offsets[1:])
    flat = np.fromiter((i for ids in offsets_ids for i in ids), dtype=np.int64, count=int(offsets[-1]))
    part = np.asarray(partial, dtype=np.int64)
    # partial ids: fresh ids after every full-block id (they are never hits)
    base = int(flat.max()) + 1 if flat.size else 0
    part = np.where(part >= 0, base + part, -1)
    kw: dict[str, Any] = {}
    if keep_tokens:
        tok_off = np.zeros(n + 1, dtype=np.int64)
        np.cumsum([x.size for x in toks_kept], out=tok_off[1:])
        kw.update(token_offsets=tok_off, tokens=np.concatenate(toks_kept))
    trace = Trace(
        arrival_s=np.asarray(arrival) - arrival[0], input_tokens=np.asarray(inp), output_tokens=np.asarray(outp),
        block_offsets=offsets, block_ids=flat, partial_block_ids=part, block_size_tokens=B,
        tenant=np.asarray(tenant_l), tenant_names=[f"tenant-{i}" for i in range(spec.n_tenants)],
        request_class=np.asarray(class_l), class_names=list(KINDS), session=np.asarray(sess_l),
        publish_boundary_tokens=np.asarray(bound_l), source=f"synthetic:{_spec_label(spec)}", **kw,
    )
    return canonicalize(trace)


def _spec_label(spec: SyntheticSpec) -> str:
    mix = "+".join(k for k, _ in spec.mix)
    return f"{mix},n={spec.n_requests},B={spec.block_size_tokens},seed={spec.seed}"


def write_tokens_jsonl(trace: Trace, path: str | Path) -> None:
    """Write a trace that kept its tokens as generic token JSONL."""
    if trace.tokens is None:
        raise ConfigError("tokens", "this trace has no raw tokens (generate with keep_tokens=True)")
    with open(path, "w") as f:
        for i in range(len(trace)):
            obj: dict[str, Any] = {"timestamp": float(trace.arrival_s[i]), "tokens": trace.prompt(i).tolist(), "output_length": int(trace.output_tokens[i])}
            if trace.tenant is not None:
                obj["tenant"] = trace.tenant_names[int(trace.tenant[i])]
            if trace.request_class is not None:
                obj["app"] = trace.class_names[int(trace.request_class[i])]
            if trace.session is not None:
                obj["session"] = str(int(trace.session[i]))
            obj["request_id"] = trace.request_ids[i] if trace.request_ids else str(i)
            f.write(json.dumps(obj) + "\n")
