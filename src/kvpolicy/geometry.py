"""KV size from the attention geometry — KV heads, not the model's name.

Dense / GQA transformer, no special compression::

    bytes_per_token = 2 × L × Hkv × D × q          (K and V, every layer)
    bytes_prefix    = bytes_per_token × T

MLA (DeepSeek-style) caches one latent vector plus the RoPE key per layer::

    bytes_per_token = L × (kv_lora_rank + qk_rope_head_dim) × q

Sliding-window, chunked-attention or hybrid (SSM) layers make KV bytes
non-linear in T; for those :meth:`KVGeometry.from_hf_config` raises
:class:`~kvpolicy.errors.ProfileRequiredError` instead of returning the dense
number — measure allocated cache at a short and a long prefix and take the slope.

Only full blocks of B tokens are useful remotely::

    useful_tokens = floor(T_match / B) × B
    S_load        = bytes_per_token × useful_tokens
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import attrs

from ._io import json_loads, read_text
from .errors import ConfigError, ProfileRequiredError

#: element sizes for HF ``torch_dtype`` spellings and KV-dtype overrides.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4, "fp32": 4, "float": 4,
    "float16": 2, "fp16": 2, "half": 2,
    "bfloat16": 2, "bf16": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int8": 1,
}


def _positive_int(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(attribute.name, f"must be a positive int, got {value!r}")


def _non_negative_int(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(attribute.name, f"must be a non-negative int, got {value!r}")


def _check_block(block_size_tokens: int) -> None:
    if isinstance(block_size_tokens, bool) or not isinstance(block_size_tokens, int) or block_size_tokens <= 0:
        raise ConfigError("block_size_tokens", f"must be a positive int, got {block_size_tokens!r}")


def useful_tokens(matched_tokens: int, block_size_tokens: int) -> int:
    """``floor(T_match / B) × B``: the tail inside a partial block is recomputed."""
    _check_block(block_size_tokens)
    if isinstance(matched_tokens, bool) or not isinstance(matched_tokens, int) or matched_tokens < 0:
        raise ConfigError("matched_tokens", f"must be a non-negative int, got {matched_tokens!r}")
    return (matched_tokens // block_size_tokens) * block_size_tokens


@attrs.frozen
class KVGeometry:
    """Per-token KV footprint of one model replica's cache."""

    num_layers: int = attrs.field(validator=_positive_int)
    bytes_per_element: int = attrs.field(validator=_positive_int)
    num_kv_heads: int = attrs.field(default=0, validator=_non_negative_int)
    head_dim: int = attrs.field(default=0, validator=_non_negative_int)
    kind: Literal["dense", "mla"] = attrs.field(default="dense")
    mla_latent_dim: int = attrs.field(default=0, validator=_non_negative_int)
    #: engine-specific bytes per token beyond K/V (e.g. FP8 scales); from the engine, default 0.
    overhead_bytes_per_token: int = attrs.field(default=0, validator=_non_negative_int)

    def __attrs_post_init__(self) -> None:
        if self.kind == "dense":
            if self.num_kv_heads <= 0 or self.head_dim <= 0:
                raise ConfigError("num_kv_heads", "a dense geometry needs num_kv_heads > 0 and head_dim > 0")
        elif self.kind == "mla":
            if self.mla_latent_dim <= 0:
                raise ConfigError("mla_latent_dim", "an MLA geometry needs kv_lora_rank + qk_rope_head_dim > 0")
        else:
            raise ConfigError("kind", f"must be 'dense' or 'mla', got {self.kind!r}")

    @classmethod
    def dense(cls, num_layers: int, num_kv_heads: int, head_dim: int, bytes_per_element: int, **kw: Any) -> KVGeometry:
        return cls(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, bytes_per_element=bytes_per_element, **kw)

    @classmethod
    def mla(cls, num_layers: int, kv_lora_rank: int, qk_rope_head_dim: int, bytes_per_element: int, **kw: Any) -> KVGeometry:
        return cls(num_layers=num_layers, kind="mla", mla_latent_dim=kv_lora_rank + qk_rope_head_dim, bytes_per_element=bytes_per_element, **kw)

    @property
    def bytes_per_token(self) -> int:
        if self.kind == "mla":
            base = self.num_layers * self.mla_latent_dim * self.bytes_per_element
        else:
            base = 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.bytes_per_element
        return base + self.overhead_bytes_per_token

    def kv_bytes(self, prefix_tokens: int) -> int:
        """Bytes of KV for ``prefix_tokens`` tokens."""
        if isinstance(prefix_tokens, bool) or not isinstance(prefix_tokens, int) or prefix_tokens < 0:
            raise ConfigError("prefix_tokens", f"must be a non-negative int, got {prefix_tokens!r}")
        return self.bytes_per_token * prefix_tokens

    def load_bytes(self, matched_tokens: int, block_size_tokens: int) -> int:
        """``S_load = bytes_per_token × useful_tokens``."""
        return self.bytes_per_token * useful_tokens(matched_tokens, block_size_tokens)

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | str | Path, kv_dtype: str | None = None) -> KVGeometry:
        """Geometry from a Hugging Face ``config.json`` (a mapping or a path).

        ``kv_dtype`` overrides the element format of the cache (``"fp8"`` → q = 1);
        ``None`` or ``"auto"`` uses ``torch_dtype``.
        """
        where = "config"
        if isinstance(config, (str, Path)):
            where = str(config)
            try:
                config = json_loads(read_text(config, "config"))
            except json.JSONDecodeError as exc:
                raise ConfigError("config", f"{where}:{exc.lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(config, Mapping):
            raise ConfigError("config", f"{where}: must be a JSON object")
        cfg: Mapping[str, Any] = config
        if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), Mapping):
            outer = cfg
            cfg = cfg["text_config"]
            where += ".text_config"
            if cfg.get("torch_dtype", cfg.get("dtype")) is None and outer.get("torch_dtype", outer.get("dtype")) is not None:
                # a multimodal config (Qwen2-VL, LLaVA) often states the dtype once, at the top: the text model's too
                cfg = {**cfg, "torch_dtype": outer.get("torch_dtype", outer.get("dtype"))}

        def need_int(name: str) -> int:
            v = cfg.get(name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(f"{where}: {name}", f"must be a positive int, got {v!r}")
            return v

        layers = need_int("num_hidden_layers")
        _refuse_nonlinear(cfg, where)
        if kv_dtype is None or kv_dtype == "auto":
            dtype = cfg.get("torch_dtype", cfg.get("dtype"))
            if dtype is None:
                raise ConfigError(f"{where}: torch_dtype", "missing; pass kv_dtype explicitly (e.g. 'bf16')")
            field = "torch_dtype"
        else:
            dtype, field = kv_dtype, "kv_dtype"
        q = DTYPE_BYTES.get(str(dtype).lower())
        if q is None:
            raise ConfigError(f"{where}: {field}" if field == "torch_dtype" else "kv_dtype", f"unknown dtype {dtype!r}; known: {sorted(DTYPE_BYTES)}")
        if cfg.get("kv_lora_rank") is not None:
            rank = need_int("kv_lora_rank")
            rope = need_int("qk_rope_head_dim")
            return cls.mla(num_layers=layers, kv_lora_rank=rank, qk_rope_head_dim=rope, bytes_per_element=q)
        heads = need_int("num_attention_heads")
        kv_heads = cfg.get("num_key_value_heads")
        if kv_heads is None:
            kv_heads = heads  # absent means multi-head attention
        elif isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads <= 0 or heads % kv_heads:
            raise ConfigError(f"{where}: num_key_value_heads", f"must be a positive divisor of num_attention_heads ({heads}), got {kv_heads!r}")
        if cfg.get("head_dim") is not None:
            head_dim = need_int("head_dim")
        else:
            hidden = need_int("hidden_size")
            if hidden % heads:
                raise ConfigError(f"{where}: hidden_size", f"{hidden} is not divisible by num_attention_heads {heads}; give head_dim")
            head_dim = hidden // heads
        return cls.dense(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, bytes_per_element=q)


def _refuse_nonlinear(cfg: Mapping[str, Any], where: str) -> None:
    """Raise where the dense formula would silently be wrong."""
    why = None
    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, list) and any(t != "full_attention" for t in layer_types):
        kinds = sorted({str(t) for t in layer_types})
        why = f"layer_types mixes {kinds}"
    elif cfg.get("sliding_window") is not None and cfg.get("use_sliding_window", True) is not False:
        why = f"sliding_window={cfg.get('sliding_window')} bounds the cache of some layers"
    elif cfg.get("attention_chunk_size") is not None:
        why = f"attention_chunk_size={cfg.get('attention_chunk_size')} (chunked local attention)"
    elif cfg.get("layers_block_type") is not None or cfg.get("hybrid_override_pattern") is not None:
        why = "hybrid attention/SSM layers"
    if why:
        raise ProfileRequiredError(
            f"{where}: {why}, so KV bytes are not linear in prefix length; measure allocated cache at a "
            "short and a long prefix (a profile CSV, `kvpolicy profile`) instead of the dense formula"
        )
