#!/usr/bin/env python3
"""Make the long-form fixtures (issue 28) with Kokoro-82M neural voices: four files of two minutes or more of
different structure, and short clips whose first word is a weak syllable.

Kokoro runs in a virtual environment of its own, with no torch and no network (install lines in
scripts/kokoro_tts.py, which holds the voices):

    ~/kokoro-venv/bin/python -m scripts.make_longform_fixtures               # voices from $KOKORO_VOICES
    ~/kokoro-venv/bin/python -m scripts.make_longform_fixtures --set heldout --out runs/longform_heldout

The texts are data: scripts/texts/longform_fixtures.json and, for `--set heldout`, longform_heldout.json.
`--set heldout` makes the same four structures and clips from other texts (scripts/texts/longform_heldout.json) in
other voice pairings with another seed: files nothing was tuned on, to check what the fixtures chose.
`--set heldout2` does the same again from a third set of texts (longform_heldout2.json) in yet other pairings,
`--set heldout3` from a fourth (longform_heldout3.json).
Writes under --out (default tests/fixtures/longform), 16 kHz mono Ogg Opus:

    dense_windows.opus       (a) dense speech in three voices, 0.2-0.45 s pauses, planned so that each 30 s
                             voice-activity chunk ends with a complete sentence 0.6-1.4 s before the window's end
    dialogue_pauses.opus     (b) two voices taking turns, 1.5-4 s pauses
    ends_mid_sentence.opus   (c) three readers, 0.3-0.9 s pauses; the audio is cut at the comma of its last sentence
    monologue_speeds.opus    (d) one voice, speed 0.85-1.15 per sentence, some sentences of 9-12 s
    NAME.txt                 the whole reference (what is spoken, one line)
    NAME.sentences.tsv       start_s, end_s, sentence: every spoken sentence with its time in the file
    clips/weak_NN.opus, .txt short clips in eight voices whose first word is a weak syllable ("A", "The", "In",
                             ...), speech starting 0.2 s into the file; the odd ones start softly (-20 dB
                             rising to 0 over 0.35 s); clips/manifest.tsv: file, voice, onset, text

Deterministic: the pauses, speeds, voices and noise come from the set's seed; Kokoro runs on one onnxruntime
thread. A low noise floor (-70 dBFS, white) lies under everything, as under a real recording (digital silence
would take the voice-activity detector's shortcut for silent frames). Times in the tsv files are of the trimmed
speech (frames within kokoro_tts.TRIM_DB of the sentence's loudest), so a sentence's `start_s` is where its first
sound starts.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from scripts import texts
from scripts.kokoro_tts import SAMPLE_RATE, VOICES_DIR, Kokoro

NOISE_STD = 3e-4  # the noise floor under every file: -70 dBFS, above the VAD's digital-silence bound (1e-4)
OPUS_LEVEL = 0.9  # libsndfile Opus compression level (0 = best quality, 1 = smallest): about 31 kbit/s here

# (a): a window's speech (first sentence start to last sentence end) lands in WINDOW_SPAN_S, so with the VAD's
# 0.2 s padding and its speech tail the chunk is 28.8-29.9 s and its last sentence ends 0.6-1.4 s before 30 s
WINDOW_SPAN_S = (28.4, 29.2)
DENSE_PAUSE_S = (0.2, 0.38)  # between sentences inside a window
DENSE_BOUNDARY_S = 0.45  # between windows: the longest pause, where the chunk planner cuts
DIALOGUE_PAUSE_S = (1.5, 4.0)
GARDEN_PAUSE_S = (0.3, 0.9)
BRIDGES_PAUSE_S = (0.4, 1.2)
BRIDGES_SPEED = (0.85, 1.15)
CLIP_LEAD_S, CLIP_TAIL_S = 0.2, 0.4  # silence before and after a clip's speech
# the odd-numbered clips start softly: their gain rises from SOFT_ONSET_DB to 0 dB over the first SOFT_ONSET_S
# (a speaker who starts quietly, or turns to the microphone); silero's onset comes up to ~0.1 s late on them
SOFT_ONSET_DB, SOFT_ONSET_S = -20.0, 0.35
FILE_LEAD_S, FILE_TAIL_S = 0.3, 0.5  # silence before and after a long file's speech


@dataclass(frozen=True)
class Texts:
    """What a set's files say (scripts/texts/*.json; its "about" entry says what each list is for)."""

    dense: tuple[str, ...]
    dialogue: tuple[str, ...]
    garden: tuple[str, ...]
    last_sentence: str
    last_spoken: str  # the part of last_sentence before its first comma: all the memoir's file says of it
    bridges: tuple[str, ...]
    weak_onsets: tuple[str, ...]

    @classmethod
    def load(cls, name: str) -> Texts:
        data = texts.load(name)
        return cls(**{name: data[name] if isinstance(data[name], str) else tuple(data[name])
                      for name in cls.__dataclass_fields__})


