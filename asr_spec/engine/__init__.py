"""The decoding engine: ragged KV cache, Whisper logit rules, speculative step, continuous-batching scheduler."""

from asr_spec.engine.options import DecodeOptions
from asr_spec.engine.scheduler import ChunkRequest, ChunkResult, ChunkStats, Engine

__all__ = ["ChunkRequest", "ChunkResult", "ChunkStats", "DecodeOptions", "Engine"]
