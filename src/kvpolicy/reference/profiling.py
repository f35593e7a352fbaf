"""``kvpolicy profile``: the brief's minimal measurement, on any :class:`~kvpolicy.protocols.ProfileTarget`.

For each prefix length: the allocated KV bytes; cold prefill; TTFT with the
prefix cached locally; TTFT with about half of it cached (targets with a
``cache_granule_tokens``: what fits the prefill model's cross term); the prefix's blocks loaded from another replica (lookup,
transfer, staging copy, install) — alone and under each concurrency level,
repeated for p50 and p95. The result is a profile CSV the foundation's reader
takes (``prefix_tokens,kv_bytes,cold_prefill_ms,local_hit_ttft_ms`` from the
runs alone, at p50, plus p95 and remote-load columns and one set of columns per
concurrency level), the measured byte slope (which must equal the geometry
formula), and the break-even prefix on this machine: the shortest prefix whose
**p95** remote load is below the **p50** cold prefill.
"""

from __future__ import annotations

import math
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..profile import HALF_HIT_COLUMNS, TAIL_COLUMN, MeasuredProfile, describe_prefill
from .model import ModelConfig


class ReferenceProfileTarget:
    """The reference engine as a ProfileTarget, with a peer replica in another process
    serving the prefix's blocks over TCP for the remote-load measurement."""

    def __init__(self, config: ModelConfig | None = None, *, block_size_tokens: int = 16, max_prefix_tokens: int = 8192, seed: int = 0) -> None:
        from .replica import PeerReplica

        self.config = config or ModelConfig()
        self.B = block_size_tokens
        rng = np.random.default_rng(seed)
        self.base = rng.integers(0, self.config.vocab_size, max_prefix_tokens).astype(np.int64)
        self.capacity_blocks = 2 * (max_prefix_tokens // block_size_tokens) + 64
        self._secret = secrets.token_bytes(32)  # this measurement's own deployment: the peer and the profiler share it
        self.peer = PeerReplica.start(self.config, secret=self._secret, block_size_tokens=block_size_tokens, capacity_blocks=self.capacity_blocks)
        # the peer computes and publishes every full block of the longest prefix, served before we measure
        self.peer.prefill(self.base, wait_published=True)
        self._local = threading.local()
        self._seed = seed
        self._n = 0
        self._lock = threading.Lock()

    def _engine(self) -> Any:
        from .engine import ReferenceEngine
        from .transport import PeerClient

        e = getattr(self._local, "engine", None)
        if e is None:
            peer = PeerClient(self.peer.address, self.peer.namespace_digest, secret=self._secret, block_bytes=self.config.block_bytes(self.B),
                              name="peer", timeout_s=30.0)
            e = ReferenceEngine(self.config, block_size_tokens=self.B, capacity_blocks=self.capacity_blocks, peers=[peer], replica="profiler",
                                secret=self._secret)
            self._local.engine = e
            with self._lock:
                self._n += 1
                self._local.rng = np.random.default_rng(self._seed + 1000 * self._n)
        return e

    def _prefix(self, prefix_tokens: int) -> np.ndarray:
        if prefix_tokens % self.B or not 0 < prefix_tokens <= self.base.size:
            raise ConfigError("--lengths", f"{prefix_tokens}: prefix lengths must be multiples of the block size {self.B} up to {self.base.size}")
        return self.base[:prefix_tokens]

    def _tail(self, n: int) -> np.ndarray:
        return self._local.rng.integers(0, self.config.vocab_size, n).astype(np.int64)

    def kv_bytes(self, prefix_tokens: int) -> int:
        e = self._engine()
        e.reset()
        e.prefill(self._prefix(prefix_tokens), publish=False)
        return e.allocated_kv_bytes()

    def cold_prefill_s(self, prefix_tokens: int, tail_tokens: int) -> float:
        e = self._engine()
        e.reset()
        prompt = np.concatenate([self._prefix(prefix_tokens), self._tail(tail_tokens)])
        t0 = time.perf_counter()
        e.prefill(prompt, publish=False)
        return time.perf_counter() - t0

    @property
    def cache_granule_tokens(self) -> int:
        return self.B

    def local_hit_ttft_s(self, prefix_tokens: int, tail_tokens: int, cached_tokens: int | None = None) -> float:
        """The prefix plus a new tail, with the prefix's first ``cached_tokens`` (all of it by
        default; whole blocks) cached locally by an earlier request."""
        e = self._engine()
        e.reset()
        pre = self._prefix(prefix_tokens)
        cached = prefix_tokens if cached_tokens is None else cached_tokens
        if cached % self.B or not 0 <= cached <= prefix_tokens:
            raise ConfigError("cached_tokens", f"{cached}: must be whole blocks of {self.B} tokens, at most the prefix's {prefix_tokens}")
        if cached:
            e.prefill(np.concatenate([pre[:cached], self._tail(tail_tokens)]), publish=False)
        prompt = np.concatenate([pre, self._tail(tail_tokens)])
        t0 = time.perf_counter()
        r = e.prefill(prompt, publish=False)
        dt = time.perf_counter() - t0
        if r.local_blocks != cached // self.B:
            raise RuntimeError(f"expected a local hit of {cached // self.B} blocks, got {r.local_blocks}")
        return dt

    def remote_load(self, prefix_tokens: int) -> dict[str, float]:
        e = self._engine()
        e.reset()
        keys = list(e.hasher.hash_blocks(self._prefix(prefix_tokens)))
        peer = e.peers[0]
        t0 = time.perf_counter()
        n = peer.match_prefix(keys)
        lookup = time.perf_counter() - t0
        if n != len(keys):
            raise RuntimeError(f"the peer holds {n} of {len(keys)} blocks")
        t = e.load_remote(peer, keys, None, timeout_s=60.0)
        for k in keys:
            e.policy.unpin(k)
        return {"lookup_s": lookup, "transfer_s": t["transfer_s"], "stage_s": t["stage_s"], "install_s": t["install_s"],
                "total_s": lookup + t["transfer_s"] + t["stage_s"] + t["install_s"]}

    def close(self) -> None:
        self.peer.close()


def _q(xs: Sequence[float], q: float) -> float:
    return float(np.quantile(np.asarray(xs, dtype=np.float64), q))


def _concurrent(fn: Callable[[], Any], c: int) -> list[Any]:
    """Run ``fn`` in ``c`` threads released together; results in thread order."""
    if c == 1:
        return [fn()]
    out: list[Any] = [None] * c
    errors: list[BaseException] = []
    barrier = threading.Barrier(c)

    def run(i: int) -> None:
        try:
            barrier.wait()
            out[i] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(c)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]
    return out