@dataclass(frozen=True)
class FileSet:
    """What a set of files speaks and in which voices: its texts file (in scripts/texts/) and its seed."""

    texts: str
    seed: int
    dense: tuple[str, ...]
    dialogue: tuple[str, str]
    garden: tuple[str, ...]
    bridges: str
    clips: tuple[str, ...]

    def load_texts(self) -> Texts:
        return Texts.load(self.texts)

    def every_text(self) -> list[str]:
        """Every sentence the set speaks (kept out of the draft-training corpus, make_draft_corpus.py)."""
        t = self.load_texts()
        return [*t.dense, *t.dialogue, *t.garden, t.last_sentence, *t.bridges, *t.weak_onsets]


SETS = {
    # the committed fixtures (tests/fixtures/longform)
    "fixtures": FileSet("longform_fixtures", 28_2026, ("af_heart", "bm_george", "bf_emma"),
                        ("am_michael", "bf_alice"), ("af_sarah", "bm_lewis", "af_aoede"), "bm_daniel",
                        ("af_alloy", "am_liam", "bf_isabella", "af_kore", "am_fenrir", "af_jessica", "bm_george",
                         "af_nova")),
    # held out: other texts, five of the six voices no fixture uses and other pairings of the rest; for checking
    # that what was measured and chosen on the fixtures holds on files nobody tuned anything on (not committed)
    "heldout": FileSet("longform_heldout", 28_1201, ("af_bella", "am_onyx", "bf_alice"), ("am_adam", "af_river"),
                       ("af_nova", "bm_george", "am_eric"), "af_kore",
                       ("af_bella", "am_onyx", "af_river", "am_adam", "bf_emma", "am_eric", "bm_lewis", "af_heart")),
    # a second held-out set (2026-12-05): new texts, and dense voices, pairings and a seed of neither set above
    "heldout2": FileSet("longform_heldout2", 5_1205, ("bf_isabella", "am_michael", "af_aoede"),
                        ("bm_daniel", "af_jessica"), ("af_river", "bm_lewis", "am_liam"), "bf_emma",
                        ("af_sarah", "am_fenrir", "bf_alice", "bm_george", "af_alloy", "am_adam", "af_kore",
                         "af_heart")),
    # a third held-out set (2026-12-05, twenty-fourth session): new texts (a circus, a piano up the stairs, sailing
    # with a grandmother, old maps, a harvest), new pairings (am_santa's first use) and a seed of no set above
    "heldout3": FileSet("longform_heldout3", 24_1205, ("af_sarah", "am_eric", "bm_daniel"), ("am_liam", "af_kore"),
                        ("bf_emma", "am_fenrir", "af_nova"), "bm_george",
                        ("af_bella", "am_santa", "bf_isabella", "af_river", "am_onyx", "af_jessica", "bm_lewis",
                         "af_alloy")),
}


@dataclass
class Track:
    """A file being assembled: its samples and one (start_s, end_s, sentence) row per sentence."""

    samples: list[np.ndarray]
    rows: list[tuple[float, float, str]]

    @classmethod
    def start(cls, lead_s: float) -> Track:
        return cls([np.zeros(int(lead_s * SAMPLE_RATE), np.float32)], [])

    @property
    def n_samples(self) -> int:
        return sum(len(s) for s in self.samples)

    def pause(self, seconds: float) -> None:
        self.samples.append(np.zeros(int(round(seconds * SAMPLE_RATE)), np.float32))

    def say(self, audio: np.ndarray, sentence: str) -> None:
        start = self.n_samples
        self.samples.append(audio)
        self.rows.append((start / SAMPLE_RATE, self.n_samples / SAMPLE_RATE, sentence))

    def finish(self, tail_s: float, rng: np.random.Generator) -> np.ndarray:
        self.pause(tail_s)
        audio = np.concatenate(self.samples)
        return (audio + rng.normal(0.0, NOISE_STD, len(audio))).astype(np.float32)


# -- the four long files ---------------------------------------------------------------------------------------

def dense_windows(tts: Kokoro, rng: np.random.Generator, fs: FileSet) -> Track:
    """(a): sentences packed into windows whose speech spans WINDOW_SPAN_S, windows split by DENSE_BOUNDARY_S."""
    sentences = fs.load_texts().dense
    voices = [fs.dense[i % len(fs.dense)] for i in range(len(sentences))]
    pool = [(text, tts(text, voice)) for text, voice in zip(sentences, voices, strict=True)]
    track = Track.start(FILE_LEAD_S)
    while pool:
        window = plan_window(pool, rng)
        for index, (pause_s, (text, audio)) in enumerate(window):
            if index:
                track.pause(pause_s)
            track.say(audio, text)
        if pool:
            track.pause(DENSE_BOUNDARY_S)
    return track


