"""LibriSpeech evaluation: transcribe utterances, log one record each, resume, check against greedy, summarise.

    iter_local / iter_hub ──take(limit)──► [long_form per chapter] ──skip ResultsLog.done_ids()──► groups of
    group_size ──Transcriber.transcribe──► [the same group again, greedy] ──► ResultsLog.append (one fsync'ed line
    per utterance) ──► summarize(log) + speed-up ──► <log>.summary.json and a printed table

Utterances go to the Transcriber a group at a time (`group_size`, default 4 × batch_size; long-form chapters, which
are minutes long and many chunks each, batch_size at a time) so that its batch stays full across utterances while a
killed run loses at most one group: rerunning with the same log skips every id already in it. `--limit N` means
the first N utterances (long-form: chapters) of the split, resumed or not.

Timing. A group is timed as a whole (warm models, device synchronised before each clock read) and its wall time is
shared among its utterances in proportion to their audio length, so that the log's `wall_s` sum to the real wall
time and RTFx = Σ audio_s / Σ wall_s is the throughput of the batched run. (`Transcription.wall_s`, the latency of
one utterance inside its batch, overlaps the others' and is kept as `latency_s`.) With --compare-greedy the same
group is then decoded by the same target without a draft: `greedy_wall_s` is timed the same way, and speed-up =
Σ greedy_wall_s / Σ wall_s.

Record fields (those `asr_spec.librispeech.summarize` reads, plus more): id, ref, hyp, audio_s, wall_s, latency_s,
language, chunks, generated_tokens, target_passes, draft_passes, draft_tokens, accepted_tokens, accepted_hist,
parts (long-form: the utterance ids joined), error (a failed utterance, one line); with --compare-greedy:
greedy_hyp, greedy_wall_s, greedy_generated_tokens, identical_to_greedy (the same token ids in every chunk, so
the same text and segments).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from asr_spec.audio.loading import SAMPLE_RATE
from asr_spec.errors import AsrSpecError, InputError, one_line, show_warning_line
from asr_spec.eval.librispeech import HubUnavailableError, ResultsLog, Utterance, iter_hub, iter_local, long_form, summarize, take

__all__ = [
    "EvalOptions",
    "EvalRun",
    "LibriSplit",
    "eval_main",
    "eval_summary",
    "evaluate",
    "format_summary",
    "parse_split",
    "run_eval",
    "utterances",
]

GROUP_BATCHES = 4  # default group: this many engine batches of utterances per Transcriber call
WARMUP_SAMPLES = 30 * SAMPLE_RATE  # warm-up input: at most one 30 s window of the first unit
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


# -- splits ------------------------------------------------------------------------------------------------------

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


# -- options -----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class EvalOptions:
    """One evaluation run. `evaluate` loads the models from `preset` and the data from `data_dir` or the hub."""

    preset: str = "base"  # preset name or .toml path (asr_spec.presets)
    split: str = "test.clean"  # see parse_split
    data_dir: str | None = None  # a local LibriSpeech tree (holding <split>/ or being it); None = the hub
    limit: int | None = None  # first N utterances (long-form: chapters) of the split; None = all
    long_form: bool = False  # one input per chapter, its utterances end to end (librispeech.long_form)
    compare_greedy: bool = False  # decode each group again without the draft; log greedy_hyp, identical_to_greedy
    batch_size: int | None = None  # engine rows; None = the preset's
    group_size: int | None = None  # units per Transcriber call; None = GROUP_BATCHES * batch_size (long-form: x1)
    output: str | None = None  # the JSONL log; None = runs/<preset>-<split>[-long].jsonl
    device: str | None = None  # "cpu", "cuda", "cuda:1"; None = CUDA when available
    dtype: str | None = None  # "float32", "float16", "bfloat16", "auto"; None = the preset's
    language: str | None = None  # None = the preset's ("auto" = detect per chunk)
    no_draft: bool = False  # greedy decoding only (the preset's draft is not loaded)
    streaming: bool = True  # hub only: stream the split instead of downloading it whole

    def __post_init__(self) -> None:
        _verify_eval_options(self)

    @property
    def libri_split(self) -> LibriSplit:
        return parse_split(self.split)

    def output_path(self) -> Path:
        if self.output is not None:
            return Path(self.output)
        stem = Path(self.preset).stem if self.preset.endswith(".toml") else self.preset
        return Path("runs") / f"{stem}-{self.libri_split.name}{'-long' if self.long_form else ''}.jsonl"


def _is_count(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _verify_eval_options(o: EvalOptions) -> None:
    parse_split(o.split)
    if o.limit is not None and not _is_count(o.limit, 0):
        raise InputError(f"limit must be an integer >= 0, got {o.limit!r}")
    for name in ("batch_size", "group_size"):
        value = getattr(o, name)
        if value is not None and not _is_count(value, 1):
            raise InputError(f"{name} must be an integer >= 1, got {value!r}")
    if o.compare_greedy and o.no_draft:
        raise InputError("compare_greedy needs a draft: it compares speculative decoding with greedy (drop no_draft)")
    if o.data_dir is not None and not Path(o.data_dir).is_dir():
        raise InputError(f"{o.data_dir}: no such directory (data_dir must be a LibriSpeech tree)")


# -- data --------------------------------------------------------------------------------------------------------

def utterances(options: EvalOptions) -> Iterator[Utterance]:
    """The split's utterances from `options.data_dir`, or from the hub when it is None. Errors (no such split
    folder, hub unreachable) are raised by the first `next`, as one line naming the fix."""
    split = options.libri_split
    if options.data_dir is not None:
        yield from iter_local(options.data_dir, split.local_dir)
        return
    try:
        yield from iter_hub(split.hub_config, split.hub_split, streaming=options.streaming)
    except HubUnavailableError as err:
        cause = str(err).split("; pass a local", 1)[0]
        fix = f"pass --data-dir DIR (a local LibriSpeech tree with {split.local_dir}/)"
        raise HubUnavailableError(f"{cause}; {fix}") from err


def _units(items: Iterable[Utterance], *, limit: int | None, as_long_form: bool,
           done: set[str]) -> Iterator[tuple[str, Callable[[], Utterance]]]:
    """(id, make) for the first `limit` evaluation units not in `done`; `make` builds the unit (long-form: joins
    its chapter's audio) only when called, so skipped chapters are never loaded."""
    if not as_long_form:
        for u in take(items, limit):
            if u.id not in done:
                yield u.id, (lambda u=u: u)
        return
    chapters = itertools.groupby(items, key=lambda u: (u.speaker, u.chapter))
    for (speaker, chapter), group in itertools.islice(chapters, limit):
        unit_id = f"{speaker}-{chapter}"  # the id long_form gives the joined chapter
        if unit_id in done:
            continue
        parts = list(group)
        yield unit_id, (lambda parts=parts: next(long_form(parts)))


# -- running -----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class EvalRun:
    """What one `run_eval` call did."""

    n_done: int  # records appended by this call
    n_skipped: int  # units already in the log (resumed)
    n_failed: int  # of n_done, records with an error
    n_not_identical: int  # of n_done, speculative tokens != greedy tokens (must be 0)
    wall_s: float  # seconds this call spent decoding (warm-up excluded)


def _source(u: Utterance) -> Any:
    """What the Transcriber takes for `u`: a file path (streamed) or an in-memory array."""
    if isinstance(u.audio, (str, os.PathLike)):
        return os.fspath(u.audio)
    return {"array": u.audio, "sampling_rate": u.sampling_rate}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_transcribe(transcriber: Any, sources: list[Any], batch_size: int) -> tuple[list[Any], float]:
    _sync(transcriber.device)
    start = time.perf_counter()
    results = transcriber.transcribe(sources, batch_size=batch_size, progress=False)
    _sync(transcriber.device)
    return results, time.perf_counter() - start


def _share(wall_s: float, audio_s: Sequence[float]) -> list[float]:
    """`wall_s` split in proportion to `audio_s` (equal shares when there is no audio)."""
    total = sum(audio_s)
    if total <= 0:
        return [wall_s / len(audio_s)] * len(audio_s)
    return [wall_s * a / total for a in audio_s]


def _identical(a: Any, b: Any) -> bool:
    """Speculative and greedy decoding agree token for token in every chunk (and hence in text and segments)."""
    return a.chunk_tokens == b.chunk_tokens and a.text == b.text and a.segments == b.segments


def _record(u: Utterance, t: Any, wall_s: float, greedy: tuple[Any, float] | None) -> dict[str, Any]:
    record: dict[str, Any] = {"id": u.id, "ref": u.text, "hyp": t.text, "audio_s": t.audio_s or u.duration_s,
                              "wall_s": wall_s, "latency_s": t.wall_s}
    if u.parts:
        record["parts"] = list(u.parts)
    if t.error is not None:
        record["error"] = t.error
        return record
    s = t.stats
    record.update(language=t.language, chunks=s.chunks, generated_tokens=s.generated_tokens,
                  target_passes=s.target_passes, draft_passes=s.draft_passes, draft_tokens=s.drafted_tokens,
                  accepted_tokens=s.accepted_tokens, accepted_hist=list(s.accepted_hist))
    if greedy is not None:
        g, g_wall_s = greedy
        if g.error is not None:  # the same audio failed greedy but not speculative: a bug, never an ignored row
            record["error"] = f"greedy decoding failed ({g.error})"
            return record
        record.update(greedy_hyp=g.text, greedy_wall_s=g_wall_s, greedy_generated_tokens=g.stats.generated_tokens,
                      identical_to_greedy=_identical(t, g))
    return record


def _greedy_twin(transcriber: Any) -> Any:
    """The same target, processor and options without the draft (no weights copied)."""
    from asr_spec.transcribe import Transcriber

    return Transcriber(transcriber.target, None, transcriber.processor, transcriber.options, transcriber.device)


def run_eval(
    transcriber: Any,
    items: Iterable[Utterance],
    results: ResultsLog | str | os.PathLike,
    *,
    limit: int | None = None,
    as_long_form: bool = False,
    compare_greedy: bool = False,
    batch_size: int | None = None,
    group_size: int | None = None,
    warmup: bool = True,
    on_record: Callable[[dict[str, Any]], None] | None = None,
) -> EvalRun:
    """Transcribe `items` (minus the ids already in `results`) a group at a time and append one record each.

    transcriber: a `Transcriber`; with compare_greedy it must have a draft, and its greedy twin (same target, no
                 draft) decodes every group again.
    items:       utterances in corpus order (iter_local / iter_hub); `limit` keeps the first N (long-form: the
                 first N chapters) before resumed ids are skipped, so a resumed run covers the same units.
    warmup:      decode the first unit once, untimed, with each model before timing anything.
    on_record:   called with each record once it is on disk (progress printing).
    """
    log_ = results if isinstance(results, ResultsLog) else ResultsLog(results)
    rows = transcriber.options.batch_size if batch_size is None else batch_size
    if group_size is None:  # long-form units are whole chapters (minutes, many chunks each): fewer per group
        group_size = rows if as_long_form else GROUP_BATCHES * rows
    group = group_size
    if not _is_count(rows, 1) or not _is_count(group, 1):
        raise InputError(f"batch_size and group_size must be integers >= 1, got {rows!r} and {group!r}")
    if limit is not None and not _is_count(limit, 0):
        raise InputError(f"limit must be an integer >= 0, got {limit!r}")
    if compare_greedy and transcriber.draft is None:
        raise InputError("compare_greedy: the transcriber has no draft, so there is nothing to compare with greedy")
    greedy = _greedy_twin(transcriber) if compare_greedy else None
    done = log_.done_ids()
    units = _units(items, limit=limit, as_long_form=as_long_form, done=done)
    n_done = n_failed = n_not_identical = 0
    wall_total = 0.0
    warmed = not warmup
    for n_group in itertools.count():
        batch = list(itertools.islice(units, group))
        if not batch:
            break
        utts = [make() for _, make in batch]
        sources = [_source(u) for u in utts]
        if not warmed:  # the first chunk of the first unit, once per model, untimed
            warm = {"array": utts[0].load()[:WARMUP_SAMPLES], "sampling_rate": SAMPLE_RATE}
            for model in (transcriber, greedy):
                if model is not None:
                    model.transcribe([warm], batch_size=rows, progress=False)
            warmed = True
        plain: list[Any] = []
        greedy_wall_s = 0.0
        greedy_first = greedy is not None and n_group % 2 == 1  # alternate the order: neither always runs first
        if greedy_first:
            plain, greedy_wall_s = _timed_transcribe(greedy, sources, rows)
        spec, wall_s = _timed_transcribe(transcriber, sources, rows)
        if greedy is not None and not greedy_first:
            plain, greedy_wall_s = _timed_transcribe(greedy, sources, rows)
        audio_s = [t.audio_s or u.duration_s for t, u in zip(spec, utts)]
        shares = _share(wall_s, audio_s)
        greedy_pairs: list[tuple[Any, float] | None] = [None] * len(utts)
        if greedy is not None:
            greedy_pairs = list(zip(plain, _share(greedy_wall_s, audio_s)))
        wall_total += wall_s + greedy_wall_s
        for u, t, share, pair in zip(utts, spec, shares, greedy_pairs):
            record = _record(u, t, share, pair)
            log_.append(record)
            n_done += 1
            n_failed += bool(record.get("error"))
            n_not_identical += record.get("identical_to_greedy") is False
            if on_record is not None:
                on_record(record)
    return EvalRun(n_done, len(done), n_failed, n_not_identical, wall_total)


# -- summary -----------------------------------------------------------------------------------------------------

def eval_summary(path: str | os.PathLike, **summarize_kwargs: Any) -> dict[str, Any]:
    """`librispeech.summarize` of the log, plus the figures of the speculative run:

    mean_accepted_per_target_pass  accepted draft tokens / target passes
    target_passes_per_token        target passes / generated tokens (1 for greedy; lower is better)
    accepted_hist                  steps that accepted j draft tokens, summed over the records that have it
    identical_fraction             n_identical_to_greedy / n_greedy_checked (with --compare-greedy; must be 1)
    greedy_wall_s, speedup         Σ greedy_wall_s / Σ wall_s over the records that have both
    greedy_rtfx                    Σ audio_s / Σ greedy_wall_s over the same records
    """
    path = Path(path)
    summary = summarize(path, **summarize_kwargs)
    scored = [r for r in ResultsLog(path).records() if not r.get("error")]
    scored = list({r["id"]: r for r in scored}.values())  # a repeated id keeps its last record, as in summarize
    if summary.get("target_passes"):
        summary["target_passes_per_token"] = summary["target_passes"] / summary["generated_tokens"] \
            if summary["generated_tokens"] else math.nan
        with_both = [r for r in scored if "accepted_tokens" in r and "target_passes" in r]
        passes = sum(r["target_passes"] for r in with_both)
        summary["mean_accepted_per_target_pass"] = sum(r["accepted_tokens"] for r in with_both) / passes \
            if passes else math.nan
    hists = [r["accepted_hist"] for r in scored if r.get("accepted_hist")]
    if hists:
        width = max(map(len, hists))
        summary["accepted_hist"] = [sum(h[j] for h in hists if j < len(h)) for j in range(width)]
    if summary.get("n_greedy_checked"):
        summary["identical_fraction"] = summary["n_identical_to_greedy"] / summary["n_greedy_checked"]
    timed = [r for r in scored if "greedy_wall_s" in r]
    if timed:
        greedy_wall_s = sum(r["greedy_wall_s"] for r in timed)
        spec_wall_s = sum(r["wall_s"] for r in timed)
        summary["greedy_wall_s"] = greedy_wall_s
        summary["greedy_rtfx"] = sum(r["audio_s"] for r in timed) / greedy_wall_s if greedy_wall_s > 0 else math.nan
        summary["speedup"] = greedy_wall_s / spec_wall_s if spec_wall_s > 0 else math.nan
    return summary


def _jsonable(value: Any) -> Any:
    """Non-finite floats become None (strict JSON has no NaN/inf)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def summary_path(log_path: str | os.PathLike) -> Path:
    """runs/x.jsonl -> runs/x.summary.json"""
    path = Path(log_path)
    return path.with_name(f"{path.stem}.summary.json")


def write_summary(summary: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write `summary` as JSON atomically (temporary file, then rename); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(_jsonable(summary), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def _pct(x: Any) -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{100 * x:.2f} %"


def _num(x: Any, fmt: str = ".2f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def format_summary(summary: dict[str, Any], title: str = "") -> str:
    """The summary as an aligned two-column table (figures that the log cannot give are left out)."""
    rows = [
        ("utterances", f"{summary['n_scored']} scored, {summary['n_failed']} failed"),
        ("WER", _pct(summary["wer"])),
        ("CER", _pct(summary["cer"])),
        ("audio", f"{summary['audio_s']:.1f} s in {summary['wall_s']:.1f} s"),
        ("RTFx", _num(summary["rtfx"], ".1f")),
    ]
    if "tokens_per_target_pass" in summary:
        rows.append(("tokens per target pass", _num(summary["tokens_per_target_pass"])))
        rows.append(("target passes per token", _num(summary.get("target_passes_per_token"), ".3f")))
    if summary.get("draft_tokens"):
        rows.append(("acceptance rate", _pct(summary.get("acceptance_rate"))))
        rows.append(("accepted tokens / target pass", _num(summary.get("mean_accepted_per_target_pass"))))
    if "accepted_hist" in summary and summary.get("draft_tokens"):
        rows.append(("accepted per step (histogram)", " ".join(map(str, summary["accepted_hist"]))))
    if "n_greedy_checked" in summary:
        rows.append(("identical to greedy", f"{_pct(summary['identical_fraction'])} "
                                             f"({summary['n_identical_to_greedy']}/{summary['n_greedy_checked']})"))
    if "speedup" in summary:
        rows.append(("greedy RTFx", _num(summary["greedy_rtfx"], ".1f")))
        rows.append(("speed-up vs greedy", f"{_num(summary['speedup'])}x"))
    width = max(len(name) for name, _ in rows)
    lines = [title] if title else []
    lines += [f"{name:<{width}}  {value}" for name, value in rows]
    return "\n".join(lines)


# -- the whole run -----------------------------------------------------------------------------------------------

def _load_transcriber(options: EvalOptions) -> Any:
    from asr_spec.transcribe import Transcriber

    overrides: dict[str, Any] = {}
    for key in ("batch_size", "device", "dtype", "language"):
        if getattr(options, key) is not None:
            overrides[key] = getattr(options, key)
    if options.no_draft:
        overrides["draft"] = None
    transcriber = Transcriber.from_preset(options.preset, **overrides)
    if options.compare_greedy and transcriber.draft is None:
        raise InputError(f"preset {options.preset}: no draft model (its draft is missing or not set), so "
                         "--compare-greedy has nothing to compare; give a preset with a draft")
    return transcriber


def evaluate(options: EvalOptions, *, transcriber: Any = None,
             on_record: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run (or resume) the evaluation `options` describe and return its summary, also written next to the log.

    The data source is opened before the models load, so a bad --data-dir or an unreachable hub fails fast.
    `transcriber` replaces the preset's models (options.preset/device/dtype/language/no_draft are then unused).
    """
    items = utterances(options)
    try:
        first = next(items)
    except StopIteration:
        raise InputError(f"{options.data_dir or 'the hub'}: split {options.split} has no utterances") from None
    if transcriber is None:
        transcriber = _load_transcriber(options)
    path = options.output_path()
    run_eval(transcriber, itertools.chain([first], items), path, limit=options.limit,
             as_long_form=options.long_form, compare_greedy=options.compare_greedy,
             batch_size=options.batch_size, group_size=options.group_size, on_record=on_record)
    summary = eval_summary(path)
    summary["log"] = str(path)
    write_summary(summary, summary_path(path))
    return summary


# -- command line ------------------------------------------------------------------------------------------------

def build_parser(prog: str = "asr-spec eval") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description="WER, CER and speed of asr-spec on LibriSpeech; resumable (one JSONL line per "
        "utterance, rerun with the same --output to continue).")
    p.add_argument("--preset", default="base", help="preset name or .toml path (default: base)")
    p.add_argument("--split", default="test.clean", help="test.clean, test.other, validation.clean, ... "
                   "(local folders: test-clean, ...)")
    p.add_argument("--data-dir", help="local LibriSpeech tree (holding e.g. test-clean/); default: the HF hub")
    p.add_argument("--limit", type=int, help="first N utterances (with --long-form: chapters)")
    p.add_argument("--long-form", action="store_true", help="one input per chapter, its utterances end to end")
    p.add_argument("--compare-greedy", action="store_true",
                   help="also decode without the draft: check identical output, measure the speed-up")
    p.add_argument("--batch-size", type=int, help="chunks decoded together (default: the preset's)")
    p.add_argument("--group-size", type=int, help=f"utterances per Transcriber call (default {GROUP_BATCHES} x batch; "
                   "long-form: batch)")
    p.add_argument("--output", help="results JSONL (default runs/<preset>-<split>.jsonl); its summary is written "
                   "next to it as <name>.summary.json")
    p.add_argument("--device", help="cpu, cuda, cuda:1 (default: cuda when available)")
    p.add_argument("--dtype", help="auto, float32, float16, bfloat16 (default: the preset's)")
    p.add_argument("--language", help="language code, or auto (default: the preset's)")
    p.add_argument("--no-draft", action="store_true", help="greedy decoding only")
    p.add_argument("--no-streaming", action="store_true", help="hub: download the split instead of streaming it")
    p.add_argument("--quiet", action="store_true", help="no per-utterance lines")
    return p


