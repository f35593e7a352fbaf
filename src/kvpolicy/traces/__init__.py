"""Traces: the columnar model, readers and the synthetic generator."""

from .model import ChainConflict, Trace, canonicalize, chain_check, chain_conflict, check_trace, first_appearance_ids
from .readers import FORMATS, detect_format, read_bailian, read_mooncake, read_tokens_jsonl, read_trace
from .synthetic import PRESETS, SyntheticSpec, generate, preset, write_tokens_jsonl

__all__ = [
    "FORMATS",
    "ChainConflict",
    "PRESETS",
    "SyntheticSpec",
    "Trace",
    "canonicalize",
    "chain_check",
    "chain_conflict",
    "check_trace",
    "detect_format",
    "first_appearance_ids",
    "generate",
    "preset",
    "read_bailian",
    "read_mooncake",
    "read_tokens_jsonl",
    "read_trace",
    "write_tokens_jsonl",
]
