"""Presets: a model pair and its chunking/drafting settings, kept as TOML files in ``configs/``.

A preset is named after its file (``configs/large-v2.toml`` is ``"large-v2"``) or given as a path to any ``.toml``
file. Its keys (every one optional except ``model``; an unknown key is an error, not ignored)::

    model             the target: the model to transcribe with: hub id, local directory, CTranslate2 directory,
                      "embedded:<name>"
    draft             draft model (same forms); left out = no draft, plain greedy decoding
    draft_optional    true: a draft given as a path that does not exist means greedy decoding, with a one-line
                      warning, instead of an error (hub ids are always loaded)
    share_encoder     true / false: the draft reads the target's encoder output / runs its own; left out = compare
                      the encoders (equal up to fp16 rounding = shared) and log the decision
    cpu_draft_max_rows  on a CPU, the draft decodes runs of at most this many chunks at a time (batch slots: the
                      batch size, or fewer chunks), larger runs are greedy (0, the default: greedy on a CPU unless
                      a draft is asked for); one number for every CPU run, or a table by decode class
                      (`asr_spec.models.cpu.DECODE_CLASSES`: "amx-bf16", "avx512-bf16" for bf16 runs on those
                      CPUs, "int8" for the int8 precision's runs, "fp32" for the rest), e.g. { amx-bf16 = 8,
                      avx512-bf16 = 8, int8 = 1, fp32 = 4 }; a class left out is 0 ("int8" left out: fp32's)
    chunk_length_s    seconds per window, at most 30
    stride_length_s   seconds of context per side, or [left, right]
    num_draft_tokens  draft tokens proposed per step (K); one number, or a table by decode class as
                      cpu_draft_max_rows', e.g. { amx-bf16 = 2, fp32 = 3 }: a CPU run takes its class's K, a class
                      left out and other devices the option's default (`DecodeOptions.num_draft_tokens`)

A preset's draft is used on CUDA in every run; on a CPU only in the runs ``cpu_draft_max_rows`` allows, or in every
run when a draft is asked for explicitly (``Transcriber.from_preset(name, draft=...)``, CLI ``--draft``): an fp32
CPU verify pass is compute-bound from a few rows on, so there a draft pays only with few rows; a bf16 one on AMX or
AVX-512 bf16 stays memory-bound longer (docs/cpu.md).
    language          "en", "english", ...; "auto" = detect it (once per file: `ChunkRequest.language_group`)
    chunking          "vad" (speech chunks found by silero-vad, non-speech skipped, no overlap) or "stride"
                      (overlapping windows stitched at their seams, as transformers' pipeline does)
    word_timestamps   true: per-word times (json `words`) from the alignment heads; needs chunking "vad"
    max_words_per_cue srt/vtt cues of at most this many words (needs word_timestamps); left out = one per segment
    max_line_width    srt/vtt cue text wrapped into lines of at most this many characters (at spaces)
    max_line_count    with max_line_width: cues of at most this many lines (needs word_timestamps)
    timestamps        true: Whisper's timestamp mode (its trained long-form mode: segment times from the model,
                      and no chunk given up after a word, as whisper-base does on tests/fixtures/speech/long_75s)
    dtype             "auto" (float16 on CUDA; on a CPU bfloat16 where native and lossless, else "int8" on an
                      AVX2 CPU where the kernel extension builds (fp32 weights, int8 encoder products), else float32:
                      `asr_spec.models.cpu.auto_choice`), "float32", "float16", "bfloat16" or "int8" (docs/cpu.md)
    description       one line for ``--help`` listings

A key left out means the default of the option it feeds, stated once where that option is defined
(:class:`asr_spec.audio.chunking.ChunkingOptions`, :class:`asr_spec.engine.DecodeOptions`, the dtype argument of
:meth:`asr_spec.transcribe.Transcriber.from_pretrained`); the Preset fields are None for "not set".

Paths starting with ``./``, ``../`` or ``~`` are relative to the TOML file (resp. the home directory). The keys
that choose and load models are checked here; the option values only where they become options, once
(:meth:`asr_spec.transcribe.Transcriber.from_preset`, with the file named in the message).
"""

from __future__ import annotations

import functools
import logging
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from asr_spec.checks import int_at_least
from asr_spec.errors import InputError
from asr_spec.logs import NOTICE
from asr_spec.models.cpu import DECODE_CLASSES, DTYPES, CpuCapabilities, class_entry, decode_class, resolve_precision

