#!/usr/bin/env python
"""Live streams that end in the middle of a sentence: what the final close decode's last segment says, how much
speech it holds a word and how far past the audio it is timed (`hearing.before_guess`, the rule that leaves out a
last segment guessed into the silence after a cut-off word).

    python -m benchmarks.cut_streams --fractions 0.1,0.3,0.6

For each file of the long fixtures and each sentence from the third on (its `NAME.sentences.tsv`: start_s, end_s,
sentence), at most --sentences of them: a stream of the audio from the sentence before it (0.2 s earlier) to a cut
--fractions of the way into it, fed at once through `Transcriber.stream` (the `base` preset, voice activity on).
One line each: speech per word of the final close decode's last closed segment (silero frames between its opening
timestamp and the audio's end), its end against the audio's, its text and the words said before the cut
(approximate: the fraction of the sentence's words), and whether the rule leaves it out; then the count.
"""

from __future__ import annotations

import argparse
import csv
import logging
import re
from pathlib import Path

import numpy as np

from asr_spec import Transcriber
from asr_spec.audio.loading import SAMPLE_RATE, load_audio
from asr_spec.stream.driver import silero_voices
from asr_spec.stream.hearing import FRAME_SAMPLES, GUESS_PAST_S, GUESS_S_PER_WORD

REPO = Path(__file__).resolve().parent.parent
FIXTURES = sorted((REPO / "tests" / "fixtures" / "longform").glob("*.opus"))
CLOSE = re.compile(r"\(close\) of ([\d.]+)-([\d.]+) s, heard [\d.]+ s: (.*?) \| committed")
SEGMENT = re.compile(r"<\|([\d.]+)\|>([^<]+)<\|([\d.]+)\|>")


class Lines(logging.Handler):
    """The policy's trace lines (`StreamPolicy` logs one per result at DEBUG), kept."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def last_segment(line: str, speech: np.ndarray) -> tuple[float, float, int, str] | None:
    """(speech seconds a word, seconds past the audio, words, text) of a close trace line's last closed segment;
    `speech`: (n_frames,) bool of the stream. None without one."""
    found = CLOSE.search(line)
    if found is None or not (segments := SEGMENT.findall(found.group(3))):
        return None
    begin, end = float(found.group(1)), float(found.group(2))
    opened, text, closed = segments[-1]
    first = int((begin + float(opened)) * SAMPLE_RATE) // FRAME_SAMPLES
    last = -(-int(end * SAMPLE_RATE) // FRAME_SAMPLES)
    n_words = len(text.split())
    heard_s = np.count_nonzero(speech[first:last]) * FRAME_SAMPLES / SAMPLE_RATE
    return heard_s / n_words, begin + float(closed) - end, n_words, text.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fractions", default="0.1,0.3,0.6", help="where in a sentence the stream is cut")
    parser.add_argument("--sentences", type=int, default=10, help="sentences a file, from its third")
    args = parser.parse_args()
    fractions = [float(f) for f in args.fractions.split(",")]
    handler = Lines()
    policy_log = logging.getLogger("asr_spec.stream.policy")
    policy_log.setLevel(logging.DEBUG)
    policy_log.addHandler(handler)
    asr, voices = Transcriber.from_preset("base", batch_size=1), silero_voices()
    n, guessed = 0, 0
    for path in FIXTURES:
        audio = load_audio(str(path))
        with open(path.with_suffix(".sentences.tsv"), encoding="utf-8") as tsv:
            rows = list(csv.DictReader(tsv, delimiter="\t"))
        for i in range(2, min(len(rows), 2 + args.sentences)):
            start, end, words = float(rows[i]["start_s"]), float(rows[i]["end_s"]), rows[i]["sentence"].split()
            for fraction in fractions:
                cut = start + fraction * (end - start)
                piece = audio[int((float(rows[i - 1]["start_s"]) - 0.2) * SAMPLE_RATE):int(cut * SAMPLE_RATE)]
                handler.lines.clear()
                list(asr.stream([piece]))
                n_frames = len(piece) // FRAME_SAMPLES * FRAME_SAMPLES
                speech = np.asarray(voices()(piece[:n_frames])) >= 0.5
                closes = [line for line in handler.lines if "(close)" in line]
                found = last_segment(closes[-1], speech) if closes else None
                if found is None:
                    continue
                per_word, past, n_words, text = found
                left_out = past >= GUESS_PAST_S and per_word < GUESS_S_PER_WORD
                n, guessed = n + 1, guessed + left_out
                said = " ".join(words[:max(1, round(fraction * len(words)))])
                mark = "  LEFT OUT" if left_out else ""
                print(f"{per_word:.3f} s a word, {past:+.2f} s past, {n_words:2d} words{mark}  {path.stem} #{i} at "
                      f"{fraction:g}: {text!r} (said: {said!r})", flush=True)
    print(f"{guessed} of {n} last segments left out (past >= {GUESS_PAST_S} s, < {GUESS_S_PER_WORD} s a word)")


if __name__ == "__main__":
    main()
