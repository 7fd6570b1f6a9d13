"""The events of `/v1/realtime` (vLLM's realtime transcription protocol), pure: client JSON in, checked events
out; server events as dicts. No I/O here (the session is realtime.py); docs/serve.md lists every event.

Client -> server:
    {"type": "session.update", "model": str?, "tentative": bool?, "lag": bool?}
                                                    `tentative`, `lag` (asr-spec extensions, default off): also
                                                    send transcription.tentative, transcription.lag
    {"type": "input_audio_buffer.append", "audio": base64 of PCM16 little-endian mono 16 kHz}
    {"type": "input_audio_buffer.commit", "final": bool?}           final: the end of this input
Server -> client:
    {"type": "session.created", "id", "created"}                     first, once
    {"type": "transcription.delta", "delta": str}                    newly committed text
    {"type": "transcription.tentative", "text": str}                 the uncommitted rest (only when asked for)
    {"type": "transcription.lag", "behind_s": float}                 audio waiting when a result came back: sent
                                                                     while the server is behind (catching up) and
                                                                     once when it is not (only when asked for)
    {"type": "transcription.done", "text": str, "usage": {...}}      the whole final text of the input
    {"type": "error", "error": str, "code": str}                     one line; the connection stays usable
"""

from __future__ import annotations

import base64
import binascii
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from asr_spec.audio.opening import container_of

__all__ = ["Append", "Commit", "ProtocolError", "SessionUpdate", "created", "delta", "done", "error", "lag", "parse",
           "tentative"]

PCM16_FULL_SCALE = 32768.0  # int16 -> float32 in [-1, 1): what the feature extractor expects


class ProtocolError(ValueError):
    """A client event the server cannot take; `code` is the error event's code."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class SessionUpdate:
    model: str | None = None
    tentative: bool | None = None  # None: unchanged
    lag: bool | None = None  # None: unchanged


@dataclass(frozen=True)
class Append:
    samples: np.ndarray  # (n,) float32 in [-1, 1), 16 kHz mono


@dataclass(frozen=True)
class Commit:
    final: bool = False


Event = SessionUpdate | Append | Commit
_FIELDS = {"session.update": {"model", "tentative", "lag"}, "input_audio_buffer.append": {"audio"},
           "input_audio_buffer.commit": {"final"}}
_IGNORED = {"type", "event_id"}  # event_id: OpenAI's clients tag events with it


def parse(message: str | bytes | None, max_samples: int) -> Event:
    """The checked event of one WebSocket message (text: a JSON object), else `ProtocolError` with a one-line
    message naming the event and the cause. max_samples: the most 16 kHz samples one append may carry."""
    if not isinstance(message, str):
        raise ProtocolError("binary messages are not events: send JSON text", "invalid_event")
    try:
        event = json.loads(message)
    except json.JSONDecodeError as err:
        raise ProtocolError(f"the message is not JSON ({err.msg} at character {err.pos})", "invalid_json") from err
    except RecursionError as err:  # arrays nested thousands deep: JSON, but no event
        raise ProtocolError("the message nests too deeply to be an event", "invalid_json") from err
    except ValueError as err:  # JSON Python will not read: an integer of more than 4,300 digits
        raise ProtocolError(f"the message cannot be read ({err})", "invalid_json") from err
    if not isinstance(event, dict):
        raise ProtocolError(f"an event is a JSON object, got {type(event).__name__}", "invalid_event")
    kind = event.get("type")
    if not isinstance(kind, str) or kind not in _FIELDS:
        known = ", ".join(_FIELDS)
        raise ProtocolError(f"unknown event type {kind!r} (known: {known})", "unknown_event")
    unknown = sorted(set(event) - _FIELDS[kind] - _IGNORED)
    if unknown:
        # ascii(): a field name may hold a lone surrogate ("\ud800"), which the error event could not encode
        raise ProtocolError(f"{kind}: unknown field(s) {', '.join(map(ascii, unknown))}", "invalid_event")
    if kind == "session.update":
        return SessionUpdate(_optional(event, kind, "model", str), _optional(event, kind, "tentative", bool),
                             _optional(event, kind, "lag", bool))
    if kind == "input_audio_buffer.commit":
        return Commit(bool(_optional(event, kind, "final", bool)))
    return Append(_pcm16(event, max_samples))


def _optional(event: dict[str, Any], kind: str, name: str, wanted: type) -> Any:
    value = event.get(name)
    if value is not None and type(value) is not wanted:  # type(): a bool is not an int, 1 is not a bool
        raise ProtocolError(f"{kind}: {name} must be a {wanted.__name__}, got {json.dumps(value)[:40]}",
                            "invalid_event")
    return value


def _pcm16(event: dict[str, Any], max_samples: int) -> np.ndarray:
    kind = "input_audio_buffer.append"
    audio = event.get("audio")
    if not isinstance(audio, str):
        raise ProtocolError(f"{kind}: audio must be a base64 string of PCM16 mono 16 kHz", "invalid_audio")
    if len(audio) > 4 * ((2 * max_samples + 2) // 3):
        raise ProtocolError(f"{kind}: more than {max_samples / 16000:g} s of audio in one event: send smaller "
                            "appends", "audio_too_large")
    try:
        raw = base64.b64decode(audio, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ProtocolError(f"{kind}: audio is not valid base64 ({err})", "invalid_audio") from err
    if not raw or len(raw) % 2:
        raise ProtocolError(f"{kind}: audio must be a non-empty whole number of PCM16 samples, got {len(raw)} "
                            "bytes", "invalid_audio")
    encoded = container_of(raw)
    if encoded is not None:  # a file sent whole or in pieces: its header would decode as noise
        raise ProtocolError(f"{kind}: audio looks like {encoded}, not raw PCM16 mono 16 kHz", "invalid_audio")
    return np.frombuffer(raw, dtype="<i2").astype(np.float32) / PCM16_FULL_SCALE


# -- server events ----------------------------------------------------------------------------------------------

def created() -> dict[str, Any]:
    return {"type": "session.created", "id": f"sess-{uuid.uuid4().hex}", "created": int(time.time())}


def delta(text: str) -> dict[str, Any]:
    return {"type": "transcription.delta", "delta": text}


def tentative(text: str) -> dict[str, Any]:
    return {"type": "transcription.tentative", "text": text}


def lag(behind_s: float) -> dict[str, Any]:
    """behind_s: seconds of audio received and not yet decoded when a result came back (about 0: caught up)."""
    return {"type": "transcription.lag", "behind_s": round(behind_s, 2)}


def done(text: str, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """usage counts tokens over every re-decode of the input (prompt: the decoder prompts fed; completion: the
    tokens generated), as vLLM's usage does for its one decode."""
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens}
    return {"type": "transcription.done", "text": text, "usage": usage}


def error(message: str, code: str) -> dict[str, Any]:
    return {"type": "error", "error": message, "code": code}