__all__ = ["DEFAULT_PRESET", "ModelPlan", "Preset", "available_presets", "load_preset", "plan_models",
           "presets_dir"]

log = logging.getLogger(__name__)

DEFAULT_PRESET = "base"  # the offline one: works with no network once asr-spec[offline] is installed
PRESET_SUFFIX = ".toml"
# dtype names a preset or --dtype may use: `cpu.DTYPES` (with "auto", `cpu.auto_dtype`)
# Preset keys that become transcription options (the rest say which models to load, and how)
OPTION_KEYS = ("chunk_length_s", "stride_length_s", "num_draft_tokens", "language", "timestamps", "chunking",
               "word_timestamps", "max_words_per_cue", "max_line_width", "max_line_count")


@dataclass(frozen=True)
class Preset:
    """One preset, with relative paths already resolved. Derive variants with ``dataclasses.replace``."""

    name: str  # file stem, or the name it was built under
    model: str  # the target: model id / directory (see the module docstring)
    draft: str | None = None  # None: no draft, greedy decoding
    draft_optional: bool = False  # a missing draft directory means greedy (with a warning) instead of an error
    share_encoder: bool | None = None  # None: decided by comparing the encoders (asr_spec.engine.pairing)
    # on a CPU the draft decodes runs of at most this many rows (0: none); or a {decode class: rows} table
    cpu_draft_max_rows: int | Mapping[str, int] = 0
    # The option values below: None = not set by the preset, the option's own default applies.
    chunk_length_s: float | None = None  # seconds
    stride_length_s: float | tuple[float, float] | None = None  # seconds per side, or (left, right)
    num_draft_tokens: int | Mapping[str, int] | None = None  # or a {decode class: K} table (`draft_tokens`)
    language: str | None = None  # "auto": detect it per file (TranscribeOptions.from_values reads it so)
    timestamps: bool | None = None  # Whisper timestamp mode
    dtype: str | None = None
    chunking: str | None = None  # "vad" or "stride"
    word_timestamps: bool | None = None
    max_words_per_cue: int | None = None  # None: one cue per segment
    max_line_width: int | None = None  # None: a cue's text on one line
    max_line_count: int | None = None  # None: as many lines as its words take
    description: str = ""
    path: Path | None = None  # the TOML file it came from

    def __post_init__(self) -> None:
        _verify_preset(self)

    def option_values(self) -> dict[str, Any]:
        """The keys the preset sets that become transcription options, as ``TranscribeOptions.from_values`` takes
        them (keys left out are absent, so the options' own defaults apply)."""
        values = {key: getattr(self, key) for key in OPTION_KEYS if getattr(self, key) is not None}
        if isinstance(self.num_draft_tokens, Mapping):  # a table: decided per run by `plan_models`
            del values["num_draft_tokens"]
        return values

    def cpu_draft_rows(self, decode_class: str) -> int:
        """`cpu_draft_max_rows` for a CPU run of `decode_class` (`asr_spec.models.cpu.decode_class`)."""
        rows = self.cpu_draft_max_rows
        if isinstance(rows, int):
            return rows
        entry = class_entry(rows, decode_class)
        return 0 if entry is None else entry

    def draft_tokens(self, decode_class: str | None) -> int | None:
        """The K of a `num_draft_tokens` table for a run of `decode_class` (None: not a CPU run); None where the
        table leaves the class out or the preset has no table (a plain K is one of its `option_values`)."""
        k = self.num_draft_tokens
        if not isinstance(k, Mapping) or decode_class is None:
            return None
        return class_entry(k, decode_class)

    def draft_or_none(self) -> str | None:
        """The draft to load; None when there is none, or (with a one-line warning) when an optional draft
        directory is missing."""
        if self.draft is None or not self.draft_optional or not os.path.isabs(self.draft) or Path(self.draft).exists():
            return self.draft
        log.warning("preset %s: no draft at %s: running greedy (same transcript, no speed-up)", self.name, self.draft)
        return None


