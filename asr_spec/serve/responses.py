"""What the server answers: a transcript in the response format asked for, or an error in OpenAI's shape."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse, PlainTextResponse, Response

from asr_spec.transcribe.outputs import CueOptions, render_srt, render_vtt

__all__ = ["RESPONSE_FORMATS", "HTTPError", "error_body", "render"]

RESPONSE_FORMATS = ("json", "text", "srt", "vtt", "verbose_json")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}; code: a string naming the cause
    ("invalid_api_key") or null, as OpenAI's (the HTTP status was put there: typed clients read a string)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class HTTPError(Exception):
    """An answer other than 200, in OpenAI's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.status, self.message, self.param), status_code=self.status,
                            headers=self.headers)


def render(result: Any, response_format: str, task: str, words: bool = False, cues: CueOptions = CueOptions()
           ) -> Response:
    """The `Transcription` `result` as `response_format` asks: json and verbose_json as JSON, text and srt as
    text/plain, vtt as text/vtt; words: verbose_json gains the words of the whole file; cues: how srt and vtt cues
    are cut and laid out (the served options', as `transcribe` writes them)."""
    if response_format == "json":
        return JSONResponse({"text": result.text})
    if response_format == "text":
        return PlainTextResponse(result.text + "\n")
    if response_format == "srt":
        return PlainTextResponse(render_srt(result, cues))
    if response_format == "vtt":
        return PlainTextResponse(render_vtt(result, cues), media_type="text/vtt")
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    segments = [{"id": i, "start": s.start_s, "end": s.end_s, "text": s.text} for i, s in enumerate(result.segments)]
    body = {"task": task, "language": LANGUAGES.get(result.language or "", result.language or ""),
            "duration": result.audio_s, "text": result.text, "segments": segments}
    if words:  # OpenAI's shape: the words of the whole file, text without the leading space
        body["words"] = [{"word": w.word.strip(), "start": w.start, "end": w.end}
                         for s in result.segments for w in s.words]
    return JSONResponse(body)