def run_profile(target: Any, lengths: Sequence[int], concurrency: Sequence[int] = (1,), *, repeats: int = 5, tail_tokens: int = 16,
                progress: Callable[[str], None] | None = None, expected_bytes_per_token: int | None = None) -> tuple[MeasuredProfile, dict[str, Any]]:
    """Measure ``target``; returns the profile (readable by :func:`kvpolicy.profile.read_profile`) and a report."""
    lengths = sorted(int(x) for x in lengths)
    if not lengths or any(x <= 0 for x in lengths) or len(set(lengths)) != len(lengths):
        raise ConfigError("--lengths", f"need distinct positive prefix lengths, got {lengths}")
    conc = sorted(set(int(c) for c in concurrency) | {1})
    if any(c <= 0 for c in conc):
        raise ConfigError("--concurrency", f"must be positive, got {list(concurrency)}")
    if repeats < 2:
        raise ConfigError("--repeats", f"need at least 2 to give a p95, got {repeats}")
    step = progress or (lambda _m: None)
    has_remote = getattr(target, "has_remote", True)  # an OpenAI endpoint cannot load from another replica
    step("warm-up")
    target.cold_prefill_s(lengths[0], tail_tokens)
    target.local_hit_ttft_s(lengths[0], tail_tokens)
    if has_remote:
        target.remote_load(lengths[0])
    kv = []
    for L in lengths:
        step(f"kv bytes at {L} tokens")
        kv.append(int(target.kv_bytes(L)))
    rows: dict[int, dict[int, dict[str, list[float]]]] = {c: {} for c in conc}
    granule = getattr(target, "cache_granule_tokens", None)  # half hits: about half of each prefix, whole granules, cached
    half_cached = {L: (L // 2 // granule) * granule for L in lengths} if isinstance(granule, int) and granule > 0 else None
    for c in conc:
        rounds = repeats if c == 1 else max(2, math.ceil(repeats / c))
        for L in lengths:
            cold: list[float] = []
            local: list[float] = []
            half: list[float] = []
            remote: list[dict[str, float]] = []
            for r in range(rounds):
                step(f"concurrency {c}, {L} tokens, round {r + 1}/{rounds}")
                cold += _concurrent(lambda: target.cold_prefill_s(L, tail_tokens), c)
                local += _concurrent(lambda: target.local_hit_ttft_s(L, tail_tokens), c)
                if half_cached is not None and c == 1:
                    half.append(target.local_hit_ttft_s(L, tail_tokens, cached_tokens=half_cached[L]))
                if has_remote:
                    remote += _concurrent(lambda: target.remote_load(L), c)
            rows[c][L] = {"cold": cold, "local": local, "half": half, "remote": [x["total_s"] for x in remote],
                          **{k: [x[k] for x in remote] for k in ("lookup_s", "transfer_s", "stage_s", "install_s")}}
    one = rows[1]
    extra: dict[str, np.ndarray] = {}

    def col(name: str, values: list[float]) -> None:
        extra[name] = np.asarray(values, dtype=np.float64)

    col("cold_prefill_p95_ms", [_q(one[L]["cold"], 0.95) * 1e3 for L in lengths])
    col("local_hit_ttft_p95_ms", [_q(one[L]["local"], 0.95) * 1e3 for L in lengths])
    col(TAIL_COLUMN, [float(tail_tokens)] * len(lengths))  # every row is then fitted as the prefill it ran
    if half_cached is not None:
        col(HALF_HIT_COLUMNS[0], [float(half_cached[L]) for L in lengths])
        col(HALF_HIT_COLUMNS[1], [_q(one[L]["half"], 0.5) * 1e3 for L in lengths])
    if has_remote:
        col("remote_load_p50_ms", [_q(one[L]["remote"], 0.5) * 1e3 for L in lengths])
        col("remote_load_p95_ms", [_q(one[L]["remote"], 0.95) * 1e3 for L in lengths])
        for part in ("lookup_s", "transfer_s", "stage_s", "install_s"):
            col(f"remote_{part[:-2]}_p50_ms", [_q(one[L][part], 0.5) * 1e3 for L in lengths])
    kinds = (("cold_prefill", "cold"), ("local_hit_ttft", "local")) + ((("remote_load", "remote"),) if has_remote else ())
    for c in conc:
        if c == 1:
            continue
        for name, key in kinds:
            col(f"{name}_c{c}_p50_ms", [_q(rows[c][L][key], 0.5) * 1e3 for L in lengths])
            col(f"{name}_c{c}_p95_ms", [_q(rows[c][L][key], 0.95) * 1e3 for L in lengths])
    prof = MeasuredProfile(
        prefix_tokens=np.asarray(lengths, dtype=np.int64), kv_bytes=np.asarray(kv, dtype=np.float64),
        cold_prefill_ms=np.asarray([_q(one[L]["cold"], 0.5) * 1e3 for L in lengths]),
        local_hit_ttft_ms=np.asarray([_q(one[L]["local"], 0.5) * 1e3 for L in lengths]), extra=extra, source="kvpolicy profile",
    )
    slope = prof.bytes_per_token if len(prof) >= 2 else kv[0] / lengths[0]
    breakeven = next((L for i, L in enumerate(lengths) if extra["remote_load_p95_ms"][i] < prof.cold_prefill_ms[i]), None) if has_remote else None
    report = {
        "lengths": lengths, "concurrency": conc, "repeats": repeats, "tail_tokens": tail_tokens,
        "kv_bytes": kv, "measured_bytes_per_token": slope, "formula_bytes_per_token": expected_bytes_per_token,
        "slope_matches_formula": None if expected_bytes_per_token is None else bool(abs(slope - expected_bytes_per_token) < 1e-6 * expected_bytes_per_token),
        "breakeven_prefix_tokens": breakeven, "has_remote": has_remote, "prefill_model": prof.prefill_model().to_dict(),
        "rows": [{"prefix_tokens": L, "concurrency": c, "cold_prefill_p50_ms": _q(rows[c][L]["cold"], 0.5) * 1e3,
                  "cold_prefill_p95_ms": _q(rows[c][L]["cold"], 0.95) * 1e3, "local_hit_ttft_p50_ms": _q(rows[c][L]["local"], 0.5) * 1e3,
                  "local_hit_ttft_p95_ms": _q(rows[c][L]["local"], 0.95) * 1e3,
                  "half_hit_cached_tokens": half_cached[L] if half_cached is not None and c == 1 else None,
                  "half_hit_ttft_p50_ms": _q(rows[c][L]["half"], 0.5) * 1e3 if half_cached is not None and c == 1 else None,
                  "remote_load_p50_ms": _q(rows[c][L]["remote"], 0.5) * 1e3 if has_remote else None,
                  "remote_load_p95_ms": _q(rows[c][L]["remote"], 0.95) * 1e3 if has_remote else None, "samples": len(rows[c][L]["cold"])}
                 for c in conc for L in lengths],
    }
    return prof, report


def render(report: dict[str, Any]) -> str:
    lines = [f"{'prefix':>7} {'conc':>4} {'cold p50':>9} {'cold p95':>9} {'local p50':>10} {'half-hit p50 (cached)':>21} {'remote p50':>11} {'remote p95':>11}  (ms)  samples"]
    for r in report["rows"]:
        rp50 = "-" if r["remote_load_p50_ms"] is None else f"{r['remote_load_p50_ms']:.2f}"
        rp95 = "-" if r["remote_load_p95_ms"] is None else f"{r['remote_load_p95_ms']:.2f}"
        half = "-" if r.get("half_hit_ttft_p50_ms") is None else f"{r['half_hit_ttft_p50_ms']:.1f} ({r['half_hit_cached_tokens']:,})"
        lines.append(f"{r['prefix_tokens']:>7} {r['concurrency']:>4} {r['cold_prefill_p50_ms']:>9.1f} {r['cold_prefill_p95_ms']:>9.1f} "
                     f"{r['local_hit_ttft_p50_ms']:>10.2f} {half:>21} {rp50:>11} {rp95:>11}        {r['samples']}")
    f = report["formula_bytes_per_token"]
    lines.append("")
    lines.append(f"byte slope       {report['measured_bytes_per_token']:,.1f} bytes/token measured"
                 + ("" if f is None else f"; formula 2 x L x Hkv x D x q = {f:,} ({'equal' if report['slope_matches_formula'] else 'DIFFERENT'})"))
    if report.get("prefill_model") is not None:
        lines += describe_prefill(report["prefill_model"])
    be = report["breakeven_prefix_tokens"]
    if not report.get("has_remote", True):
        lines.append("break-even       not measured: this target cannot load from another replica; run kvpolicy breakeven --profile with your link")
    else:
        lines.append("break-even       " + (f"{be:,} tokens: from here p95 remote load < p50 cold prefill on this machine" if be is not None
                                           else "none of the measured prefixes: p95 remote load never beats p50 cold prefill here"))
    return "\n".join(lines)


def figure(report: dict[str, Any], out_dir: Any) -> Any:
    from pathlib import Path

    from ..plots import _plt, save_figure

    plt = _plt()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for c in report["concurrency"]:
        rs = [r for r in report["rows"] if r["concurrency"] == c]
        x = [r["prefix_tokens"] for r in rs]
        style = "-" if c == 1 else "--"
        ax.plot(x, [r["cold_prefill_p50_ms"] for r in rs], style, marker="o", label=f"cold prefill p50 (x{c})")
        if report.get("has_remote", True):
            ax.plot(x, [r["remote_load_p95_ms"] for r in rs], style, marker="s", label=f"remote load p95 (x{c})")
        ax.plot(x, [r["local_hit_ttft_p50_ms"] for r in rs], style, marker="^", label=f"local-hit TTFT p50 (x{c})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prefix tokens")
    ax.set_ylabel("ms")
    ax.set_title("measured profile (reference engine)")
    ax.legend(fontsize=7)
    return save_figure(plt, fig, out / "profile.png")
