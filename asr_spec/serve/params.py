"""The form fields of a transcription request, checked against what this server does: every field OpenAI's
endpoint takes is either honoured or refused with a 400 naming it, never silently ignored."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from asr_spec.errors import InputError, one_line
from asr_spec.serve.responses import RESPONSE_FORMATS, HTTPError
from asr_spec.transcribe.fallback import schedule_from
from asr_spec.transcribe.outputs import CAPTION_FORMATS
from asr_spec.transcribe.prompts import PromptOptions, per_input

__all__ = ["FIELDS", "MODEL_ALIASES", "Params", "check_params"]

MODEL_ALIASES = ("whisper-1",)  # what OpenAI's examples send; served by the one model here
# OpenAI's fields, then asr-spec's own: hotwords and prefix (asr_spec.transcribe.prompts)
FIELDS = ("file", "model", "response_format", "language", "prompt", "temperature", "timestamp_granularities[]",
          "hotwords", "prefix")
MAX_PROMPT_CHARS = 10_000  # of a prompt, hotwords or prefix field: far more than the 223 tokens a prompt keeps


@dataclass(frozen=True)
class Params:
    """The form fields of one transcription request, checked."""

    upload: Any  # starlette's UploadFile
    response_format: str
    words: bool  # words aligned: timestamp_granularities[] holds "word", or srt/vtt cues are cut from them
    # the request's temperature schedule (fallback.py): None = the server's (--temperature); OpenAI's temperature
    # 0 = "raise the temperature automatically until the thresholds are met": openai-whisper's 0, 0.2, ..., 1.0;
    # t > 0: the schedule starts at t (t, t + 0.2, ... <= 1)
    temperature: tuple[float, ...] | None = None
    prompts: PromptOptions = PromptOptions()  # prompt (as initial_prompt), hotwords, prefix over the server's own


def check_params(form: Any, options: Any, model_id: str) -> Params:
    """The checked fields of `form` for a server with `TranscribeOptions` `options` serving `model_id`; 400
    (`HTTPError`) for a missing file, an unknown field or a value this server does not take."""
    unknown = sorted(set(form.keys()) - set(FIELDS))
    if unknown:
        raise HTTPError(400, f"unknown field(s) {', '.join(map(repr, unknown))} (accepted: {', '.join(FIELDS)})",
                        unknown[0])
    upload = form.get("file")
    if upload is None or isinstance(upload, str):
        raise HTTPError(400, "file: missing (send the audio as a multipart file field named 'file')", "file")
    for key in FIELDS[1:]:
        values = form.getlist(key)
        if any(not isinstance(value, str) for value in values):
            raise HTTPError(400, f"{key}: must be a text field, not a file", key)
        if key != "timestamp_granularities[]" and len(values) > 1:  # form.get would take the last
            raise HTTPError(400, f"{key}: given {len(values)} times (send it once)", key)
    model = form.get("model")
    if model and model not in (model_id, *MODEL_ALIASES):
        served = ", ".join((model_id, *MODEL_ALIASES))
        raise HTTPError(400, f"model {model!r} is not served here (serving: {served})", "model")
    response_format = form.get("response_format") or "json"
    if response_format not in RESPONSE_FORMATS:
        raise HTTPError(400, f"response_format {response_format!r} is not one of {', '.join(RESPONSE_FORMATS)}",
                        "response_format")
    temperature = _temperature(form.get("temperature"))
    _check_language(form.get("language"), options.decode.language)
    # srt/vtt cues cut from word times (the served options': a preset's max_words_per_cue) need the words aligned
    words = (_wants_words(form, response_format, options.word_timestamps)
             or (response_format in CAPTION_FORMATS and options.cues.needs_words))
    return Params(upload, response_format, words, temperature, _prompts(form, options.prompts))


def _prompts(form: Any, served: PromptOptions) -> PromptOptions:
    """The request's prompts: OpenAI's `prompt` (previous text: Whisper's initial prompt), `hotwords` and
    `prefix`, each over the server's own (an empty or absent field keeps the server's)."""
    values = {}
    for field, name in (("prompt", "initial_prompt"), ("hotwords", "hotwords"), ("prefix", "prefix")):
        value = form.get(field)
        if value and len(value) > MAX_PROMPT_CHARS:
            raise HTTPError(400, f"{field}: {len(value)} characters, over this server's limit of "
                            f"{MAX_PROMPT_CHARS} (a prompt keeps its last 223 tokens)", field)
        values[name] = value or None
    try:
        return per_input(served, 1, **values)[0]
    except InputError as err:
        raise HTTPError(400, one_line(err), "prompt") from err


def _wants_words(form: Any, response_format: str, words_on: bool) -> bool:
    """Whether timestamp_granularities[] asks for words (OpenAI: only with verbose_json); 400 when this server
    cannot give them (started without --word-timestamps) or for a granularity other than segment and word."""
    granularities = form.getlist("timestamp_granularities[]")
    for granularity in granularities:
        if granularity not in ("segment", "word"):
            raise HTTPError(400, f"timestamp_granularities: {granularity!r} is not segment or word",
                            "timestamp_granularities[]")
    if "word" not in granularities:
        return False
    if not words_on:
        raise HTTPError(400, "timestamp_granularities: word timestamps are off on this server (start it with "
                        "`asr-spec serve --word-timestamps`, which needs chunking 'vad')", "timestamp_granularities[]")
    if response_format != "verbose_json":
        raise HTTPError(400, f"timestamp_granularities: word needs response_format verbose_json, got "
                        f"{response_format!r}", "timestamp_granularities[]")
    return True


def _temperature(value: Any) -> tuple[float, ...] | None:
    """The schedule of OpenAI's temperature field (see `Params.temperature`); 400 outside [0, 1]."""
    if value in (None, ""):
        return None
    try:
        temperature = float(value)
    except ValueError:
        temperature = math.nan
    if not 0.0 <= temperature <= 1.0:
        raise HTTPError(400, f"temperature {value!r}: must be a number in [0, 1] (0: raise it automatically while a "
                        "window fails Whisper's thresholds)", "temperature")
    return schedule_from(temperature)


def _check_language(value: Any, served: str | None) -> None:
    """A request may name the language the server decodes (e.g. "en"), nothing else: one batch, one language."""
    if not value:
        return
    if served is None or _language_code(value) != _language_code(served):
        mode = "detects the language of each upload" if served is None else f"decodes {served!r}"
        raise HTTPError(400, f"language {value!r}: this server {mode} (set with `asr-spec serve --language`); "
                        "a per-request language is not supported", "language")


def _language_code(value: str) -> str:
    from transformers.models.whisper.tokenization_whisper import TO_LANGUAGE_CODE

    code = value.strip().strip("<|>").lower()
    return TO_LANGUAGE_CODE.get(code, code)
