"""The measured profile: the brief's first measurement, as a table.

CSV columns (more may follow, e.g. remote-load timings)::

    prefix_tokens,kv_bytes,cold_prefill_ms,local_hit_ttft_ms

``Δkv_bytes / Δtokens`` between neighbouring rows is the real byte slope. Cold
prefill time is fitted with a non-negative quadratic
``T_prefill(T) = a + b·T + c·T²`` (attention makes prefill superlinear), by least
squares on *relative* error so short and long prefixes weigh alike; the fit
error is reported, and the model is usable between and beyond measured points.

A prefill with part of its prompt cached costs more than the cold prefill of its
new tokens alone: each new token attends to every cached one. Two optional
columns, ``half_hit_cached_tokens,half_hit_ttft_ms`` (the row's prompt again with
about its first half cached), measure that cross term; without them it is the
one a causal-skipping attention kernel pays (see :class:`PrefillModel`). With a
``tail_tokens`` column (the new tokens after the prefix in every measured
prompt) each row is fitted as the prefill it ran and all terms at once
(:func:`fit_prefill_rows`); ``kvpolicy profile`` writes all three columns.
"""

from __future__ import annotations

import csv
import io
import itertools
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from ._validate import non_negative_number
from .errors import ConfigError, ProfileFormatError

#: the longest prefix a profile row may describe (tokens)
MAX_PREFIX_TOKENS = 2**40
REQUIRED_COLUMNS = ("prefix_tokens", "kv_bytes", "cold_prefill_ms", "local_hit_ttft_ms")
#: optional, together: the prompt of each row again, with its first ``half_hit_cached_tokens``
#: (about half, whole blocks) cached locally — what fits the cross term of :class:`PrefillModel`
HALF_HIT_COLUMNS = ("half_hit_cached_tokens", "half_hit_ttft_ms")
#: optional: the new tokens after the prefix in every measured prompt (``kvpolicy profile``'s
#: ``--tail-tokens``); with it each row is fitted as the prefill it really ran
TAIL_COLUMN = "tail_tokens"

#: a column of numbers: a sequence, or a numpy array
Floats = Sequence[float] | np.ndarray


@attrs.frozen
class PrefillModel:
    """``T_prefill(T) = a_s + b_s_per_token·T + c_s_per_token2·T²`` (seconds), and for a prefill
    of the q = end − start new tokens of [start, end) with [0, start) already cached::

        a + b·q + c·q² + x·q·start + d·start

    x (``cross``) is what each new token pays per cached token it attends to. An engine that
    skips masked work (FlashAttention's causal kernels) pays ``x = 2c``, which makes the
    marginal ``c·(end² − start²)`` — the default when x was not measured. One that computes a
    dense score block per chunk pays less or more: x is fitted from half-hit rows of the
    profile when it has them. d is what reading the cached prefix costs the engine (gathering
    its KV; 0 for engines that attend to cached pages in place), measured from local-hit rows.
    (With the profile's tail known, every term is fitted from every row: :func:`fit_prefill_rows`.)"""

    # the coefficients are finite and >= 0 (a NaN one made every T_recompute NaN and the controller's decisions
    # arbitrary, without a word); the fit's errors may be NaN: not measured
    a_s: float = attrs.field(validator=non_negative_number)
    b_s_per_token: float = attrs.field(validator=non_negative_number)
    c_s_per_token2: float = attrs.field(validator=non_negative_number)
    rms_rel_error: float
    max_rel_error: float
    d_s_per_cached_token: float = attrs.field(default=0.0, validator=non_negative_number)
    #: seconds per (new token × cached token); None: 2c, causal skipping (not measured)
    cross_s_per_token2: float | None = attrs.field(default=None, validator=attrs.validators.optional(non_negative_number))
    #: rms relative error of the model on the half-hit rows x was fitted from (None: not measured)
    cross_rms_rel_error: float | None = None

    @property
    def cross(self) -> float:
        """x: the measured cross term, else 2c."""
        return 2.0 * self.c_s_per_token2 if self.cross_s_per_token2 is None else self.cross_s_per_token2

    def __call__(self, tokens: float | np.ndarray) -> float | np.ndarray:
        t = np.asarray(tokens, dtype=np.float64)
        out = self.a_s + self.b_s_per_token * t + self.c_s_per_token2 * t * t
        return float(out) if out.ndim == 0 else out

    def marginal_s(self, start_tokens: Any, end_tokens: Any) -> Any:
        """Seconds the new tokens [start, end) add, [0, start) cached: ``b·q + c·q² + x·q·start``
        (no fixed term, no cost of reading the cache). Scalars or numpy arrays."""
        q = end_tokens - start_tokens
        return self.b_s_per_token * q + self.c_s_per_token2 * q * q + self.cross * q * start_tokens

    def prefill_s(self, start_tokens: Any, end_tokens: Any) -> Any:
        """Seconds to prefill [start, end) with [0, start) cached: fixed term + marginal + reading
        the cached prefix."""
        return self.a_s + self.marginal_s(start_tokens, end_tokens) + self.d_s_per_cached_token * start_tokens

    def to_dict(self) -> dict[str, float]:
        return attrs.asdict(self)


