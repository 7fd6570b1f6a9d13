"""The decoding engine: ragged KV cache, Whisper logit rules, speculative step, continuous-batching scheduler."""

from asr_spec.engine.options import DecodeOptions
from asr_spec.engine.pairing import DraftKind, check_pair
from asr_spec.engine.scheduler import ChunkRequest, ChunkResult, Engine, EngineError
from asr_spec.engine.stats import ChunkStats

__all__ = ["ChunkRequest", "ChunkResult", "ChunkStats", "DecodeOptions", "DraftKind", "Engine", "EngineError",
           "check_pair"]
