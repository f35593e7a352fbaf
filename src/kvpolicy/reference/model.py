"""A small decoder-only transformer in numpy: RoPE, GQA, RMSNorm, SwiGLU — random weights from a seed.

Real enough that its KV cache behaves like an engine's: K and V per layer per
token for ``num_kv_heads < num_heads`` (GQA), positions baked into K by RoPE (so a
block computed at other positions or another ``rope_theta`` is *not* the same
block), attention over cached plus new tokens, causal within the new ones. Not a
language model — its logits are a deterministic function of the tokens, which is
all a cache needs to be checked against.
"""

from __future__ import annotations

import attrs
import numpy as np

from .._validate import check_non_negative_int, check_positive_number
from .._validate import positive_int as _pos
from ..errors import ConfigError
from ..geometry import KVGeometry
from ..keys import Namespace

DTYPES = {"float32": 4, "float16": 2}


@attrs.frozen
class ModelConfig:
    num_layers: int = attrs.field(default=2, validator=_pos)
    num_heads: int = attrs.field(default=4, validator=_pos)
    num_kv_heads: int = attrs.field(default=1, validator=_pos)
    head_dim: int = attrs.field(default=32, validator=_pos)
    ffn_dim: int = attrs.field(default=256, validator=_pos)
    vocab_size: int = attrs.field(default=4096, validator=_pos)
    rope_theta: float = 10000.0
    dtype: str = "float32"
    seed: int = 0
    model_id: str = "kvpolicy-reference"
    revision: str = "r1"

    def __attrs_post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError("num_kv_heads", f"must divide num_heads ({self.num_heads}), got {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError("head_dim", "must be even (RoPE rotates pairs)")
        if not isinstance(self.dtype, str) or self.dtype not in DTYPES:
            raise ConfigError("dtype", f"must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        check_positive_number("rope_theta", self.rope_theta)
        check_non_negative_int("seed", self.seed)
        for name in ("model_id", "revision"):  # they go into every block key's namespace
            v = getattr(self, name)
            if not isinstance(v, str) or not v:
                raise ConfigError(name, f"must be a non-empty string, got {v!r}")

    @property
    def d_model(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def bytes_per_element(self) -> int:
        return DTYPES[self.dtype]

    def geometry(self) -> KVGeometry:
        return KVGeometry.dense(self.num_layers, self.num_kv_heads, self.head_dim, self.bytes_per_element)

    def block_bytes(self, block_size_tokens: int) -> int:
        """Bytes of one block's K and V over every layer: what the transport accepts per block."""
        return self.geometry().bytes_per_token * block_size_tokens

    def namespace(self, block_size_tokens: int, *, tenant: str = "default", adapter: tuple[str, str] | None = None) -> Namespace:
        """Every field that changes the KV goes into the key's namespace (``adapter``: (name, version))."""
        return Namespace(model_id=self.model_id, model_revision=f"{self.revision}/seed={self.seed}", tokenizer_version="reference-v1",
                         kv_dtype={"float32": "fp32", "float16": "fp16"}[self.dtype], block_size_tokens=block_size_tokens,
                         position_encoding={"type": "rope", "rope_theta": float(self.rope_theta)},
                         attention=f"gqa-h{self.num_heads}-kv{self.num_kv_heads}-d{self.head_dim}-l{self.num_layers}",
                         adapter_name=adapter[0] if adapter else None, adapter_version=adapter[1] if adapter else None, tenant=tenant)


class Transformer:
    """Weights and the forward pass. ``forward`` returns the last position's logits and the new K/V."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = c = config
        rng = np.random.default_rng(c.seed)
        dt = np.dtype(c.dtype)
        d, H, Hkv, D, F = c.d_model, c.num_heads, c.num_kv_heads, c.head_dim, c.ffn_dim

        def w(*shape: int, fan_in: int) -> np.ndarray:
            return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(dt)

        self.embed = w(c.vocab_size, d, fan_in=1) * dt.type(0.5)
        self.layers = [
            {"wq": w(d, H * D, fan_in=d), "wk": w(d, Hkv * D, fan_in=d), "wv": w(d, Hkv * D, fan_in=d), "wo": w(H * D, d, fan_in=H * D),
             "w1": w(d, F, fan_in=d), "w3": w(d, F, fan_in=d), "w2": w(F, d, fan_in=F)}
            for _ in range(c.num_layers)
        ]
        inv = 1.0 / (c.rope_theta ** (np.arange(0, D, 2, dtype=np.float64) / D))
        self._inv_freq = inv

    def _rope(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Rotate pairs (x[..., :D/2], x[..., D/2:]) by position × inv_freq. x: (T, heads, D)."""
        ang = positions[:, None].astype(np.float64) * self._inv_freq[None, :]
        cos = np.cos(ang).astype(x.dtype)[:, None, :]
        sin = np.sin(ang).astype(x.dtype)[:, None, :]
        h = x.shape[-1] // 2
        a, b = x[..., :h], x[..., h:]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)

    @staticmethod
    def _rms(x: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x.astype(np.float32) ** 2, axis=-1, keepdims=True) + 1e-6).astype(x.dtype)

    def forward(self, tokens: np.ndarray, start_pos: int, past_k: list[np.ndarray] | None = None, past_v: list[np.ndarray] | None = None,
                *, q_chunk: int = 512) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
        """Tokens at positions ``start_pos ...`` after ``past`` K/V (per layer ``(start_pos, Hkv, D)``).

        Returns (logits of the last token (vocab,), new K per layer (T, Hkv, D), new V per layer).
        """
        c = self.config
        toks = np.asarray(tokens, dtype=np.int64)
        if toks.ndim != 1 or toks.size == 0:
            raise ConfigError("tokens", "need at least one token")
        if toks.min() < 0 or toks.max() >= c.vocab_size:
            raise ConfigError("tokens", f"token ids must be in [0, {c.vocab_size})")
        T = toks.size
        H, Hkv, D = c.num_heads, c.num_kv_heads, c.head_dim
        group = H // Hkv
        pos = np.arange(start_pos, start_pos + T)
        x = self.embed[toks]
        new_k: list[np.ndarray] = []
        new_v: list[np.ndarray] = []
        scale = np.float32(1.0 / np.sqrt(D))
        for li, L in enumerate(self.layers):
            h = self._rms(x)
            q = self._rope((h @ L["wq"]).reshape(T, H, D), pos)
            k = self._rope((h @ L["wk"]).reshape(T, Hkv, D), pos)
            v = (h @ L["wv"]).reshape(T, Hkv, D)
            new_k.append(k)
            new_v.append(v)
            if past_k is not None and start_pos:
                K = np.concatenate([past_k[li], k], axis=0)
                V = np.concatenate([past_v[li], v], axis=0)  # type: ignore[index]
            else:
                K, V = k, v
            out = np.empty((T, H, D), dtype=x.dtype)
            for s in range(0, T, q_chunk):
                e = min(s + q_chunk, T)
                n = e - s
                S = start_pos + e  # keys beyond the chunk's last position are all masked: never computed
                Kg = K[:S].transpose(1, 2, 0)  # (Hkv, D, S)
                Vg = V[:S].transpose(1, 0, 2)  # (Hkv, S, D)
                qc = q[s:e].reshape(n, Hkv, group, D).transpose(1, 0, 2, 3).reshape(Hkv, n * group, D)
                sc = (qc @ Kg).astype(np.float32, copy=False) * scale  # (Hkv, n*group, S)
                sc = sc.reshape(Hkv, n, group, S)
                # causal mask on the last n keys only: query i (position start+s+i) sees key j (start+s+j) iff j <= i
                tri = np.triu(np.ones((n, n), dtype=bool), k=1)
                diag = sc[..., S - n:]  # a view: (Hkv, n, group, n)
                diag[:, np.broadcast_to(tri[:, None, :], (n, group, n))] = -np.inf
                sc -= sc.max(axis=-1, keepdims=True)
                np.exp(sc, out=sc)
                sc /= sc.sum(axis=-1, keepdims=True)
                o = sc.reshape(Hkv, n * group, S).astype(x.dtype, copy=False) @ Vg  # (Hkv, n*group, D)
                out[s:e] = o.reshape(Hkv, n, group, D).transpose(1, 0, 2, 3).reshape(n, H, D)
            x = x + out.reshape(T, H * D) @ L["wo"]
            h = self._rms(x)
            a = h @ L["w1"]
            g = h @ L["w3"]
            x = x + ((a / (1 + np.exp(-a.astype(np.float32))).astype(x.dtype)) * g) @ L["w2"]
        logits = self._rms(x[-1:]) @ self.embed.T
        return logits[0].astype(np.float32), new_k, new_v