def _configure_logging() -> None:
    """Warnings as one stderr line each; no transformers chatter."""
    package = logging.getLogger("asr_spec")
    if not package.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("warning: %(message)s"))
        package.addHandler(handler)
        package.setLevel(logging.WARNING)
        package.propagate = False
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass



def eval_main(argv: list[str] | None = None, *, prog: str = "asr-spec eval") -> int:
    """`asr-spec eval ARGS` / `scripts/eval_librispeech.py ARGS`. Returns the exit code: 0 done, 1 some utterance
    failed or differed from greedy, 2 bad options or data (one `error:` line on stderr), 130 interrupted.
    (--help and argparse's own usage errors exit through SystemExit, code 0 / 2, as argparse does.)"""
    args = build_parser(prog).parse_args(argv)
    _configure_logging()
    try:
        options = EvalOptions(
            preset=args.preset, split=args.split, data_dir=args.data_dir, limit=args.limit, long_form=args.long_form,
            compare_greedy=args.compare_greedy, batch_size=args.batch_size, group_size=args.group_size,
            output=args.output, device=args.device, dtype=args.dtype, language=args.language,
            no_draft=args.no_draft, streaming=not args.no_streaming,
        )
    except AsrSpecError as err:
        print(f"error: {one_line(err)}", file=sys.stderr)
        return EXIT_USAGE

    def show(record: dict[str, Any]) -> None:
        if args.quiet:
            return
        if record.get("error"):
            print(f"error: {record['id']}: {record['error']}", file=sys.stderr)
            return
        mark = "" if record.get("identical_to_greedy", True) else "  [DIFFERS FROM GREEDY]"
        print(f"{record['id']}  {record['audio_s']:.1f} s  {record['hyp']}{mark}", file=sys.stderr)

    try:
        with warnings.catch_warnings():
            warnings.showwarning = show_warning_line  # "warning: <message>", not a raw UserWarning and source line
            warnings.filterwarnings("ignore", message="English text normaliser built without")
            summary = evaluate(options, on_record=show)
    except KeyboardInterrupt:
        print("interrupted (rerun the same command to resume)", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (AsrSpecError, ValueError, OSError, ImportError) as err:  # bad preset/data/device, missing extra
        print(f"error: {one_line(err)}", file=sys.stderr)
        return EXIT_USAGE
    split = options.libri_split.name + (" long-form" if options.long_form else "")
    print(format_summary(summary, title=f"{options.preset} on LibriSpeech {split} ({summary['log']})"))
    print(f"summary: {summary_path(summary['log'])}")
    differs = summary.get("n_greedy_checked", 0) - summary.get("n_identical_to_greedy", 0)
    if differs:
        print(f"error: {differs} transcripts differ from greedy decoding: speculative decoding must be lossless",
              file=sys.stderr)
    return EXIT_FAILED if summary["n_failed"] or differs else EXIT_OK
