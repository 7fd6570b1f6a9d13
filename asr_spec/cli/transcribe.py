"""`asr-spec transcribe`: the options parsed into the keyword arguments of `Transcriber.from_preset`, then
`Transcriber.iter_transcribe`, exactly what a Python user would call (or `asr_spec.distributed.transcribe_dataset`
with --ray). Transcripts go to stdout (or to files with --output-dir), the progress bar, warnings, per-file errors
and a one-line summary to stderr. Exit codes: 0 all transcribed, 1 some input failed (each reported as
``error: <file>: <cause>``, the others still transcribed), 2 bad options, an unloadable model, an unusable
--output-dir or a batch that cannot fit in memory (one line), 130 interrupted (one line: how many files were
finished, and where).
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, NoReturn

import typer

from asr_spec.cli.options import (
    BATCH_SIZE,
    BEST_OF,
    COMPRESSION_RATIO_THRESHOLD,
    DEVICE,
    DRAFT,
    DTYPE,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    HOTWORDS,
    INITIAL_PROMPT,
    LANGUAGE,
    MODEL,
    NO_DRAFT,
    PRESET,
    RAY,
    RAY_ADDRESS,
    SEED,
    TEMPERATURE,
    THREADS,
    THREADS_PER_WORKER,
    USER_ERRORS,
    WORKERS,
    fail,
    interruptible,
    preset_overrides,
    reader_gone,
    use_threads,
)
from asr_spec.errors import one_line

__all__ = ["transcribe"]


def transcribe(  # long function: typer declares each of its ~30 options as a parameter
    files: list[str] | None = typer.Argument(None, metavar="FILE", help="Audio files (wav, flac, mp3, ogg, "
                                                 "m4a...); with --ray also glob patterns."),
    preset: str = PRESET,
    model: str | None = MODEL,
    draft: str | None = DRAFT,
    no_draft: bool = NO_DRAFT,
    device: str = DEVICE,
    dtype: str | None = DTYPE,
    language: str | None = LANGUAGE,
    task: str | None = typer.Option(None, help="transcribe or translate (to English)."),
    timestamps: bool | None = typer.Option(None, "--timestamps/--no-timestamps", help="Whisper timestamp mode "
                                              "(segment times from the model). Default: the preset's (on)."),
    chunk_length: float | None = typer.Option(None, help="Seconds per window (at most 30). Default: the "
                                                 "preset's."),
    chunking: str | None = typer.Option(None, help="vad (speech chunks found by silero-vad; silence skipped) "
                                           "or stride (overlapping windows stitched at the seams). Default: the "
                                           "preset's."),
    word_timestamps: bool | None = typer.Option(None, "--word-timestamps/--no-word-timestamps",
                                                   help="Per-word times in the json output (needs --chunking "
                                                   "vad). Default: the preset's (off)."),
    max_words_per_cue: int | None = typer.Option(None, help="srt/vtt cues of at most N words (needs "
                                                    "--word-timestamps). Default: one cue per segment."),
    max_line_width: int | None = typer.Option(None, help="srt/vtt cue text wrapped at spaces into lines of at "
                                                 "most N characters (subtitles: 42). Default: one line."),
    max_line_count: int | None = typer.Option(None, help="With --max-line-width: cues of at most N lines, cut "
                                                 "at word times (needs --word-timestamps; subtitles: 2)."),
    num_draft_tokens: int | None = typer.Option(None, help="Draft tokens per step (K). Default: the "
                                                  "preset's, else DecodeOptions'."),
    batch_size: int | None = BATCH_SIZE,
    output_dir: Path | None = typer.Option(None, help="Write <name>.<format> files here instead of printing."),
    format: str | None = typer.Option(None, "--format", help="With --output-dir: comma-separated txt, json, "
                                         "srt, vtt. Default: all four."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar, no summary (errors still shown)."),
    threads: int | None = THREADS,
    ray: bool = RAY,
    ray_address: str | None = RAY_ADDRESS,
    workers: int | None = WORKERS,
    threads_per_worker: int | None = THREADS_PER_WORKER,
    manifest: Path | None = typer.Option(None, help="With --ray: a .csv/.tsv/.jsonl manifest with a path column "
                                            "(a text column is kept as the reference) instead of FILEs."),
    output: Path | None = typer.Option(None, help="With --ray: the results JSONL (rerun to resume)."),
    no_graphs: bool = typer.Option(False, "--no-graphs", help="CUDA: run the decode step eagerly, not as captured "
                                   "CUDA graphs (the same tokens; the tests' reference)."),
    no_speech_threshold: float | None = typer.Option(None, help="Drop a window whose <|nospeech|> probability "
                                                        "exceeds this (Whisper's rule). Default 0.6."),
    logprob_threshold: float | None = typer.Option(None, help="...unless its average token log-probability "
                                                      "exceeds this; with --temperature, a window below it is "
                                                      "decoded again. Default -1.0."),
    keep_no_speech: bool = typer.Option(False, "--keep-no-speech", help="Turn the no-speech rule off: decode "
                                        "and keep every window, silent or not."),
    temperature: str | None = TEMPERATURE,
    compression_ratio_threshold: float | None = COMPRESSION_RATIO_THRESHOLD,
    best_of: int | None = BEST_OF,
    seed: int | None = SEED,
    initial_prompt: str | None = INITIAL_PROMPT,
    hotwords: str | None = HOTWORDS,
    prefix: str | None = typer.Option(None, help="Text each file's transcript starts with (forced on its first "
                                         "chunk, part of the transcript)."),
) -> None:
    """Transcribe audio files; the transcript goes to stdout unless --output-dir (or --ray --output) is given."""
    with interruptible():
        from asr_spec import allocator
        from asr_spec.models.cpu import precision_line, run_of
        from asr_spec.transcribe import Transcriber

    ray_only = (workers, threads_per_worker, manifest, output, ray_address)
    if not ray and any(value is not None for value in ray_only):
        fail("--workers, --threads-per-worker, --manifest, --output and --ray-address need --ray", EXIT_USAGE)
    if ray and threads is not None:
        fail("--threads sets this process's threads: with --ray give --threads-per-worker", EXIT_USAGE)
    if not files and manifest is None:
        fail("no input: give audio FILEs" + (" or --manifest" if ray else ""), EXIT_USAGE)
    if ray and (output_dir is not None or format is not None):
        fail("--ray writes JSONL records to --output: drop --output-dir/--format", EXIT_USAGE)
    if format is not None and output_dir is None:
        fail("--format needs --output-dir (without it the transcript is printed)", EXIT_USAGE)
    if keep_no_speech and no_speech_threshold is not None:
        fail("--keep-no-speech and --no-speech-threshold contradict each other: give one", EXIT_USAGE)
    overrides = preset_overrides(model, draft, no_draft, dtype=dtype, language=language, task=task,
                                 chunk_length_s=chunk_length, num_draft_tokens=num_draft_tokens,
                                 batch_size=batch_size, formats=format, timestamps=timestamps,
                                 cuda_graphs=False if no_graphs else None, no_speech_threshold=no_speech_threshold,
                                 logprob_threshold=logprob_threshold, chunking=chunking,
                                 word_timestamps=word_timestamps, max_words_per_cue=max_words_per_cue,
                                 max_line_width=max_line_width, max_line_count=max_line_count,
                                 temperature=temperature, compression_ratio_threshold=compression_ratio_threshold,
                                 best_of=best_of, seed=seed, initial_prompt=initial_prompt, hotwords=hotwords,
                                 prefix=prefix)
    if keep_no_speech:
        overrides["no_speech_threshold"] = None
    if ray:
        _check_cue_flags(None, max_words_per_cue, max_line_width, max_line_count)
        _transcribe_on_ray(files or [], manifest, output, preset, device, overrides, quiet,
                           address=ray_address, workers=workers, threads_per_worker=threads_per_worker)
        return
    use_threads(threads)  # before `auto`'s precision probe (10 s at the 1 thread asked for ran 70 s at torch's 2)
    # begun before the options' check: on a CPU with native bf16 `auto`'s probe builds the CPU kernels there (a fresh
    # machine's ~55 s build went unreported)
    run = _Run(len(files), output_dir)
    try:  # the options checked before the files, the files before any model loads
        _, options = Transcriber.plan_preset(preset, device=device, **overrides)
        _check_cue_flags(options.formats if output_dir is not None else (), max_words_per_cue, max_line_width,
                         max_line_count)
        run.check_files(files)  # a mistyped name said before the models load (~3 s, ~30-60 s cold), not after
    except USER_ERRORS as err:
        fail(one_line(err), EXIT_USAGE)
    except KeyboardInterrupt:  # the probe and the files' check take seconds: Ctrl-C there says so too
        run.interrupted()
    if run.nothing_readable:
        run.none_read(quiet)
    allocator.pin()  # a process of its own: the engine's transient buffers kept in the heap, not mapped every call
    try:
        if output_dir is not None:  # before any model loads: the folder usable, names distinct, stale temps gone
            from asr_spec.transcribe.outputs import check_not_replacing, output_stems, prepare_output_dir

            check_not_replacing(output_dir, output_stems(files), files)
            prepare_output_dir(output_dir)
        transcriber = Transcriber.from_preset(preset, device=device, **overrides)
        run.precision = precision_line(*run_of(transcriber))
        run.detects = transcriber.options.decode.language is None and transcriber.tokens.is_multilingual
        run.loaded()
    except USER_ERRORS as err:
        fail(one_line(err), EXIT_USAGE)
    except KeyboardInterrupt:
        run.interrupted()
    try:
        for result in transcriber.iter_transcribe(files, progress=False if quiet else None, output_dir=output_dir):
            run.add(result)
    except BrokenPipeError:
        reader_gone()
    except USER_ERRORS as err:  # raised before any input is read, or a run that cannot fit in memory
        fail(one_line(err), EXIT_USAGE)
    except KeyboardInterrupt:
        run.interrupted()
    if not quiet:
        typer.echo(run.summary(), err=True)
    if run.n_failed:
        raise typer.Exit(EXIT_FAILED)


def _check_cue_flags(formats: tuple[str, ...] | None, max_words_per_cue: int | None, max_line_width: int | None,
                     max_line_count: int | None) -> None:
    """The cue flags given (not None) shape srt/vtt files only: a usage error when none of `formats`, the files
    written (() when the transcript is printed; None: --ray's JSONL records), is one (they were taken and
    ignored)."""
    given = [flag for flag, value in (("--max-words-per-cue", max_words_per_cue), ("--max-line-width", max_line_width),
                                      ("--max-line-count", max_line_count)) if value is not None]
    if given and not {"srt", "vtt"} & set(formats or ()):
        if formats is None:
            fail(f"{'/'.join(given)} shape srt/vtt cues, but --ray writes JSONL records: drop them", EXIT_USAGE)
        where = "no file is written" if not formats else f"--format is {','.join(formats)}"
        fail(f"{'/'.join(given)} shape srt/vtt cues, but {where}: give --output-dir with srt or vtt in --format",
             EXIT_USAGE)


def _transcribe_on_ray(files: list[str], manifest: Path | None, output: Path | None, preset: str, device: str,
                       overrides: dict[str, Any], quiet: bool, **ray_options: Any) -> None:
    """`transcribe --ray`: `asr_spec.distributed.transcribe_dataset` over the files or the manifest."""
    from asr_spec import distributed
    from asr_spec.transcribe import Transcriber

    if output is None:
        fail("--ray needs --output results.jsonl", EXIT_USAGE)
    if files and manifest is not None:
        fail("give FILEs or --manifest, not both", EXIT_USAGE)

    def show(record: dict[str, Any]) -> None:
        if record.get("error"):
            typer.echo(f"error: {record['path']}: {record['error']}", err=True)

    given = {key: value for key, value in ray_options.items() if value is not None}  # else RayOptions' defaults
    try:
        # the options checked here, before Ray starts (found by every actor: a 110-line traceback and "rerun to
        # resume"); the workers' device is theirs, checked there
        Transcriber.plan_preset(preset, device=device if device in ("auto", "cpu") else "cpu", **overrides)
        options = distributed.RayOptions(progress=not quiet, **given)
        inputs = distributed.manifest_inputs(manifest) if manifest else distributed.file_inputs(files)
        report = distributed.transcribe_dataset(inputs, output, preset=preset, options=options, on_record=show,
                                                device=device, **overrides)
    except USER_ERRORS as err:
        fail(one_line(err), EXIT_USAGE)
    except KeyboardInterrupt:  # (typer's own exit 130 said nothing)
        fail(f"interrupted (the records in {output} are kept: rerun the same command to resume)", EXIT_INTERRUPTED)
    if not quiet:
        typer.echo(f"{report.n_written} records written to {output} ({report.n_failed} failed), "
                   f"{report.n_skipped} already there, in {report.wall_s:.1f} s", err=True)
        if report.hardware:
            from asr_spec.models.cpu import precision_words

            typer.echo(f"the workers decoded on: {precision_words(report.hardware)}", err=True)
    if report.n_failed_before:
        typer.echo(f"{report.n_failed_before} failed before: their records in {output} are kept by a rerun (delete "
                   "their lines to try them again)", err=True)
    if report.n_failed or report.n_failed_before:
        raise typer.Exit(EXIT_FAILED)


def _build_seconds() -> float:
    """Seconds this process has spent building the CPU kernels (`cpu_attention.build_seconds`)."""
    from asr_spec.engine import cpu_attention

    return cpu_attention.build_seconds()


class _Run:
    """What a `transcribe` command has done so far: printed, counted and summed as each file finishes."""

    def __init__(self, n_files: int, output_dir: Path | None):
        self.n_files, self.output_dir = n_files, output_dir
        self.n_done = self.n_failed = self.n_dropped = self.n_tails = 0
        self.fallback: dict[float, int] = {}  # windows decoded again at each temperature
        self.audio_s, self.stats, self.start = 0.0, [], time.perf_counter()
        self.built_before_s = _build_seconds()  # the CPU kernels' builds before this run (an in-process caller's)
        self.loaded_at, self.built_at_load = self.start, self.built_before_s  # `loaded`: the models ready
        self.precision = ""  # where and in what dtype it decodes: "cpu amx-bf16, bfloat16" (models.cpu)
        self.said: Counter[str] = Counter()  # files whose error `check_files` printed, not printed again by `add`
        self.detects = False  # whether the language is detected (`auto` on a multilingual model): the summary says
        self.languages: Counter[str] = Counter()  # what it found, per file

    def check_files(self, files: list[str]) -> None:
        """Say at once each file that cannot be audio (missing, a folder, empty, text: `check_file`); it stays in
        the run (its output name, its place), which reports it failed again without a second line."""
        from asr_spec.audio.opening import check_file
        from asr_spec.errors import AudioError

        for file in files:
            try:
                check_file(file)
            except AudioError as err:
                typer.echo(f"error: {file}: {one_line(err, file)}", err=True)
                self.said[file] += 1

    @property
    def nothing_readable(self) -> bool:
        """Every file failed `check_files`: no model is to be loaded for nothing."""
        return self.said.total() >= self.n_files

    def none_read(self, quiet: bool) -> NoReturn:
        """The end of a run whose every file failed `check_files`: its summary line, exit 1."""
        self.n_done = self.n_failed = self.n_files
        if not quiet:
            typer.echo(f"{self._files()}: no file could be read, no model loaded", err=True)
        raise typer.Exit(EXIT_FAILED)

    def add(self, result: Any) -> None:
        self.n_done += 1
        if result.error is not None:
            self.n_failed += 1
            if self.said[result.source] > 0:
                self.said[result.source] -= 1
            else:
                typer.echo(f"error: {result.source}: {result.error}", err=True)
            return
        self.audio_s += result.audio_s
        self.stats.append(result.stats)
        self.n_dropped += result.n_dropped
        self.n_tails += result.redecoded_tails
        if self.detects and result.language:
            self.languages[result.language] += 1
        for t, n in result.fallback_windows:
            self.fallback[t] = self.fallback.get(t, 0) + n
        if self.output_dir is None:
            if self.n_files > 1:
                typer.echo(f"==> {result.source} <==")
            typer.echo(result.text)
            sys.stdout.flush()

    def loaded(self) -> None:
        """The models are loaded: what follows is the transcription, whose speed the summary gives (loading, ~3 s on
        a two-core AMX Xeon, ~30 s cold or beside other work, said apart)."""
        self.loaded_at, self.built_at_load = time.perf_counter(), _build_seconds()

    def interrupted(self) -> NoReturn:
        """Ctrl-C: one line saying what is finished and where, exit 130. (typer turns a KeyboardInterrupt that
        escapes a command into a silent exit 130, so it is caught here, where the counts are known.)"""
        where = f"outputs in {self.output_dir}" if self.output_dir is not None else "printed above"
        ok = self.n_done - self.n_failed
        typer.echo(f"\ninterrupted: {ok} of {self.n_files} files finished ({where})", err=True)
        raise typer.Exit(EXIT_INTERRUPTED)

    def _files(self) -> str:
        """"3/4 files (1 failed)": the summary's count."""
        failed = f" ({self.n_failed} failed)" if self.n_failed else ""
        return f"{self.n_files - self.n_failed}/{self.n_files} files{failed}"

    def summary(self) -> str:
        from asr_spec.engine import ChunkStats

        stats = ChunkStats.total(self.stats)
        build_s = _build_seconds() - self.built_before_s  # a first run's one-time cost, not its speed
        load_s = max(self.loaded_at - self.start - (self.built_at_load - self.built_before_s), 0.0)
        wall_s = max(time.perf_counter() - self.loaded_at - (_build_seconds() - self.built_at_load), 0.0)
        rtfx = self.audio_s / wall_s if wall_s > 0 else 0.0
        built = f"; the CPU kernels' one-time build took {build_s:.1f} s more" if build_s else ""
        speed = f"{self.audio_s:.1f} s audio in {wall_s:.1f} s (RTFx {rtfx:.1f}; loading {load_s:.1f} s before{built})"
        if stats.drafted_tokens:
            drafting = f"acceptance {stats.acceptance_rate:.1%}, {stats.tokens_per_target_pass:.2f} tokens/target pass"
        elif stats.generated_tokens:
            drafting = "greedy (no draft), 1.00 tokens/target pass"
        elif self.n_failed == self.n_files:  # not "greedy (no draft)" of a run with a draft loaded
            drafting = "no file transcribed"
        else:  # files read, none with speech heard: not "no file transcribed" (a reviewer read it as a failure)
            drafting = "no speech heard"
        dropped = f", {self.n_dropped} windows without speech left out" if self.n_dropped else ""
        tails = f", {self.n_tails} chunk tails decoded again" if self.n_tails else ""
        at = ", ".join(f"{n} at {t:g}" for t, n in self.fallback.items())
        fallback = f", windows decoded again (fallback_windows): {at}" if any(self.fallback.values()) else ""
        precision = f" [{self.precision}]" if self.precision else ""
        return f"{self._files()}: {speed}, {drafting}{dropped}{tails}{fallback}{self._languages()}{precision}"

    def _languages(self) -> str:
        """", language fr (detected)" or ", languages detected: fr 2, de 1" when the run detected them: a French
        file decoded as Thai showed only in the JSON before."""
        if not self.languages:
            return ""
        if len(self.languages) == 1:
            return f", language {next(iter(self.languages))} (detected)"
        return ", languages detected: " + ", ".join(f"{code} {n}" for code, n in self.languages.most_common())
