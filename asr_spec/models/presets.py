"""Presets: a model pair and its chunking/drafting settings, kept as TOML files in ``configs/``.

A preset is named after its file (``configs/large-v2.toml`` is ``"large-v2"``) or given as a path to any ``.toml``
file. Its keys (every one optional except ``target``; an unknown key is an error, not ignored)::

    target            model to transcribe with: hub id, local directory, CTranslate2 directory, "embedded:<name>"
    draft             draft model (same forms); left out = no draft, plain greedy decoding
    draft_optional    true: a draft given as a path that does not exist means greedy decoding, with a one-line
                      warning, instead of an error (hub ids are always loaded)
    chunk_length_s    seconds per window, at most 30
    stride_length_s   seconds of context per side, or [left, right]; left out = chunk_length_s / 6
    num_draft_tokens  draft tokens proposed per step
    language          "en", "english", ...; left out or "auto" = detect per chunk
    chunking          "vad" (speech chunks found by silero-vad, non-speech skipped, no overlap) or "stride"
                      (overlapping windows stitched at their seams, as transformers' pipeline does)
    word_timestamps   true: per-word times (json `words`) from the alignment heads; needs chunking "vad"
    max_words_per_cue srt/vtt cues of at most this many words (needs word_timestamps); left out = one per segment
    timestamps        true: Whisper's timestamp mode (its trained long-form mode: segment times from the model,
                      and no chunk given up after a word, as whisper-base does on tests/fixtures/speech/long_75s)
    dtype             "auto" (float16 on CUDA, float32 on CPU), "float32", "float16" or "bfloat16"
    description       one line for ``--help`` listings

Paths starting with ``./``, ``../`` or ``~`` are relative to the TOML file (resp. the home directory). Types are
checked here, with the file named in the message; value ranges are checked by the options they feed
(:class:`asr_spec.transcribe.TranscribeOptions`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from asr_spec.errors import InputError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

__all__ = ["DEFAULT_PRESET", "Preset", "available_presets", "load_preset", "presets_dir"]

log = logging.getLogger(__name__)

DEFAULT_PRESET = "base"  # the offline one: works with no network once asr-spec[offline] is installed
PRESET_SUFFIX = ".toml"
DTYPES = ("auto", "float32", "fp32", "float16", "fp16", "bfloat16", "bf16")
# Preset keys that become transcription options (the rest say which models to load, and how)
OPTION_KEYS = ("chunk_length_s", "stride_length_s", "num_draft_tokens", "language", "timestamps", "chunking",
               "word_timestamps", "max_words_per_cue")


@dataclass(frozen=True)
class Preset:
    """One preset, with relative paths already resolved. Derive variants with ``dataclasses.replace``."""

    name: str  # file stem, or the name it was built under
    target: str  # model id / directory (see the module docstring)
    draft: str | None = None  # None: no draft, greedy decoding
    draft_optional: bool = False  # a missing draft directory means greedy (with a warning) instead of an error
    chunk_length_s: float = 30.0  # seconds
    stride_length_s: float | tuple[float, float] | None = None  # seconds per side; None = chunk_length_s / 6
    num_draft_tokens: int = 5
    language: str | None = None  # None = detect per chunk
    timestamps: bool = False  # Whisper timestamp mode
    chunking: str = "stride"  # "vad" or "stride"
    word_timestamps: bool = False
    max_words_per_cue: int | None = None  # None: one cue per segment
    dtype: str = "auto"
    description: str = ""
    path: Path | None = None  # the TOML file it came from

    def __post_init__(self) -> None:
        _verify_preset(self)

    def option_values(self) -> dict[str, Any]:
        """The keys that become transcription options, as ``TranscribeOptions.from_values`` takes them."""
        return {key: getattr(self, key) for key in OPTION_KEYS}

    def draft_or_none(self) -> str | None:
        """The draft to load; None when there is none, or (with a one-line warning) when an optional draft
        directory is missing."""
        if self.draft is None or not self.draft_optional or not os.path.isabs(self.draft) or Path(self.draft).exists():
            return self.draft
        log.warning("preset %s: no draft at %s: running greedy (same transcript, no speed-up)", self.name, self.draft)
        return None


def _where(preset: Preset) -> str:
    return str(preset.path) if preset.path is not None else f"preset {preset.name}"


def _verify_preset(preset: Preset) -> None:
    """Type checks of every Preset field, in one place; messages name the file."""
    where = _where(preset)

    def bad(key: str, expected: str) -> InputError:
        return InputError(f"{where}: {key} must be {expected}, got {getattr(preset, key)!r}")

    if not isinstance(preset.target, str) or not preset.target.strip():
        raise bad("target", "a model id or path (a non-empty string)")
    if preset.draft is not None and (not isinstance(preset.draft, str) or not preset.draft.strip()):
        raise bad("draft", "a model id or path (a non-empty string), or left out")
    if preset.chunking not in ("vad", "stride"):
        raise bad("chunking", '"vad" or "stride"')
    cue = preset.max_words_per_cue
    if cue is not None and (isinstance(cue, bool) or not isinstance(cue, int)):
        raise bad("max_words_per_cue", "an integer")
    for key in ("draft_optional", "timestamps", "word_timestamps"):
        if not isinstance(getattr(preset, key), bool):
            raise bad(key, "true or false")
    if not _is_number(preset.chunk_length_s):
        raise bad("chunk_length_s", "a number of seconds")
    stride = preset.stride_length_s
    if stride is not None and not _is_number(stride) and not (
        isinstance(stride, tuple) and len(stride) == 2 and all(_is_number(v) for v in stride)
    ):
        raise bad("stride_length_s", "a number of seconds or a [left, right] pair")
    if isinstance(preset.num_draft_tokens, bool) or not isinstance(preset.num_draft_tokens, int):
        raise bad("num_draft_tokens", "an integer")
    if preset.language is not None and (not isinstance(preset.language, str) or not preset.language.strip()):
        raise bad("language", 'a language code or name, or "auto"')
    if preset.dtype not in DTYPES:
        raise bad("dtype", f"one of {', '.join(DTYPES)}")
    if not isinstance(preset.description, str):
        raise bad("description", "a string")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def presets_dir() -> Path:
    """``configs/`` at the top of the repository this package lives in (an editable install), or the copy a
    wheel carries inside the package."""
    package = Path(__file__).resolve().parent.parent
    repo = package.parent / "configs"
    return repo if repo.is_dir() else package / "configs"


def available_presets() -> list[str]:
    """Names of the presets in :func:`presets_dir`, sorted."""
    folder = presets_dir()
    return sorted(p.name[: -len(PRESET_SUFFIX)] for p in folder.glob(f"*{PRESET_SUFFIX}")) if folder.is_dir() else []


def _looks_like_path(name: str) -> bool:
    return name.endswith(PRESET_SUFFIX) or os.sep in name or "/" in name


def load_preset(name_or_path: str | os.PathLike[str]) -> Preset:
    """Load the preset called ``name_or_path`` (e.g. ``"large-v2"``), or the ``.toml`` file at that path.

    Raises ``InputError`` for an unknown name (listing the known ones), a missing or malformed file, an unknown key
    or a value of the wrong type.
    """
    text = os.fspath(name_or_path)
    if isinstance(name_or_path, os.PathLike) or _looks_like_path(text):
        path = Path(text).expanduser()
        if not path.is_file():
            raise InputError(f"{text}: no such preset file")
    else:
        path = presets_dir() / f"{text}{PRESET_SUFFIX}"
        if not path.is_file():
            known = ", ".join(available_presets()) or f"none found in {presets_dir()}"
            raise InputError(f"unknown preset {text!r} (known: {known}; or give the path of a .toml file)")
    try:
        table = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise InputError(f"{path}: cannot read the preset ({err})") from err
    return _from_table(table, path)


def _from_table(table: dict[str, Any], path: Path) -> Preset:
    allowed = [f.name for f in fields(Preset) if f.name not in ("name", "path")]
    unknown = sorted(set(table) - set(allowed))
    if unknown:
        raise InputError(f"{path}: unknown key(s) {', '.join(unknown)} (allowed: {', '.join(allowed)})")
    if "target" not in table:
        raise InputError(f"{path}: missing 'target' (the model to transcribe with)")
    values = dict(table)
    for key in ("target", "draft"):
        if isinstance(values.get(key), str):
            values[key] = _resolve_path(values[key], path.parent)
    if isinstance(values.get("stride_length_s"), list):
        values["stride_length_s"] = tuple(values["stride_length_s"])
    if isinstance(values.get("language"), str) and values["language"].strip().lower() == "auto":
        values["language"] = None
    return Preset(name=path.name.removesuffix(PRESET_SUFFIX), path=path, **values)


def _resolve_path(value: str, folder: Path) -> str:
    """``./x`` and ``../x`` relative to ``folder``, ``~/x`` to the home directory; anything else unchanged."""
    if value.startswith("~"):
        return str(Path(value).expanduser())
    if value.startswith(("./", "../")) or value in (".", ".."):
        return str((folder / value).resolve())
    return value
