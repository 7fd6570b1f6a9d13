"""`asr-spec eval ARGS` / `scripts/eval_librispeech.py ARGS`: argparse over `EvalOptions` and `evaluate`.

Exit codes: 0 done, 1 some utterance failed or differed from greedy, 2 bad options or data (one `error:` line on
stderr), 130 interrupted. (--help and argparse's own usage errors exit through SystemExit, code 0 / 2.)
"""

from __future__ import annotations

import argparse
import sys
import warnings
from dataclasses import fields
from typing import Any

from asr_spec.errors import AsrSpecError, one_line, show_warning_line
from asr_spec.eval.evaluate import evaluate
from asr_spec.eval.options import GROUP_BATCHES, EvalOptions
from asr_spec.eval.summary import format_summary, summary_path

__all__ = ["build_parser", "eval_main"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def build_parser(prog: str = "asr-spec eval") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description="WER, CER and speed of asr-spec on LibriSpeech; resumable (one JSONL line per "
        "utterance, rerun with the same --output to continue).")
    p.add_argument("--preset", help="preset name or .toml path (default: asr-spec's default preset, base)")
    p.add_argument("--split", default="test.clean", help="hub: test.clean, test.other, validation.clean, ...; "
                   "with --data-dir: any folder of the tree (test-clean, my-split, ...)")
    p.add_argument("--data-dir", help="local LibriSpeech tree (holding e.g. test-clean/); default: the HF hub")
    p.add_argument("--limit", type=int, help="first N utterances (with --long-form: chapters)")
    p.add_argument("--long-form", action="store_true", help="one input per chapter, its utterances end to end")
    p.add_argument("--compare-greedy", action="store_true",
                   help="also decode without the draft: check identical output, measure the speed-up")
    p.add_argument("--batch-size", type=int, help="chunks decoded together (default: TranscribeOptions.batch_size; "
                   "presets set none)")
    p.add_argument("--group-size", type=int, help=f"utterances per Transcriber call (default {GROUP_BATCHES} x batch; "
                   "long-form: batch)")
    p.add_argument("--output", help="results JSONL (default runs/<preset>-<split>.jsonl); its summary is written "
                   "next to it as <name>.summary.json")
    p.add_argument("--model", help="target model, replacing the preset's (and its draft)")
    p.add_argument("--draft", help="draft model, replacing the preset's")
    p.add_argument("--no-draft", action="store_true", help="greedy decoding only")
    p.add_argument("--device", help="cpu, cuda, cuda:1 (default: cuda when available)")
    p.add_argument("--dtype", help="auto, float32, float16, bfloat16 (default: the preset's)")
    p.add_argument("--language", help="language code, or auto (default: the preset's)")
    p.add_argument("--no-streaming", action="store_true", help="hub: download the split instead of streaming it")
    p.add_argument("--quiet", action="store_true", help="no per-utterance lines")
    p.add_argument("--ray", action="store_true", help="transcribe on a Ray cluster (needs --data-dir; "
                   "pip install 'asr-spec[ray]')")
    p.add_argument("--ray-address", help="with --ray: the cluster (auto, ray://host:10001); default RAY_ADDRESS, "
                   "else a local Ray")
    p.add_argument("--workers", type=int, default=1, help="with --ray: transcription actors (default 1)")
    return p


def _options(args: argparse.Namespace) -> EvalOptions:
    values = {f.name: getattr(args, f.name) for f in fields(EvalOptions) if hasattr(args, f.name)}
    return EvalOptions(**values, streaming=not args.no_streaming)


def _show(record: dict[str, Any]) -> None:
    if record.get("error"):
        print(f"error: {record['id']}: {record['error']}", file=sys.stderr)
        return
    mark = "" if record.get("identical_to_greedy", True) else "  [DIFFERS FROM GREEDY]"
    print(f"{record['id']}  {record['audio_s']:.1f} s  {record['hyp']}{mark}", file=sys.stderr)


def eval_main(argv: list[str] | None = None, *, prog: str = "asr-spec eval") -> int:
    """Parse `argv`, run `evaluate`, print the summary table; returns the exit code (see the module doc)."""
    args = build_parser(prog).parse_args(argv)
    try:
        options = _options(args)
    except AsrSpecError as err:
        print(f"error: {one_line(err)}", file=sys.stderr)
        return EXIT_USAGE
    try:
        with warnings.catch_warnings():
            warnings.showwarning = show_warning_line  # "warning: <message>", not a raw UserWarning and source line
            warnings.filterwarnings("ignore", message="English text normaliser built without")
            summary = evaluate(options, on_record=None if args.quiet else _show)
    except KeyboardInterrupt:
        print("interrupted (rerun the same command to resume)", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (AsrSpecError, ValueError, OSError, ImportError) as err:  # bad preset/data/device, missing extra
        print(f"error: {one_line(err)}", file=sys.stderr)
        return EXIT_USAGE
    split = options.split_name + (" long-form" if options.long_form else "")
    print(format_summary(summary, title=f"{options.preset_name()} on LibriSpeech {split} ({summary['log']})"))
    print(f"summary: {summary_path(summary['log'])}")
    differs = summary.get("n_greedy_checked", 0) - summary.get("n_identical_to_greedy", 0)
    if differs:
        print(f"error: {differs} transcripts differ from greedy decoding: speculative decoding must be lossless",
              file=sys.stderr)
    return EXIT_FAILED if summary["n_failed"] or differs else EXIT_OK