def _nnls_relative(basis: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative coefficients minimising the squared *relative* error ``Σ (basis·coef / y − 1)²``,
    exactly: least squares over every subset of the (few) columns, the best feasible one kept. A
    subset with more columns than rows is skipped; the constant alone is always feasible."""
    w = 1.0 / y
    n = basis.shape[1]
    best: tuple[float, np.ndarray] | None = None
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            if len(cols) > y.size:
                continue
            coef, *_ = np.linalg.lstsq(basis[:, cols] * w[:, None], np.ones_like(y), rcond=None)
            if np.any(coef < 0):
                continue
            full = np.zeros(n)
            full[list(cols)] = coef
            sse = float(np.sum((basis @ full * w - 1.0) ** 2))
            if best is None or sse < best[0] - 1e-15:
                best = (sse, full)
    assert best is not None
    return best[1]


def _column(name: str, values: Any, *, n: int | None = None, allow_nan: bool = False) -> np.ndarray:
    """Measured numbers as a 1-D float array: each a finite non-negative number (NaN where ``allow_nan``: not
    measured), ``n`` of them when given — a NaN that reached the least squares made LAPACK print an error and
    raise LinAlgError."""
    try:
        a = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise ConfigError(name, f"must be a sequence of numbers, got {values!r:.60}") from None
    if a.ndim != 1:
        raise ConfigError(name, f"must be a flat sequence of numbers, got {a.ndim} dimensions")
    if n is not None and a.size != n:
        raise ConfigError(name, f"has {a.size} values, the other columns {n}")
    bad = np.isinf(a) | (a < 0) | (np.isnan(a) if not allow_nan else np.zeros(a.shape, dtype=bool))
    if bad.any():
        i = int(np.argmax(bad))
        raise ConfigError(name, f"value {i} is {float(a[i])!r}: measurements must be finite and non-negative")
    return a


def fit_prefill(prefix_tokens: Floats, seconds: Floats) -> PrefillModel:
    """Non-negative least squares on relative error over subsets of {1, T, T²}."""
    t = _column("prefix_tokens", prefix_tokens)
    y = _column("seconds", seconds)
    if t.size != y.size or t.size < 1:
        raise ConfigError("prefix_tokens", "need at least one (prefix_tokens, seconds) pair of equal lengths")
    if np.any(y <= 0):
        raise ConfigError("cold_prefill_ms", "prefill times must be positive to fit")
    scale = max(float(t.max()), 1.0)
    basis = np.stack([np.ones_like(t), t / scale, (t / scale) ** 2], axis=1)
    coef = _nnls_relative(basis, y)
    rel = basis @ coef / y - 1.0
    return PrefillModel(
        a_s=float(coef[0]),
        b_s_per_token=float(coef[1] / scale),
        c_s_per_token2=float(coef[2] / scale**2),
        rms_rel_error=float(np.sqrt(np.mean(rel**2))),
        max_rel_error=float(np.max(np.abs(rel))),
    )


def fit_prefill_rows(prefix_tokens: Floats, tail_tokens: Floats, cold_s: Floats, local_s: Floats,
                     half_cached_tokens: Floats | None = None, half_s: Floats | None = None) -> PrefillModel:
    """Every term at once, each row as what it ran: the cold row is a prefill of [0, L + tail), the
    local hit [L, L + tail), the half hit [r, L + tail) — a, b, c, d and x by non-negative least
    squares on relative error over all rows (x tied to 2c without half-hit rows, which alone
    tell it apart from d). ``rms_rel_error``/``max_rel_error`` are over the cold rows,
    ``cross_rms_rel_error`` over the half-hit rows."""
    L = _column("prefix_tokens", prefix_tokens)
    if L.size < 1:
        raise ConfigError("prefix_tokens", "need at least one row to fit")
    t = _column("tail_tokens", tail_tokens, n=L.size)
    groups = [(np.zeros_like(L), L + t, _column("cold_prefill_ms", cold_s, n=L.size))]
    local = _column("local_hit_ttft_ms", local_s, n=L.size, allow_nan=True)  # NaN: a row without a local-hit measurement
    ok = np.isfinite(local)
    groups.append((L[ok], (L + t)[ok], local[ok]))
    has_half = half_cached_tokens is not None and half_s is not None and bool(np.any(np.asarray(half_cached_tokens) > 0))
    if has_half:
        r = _column(HALF_HIT_COLUMNS[0], half_cached_tokens, n=L.size)
        use = r > 0
        groups.append((r[use], (L + t)[use], _column(HALF_HIT_COLUMNS[1], half_s, n=L.size, allow_nan=True)[use]))
    for name, g in zip(("cold_prefill_ms", "local_hit_ttft_ms", HALF_HIT_COLUMNS[1]), groups):
        if np.any(g[2] <= 0):
            raise ConfigError(name, "prefill times must be positive to fit")
    start = np.concatenate([g[0] for g in groups])
    end = np.concatenate([g[1] for g in groups])
    y = np.concatenate([g[2] for g in groups])
    s = max(float(end.max()), 1.0)  # scaled columns keep the least squares well conditioned
    q, r0 = (end - start) / s, start / s
    one = np.ones_like(q)
    # columns a, b, c, [x,] d; without half hits x is tied to 2c: c·(q² + 2q·start) = c·(end² − start²)
    cols = [one, q, q * q, q * r0, r0] if has_half else [one, q, q * q + 2.0 * q * r0, r0]
    coef = _nnls_relative(np.stack(cols, axis=1), y)
    m = PrefillModel(a_s=float(coef[0]), b_s_per_token=float(coef[1] / s), c_s_per_token2=float(coef[2] / s**2), rms_rel_error=0.0,
                     max_rel_error=0.0, d_s_per_cached_token=float(coef[-1] / s),
                     cross_s_per_token2=float(coef[3] / s**2) if has_half else None)
    rel = [m.prefill_s(g[0], g[1]) / g[2] - 1.0 for g in groups]
    return attrs.evolve(m, rms_rel_error=float(np.sqrt(np.mean(rel[0] ** 2))), max_rel_error=float(np.max(np.abs(rel[0]))),
                        cross_rms_rel_error=float(np.sqrt(np.mean(rel[2] ** 2))) if has_half else None)


def describe_prefill(m: dict[str, Any]) -> list[str]:
    """Two lines for people: the cold fit and the cross term (``m``: :meth:`PrefillModel.to_dict`)."""
    lines = [f"prefill model    T_prefill(T) = {m['a_s'] * 1e3:.3f} ms + {m['b_s_per_token'] * 1e6:.4f} us*T + "
             f"{m['c_s_per_token2'] * 1e12:.4f} ps*T^2   (rms rel err {m['rms_rel_error']:.1%}, max {m['max_rel_error']:.1%})"]
    x = m.get("cross_s_per_token2")
    if x is None:
        lines.append("cross term       2c per (new x cached token), causal skipping: no half-hit rows measured it")
    else:
        ratio = f"{x / m['c_s_per_token2']:.2f}c" if m["c_s_per_token2"] > 0 else "c = 0"
        lines.append(f"cross term       {x * 1e12:.4f} ps per (new x cached token) = {ratio}, from the half-hit rows "
                     f"(rms rel err {m['cross_rms_rel_error']:.1%})")
    return lines


def fit_cross(model: PrefillModel, prefix_tokens: Floats, cached_tokens: Floats, seconds: Floats) -> PrefillModel:
    """x, the seconds per (new token × cached token), from half-hit rows: prompts of ``prefix_tokens``
    whose first ``cached_tokens`` were cached. With a, b, c, d fixed (cold and local-hit rows),
    x is the least-squares fit on relative error of what is left, clipped at 0. Rows with nothing
    cached say nothing about x; without any other, the model is returned unchanged (x = 2c)."""
    if not isinstance(model, PrefillModel):
        raise ConfigError("model", f"must be a PrefillModel (fit_prefill or fit_prefill_rows gives one), got {type(model).__name__}")
    t = _column("prefix_tokens", prefix_tokens)
    r = _column("cached_tokens", cached_tokens, n=t.size)
    y = _column("seconds", seconds, n=t.size)
    use = r > 0
    if not np.any(use):
        return model
    t, r, y = t[use], r[use], y[use]
    q = t - r
    rest = y - (model.a_s + model.b_s_per_token * q + model.c_s_per_token2 * q * q + model.d_s_per_cached_token * r)
    xq = q * r / y  # the cross term's column, weighted by 1/y
    x = max(float(np.sum(xq * rest / y) / np.sum(xq * xq)), 0.0)
    fitted = attrs.evolve(model, cross_s_per_token2=x)
    rel = fitted.prefill_s(r, t) / y - 1.0
    return attrs.evolve(fitted, cross_rms_rel_error=float(np.sqrt(np.mean(rel**2))))


@attrs.frozen(eq=False)
class MeasuredProfile:
    """Rows of the measured profile, as numpy columns (sorted by prefix length)."""

    prefix_tokens: np.ndarray
    kv_bytes: np.ndarray
    cold_prefill_ms: np.ndarray
    local_hit_ttft_ms: np.ndarray
    extra: dict[str, np.ndarray] = attrs.field(factory=dict)
    source: str = "<memory>"

    def __len__(self) -> int:
        return int(self.prefix_tokens.size)

    def byte_slopes(self) -> np.ndarray:
        """``Δkv_bytes / Δtokens`` between neighbouring rows (bytes per token)."""
        return np.diff(self.kv_bytes) / np.diff(self.prefix_tokens)

    @property
    def bytes_per_token(self) -> float:
        """Least-squares slope of kv_bytes over prefix_tokens (bytes per token)."""
        if len(self) < 2:
            raise ConfigError("profile", f"{self.source}: a byte slope needs at least two rows")
        slope, _ = np.polyfit(self.prefix_tokens.astype(np.float64), self.kv_bytes.astype(np.float64), 1)
        return float(slope)

    def prefill_model(self) -> PrefillModel:
        """With a ``tail_tokens`` column (what ``kvpolicy profile`` writes): every row as the prefill it
        ran, all terms fitted at once (:func:`fit_prefill_rows`). Without it: the cold-prefill fit
        over the prefix, the cost per cached token as the slope of local-hit TTFT over the cached
        prefix (least squares, clipped at 0), then the cross term from half-hit rows if any."""
        half = HALF_HIT_COLUMNS[0] in self.extra
        if TAIL_COLUMN in self.extra:
            return fit_prefill_rows(self.prefix_tokens, self.extra[TAIL_COLUMN], self.cold_prefill_ms / 1e3, self.local_hit_ttft_ms / 1e3,
                                    self.extra[HALF_HIT_COLUMNS[0]] if half else None, self.extra[HALF_HIT_COLUMNS[1]] / 1e3 if half else None)
        m = fit_prefill(self.prefix_tokens, self.cold_prefill_ms / 1e3)
        hit = self.local_hit_ttft_ms / 1e3
        if len(self) >= 2 and np.all(np.isfinite(hit)):
            d = float(np.polyfit(self.prefix_tokens.astype(np.float64), hit, 1)[0])
            m = attrs.evolve(m, d_s_per_cached_token=max(d, 0.0))
        if half:
            m = fit_cross(m, self.prefix_tokens, self.extra[HALF_HIT_COLUMNS[0]], self.extra[HALF_HIT_COLUMNS[1]] / 1e3)
        return m

    def to_csv(self) -> str:
        buf = io.StringIO()
        cols = list(REQUIRED_COLUMNS) + sorted(self.extra)
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(cols)
        for i in range(len(self)):
            row: list[int | str] = [int(self.prefix_tokens[i]), int(self.kv_bytes[i])]
            row += [_fmt(self.cold_prefill_ms[i]), _fmt(self.local_hit_ttft_ms[i])]
            row += [_fmt(self.extra[c][i]) for c in sorted(self.extra)]
            w.writerow(row)
        return buf.getvalue()

    def write(self, path: str | Path) -> None:
        from ._io import write_text_atomic

        write_text_atomic(path, self.to_csv())


def _fmt(x: float) -> str:
    return repr(float(x))


#: A profile's measured KV bytes/token may differ from a config's formula by this much before
#: the two are refused as describing different models (padding, allocator rounding and
#: per-block metadata stay well inside it; a different model or dtype is ≥ 2× off).
MISMATCH_TOLERANCE = 0.10


def check_matches_model(profile: MeasuredProfile, bytes_per_token: float, model: str, *, tolerance: float = MISMATCH_TOLERANCE) -> float | None:
    """The relative gap between the profile's measured KV bytes/token and the model's.

    Raises :class:`ConfigError` (field ``--profile``, naming both numbers) when the gap exceeds
    ``tolerance``: a profile measured on one model (say the reference engine's 512 B/token)
    drives TTFTs of hours, or a break-even of 16 tokens, when combined with another. Returns
    None when the profile has fewer than two rows or no byte column to measure a slope from.
    """
    if len(profile) < 2 or not np.any(profile.kv_bytes > 0):
        return None
    measured = profile.bytes_per_token
    gap = abs(measured - bytes_per_token) / bytes_per_token
    if gap > tolerance:
        raise ConfigError(
            "--profile",
            f"{profile.source} measures {measured:,.0f} KV bytes/token but {model} gives {bytes_per_token:,.0f} "
            f"({measured / bytes_per_token:.3g}x, more than {tolerance:.0%} apart): the profile was measured on a different "
            "model or KV dtype. Profile the model you simulate, pass the matching --config / --bytes-per-token, "
            "or --allow-mismatch to use it anyway",
        )
    return gap


def read_profile(path: str | Path) -> MeasuredProfile:
    """Read and validate a profile CSV; every problem names the file and line."""
    p = str(path)
    from ._io import read_text

    try:
        text = read_text(path, "profile")
    except ConfigError as e:
        raise ProfileFormatError(p, None, e.problem.removeprefix(f"{p}: ")) from None
    return parse_profile(text, source=p)


def parse_profile(text: str, source: str = "<string>") -> MeasuredProfile:
    rows = list(csv.reader(io.StringIO(text)))
    numbered = [(i + 1, r) for i, r in enumerate(rows) if r and any(c.strip() for c in r) and not r[0].lstrip().startswith("#")]
    if not numbered:
        raise ProfileFormatError(source, None, "empty profile: expected a header " + ",".join(REQUIRED_COLUMNS))
    header_line, header = numbered[0]
    header = [h.strip() for h in header]
    missing = [c for c in REQUIRED_COLUMNS if c not in header]
    if missing:
        raise ProfileFormatError(source, header_line, f"missing column(s) {missing}; header must include {','.join(REQUIRED_COLUMNS)}")
    dup = [c for c in header if header.count(c) > 1]
    if dup:
        raise ProfileFormatError(source, header_line, f"duplicate column {dup[0]!r}")
    half = [c for c in HALF_HIT_COLUMNS if c in header]
    if len(half) == 1:
        raise ProfileFormatError(source, header_line, f"column {half[0]!r} needs its partner: {','.join(HALF_HIT_COLUMNS)} come together")
    data = numbered[1:]
    if not data:
        raise ProfileFormatError(source, header_line, "the profile has a header but no rows")
    cols: dict[str, list[float]] = {h: [] for h in header}
    prev_tokens = -1.0
    for line, r in data:
        if len(r) != len(header):
            raise ProfileFormatError(source, line, f"expected {len(header)} fields, got {len(r)}")
        for h, cell in zip(header, r):
            cell = cell.strip()
            try:
                v = float(cell)
            except ValueError:
                raise ProfileFormatError(source, line, f"column {h!r}: {cell!r} is not a number") from None
            if math.isnan(v) or math.isinf(v):
                raise ProfileFormatError(source, line, f"column {h!r}: {cell!r} is not a finite number")
            if v < 0:
                raise ProfileFormatError(source, line, f"column {h!r}: {cell!r} is negative")
            cols[h].append(v)
        t = cols["prefix_tokens"][-1]
        if not t.is_integer() or t <= 0:
            raise ProfileFormatError(source, line, f"column 'prefix_tokens': {t!r} must be a positive integer")
        if t > MAX_PREFIX_TOKENS:  # past this a float no longer holds every integer, and past 2**63 int64 overflows
            raise ProfileFormatError(source, line, f"column 'prefix_tokens': {r[header.index('prefix_tokens')].strip()!r} is larger than any prompt (at most 2**40)")
        if t <= prev_tokens:
            raise ProfileFormatError(source, line, f"column 'prefix_tokens': {int(t)} does not increase (previous row {int(prev_tokens)})")
        if cols["cold_prefill_ms"][-1] <= 0:
            raise ProfileFormatError(source, line, "column 'cold_prefill_ms': must be positive")
        if TAIL_COLUMN in cols and (not cols[TAIL_COLUMN][-1].is_integer() or cols[TAIL_COLUMN][-1] > MAX_PREFIX_TOKENS):
            raise ProfileFormatError(source, line, f"column {TAIL_COLUMN!r}: {cols[TAIL_COLUMN][-1]:g} must be a whole number of tokens, at most 2**40")
        if HALF_HIT_COLUMNS[0] in cols:
            cached = cols[HALF_HIT_COLUMNS[0]][-1]
            if not cached.is_integer() or cached >= t:
                raise ProfileFormatError(source, line, f"column {HALF_HIT_COLUMNS[0]!r}: {cached:g} must be a whole number of tokens "
                                         f"below prefix_tokens ({int(t)})")
            if cols[HALF_HIT_COLUMNS[1]][-1] <= 0:
                raise ProfileFormatError(source, line, f"column {HALF_HIT_COLUMNS[1]!r}: must be positive")
        prev_tokens = t
    return MeasuredProfile(
        prefix_tokens=np.asarray(cols["prefix_tokens"], dtype=np.int64),
        kv_bytes=np.asarray(cols["kv_bytes"], dtype=np.float64),
        cold_prefill_ms=np.asarray(cols["cold_prefill_ms"], dtype=np.float64),
        local_hit_ttft_ms=np.asarray(cols["local_hit_ttft_ms"], dtype=np.float64),
        extra={h: np.asarray(v, dtype=np.float64) for h, v in cols.items() if h not in REQUIRED_COLUMNS},
        source=source,
    )
