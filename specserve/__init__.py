"""specserve: lossless speculative decoding, served on Ray."""
from .engine import SamplingParams, SpeculativeEngine

__all__ = ["SamplingParams", "SpeculativeEngine"]
__version__ = "0.1.0"
