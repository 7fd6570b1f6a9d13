"""What the OpenAPI schema says of each route, true to what the handlers do: the multipart body of a
transcription (its fields, their allowed values on this server), the content type of each response format, and
every error status, in OpenAI's error shape. The body is documented here rather than declared as FastAPI `Form`
parameters because the handler parses it itself, within its byte and time limits (uploads.py)."""

from __future__ import annotations

from typing import Any

from asr_spec.serve.params import MAX_PROMPT_CHARS

__all__ = ["ERROR_SCHEMA", "error_responses", "models_responses", "transcription_openapi", "transcription_responses"]

ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
_ERRORS = {
    400: "Bad request: not audio, or a field this server does not accept (the message names it).",
    401: "Missing or invalid API key (only when the server runs with --api-key).",
    404: "No such route.",
    408: "The upload did not arrive within --upload-timeout-s.",
    413: "Upload over --max-file-mb, or audio longer than --max-audio-s.",
    500: "The engine failed on this request's chunks (the server keeps serving).",
    503: "Busy: --max-requests or --max-audio-in-flight-s reached (retry after Retry-After seconds).",
}


def error_responses(*statuses: int) -> dict[int, Any]:
    """OpenAPI `responses` entries for `statuses`, each an OpenAI-shaped JSON error."""
    out: dict[int, Any] = {}
    for status in statuses:
        entry: dict[str, Any] = {"description": _ERRORS[status],
                                 "content": {"application/json": {"schema": ERROR_SCHEMA}}}
        if status == 503:
            entry["headers"] = {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds"}}
        out[status] = entry
    return out


def _auth(statuses: tuple[int, ...], keys: bool) -> tuple[int, ...]:
    return (*statuses, 401) if keys else statuses


def models_responses(keys: bool) -> dict[int, Any]:
    return error_responses(*_auth((), keys))


def transcription_responses(keys: bool) -> dict[int, Any]:
    """200 in every response format's content type, and the errors."""
    segment = {"type": "object", "required": ["id", "start", "end", "text"],
               "properties": {"id": {"type": "integer"}, "start": {"type": "number"}, "end": {"type": "number"},
                              "text": {"type": "string"}}}
    word = {"type": "object", "required": ["word", "start", "end"],
            "properties": {"word": {"type": "string"}, "start": {"type": "number"}, "end": {"type": "number"}}}
    plain = {"type": "object", "required": ["text"], "properties": {"text": {"type": "string"}}}
    verbose = {"type": "object", "required": ["task", "language", "duration", "text", "segments"],
               "properties": {"task": {"type": "string"}, "language": {"type": "string"},
                              "duration": {"type": "number"}, "text": {"type": "string"},
                              "segments": {"type": "array", "items": segment},
                              "words": {"type": "array", "items": word}}}
    ok = {"description": "The transcript: json / verbose_json as JSON, text and srt as text/plain, vtt as text/vtt.",
          "content": {"application/json": {"schema": {"anyOf": [verbose, plain]}},
                      "text/plain": {"schema": {"type": "string"}},
                      "text/vtt": {"schema": {"type": "string"}}}}
    return {200: ok, **error_responses(*_auth((400, 408, 413, 500, 503), keys))}


def transcription_openapi(model_ids: tuple[str, ...], formats: tuple[str, ...], language: str | None,
                          words: bool) -> dict[str, Any]:
    """The `openapi_extra` of POST /v1/audio/transcriptions: its multipart body as this server accepts it."""
    if language is None:  # the server detects each upload's language: a request may not name one
        language_schema: dict[str, Any] = {"type": "string", "maxLength": 0,
                                           "description": "Not accepted: this server detects the language."}
    else:
        language_schema = {"type": "string", "description": f"Only the language this server decodes ({language!r}, "
                           "as a code or an English name)."}
    granularities = ["segment", "word"] if words else ["segment"]
    properties = {
        "file": {"type": "string", "format": "binary", "description": "The audio (any format libsndfile or ffmpeg "
                 "reads)."},
        "model": {"type": "string", "enum": list(model_ids)},
        "response_format": {"type": "string", "enum": list(formats), "default": "json"},
        "language": language_schema,
        "prompt": {"type": "string", "maxLength": MAX_PROMPT_CHARS,
                   "description": "Previous text (names, terms, style) given to every chunk after <|startofprev|>; "
                   "its last 223 tokens are kept."},
        "hotwords": {"type": "string", "maxLength": MAX_PROMPT_CHARS,
                     "description": "asr-spec: hint phrases (faster-whisper's hotwords), before the prompt, on every "
                     "chunk but one with a prefix."},
        "prefix": {"type": "string", "maxLength": MAX_PROMPT_CHARS,
                   "description": "asr-spec: text the transcript starts with (forced on the first chunk, part of "
                   "the transcript)."},
        "temperature": {"type": "number", "minimum": 0, "maximum": 1,
                        "description": "OpenAI's meaning: 0 raises the temperature automatically (0, 0.2, ..., 1.0) "
                        "while a window fails Whisper's thresholds (compression ratio 2.4, log-probability -1); t > 0 "
                        "starts there (t, t + 0.2, ...). Absent: the server's --temperature. Windows decoded at 0 "
                        "are the model's greedy decoding; sampled ones are distributed as its sampling."},
        "timestamp_granularities[]": {"type": "array", "items": {"type": "string", "enum": granularities},
                                      "description": "word: with response_format verbose_json only."},
    }
    schema = {"type": "object", "required": ["file"], "properties": properties, "additionalProperties": False}
    encoding = {"file": {"contentType": "application/octet-stream"},
                "timestamp_granularities[]": {"style": "form", "explode": True}}
    return {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": schema,
                                                                                   "encoding": encoding}}}}
