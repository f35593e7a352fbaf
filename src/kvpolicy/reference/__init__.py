"""A small but real engine behind kvpolicy's seams: numpy transformer, paged KV, TCP block transfer, profiling."""

from .engine import PrefillResult, ReferenceEngine
from .model import ModelConfig, Transformer
from .transport import BlockServer, BlockStore, CorruptBlockError, PeerClient

__all__ = ["BlockServer", "BlockStore", "CorruptBlockError", "ModelConfig", "PeerClient", "PrefillResult", "ReferenceEngine", "Transformer"]
