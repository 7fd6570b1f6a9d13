"""Make the prompt fixtures: tests/fixtures/prompts/<key>.flac + names.json.

Each clip is one sentence with a rare name, spoken by the clearest Debian TTS voice (festival's SLT HTS, see
make_fixtures.py), trimmed. whisper-base spells each name the common way without a prompt ("Jackson Brookide",
"Michaela Shepanski", "Caitlin Vanderweld") and as written when the name is given as the initial prompt or as
hotwords (tests/test_prompts.py). The JSON records each clip's sentence and its name:

    [{"file": "jaxxon.flac", "text": "...", "name": "Jaxxon Brookhyde"}, ...]

Beside them, spanish.flac: seven Spanish sentences (espeak-ng's Spanish voice at 150 words a minute, the pauses of
scripts/texts/prompt_fixtures.json), ~28 s, for translation with a prefix (tests/test_prompts.py); its sentences
are in that JSON file, not in names.json.

Deterministic with the same package versions; a few seconds. Run: python -m scripts.make_prompt_fixtures
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from scripts import texts
from scripts.make_fixtures import SAMPLE_RATE, SLT_HTS, _espeak, synthesize, trim, write_flac

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "prompts"
# clip key -> (the sentence spoken, the rare name in it) (scripts/texts/prompt_fixtures.json)
CLIPS = {key: (clip["text"], clip["name"]) for key, clip in texts.load("prompt_fixtures")["clips"].items()}
TRANSLATE = texts.load("prompt_fixtures")["translate"]
SPANISH = _espeak("es", stretch=175 / 150)  # 150 words a minute


def spanish_clip(workdir: Path) -> np.ndarray:
    """The translate clip: each sentence as espeak-ng speaks it (untrimmed), then its pause of digital silence.
    shape = (n_samples,)"""
    parts = []
    for text, pause_s in TRANSLATE["sentences"]:
        parts += [synthesize(SPANISH, text, workdir), np.zeros(round(pause_s * SAMPLE_RATE), np.float32)]
    return np.concatenate(parts)


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # no options; --help must not write
    OUT.mkdir(parents=True, exist_ok=True)
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for key, (text, name) in CLIPS.items():
            write_flac(OUT / f"{key}.flac", trim(synthesize(SLT_HTS, text, Path(tmp))))
            records.append({"file": f"{key}.flac", "text": text, "name": name})
        write_flac(OUT / TRANSLATE["file"], spanish_clip(Path(tmp)))
    (OUT / "names.json").write_text(json.dumps(records, indent=1) + "\n")
    print(f"wrote {len(records)} clips to {OUT}")


if __name__ == "__main__":
    main()
