"""Long-form transcription: options, the Transcriber that wires the stages, stitching, results and output files."""

from asr_spec.transcribe.options import TranscribeOptions
from asr_spec.transcribe.results import ChunkReport, Transcription
from asr_spec.transcribe.transcriber import Transcriber

__all__ = ["ChunkReport", "TranscribeOptions", "Transcriber", "Transcription"]
