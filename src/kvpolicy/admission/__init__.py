"""Admission: load remote KV only when it is ready before recompute would be."""

from .breaker import CircuitBreaker
from .controller import REASONS, AdmissionConfig, AdmissionContext, AdmissionController, Decision, LoadOutcome, LoadResult
from .histogram import LogHistogram
from .model import LatencyModel, LinkPrior, TransferModel
from .ramp import RampController, RampStep

__all__ = [
    "REASONS",
    "AdmissionConfig",
    "AdmissionContext",
    "AdmissionController",
    "CircuitBreaker",
    "Decision",
    "LatencyModel",
    "LinkPrior",
    "LoadOutcome",
    "LoadResult",
    "LogHistogram",
    "RampController",
    "RampStep",
    "TransferModel",
]