def plan_window(pool: list[tuple[str, np.ndarray]], rng: np.random.Generator) -> list[tuple[float, tuple]]:
    """Take sentences off the front of `pool` until their speech with pauses spans WINDOW_SPAN_S (see
    `fill_window`), then stretch the pauses within DENSE_PAUSE_S to land mid-range. The pool's last window may be
    shorter. Returns (pause before, sentence) pairs."""
    chosen = fill_window(pool)
    span = window_span(chosen, DENSE_PAUSE_S[0])
    n_pauses = len(chosen) - 1
    pauses = rng.uniform(*DENSE_PAUSE_S, n_pauses) if n_pauses else np.zeros(0)
    if pool and n_pauses:  # shrink or grow the pauses (within DENSE_PAUSE_S) so the span lands mid-range
        extra, room = pauses - DENSE_PAUSE_S[0], DENSE_PAUSE_S[1] - pauses
        want = float(np.clip(sum(WINDOW_SPAN_S) / 2 - span, 0.0, extra.sum() + room.sum()))
        if want <= extra.sum():
            pauses = DENSE_PAUSE_S[0] + extra * (want / max(extra.sum(), 1e-9))
        else:
            pauses = pauses + room * ((want - extra.sum()) / max(room.sum(), 1e-9))
    return [(float(p), item) for p, item in zip(np.concatenate([[0.0], pauses]), chosen, strict=True)]


def window_span(chosen: list[tuple[str, np.ndarray]], pause_s: float) -> float:
    """Seconds from the first sentence's start to the last one's end with `pause_s` between sentences."""
    return sum(len(audio) for _, audio in chosen) / SAMPLE_RATE + pause_s * max(len(chosen) - 1, 0)


def fill_window(pool: list[tuple[str, np.ndarray]]) -> list[tuple[str, np.ndarray]]:
    """Sentences off the front of `pool` whose span, with pauses somewhere in DENSE_PAUSE_S, can reach
    WINDOW_SPAN_S: in order while they fit, then the first later sentence that closes the gap,
    giving back the last ones taken while none does."""
    low, high = WINDOW_SPAN_S
    chosen: list[tuple[str, np.ndarray]] = []
    while pool and window_span(chosen + pool[:1], DENSE_PAUSE_S[0]) <= high:
        chosen.append(pool.pop(0))
    for _ in range(len(chosen)):
        if not pool or window_span(chosen, DENSE_PAUSE_S[1]) >= low:
            break
        fits = [i for i, item in enumerate(pool)
                if window_span(chosen + [item], DENSE_PAUSE_S[0]) <= high
                and window_span(chosen + [item], DENSE_PAUSE_S[1]) >= low]
        if fits:
            chosen.append(pool.pop(fits[0]))
            break
        pool.insert(0, chosen.pop())
    return chosen


def dialogue_pauses(tts: Kokoro, rng: np.random.Generator, fs: FileSet) -> Track:
    """(b): two voices taking turns, a long pause before every turn."""
    track = Track.start(FILE_LEAD_S)
    for index, text in enumerate(fs.load_texts().dialogue):
        if index:
            track.pause(rng.uniform(*DIALOGUE_PAUSE_S))
        track.say(tts(text, fs.dialogue[index % 2]), text)
    return track


def ends_mid_sentence(tts: Kokoro, rng: np.random.Generator, fs: FileSet) -> Track:
    """(c): readers taking turns every 3-5 sentences; the last sentence is cut at its comma, ending the file."""
    track = Track.start(FILE_LEAD_S)
    said = fs.load_texts()
    voice, left = 0, int(rng.integers(3, 6))
    for index, text in enumerate(said.garden):
        if index:
            track.pause(rng.uniform(*GARDEN_PAUSE_S))
        track.say(tts(text, fs.garden[voice]), text)
        left -= 1
        if not left:
            voice, left = (voice + 1) % len(fs.garden), int(rng.integers(3, 6))
    track.pause(rng.uniform(*GARDEN_PAUSE_S))
    last_voice = fs.garden[voice]
    full = tts(said.last_sentence, last_voice)
    track.say(full[: comma_cut(full, len(tts(said.last_spoken + ",", last_voice)))], said.last_spoken)
    return track


