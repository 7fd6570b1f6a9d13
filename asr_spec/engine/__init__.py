"""The decoding engine: ragged KV cache, Whisper logit rules, speculative step, continuous-batching scheduler."""

from asr_spec.engine.decoder import Decoder, full_vocab_logits
from asr_spec.engine.feed import EngineError
from asr_spec.engine.memory import ResourceError
from asr_spec.engine.options import DecodeOptions, check_int
from asr_spec.engine.pairing import DraftKind, check_pair
from asr_spec.engine.requests import ChunkRequest, ChunkResult
from asr_spec.engine.scheduler import Engine
from asr_spec.engine.stats import ChunkStats

__all__ = ["ChunkRequest", "ChunkResult", "ChunkStats", "DecodeOptions", "Decoder", "DraftKind", "Engine",
           "EngineError", "ResourceError", "check_int", "check_pair", "full_vocab_logits"]
