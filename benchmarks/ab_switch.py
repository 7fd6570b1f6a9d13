#!/usr/bin/env python
"""One of the engine's switches (an `ASR_SPEC_NO_*` variable, read when an engine is built or at each call) on and
off, side by side in one process: the same preset loaded twice, the second built and run with the variable set,
their runs over the same files interleaved, repeat by repeat. Prints each side's wall times, median, decode-step
seconds (and steps), encoder seconds, WER against --refs, and where the two transcripts differ, word by word.

    python -m benchmarks.ab_switch --switch ASR_SPEC_NO_BF16_WEIGHTS --threads 2 --batch-size 8 \\
        --audio tests/fixtures/longform/{dialogue_pauses,dense_windows,monologue_speeds}.opus \\
        --refs tests/fixtures/longform/{dialogue_pauses,dense_windows,monologue_speeds}.txt

"on" is the engine as it ships (the switch not set), "off" the one built and run with `--switch`=1. Each side is
warmed up on the first file before the timed repeats.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from asr_spec import Transcriber
from asr_spec.eval.metrics import score


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--switch", required=True, help="an ASR_SPEC_NO_* variable (set to 1 for the 'off' side)")
    p.add_argument("--audio", nargs="+", required=True)
    p.add_argument("--refs", nargs="*", default=[], help="reference texts, one per --audio file")
    p.add_argument("--preset", default="base")
    p.add_argument("--dtype", default=None, help="the preset's dtype unless given (auto, float32, int8, ...)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if not args.switch.startswith("ASR_SPEC_NO_"):
        p.error(f"--switch {args.switch!r}: an ASR_SPEC_NO_* variable is expected")
    if args.refs and len(args.refs) != len(args.audio):
        p.error(f"--refs: {len(args.refs)} files for {len(args.audio)} --audio files")
    if args.switch in os.environ:
        p.error(f"{args.switch} is set in this environment: unset it, the 'off' side sets it")
    return args


@contextlib.contextmanager
def side(switch: str, name: str) -> Iterator[None]:
    """`switch` set to 1 inside, for the "off" side (unset again after); nothing for "on"."""
    if name == "off":
        os.environ[switch] = "1"
    try:
        yield
    finally:
        os.environ.pop(switch, None)


def build(args: argparse.Namespace, name: str) -> Transcriber:
    """The preset's transcriber for side `name`, built with the switch set for "off"."""
    overrides = {"batch_size": args.batch_size} | ({"dtype": args.dtype} if args.dtype else {})
    with side(args.switch, name):
        return Transcriber.from_preset(args.preset, **overrides)


def word_changes(a: str, b: str) -> list[str]:
    """Where text b differs from text a, word by word ("a words -> b words")."""
    aw, bw = a.split(), b.split()
    return [f"{' '.join(aw[i1:i2])} -> {' '.join(bw[j1:j2])}"
            for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, aw, bw, autojunk=False).get_opcodes()
            if tag != "equal"]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sides = {name: build(args, name) for name in ("on", "off")}
    for name, t in sides.items():
        with side(args.switch, name):
            t(args.audio[0])  # warm-up
    walls: dict[str, list[float]] = {name: [] for name in sides}
    steps: dict[str, list[float]] = {name: [] for name in sides}
    encoder: dict[str, list[float]] = {name: [] for name in sides}
    texts: dict[str, list[str]] = {}
    for _ in range(args.repeats):
        for name, t in sides.items():
            times = t.engine.times
            s0, e0 = times.steps_s, times.encoder_s
            with side(args.switch, name):
                t0 = time.perf_counter()
                out = [t(path)["text"] for path in args.audio]
                walls[name].append(time.perf_counter() - t0)
            steps[name].append(times.steps_s - s0)
            encoder[name].append(times.encoder_s - e0)
            if texts.setdefault(name, out) != out:
                print(f"{name}: a repeat gave another text (not deterministic)", file=sys.stderr)
    refs = [Path(r).read_text() for r in args.refs]
    report = {"switch": args.switch, "threads": torch.get_num_threads(), "batch_size": args.batch_size}
    for name in sides:
        wer = [round(100 * score([r], [h]).wer, 2) for r, h in zip(refs, texts[name])]
        report[name] = {"wall_s": walls[name], "median_s": statistics.median(walls[name]),
                        "steps_s": statistics.median(steps[name]), "encoder_s": statistics.median(encoder[name]),
                        "wer_percent": wer}
        print(f"{name:3}: wall {' / '.join(f'{w:.2f}' for w in walls[name])} s, median {report[name]['median_s']:.2f}"
              f" s; steps {report[name]['steps_s']:.2f} s, encoder {report[name]['encoder_s']:.2f} s; WER {wer}")
    report["on_vs_off"] = report["off"]["median_s"] / report["on"]["median_s"]
    steps_ratio = report["off"]["steps_s"] / report["on"]["steps_s"]
    print(f"on is {report['on_vs_off']:.3f}x the speed of off (medians; the steps {steps_ratio:.3f}x)")
    report["differences"] = {}
    for path, a, b in zip(args.audio, texts["off"], texts["on"]):
        changes = word_changes(a, b)
        report["differences"][path] = changes
        print(f"{path}: {'the same text' if not changes else '; '.join(changes) + ' (off -> on)'}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