def _draft_for_language(preset: Preset, draft: str, language: str | None) -> str | None:
    """The preset's draft, or None when the run's language is given and the draft was distilled on another one only
    (`drafts.trained_language`): on German and Spanish the English-distilled base draft had 13 % of its tokens
    accepted and made the run 1.35x slower, the same text. Detected languages ("auto") keep it."""
    from asr_spec.engine.options import is_auto, language_code
    from asr_spec.models.drafts import trained_language

    if language is None or is_auto(language):
        return draft
    trained = trained_language(draft)
    try:
        wanted = language_code(str(language))
    except ValueError:
        return draft  # the options' own check names it
    if trained is None or trained == wanted:
        return draft
    _note_once(f"preset {preset.name}: greedy for language {wanted!r} (its draft {draft} was distilled on "
               f"{trained!r} speech only: pass --draft to use it anyway)")
    return None


@functools.cache
def _note_once(message: str) -> None:
    """`message` as a note, once a process (a command plans its models twice: to check them, then to load them)."""
    log.info("%s", message, extra=NOTICE)


MODEL_KEYS = ("model", "draft", "dtype", "device")  # the overrides that choose and load models (not options)


@dataclass(frozen=True)
class ModelPlan:
    """What a run loads and how its draft is gated: the decision of `plan_models`, the one place it is made."""

    model: str  # the target to load
    draft: str | None  # the draft to load; None: greedy decoding (no draft loaded)
    dtype: str | None  # None / "auto": `cpu.auto_choice` (fp16 on CUDA; CPU: bf16, int8 or fp32)
    share_encoder: bool | None  # see `Preset.share_encoder`
    # DecodeOptions.draft_max_rows: the draft decodes only runs of at most this many rows; None: every run
    draft_max_rows: int | None
    # DecodeOptions.num_draft_tokens of a preset's table for this run's decode class; None: the preset's plain
    # value, or the option's default (`Preset.option_values` carries a plain value)
    num_draft_tokens: int | None = None


def plan_models(preset: Preset, device_type: str, overrides: Mapping[str, Any] | None = None, *,
                every_run: bool = False, cpu: CpuCapabilities | None = None) -> ModelPlan:
    """The one draft decision: from a preset, the device type ("cpu", "cuda", ...) and the caller's overrides
    (any of `MODEL_KEYS`, and `draft_max_rows`; a key absent = not given), which models to load and which runs the
    draft decodes. Every caller uses it: `Transcriber.from_preset` (CLI, API, server), eval and the benchmarks.

    - `draft` given (None included: off): that draft, in every run (unless `draft_max_rows` is given too);
    - `model` given without `draft`: no draft (the preset's draft belongs to its model);
    - `every_run` (evaluating or benchmarking the preset's draft: asking for it): the preset's draft
      (`draft_or_none`) on any device, in every run;
    - else the preset's draft (`draft_or_none`): on CUDA in every run; on a CPU in the runs of at most
      `cpu_draft_max_rows` rows of the run's decode class (`cpu.decode_class` of the dtype the run resolves to, on
      `cpu`, None: this machine's), and not loaded at all when that is 0 (an fp32 verify pass is compute-bound
      from a few rows on, a bf16 one on native bf16 products much later: docs/cpu.md).
    """
    overrides = {} if overrides is None else overrides
    dtype = overrides.get("dtype", preset.dtype)
    run_class = (decode_class(resolve_precision(dtype, torch.device("cpu"), cpu), cpu) if device_type == "cpu"
                 else None)
    cpu_rows = 0
    if run_class is not None and not ({"draft", "model"} & set(overrides)) and not every_run:
        cpu_rows = preset.cpu_draft_rows(run_class)
    table_k = preset.draft_tokens(run_class)  # K of a table by decode class (a plain K is an option value)
    if "draft" in overrides:
        draft, rows = overrides["draft"], None
    elif "model" in overrides:
        draft, rows = None, None
    elif every_run or device_type == "cuda":
        draft, rows = preset.draft_or_none(), None
    elif cpu_rows == 0:
        if preset.draft is not None:
            log.info("preset %s: greedy on %s (its draft %s is used on CUDA; pass draft= to use it here)",
                     preset.name, device_type, preset.draft)
        draft, rows = None, None
    else:
        draft, rows = preset.draft_or_none(), cpu_rows
    if draft is not None and "draft" not in overrides and not every_run:
        draft = _draft_for_language(preset, draft, overrides.get("language", preset.language))
    if draft is None:  # nothing drafts: no rows, no K
        rows = table_k = None
        _no_draft_for_k(overrides)
    rows = overrides.get("draft_max_rows", rows)
    return ModelPlan(overrides.get("model", preset.model), draft, dtype, preset.share_encoder, rows, table_k)


