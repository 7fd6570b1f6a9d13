"""EvalOptions: one evaluation run, validated in one place; LibriSpeech split names (hub only)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asr_spec.checks import int_at_least
from asr_spec.errors import InputError

__all__ = ["EvalOptions", "LibriSplit", "check_run_args", "parse_split"]

GROUP_BATCHES = 4  # default group: this many engine batches of utterances per Transcriber call
SETUP_VERSION = 2  # a kept setup as it resolves (`EvalOptions.resolved_setup`); the first kept what was typed


@dataclass(frozen=True)
class LibriSplit:
    """One LibriSpeech split under its three names."""

    name: str  # what --split takes: "test.clean"
    hub_config: str  # datasets config of openslr/librispeech_asr: "clean" | "other"
    hub_split: str  # datasets split inside that config: "test", "validation", "train.100", ...
    local_dir: str  # folder of the original tarballs: "test-clean"


_SPLITS = tuple(
    LibriSplit(name, config, hub_split, local)
    for name, config, hub_split, local in [
        ("test.clean", "clean", "test", "test-clean"),
        ("test.other", "other", "test", "test-other"),
        ("validation.clean", "clean", "validation", "dev-clean"),
        ("validation.other", "other", "validation", "dev-other"),
        ("train.clean.100", "clean", "train.100", "train-clean-100"),
        ("train.clean.360", "clean", "train.360", "train-clean-360"),
        ("train.other.500", "other", "train.500", "train-other-500"),
    ]
)


def parse_split(name: str) -> LibriSplit:
    """"test.clean", "test-clean" (the local folder name) or "dev.clean"/"dev-clean" -> its `LibriSplit`."""
    key = str(name).strip().lower().replace("-", ".").replace("_", ".")
    key = "validation" + key[3:] if key.startswith("dev.") else key
    for split in _SPLITS:
        if key in (split.name, split.local_dir.replace("-", ".")):
            return split
    raise InputError(f"unknown LibriSpeech split {name!r} (known: {', '.join(s.name for s in _SPLITS)})")


def check_run_args(limit: Any, batch_size: Any, group_size: Any) -> None:
    """The checks of the run arguments that `EvalOptions` and `run_eval` share (None = not given)."""
    if limit is not None:
        int_at_least(limit, "limit", 0)
    for name, value in (("batch_size", batch_size), ("group_size", group_size)):
        if value is not None:
            int_at_least(value, name, 1)


@dataclass(frozen=True)
class EvalOptions:
    """One evaluation run. `evaluate` loads the models from `preset` and the data from `data_dir` or the hub.

    Every field left None means the default of the option it feeds, stated where that option is defined.
    """

    preset: str | None = None  # preset name or .toml path (asr_spec.models.presets); None = DEFAULT_PRESET
    split: str = "test.clean"  # hub: a split name (see parse_split); local: any folder name under data_dir
    data_dir: str | None = None  # a local LibriSpeech tree (holding <split>/ or being it); None = the hub
    limit: int | None = None  # first N utterances (long-form: chapters) of the split; None = all
    long_form: bool = False  # one input per chapter, its utterances end to end (librispeech.long_form)
    compare_greedy: bool = False  # decode each group again without the draft; log greedy_hyp, identical_to_greedy
    batch_size: int | None = None  # engine rows; None = TranscribeOptions.batch_size
    group_size: int | None = None  # units per Transcriber call; None = GROUP_BATCHES * batch_size (long-form: x1)
    output: str | None = None  # the JSONL log; None = runs/<preset>-<split>[-long].jsonl
    model: str | None = None  # replaces the preset's model (and drops its draft, as Transcriber.from_preset)
    draft: str | None = None  # replaces the preset's draft
    device: str | None = None  # "cpu", "cuda", "cuda:1"; None = CUDA when available
    dtype: str | None = None  # "float32", "float16", "bfloat16", "auto"; None = the preset's
    language: str | None = None  # None = the preset's ("auto" = detected once per file)
    no_draft: bool = False  # greedy decoding only (the preset's draft is not loaded)
    streaming: bool = True  # hub only: stream the split instead of downloading it whole
    ray: bool = False  # transcribe on a Ray cluster (asr_spec.distributed): one actor per worker, local tree only
    ray_address: str | None = None  # with ray: the cluster; None = RAY_ADDRESS, else a local Ray
    workers: int = 1  # with ray: transcription actors
    threads_per_worker: int = 1  # with ray: torch threads of each CPU actor (`distributed.RayOptions`)

    def __post_init__(self) -> None:
        _verify_eval_options(self)

    @property
    def split_name(self) -> str:
        """The split as logs and titles name it: the hub name ("test.clean"), or a local folder as given."""
        if self.data_dir is None:
            return parse_split(self.split).name
        try:
            return parse_split(self.split).name
        except InputError:
            return self.split

    def local_dir(self) -> str:
        """The folder of the split under `data_dir`: `split` itself when such a folder exists (any name works),
        else the original folder of a hub split name ("test.clean" -> "test-clean")."""
        root = Path(self.data_dir or ".")
        if (root / self.split).is_dir() or root.name == self.split:
            return self.split
        try:
            return parse_split(self.split).local_dir
        except InputError:
            return self.split  # iter_local names the missing folder

    def preset_name(self) -> str:
        from asr_spec.models.presets import DEFAULT_PRESET

        return DEFAULT_PRESET if self.preset is None else self.preset

    def output_path(self) -> Path:
        if self.output is not None:
            return Path(self.output)
        preset = self.preset_name()
        stem = Path(preset).stem if preset.endswith(".toml") else preset
        return Path("runs") / f"{stem}-{self.split_name}{'-long' if self.long_form else ''}.jsonl"

    def setup(self) -> dict[str, Any]:
        """What makes a log's records what they are, as they resolve (`resolved_setup`: not as typed, so
        `--data-dir ls/test-clean` and `ls`, a model's relative and absolute path, `--language English` and `en`
        are one setup): the models, the language, the data and the checks made; a run resumes a log only with the
        same (`evaluate.open_log`). The device and dtype are checked as the precision the loaded models run in
        (`evaluate.check_precision`: `--device cpu` on a machine without CUDA is the default's). batch_size,
        group_size, limit and Ray's workers are left out: they change how fast, not what is written."""
        return self.resolved_setup({
            "preset": self.preset_name(), "model": self.model, "draft": None if self.no_draft else self.draft,
            "no_draft": self.no_draft, "language": self.language, "data": self.data_dir or "hub",
            "split": self.split_name, "long_form": self.long_form, "compare_greedy": self.compare_greedy})

    def resolved_setup(self, typed: dict[str, Any]) -> dict[str, Any]:
        """A setup's values as they resolve: `typed` is this run's values as given, or a setup kept before setups
        were resolved (no "version": its data folder, language and models as typed, with device and dtype, which
        the precision check now stands for; a log of those was refused by every resume after the change)."""
        resolved = {key: value for key, value in typed.items() if key not in ("device", "dtype")}
        data = typed.get("data")
        if data not in (None, "hub"):
            root, folder = Path(data), self.local_dir()
            resolved["data"] = os.path.abspath(root / folder if (root / folder).is_dir() else root)
        resolved["model"], resolved["draft"] = _resolved(typed.get("model")), _resolved(typed.get("draft"))
        resolved["language"] = _language(typed.get("language"), str(typed.get("preset") or self.preset_name()))
        resolved["version"] = SETUP_VERSION
        return resolved

    def model_overrides(self) -> dict[str, Any]:
        """The options that choose and load the models (for `Transcriber.from_preset`), those given only."""
        keys = ("model", "draft", "device", "dtype", "language", "batch_size")
        overrides = {key: getattr(self, key) for key in keys if getattr(self, key) is not None}
        if self.no_draft:
            overrides["draft"] = None
        return overrides


def _language(language: str | None, preset: str) -> str | None:
    """The language a run decodes: its code ("en"), or None where detected ("auto": once per file); the preset's where
    not given. Read as the transcriber reads it (`TranscribeOptions.from_values`: "auto", and the check)."""
    from asr_spec.engine.options import language_code
    from asr_spec.models.presets import load_preset
    from asr_spec.transcribe.options import TranscribeOptions

    if language is None:
        language = load_preset(preset).option_values().get("language")
    decoded = TranscribeOptions.from_values(language=language).decode.language
    return None if decoded is None else language_code(decoded)


def _resolved(name: str | None) -> str | None:
    """A model given as a folder, by its absolute path (a hub id or an embedded name as it is)."""
    return os.path.abspath(name) if name is not None and os.path.exists(name) else name


def _verify_eval_options(o: EvalOptions) -> None:
    if not isinstance(o.split, str) or not o.split.strip():
        raise InputError(f"split must be a split name or folder name, got {o.split!r}")
    if o.data_dir is None:
        parse_split(o.split)  # the hub knows only its own split names; a local tree takes any folder
    check_run_args(o.limit, o.batch_size, o.group_size)
    if o.compare_greedy and o.no_draft:
        raise InputError("compare_greedy needs a draft: it compares speculative decoding with greedy (drop no_draft)")
    if o.no_draft and o.draft is not None:
        raise InputError("no_draft and draft contradict each other: give one")
    if o.ray and (o.data_dir is None or o.long_form or o.compare_greedy):
        raise InputError("ray runs utterance files of a local tree: give data_dir, without long_form or compare_greedy")
    int_at_least(o.workers, "workers", 1)
    int_at_least(o.threads_per_worker, "threads_per_worker", 1)
    if not o.ray and (o.ray_address is not None or o.workers != 1 or o.threads_per_worker != 1):
        raise InputError("ray_address, workers and threads_per_worker are options of ray: turn it on (--ray) or "
                         "drop them")
    if o.data_dir is not None and not Path(o.data_dir).is_dir():
        raise InputError(f"{o.data_dir}: no such directory (data_dir must be a LibriSpeech tree)")
