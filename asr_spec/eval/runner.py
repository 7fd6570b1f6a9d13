"""The evaluation loop: transcribe utterances a group at a time, log one record each, resume, check vs greedy.

    iter_local / iter_hub ──take(limit)──► [long_form per chapter] ──skip ResultsLog.done_ids()──► groups of
    group_size ──Transcriber.transcribe──► [the same group again, greedy] ──► ResultsLog.append (one fsync'ed line
    per utterance)

Utterances go to the Transcriber a group at a time (`group_size`, default GROUP_BATCHES × batch_size; long-form
chapters, which are minutes long and many chunks each, batch_size at a time) so that its batch stays full across
utterances while a killed run loses at most one group: rerunning with the same log skips every id already in it.
`limit` means the first N utterances (long-form: chapters) of the split, resumed or not.

Timing. A group is timed as a whole (warm models, device synchronised before each clock read) and its wall time is
shared among its utterances in proportion to their audio length, so that the log's `wall_s` sum to the real wall
time and RTFx = Σ audio_s / Σ wall_s is the throughput of the batched run. (`Transcription.wall_s`, the latency of
one utterance inside its batch, overlaps the others' and is kept as `latency_s`.) With compare_greedy the same
group is then decoded by the same target without a draft: `greedy_wall_s` is timed the same way.

Record fields: id, ref, hyp, audio_s, wall_s, latency_s, language, the fields of `asr_spec.engine.ChunkStats`
as `dataclasses.asdict` gives them (chunks, generated_tokens, target_passes, draft_passes, drafted_tokens,
accepted_tokens, accepted_hist, acceptance_rate, tokens_per_target_pass), parts (long-form: the utterance ids
joined), error (a failed utterance, one line); with compare_greedy: greedy_hyp, greedy_wall_s,
greedy_generated_tokens, identical_to_greedy (the same token ids in every chunk, so the same text and segments).
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from asr_spec.audio.loading import SAMPLE_RATE
from asr_spec.errors import AsrSpecError, InputError, one_line
from asr_spec.eval.librispeech import HubUnavailableError, ResultsLog, Utterance, iter_hub, iter_local, long_form, take
from asr_spec.eval.options import GROUP_BATCHES, EvalOptions, check_run_args, parse_split

__all__ = ["EvalRun", "run_eval", "utterances"]

WARMUP_SAMPLES = 30 * SAMPLE_RATE  # warm-up input: at most one 30 s window of the first unit


def utterances(options: EvalOptions) -> Iterator[Utterance]:
    """The split's utterances from `options.data_dir` (any folder name), or from the hub when it is None. Errors
    (no such split folder, hub unreachable) are raised by the first `next`, as one line naming the fix."""
    if options.data_dir is not None:
        yield from iter_local(options.data_dir, options.local_dir())
        return
    split = parse_split(options.split)
    try:
        yield from iter_hub(split.hub_config, split.hub_split, streaming=options.streaming)
    except HubUnavailableError as err:
        cause = str(err).split("; pass a local", 1)[0]
        fix = f"pass --data-dir DIR (a local LibriSpeech tree with {split.local_dir}/)"
        raise HubUnavailableError(f"{cause}; {fix}") from err


def _units(items: Iterable[Utterance], *, limit: int | None, as_long_form: bool, done: set[str],
           scope: list[str]) -> Iterator[tuple[str, Callable[[], Utterance]]]:
    """(id, make) for the first `limit` evaluation units not in `done`; `make` builds the unit (long-form: joins
    its chapter's audio) only when called, so skipped chapters are never loaded. `scope` gets the id of each of
    the first `limit` units, done or not."""
    if not as_long_form:
        for u in take(items, limit):
            scope.append(u.id)
            if u.id not in done:
                yield u.id, (lambda u=u: u)
        return
    chapters = itertools.groupby(items, key=lambda u: (u.speaker, u.chapter))
    seen: set[str] = set()
    for (speaker, chapter), group in itertools.islice(chapters, limit):
        unit_id = f"{speaker}-{chapter}"  # the id long_form gives the joined chapter
        if unit_id in seen:  # as long_form says of its input: a record per id, or half the chapter goes unscored
            raise InputError(f"long_form: chapter {unit_id} appears twice; group the input by chapter")
        seen.add(unit_id)
        scope.append(unit_id)
        if unit_id in done:
            continue
        parts = list(group)
        yield unit_id, (lambda parts=parts: next(long_form(parts)))


@dataclass(frozen=True)
class EvalRun:
    """What one `run_eval` call did."""

    n_done: int  # records appended by this call
    n_skipped: int  # units already in the log (resumed)
    n_failed: int  # of n_done, records with an error
    n_not_identical: int  # of n_done, speculative tokens != greedy tokens (must be 0)
    wall_s: float  # seconds this call spent decoding (warm-up excluded)
    ids: tuple[str, ...] = ()  # the units of the run's `limit` (all of them without one), recorded before or now


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


def record_of(u: Utterance, t: Any, wall_s: float, greedy: tuple[Any, float] | None) -> dict[str, Any]:
    record: dict[str, Any] = {"id": u.id, "ref": u.text, "hyp": t.text, "audio_s": t.audio_s or u.duration_s,
                              "wall_s": wall_s, "latency_s": t.wall_s}
    if u.parts:
        record["parts"] = list(u.parts)
    if t.error is not None:  # the file named: its id alone said "no such file" with no clue which path was read
        record["error"] = f"{os.fspath(u.audio)}: {t.error}" if isinstance(u.audio, (str, os.PathLike)) else t.error
        return record
    record.update(language=t.language, **asdict(t.stats))
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


@dataclass
class _Tally:
    n_done: int = 0
    n_failed: int = 0
    n_not_identical: int = 0
    wall_s: float = 0.0

    def count(self, record: dict[str, Any]) -> None:
        self.n_done += 1
        self.n_failed += bool(record.get("error"))
        self.n_not_identical += record.get("identical_to_greedy") is False


def _warm_up(models: Sequence[Any], units: Sequence[Utterance], rows: int) -> None:
    """Decode the first 30 s window of the first of `units` that can be read once with each model, untimed (none
    when none can: their records say why). A first file that could not be read stopped the whole run, for good."""
    for unit in units:
        try:
            samples = unit.load()[:WARMUP_SAMPLES]
        except AsrSpecError:
            continue
        for model in models:
            model.transcribe([{"array": samples, "sampling_rate": SAMPLE_RATE}], batch_size=rows, progress=False)
        return


def _made(batch: list[tuple[str, Callable[[], Utterance]]]) -> tuple[list[Utterance], list[dict[str, Any]]]:
    """The group's units, and a failed record for each one that cannot be built (a long-form chapter with an
    unreadable part: it stopped the whole run, every chapter after it unscored)."""
    units, failed = [], []
    for unit_id, make in batch:
        try:
            units.append(make())
        except AsrSpecError as err:
            failed.append({"id": unit_id, "ref": "", "hyp": "", "audio_s": 0.0, "wall_s": 0.0, "latency_s": 0.0,
                           "error": one_line(err)})
    return units, failed


def _run_group(transcriber: Any, greedy: Any, utts: list[Utterance], rows: int,
               greedy_first: bool) -> tuple[list[dict[str, Any]], float]:
    """Decode one group (and again greedily, in alternating order); its records and the wall time spent."""
    sources = [_source(u) for u in utts]
    plain: list[Any] = []
    greedy_wall_s = 0.0
    if greedy is not None and greedy_first:  # alternate the order: neither always runs first
        plain, greedy_wall_s = _timed_transcribe(greedy, sources, rows)
    spec, wall_s = _timed_transcribe(transcriber, sources, rows)
    if greedy is not None and not greedy_first:
        plain, greedy_wall_s = _timed_transcribe(greedy, sources, rows)
    audio_s = [t.audio_s or u.duration_s for t, u in zip(spec, utts)]
    pairs: list[tuple[Any, float] | None] = [None] * len(utts)
    if greedy is not None:
        pairs = list(zip(plain, _share(greedy_wall_s, audio_s)))
    records = [record_of(u, t, share, pair) for u, t, share, pair in zip(utts, spec, _share(wall_s, audio_s), pairs)]
    return records, wall_s + greedy_wall_s


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
    batch_size:  engine rows (None = the transcriber's); group_size: units per call (None: see the module doc).
    warmup:      decode the first unit once, untimed, with each model before timing anything.
    on_record:   called with each record once it is on disk (progress printing).
    """
    check_run_args(limit, batch_size, group_size)
    log_ = results if isinstance(results, ResultsLog) else ResultsLog(results)
    rows = transcriber.options.batch_size if batch_size is None else batch_size
    if group_size is None:  # long-form units are whole chapters (minutes, many chunks each): fewer per group
        group_size = rows if as_long_form else GROUP_BATCHES * rows
    if compare_greedy and transcriber.draft is None:
        raise InputError("compare_greedy: the transcriber has no draft, so there is nothing to compare with greedy")
    greedy = _greedy_twin(transcriber) if compare_greedy else None
    done = log_.done_ids()
    scope: list[str] = []
    units = _units(items, limit=limit, as_long_form=as_long_form, done=done, scope=scope)
    tally = _Tally()
    for n_group in itertools.count():
        batch = list(itertools.islice(units, group_size))
        if not batch:
            break
        utts, records = _made(batch)
        if warmup and n_group == 0:
            _warm_up([m for m in (transcriber, greedy) if m is not None], utts, rows)
        wall_s = 0.0
        if utts:
            decoded, wall_s = _run_group(transcriber, greedy, utts, rows, greedy_first=n_group % 2 == 1)
            records += decoded
        tally.wall_s += wall_s
        for record in records:
            log_.append(record)
            tally.count(record)
            if on_record is not None:
                on_record(record)
    return EvalRun(tally.n_done, len(done), tally.n_failed, tally.n_not_identical, tally.wall_s, tuple(scope))