def comma_cut(audio: np.ndarray, prefix_samples: int) -> int:
    """The sample where `audio` is quietest (30 ms RMS) within 0.4 s of `prefix_samples` (where the words before
    the comma end when spoken alone): the comma's pause."""
    frame, reach = int(0.03 * SAMPLE_RATE), int(0.4 * SAMPLE_RATE)
    starts = np.arange(max(prefix_samples - reach, 0), min(prefix_samples + reach, len(audio) - frame), frame // 3)
    rms = [float(np.sqrt(np.mean(audio[s: s + frame] ** 2))) for s in starts]
    return int(starts[int(np.argmin(rms))] + frame // 2)


def monologue_speeds(tts: Kokoro, rng: np.random.Generator, fs: FileSet) -> Track:
    """(d): one voice, each sentence at its own speed."""
    track = Track.start(FILE_LEAD_S)
    for index, text in enumerate(fs.load_texts().bridges):
        if index:
            track.pause(rng.uniform(*BRIDGES_PAUSE_S))
        track.say(tts(text, fs.bridges, round(float(rng.uniform(*BRIDGES_SPEED)), 3)), text)
    return track


# -- output ----------------------------------------------------------------------------------------------------

def write_audio(path: Path, audio: np.ndarray) -> None:
    import soundfile as sf

    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(path, np.clip(audio, -1.0, 1.0), SAMPLE_RATE, format="OGG", subtype="OPUS",
             compression_level=OPUS_LEVEL)


def write_file(out: Path, name: str, track: Track, rng: np.random.Generator, fs: FileSet) -> float:
    """NAME.opus, NAME.txt and NAME.sentences.tsv; returns the duration in seconds."""
    audio = track.finish(FILE_TAIL_S if track.rows[-1][2] != fs.load_texts().last_spoken else 0.0, rng)
    write_audio(out / f"{name}.opus", audio)
    (out / f"{name}.txt").write_text(" ".join(row[2] for row in track.rows) + "\n", encoding="utf-8")
    lines = ["start_s\tend_s\tsentence"] + [f"{a:.3f}\t{b:.3f}\t{text}" for a, b, text in track.rows]
    (out / f"{name}.sentences.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return len(audio) / SAMPLE_RATE


def write_clips(out: Path, tts: Kokoro, rng: np.random.Generator, fs: FileSet) -> None:
    onsets = fs.load_texts().weak_onsets
    for index, (text, voice) in enumerate(zip(onsets, fs.clips, strict=True)):
        track = Track.start(CLIP_LEAD_S)
        audio = tts(text, voice)
        if index % 2:
            ramp = np.minimum(np.arange(len(audio)) / (SOFT_ONSET_S * SAMPLE_RATE), 1.0)
            audio = (audio * 10 ** (SOFT_ONSET_DB * (1.0 - ramp) / 20)).astype(np.float32)
        track.say(audio, text)
        write_audio(out / "clips" / f"weak_{index:02d}.opus", track.finish(CLIP_TAIL_S, rng))
        (out / "clips" / f"weak_{index:02d}.txt").write_text(text + "\n", encoding="utf-8")
    lines = ["file\tvoice\tonset\ttext"] + [f"weak_{i:02d}.opus\t{v}\t{'soft' if i % 2 else 'plain'}\t{t}"
                                             for i, (t, v) in enumerate(zip(onsets, fs.clips))]
    (out / "clips" / "manifest.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    root = Path(__file__).resolve().parent.parent
    parser.add_argument("--voices", type=Path, default=VOICES_DIR,
                        help="kokoro-js's voices/ folder (raw float32 style tables; default $KOKORO_VOICES, else "
                             "~/kokoro-voices/package/voices)")
    parser.add_argument("--set", choices=sorted(SETS), default="fixtures",
                        help="fixtures (default: the committed ones), heldout, heldout2 or heldout3 (other texts and "
                             "voices)")
    parser.add_argument("--out", type=Path, help="default tests/fixtures/longform for --set fixtures "
                                                 "(the other sets need it)")
    parser.add_argument("--cache", type=Path, help="keep each synthesised sentence here (reruns skip Kokoro)")
    args = parser.parse_args(argv)
    if not (args.voices / "af_heart.bin").exists():
        parser.error(f"--voices {args.voices}: no Kokoro voice tables there (see the install lines above)")
    if args.out is None and args.set != "fixtures":
        parser.error(f"--set {args.set}: give --out (only the fixtures have a home in the tree)")
    out = args.out or root / "tests" / "fixtures" / "longform"
    fs = SETS[args.set]
    tts = Kokoro(args.voices, args.cache)
    makers = [("dense_windows", dense_windows), ("dialogue_pauses", dialogue_pauses),
              ("ends_mid_sentence", ends_mid_sentence), ("monologue_speeds", monologue_speeds)]
    for index, (name, make) in enumerate(makers):
        rng = np.random.default_rng([fs.seed, index])  # one stream per file: a change to one leaves the others
        track = make(tts, rng, fs)
        seconds = write_file(out, name, track, rng, fs)
        print(f"{name}: {seconds:.1f} s, {len(track.rows)} sentences", file=sys.stderr)
    write_clips(out, tts, np.random.default_rng([fs.seed, len(makers)]), fs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
