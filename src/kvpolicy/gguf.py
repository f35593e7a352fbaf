"""What a GGUF file says about its model's KV cache: read from the metadata alone, never the tensors.

llama.cpp keeps, per layer and per token, one K row of ``n_embd_k_gqa`` elements and
one V row of ``n_embd_v_gqa`` elements, each in the cache's ggml type (``f16`` unless
the engine is told ``type_k``/``type_v``)::

    bytes_per_token = Σ_layers  row_bytes(type_k, n_head_kv[l] · key_length)
                              + row_bytes(type_v, n_head_kv[l] · value_length)
    row_bytes(type, n) = n / block_elems(type) · block_bytes(type)

so a quantised cache (``q8_0``: 34 bytes per 32 elements) is priced exactly, not
rounded to whole bytes per element. ``n_head_kv`` may be one number or one per layer
(GGUF stores either). The reader is bounded: string lengths, array lengths and the
metadata's count are checked against what is left of the file before anything is
allocated, so a corrupt or hostile file is refused with the field named — never a
``MemoryError`` or a traceback from ``struct``.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

import attrs

from .errors import ConfigError

GGUF_MAGIC = b"GGUF"
#: ggml types a llama.cpp KV cache can hold: name -> (elements per block, bytes per block), from ggml's type traits
KV_CACHE_TYPES: dict[str, tuple[int, int]] = {
    "f32": (1, 4), "f16": (1, 2), "bf16": (1, 2),
    "q8_0": (32, 34), "q4_0": (32, 18), "q4_1": (32, 20), "q5_0": (32, 22), "q5_1": (32, 24), "iq4_nl": (32, 18),
}
#: ggml's type ids (``enum ggml_type``) of those, as a llama.cpp state export names them
GGML_TYPE_IDS: dict[int, str] = {0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 8: "q8_0", 20: "iq4_nl", 30: "bf16"}
#: the Namespace kv_dtype each cache type is filed under (the exact ggml types also go in its ``attention`` field)
NAMESPACE_DTYPE = {"f32": "fp32", "f16": "fp16", "bf16": "bf16", "q8_0": "int8", "q4_0": "int8", "q4_1": "int8",
                   "q5_0": "int8", "q5_1": "int8", "iq4_nl": "int8"}

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
MAX_METADATA_BYTES = 256 * 2**20  # a tokenizer of 10^6 entries fits many times over
#: array elements held in memory, per array and over the whole file: the largest tokenizers have ~300k tokens and
#: ~500k merges (a 200 MB file of one u8 array peaked at 3.4 GB as a Python list)
MAX_ARRAY_ELEMENTS = 2**22
MAX_TOTAL_ELEMENTS = 2**23
#: a metadata key's bytes (llama.cpp's are under 64): a 10 MB key or architecture name made a 10 MB error line
MAX_KEY_BYTES = 256
#: layers and heads a model may have (the CLI's --layers/--heads bound): 2^27 layers ran 139 s and printed 128 TiB
MAX_LAYERS = 1024
MAX_HEADS = 1024
#: a head's K or V dimension
MAX_HEAD_DIM = 65536


def row_bytes(kv_type: str, n_elements: int) -> int:
    """Bytes of one cache row of ``n_elements`` in ``kv_type`` (ggml's ``ggml_row_size``)."""
    if kv_type not in KV_CACHE_TYPES:
        raise ConfigError("kv_type", f"unknown KV cache type {kv_type!r}; known: {sorted(KV_CACHE_TYPES)}")
    per, size = KV_CACHE_TYPES[kv_type]
    if n_elements % per:
        raise ConfigError("kv_type", f"{kv_type} stores blocks of {per} elements; a row of {n_elements} does not divide")
    return n_elements // per * size


class _Reader:
    def __init__(self, f: BinaryIO, path: str, size: int) -> None:
        self.f, self.path, self.left = f, path, size
        self.elements_left = MAX_TOTAL_ELEMENTS

    def take(self, n: int, what: str) -> bytes:
        if n > self.left or n > MAX_METADATA_BYTES:
            raise ConfigError(what, f"{self.path}: claims {n:,} bytes, the file has {self.left:,} left: truncated or not GGUF")
        b = self.f.read(n)
        if len(b) != n:
            raise ConfigError(what, f"{self.path}: truncated")
        self.left -= n
        return b

    def scalar(self, fmt: str, what: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.scalar("<Q", what)
        raw = self.take(n, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw.decode("utf-8", "replace")

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype], what)
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY and depth == 0:
            etype = self.scalar("<I", what)
            n = self.scalar("<Q", what)
            if n > self.left:  # every element takes at least a byte
                raise ConfigError(what, f"{self.path}: an array of {n:,} elements in {self.left:,} bytes: truncated or not GGUF")
            if n > MAX_ARRAY_ELEMENTS or n > self.elements_left:
                raise ConfigError(what, f"{self.path}: an array of {n:,} elements; kvpolicy reads at most {MAX_ARRAY_ELEMENTS:,} per array "
                                        f"and {MAX_TOTAL_ELEMENTS:,} in all (the largest tokenizers hold under 10^6)")
            self.elements_left -= n
            if etype in _SCALARS:
                fmt = _SCALARS[etype]
                raw = self.take(n * struct.calcsize(fmt), what)
                return list(struct.unpack(f"<{n}{fmt[1]}", raw))
            return [self.value(etype, what, depth + 1) for _ in range(n)]
        raise ConfigError(what, f"{self.path}: unknown GGUF value type {vtype}")


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The key/value metadata of a GGUF file (versions 2 and 3), tensors not read."""
    p = Path(path)
    try:
        size = p.stat().st_size
        f = p.open("rb")
    except OSError as e:
        raise ConfigError("gguf", f"cannot read {str(p)!r}: {e.strerror or e}") from None
    with f:
        r = _Reader(f, str(p), size)
        if r.take(4, "gguf") != GGUF_MAGIC:
            raise ConfigError("gguf", f"{p}: not a GGUF file (no 'GGUF' magic)")
        version = r.scalar("<I", "gguf.version")
        if version not in (2, 3):
            raise ConfigError("gguf.version", f"{p}: GGUF version {version}; this reader knows 2 and 3")
        r.scalar("<Q", "gguf.tensor_count")
        n_kv = r.scalar("<Q", "gguf.kv_count")
        if n_kv > r.left // 12:  # a key's length, its type and the smallest value
            raise ConfigError("gguf.kv_count", f"{p}: {n_kv:,} metadata entries cannot fit in the file")
        meta: dict[str, Any] = {"gguf.version": version}
        for i in range(n_kv):
            n = r.scalar("<Q", f"gguf metadata key #{i}")
            if n > MAX_KEY_BYTES:
                raise ConfigError(f"gguf metadata key #{i}", f"{p}: a key of {n:,} bytes; GGUF keys here are at most {MAX_KEY_BYTES}")
            key = r.take(n, f"gguf metadata key #{i}").decode("utf-8", "replace")
            meta[key] = r.value(r.scalar("<I", key), key)
    return meta


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


@attrs.frozen
class GGUFModel:
    """The KV-relevant facts of one GGUF model (``GGUFModel.read(path)``)."""

    path: str
    architecture: str
    name: str
    num_layers: int
    #: KV heads of each layer
    num_kv_heads: tuple[int, ...]
    key_length: int
    value_length: int
    #: sha256 of the tokenizer's metadata (model, pre-tokenizer, tokens, merges, types, special ids)
    tokenizer_digest: str
    #: the position encoding the KV was computed under (RoPE base, dimensions, scaling)
    position_encoding: Mapping[str, Any] = attrs.field(factory=dict)
    metadata_keys: int = 0

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> GGUFModel:
        meta = read_metadata(path)
        arch = meta.get("general.architecture")
        if not isinstance(arch, str) or not arch:
            raise ConfigError("general.architecture", f"{path}: missing; cannot find the model's hyperparameters")
        if len(arch) > 64 or not all(c.isalnum() or c in "_-." for c in arch):
            raise ConfigError("general.architecture", f"{path}: {arch[:40]!r}{'…' if len(arch) > 40 else ''} ({len(arch):,} characters) "
                                                      "is no architecture name (at most 64 of [A-Za-z0-9_.-])")

        def need(name: str, default: Any = None) -> Any:
            v = meta.get(f"{arch}.{name}", default)
            if v is None:
                raise ConfigError(f"{arch}.{name}", f"{path}: missing from the GGUF metadata")
            return v

        def pos_int(name: str, v: Any, most: int) -> int:
            if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= most:
                raise ConfigError(f"{arch}.{name}", f"{path}: must be an integer in [1, {most:,}], got {v!r:.40}")
            return v

        layers = pos_int("block_count", need("block_count"), MAX_LAYERS)
        heads = need("attention.head_count")
        kv = meta.get(f"{arch}.attention.head_count_kv", heads)
        per_layer = kv if isinstance(kv, list) else [kv] * layers
        if len(per_layer) != layers:
            raise ConfigError(f"{arch}.attention.head_count_kv", f"{path}: {len(per_layer)} values for {layers} layers")
        kv_heads = tuple(pos_int("attention.head_count_kv", h, MAX_HEADS) for h in per_layer)
        head = heads[0] if isinstance(heads, list) and heads else heads
        head = pos_int("attention.head_count", head, MAX_HEADS)
        embd = pos_int("embedding_length", need("embedding_length"), MAX_HEADS * MAX_HEAD_DIM)
        k_len = pos_int("attention.key_length", meta.get(f"{arch}.attention.key_length", embd // head), MAX_HEAD_DIM)
        v_len = pos_int("attention.value_length", meta.get(f"{arch}.attention.value_length", embd // head), MAX_HEAD_DIM)
        tok = hashlib.sha256()
        for key in sorted(k for k in meta if k.startswith("tokenizer.") and k != "tokenizer.chat_template"):
            tok.update(key.encode() + b"\0" + repr(meta[key]).encode() + b"\0")
        pos = {k.split(".", 1)[1]: meta[k] for k in sorted(meta) if k.startswith(f"{arch}.rope.")}
        name = meta.get("general.name")
        if isinstance(name, str) and len(name) > 256:
            raise ConfigError("general.name", f"{path}: a name of {len(name):,} characters (at most 256: it goes into every block's namespace)")
        return cls(path=str(path), architecture=arch, name=name if isinstance(name, str) and name else arch, num_layers=layers,
                   num_kv_heads=kv_heads, key_length=k_len, value_length=v_len, tokenizer_digest=tok.hexdigest()[:32],
                   position_encoding=pos, metadata_keys=len(meta))

    def layer_row_bytes(self, type_k: str = "f16", type_v: str = "f16") -> list[tuple[int, int]]:
        """(K row, V row) bytes per token for each layer."""
        return [(row_bytes(type_k, h * self.key_length), row_bytes(type_v, h * self.value_length)) for h in self.num_kv_heads]

    def bytes_per_token(self, type_k: str = "f16", type_v: str = "f16") -> int:
        return sum(k + v for k, v in self.layer_row_bytes(type_k, type_v))

    def file_digest(self) -> str:
        """sha256 of the whole file (the weights the KV was computed with)."""
        return _file_sha256(Path(self.path))

    def namespace(self, block_size_tokens: int, *, type_k: str = "f16", type_v: str = "f16", tenant: str = "default",
                  file_digest: str | None = None, **kw: Any) -> Any:
        """The :class:`~kvpolicy.keys.Namespace` this model's KV is shared under: model name and architecture, a digest
        of the file (pass ``file_digest`` to skip hashing a large file each start), the tokenizer's digest, the cache
        types and the block size. KV made under any other of these is another namespace."""
        from .keys import Namespace

        for field, t in (("type_k", type_k), ("type_v", type_v)):
            if t not in KV_CACHE_TYPES:
                raise ConfigError(field, f"unknown KV cache type {t!r}; known: {sorted(KV_CACHE_TYPES)}")
        dtype = NAMESPACE_DTYPE[type_k] if type_k == type_v else "int8" if "int8" in (NAMESPACE_DTYPE[type_k], NAMESPACE_DTYPE[type_v]) else NAMESPACE_DTYPE[type_k]
        return Namespace(model_id=f"{self.architecture}:{self.name}", model_revision=file_digest or self.file_digest(),
                         tokenizer_version=self.tokenizer_digest, kv_dtype=dtype, block_size_tokens=block_size_tokens,
                         position_encoding=dict(self.position_encoding), attention=f"llama.cpp:k={type_k}:v={type_v}", tenant=tenant, **kw)
