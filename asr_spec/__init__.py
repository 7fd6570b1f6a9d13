"""asr-spec: lossless batched speculative decoding for Whisper, for long recordings.

    from asr_spec import Transcriber
    transcriber = Transcriber.from_preset("base")          # or from_pretrained("openai/whisper-large-v2", ...)
    for t in transcriber.transcribe(["talk.flac", "interview.mp3"]):
        print(t.source, t.error or t.text)

The names below are imported on first use, so ``import asr_spec.audio`` (or ``asr-spec --help``) does not pay for
loading transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Transcriber": "asr_spec.transcribe",
    "TranscribeOptions": "asr_spec.transcribe",
    "Transcription": "asr_spec.transcribe",
    "ChunkReport": "asr_spec.transcribe",
    "DecodeOptions": "asr_spec.engine",
    "Engine": "asr_spec.engine",
    "ChunkRequest": "asr_spec.engine",
    "ChunkResult": "asr_spec.engine",
    "ChunkStats": "asr_spec.engine",
    "ChunkingOptions": "asr_spec.audio.chunking",
    "TranscriptSegment": "asr_spec.transcribe.outputs",
    "Preset": "asr_spec.models.presets",
    "load_preset": "asr_spec.models.presets",
    "AsrSpecError": "asr_spec.errors",
    "AudioError": "asr_spec.errors",
    "InputError": "asr_spec.errors",
    "ModelLoadError": "asr_spec.errors",
    "ResourceError": "asr_spec.engine",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # pragma: no cover
    from asr_spec.audio.chunking import ChunkingOptions
    from asr_spec.engine import ChunkRequest, ChunkResult, ChunkStats, DecodeOptions, Engine, ResourceError
    from asr_spec.errors import AsrSpecError, AudioError, InputError, ModelLoadError
    from asr_spec.models.presets import Preset, load_preset
    from asr_spec.transcribe import ChunkReport, TranscribeOptions, Transcriber, Transcription
    from asr_spec.transcribe.outputs import TranscriptSegment


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'asr_spec' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
