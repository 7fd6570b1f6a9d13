"""Make speech fixtures whose word boundaries are known: tests/fixtures/words/<voice>.flac + <voice>.json.

Each word is spoken alone by a Debian TTS voice (see make_fixtures.py), cut to its voiced part (the first to the
last frame whose RMS exceeds 2 % of the peak frame's), and the words are joined with digital silence of seeded
lengths. The JSON records, by construction, every word's start and end in seconds:

    {"voice": ..., "text": ..., "duration_s": ..., "words": [{"word": "village", "start": 0.912, "end": 1.37}, ...]}

Deterministic with the same package versions; about 5 s. Run: python -m scripts.make_word_fixtures
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

import numpy as np

from scripts import texts
from scripts.make_fixtures import SAMPLE_RATE, VOICE_BY_NAME, synthesize, trim, write_flac

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "words"
LEAD_S = 0.6  # silence before the first word
TAIL_S = 0.4  # after the last
GAP_RANGE_S = (0.15, 0.7)  # silence between words
SEED = 20_261_130
# voice -> the sentence it speaks a word at a time (scripts/texts/word_fixtures.json)
SENTENCES = {VOICE_BY_NAME[name]: sentence for name, sentence in texts.load("word_fixtures")["sentences"]}


def make(voice, sentence: str, rng: random.Random, workdir: Path) -> dict:
    pieces, words = [np.zeros(int(LEAD_S * SAMPLE_RATE), np.float32)], []
    position = len(pieces[0])
    for index, word in enumerate(sentence.split()):
        if index:
            gap = np.zeros(int(rng.uniform(*GAP_RANGE_S) * SAMPLE_RATE), np.float32)
            pieces.append(gap)
            position += len(gap)
        audio = trim(synthesize(voice, word, workdir), edge_s=0.0)
        words.append({"word": word, "start": round(position / SAMPLE_RATE, 4),
                      "end": round((position + len(audio)) / SAMPLE_RATE, 4)})
        pieces.append(audio)
        position += len(audio)
    pieces.append(np.zeros(int(TAIL_S * SAMPLE_RATE), np.float32))
    signal = np.concatenate(pieces)
    write_flac(OUT / f"{voice.name}.flac", signal)
    return {"voice": voice.name, "text": sentence, "duration_s": round(len(signal) / SAMPLE_RATE, 4), "words": words}


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # no options; --help must not write
    OUT.mkdir(parents=True, exist_ok=True)
    rng = random.Random(SEED)
    with tempfile.TemporaryDirectory() as tmp:
        for voice, sentence in SENTENCES.items():
            record = make(voice, sentence, rng, Path(tmp))
            (OUT / f"{voice.name}.json").write_text(json.dumps(record, indent=1) + "\n")
            print(f"{voice.name}: {record['duration_s']} s, {len(record['words'])} words")


if __name__ == "__main__":
    main()