def _no_draft_for_k(overrides: Mapping[str, Any]) -> None:
    """A K given where no draft runs (it was taken and ignored without a word): refused beside draft=None (they
    contradict each other, as --no-draft and --draft do), else a note (a preset without a draft, or whose draft sits
    this language out)."""
    if overrides.get("num_draft_tokens") is None:
        return
    if "draft" in overrides:
        raise InputError("num_draft_tokens was given with no draft (draft=None, --no-draft): give one or the other")
    log.info("num_draft_tokens %s has no effect: no draft runs", overrides["num_draft_tokens"], extra=NOTICE)


def _where(preset: Preset) -> str:
    return str(preset.path) if preset.path is not None else f"preset {preset.name}"


def _verify_class_table(where: str, key: str, value: int | Mapping[str, int], minimum: int, hint: str) -> None:
    """InputError naming the file unless `value` is an integer >= minimum or a {decode class: such integer}
    table (`cpu.DECODE_CLASSES`)."""
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(DECODE_CLASSES))
        if unknown:
            raise InputError(f"{where}: {key} has unknown class(es) {', '.join(map(str, unknown))} "
                             f"(known: {', '.join(DECODE_CLASSES)})")
    try:
        for name, number in (value.items() if isinstance(value, Mapping) else [("", value)]):
            int_at_least(number, f"{key}{'.' + name if name else ''}", minimum)
    except ValueError as err:
        raise InputError(f"{where}: {err}{hint}") from err


def _verify_preset(preset: Preset) -> None:
    """Type checks of every Preset field, in one place; messages name the file."""
    where = _where(preset)

    def bad(key: str, expected: str) -> InputError:
        return InputError(f"{where}: {key} must be {expected}, got {getattr(preset, key)!r}")

    if not isinstance(preset.model, str) or not preset.model.strip():
        raise bad("model", "a model id or path (a non-empty string)")
    if preset.draft is not None and (not isinstance(preset.draft, str) or not preset.draft.strip()):
        raise bad("draft", "a model id or path (a non-empty string), or left out")
    if not isinstance(preset.draft_optional, bool):
        raise bad("draft_optional", "true or false")
    _verify_class_table(where, "cpu_draft_max_rows", preset.cpu_draft_max_rows, 0, " (0: no draft on a CPU)")
    if isinstance(preset.num_draft_tokens, Mapping):  # a plain value is checked where it becomes an option
        _verify_class_table(where, "num_draft_tokens", preset.num_draft_tokens, 1, "")
    if preset.dtype is not None and (not isinstance(preset.dtype, str) or (preset.dtype != "auto"
                                                                             and preset.dtype not in DTYPES)):
        raise bad("dtype", f"one of auto, {', '.join(DTYPES)}")
    if preset.share_encoder is not None and not isinstance(preset.share_encoder, bool):
        raise bad("share_encoder", "true or false, or left out")
    if not isinstance(preset.description, str):
        raise bad("description", "a string")


def presets_dir() -> Path:
    """The copy of the presets a wheel carries inside the package, or ``configs/`` at the top of the repository
    this package lives in (an editable install): `presets_dir_of`."""
    return presets_dir_of(Path(__file__).resolve().parent.parent)


def presets_dir_of(package: Path) -> Path:
    """The presets of the package at `package`: its own ``configs/`` where it has one (a wheel's), else the
    ``configs/`` beside it (the repository of an editable install). The package's copy first: beside an installed
    package lies site-packages, where another distribution may have put a ``configs/`` of its own."""
    inside = package / "configs"
    return inside if inside.is_dir() else package.parent / "configs"


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
    if "model" not in table:
        raise InputError(f"{path}: missing 'model' (the target: the model to transcribe with)")
    values = dict(table)
    for key in ("model", "draft"):
        if isinstance(values.get(key), str):
            values[key] = _resolve_path(values[key], path.parent)
    if isinstance(values.get("stride_length_s"), list):
        values["stride_length_s"] = tuple(values["stride_length_s"])
    return Preset(name=path.name.removesuffix(PRESET_SUFFIX), path=path, **values)


def _resolve_path(value: str, folder: Path) -> str:
    """``./x`` and ``../x`` relative to ``folder``, ``~/x`` to the home directory; anything else unchanged."""
    if value.startswith("~"):
        return str(Path(value).expanduser())
    if value.startswith(("./", "../")) or value in (".", ".."):
        return str((folder / value).resolve())
    return value
