"""The draft-training corpus helpers: fortune texts, the seeded held-out split, augmentations."""

from __future__ import annotations

import numpy as np
import pytest

from asr_spec.distill import corpus

DATABASE = """The early bird gets the worm.
\t\t-- Proverb
%
    +--------+
    | a box  |
    +--------+
%
Q:\tWhat is the difference between a duck?
A:\tOne leg is both the same.
%
See http://example.org for details.
%
First sentence here. Second one follows. Third is last!
%
"""


def test_fortunes_are_parsed_cleaned_and_deduplicated():
    entries = corpus.parse_fortunes(DATABASE)
    assert len(entries) == 5
    assert corpus.clean_fortune(entries[0]) == "The early bird gets the worm."  # attribution dropped
    assert corpus.clean_fortune(entries[1]) is None  # ASCII art
    assert corpus.clean_fortune(entries[2]) == "Q: What is the difference between a duck? A: One leg is both the same."
    assert corpus.clean_fortune(entries[3]) is None  # URL
    texts = list(corpus.corpus_texts([DATABASE, DATABASE.upper()], max_words=4))
    assert texts[0] == "The early bird gets"  # 6 words, one sentence: cut at 4 words
    assert "the worm." not in texts  # the tail has 2 words, under min_words
    assert len(texts) == len({corpus.text_key(t) for t in texts})  # the upper-case copy adds nothing


@pytest.mark.parametrize("max_words", [1, 2, 3, 5, 100])
def test_split_sentences_keeps_every_word_in_order_and_respects_the_limit(max_words):
    text = "One two three. Four five! Six seven eight nine ten eleven? Twelve."
    pieces = corpus.split_sentences(text, max_words)
    assert " ".join(pieces).split() == text.split()
    assert all(1 <= len(p.split()) <= max_words for p in pieces)
    if max_words == 5:
        assert pieces[0] == "One two three. Four five!"  # whole sentences together when they fit


def test_held_out_split_is_seeded_stable_and_near_its_fraction():
    keys = [f"text number {i}" for i in range(4000)]
    held = [corpus.is_held_out(k, 0.05, seed=3) for k in keys]
    assert held == [corpus.is_held_out(k, 0.05, seed=3) for k in keys]  # a pure function of (key, seed)
    assert 0.035 < np.mean(held) < 0.065
    assert held != [corpus.is_held_out(k, 0.05, seed=4) for k in keys]


def _tone(seconds: float = 1.0) -> np.ndarray:
    t = np.arange(int(seconds * corpus.SAMPLE_RATE)) / corpus.SAMPLE_RATE
    return (0.3 * np.sin(2 * np.pi * 1000 * t) * np.minimum(1, t * 10)).astype(np.float32)


@pytest.mark.parametrize("color", ["white", "pink", "brown"])
def test_noise_lands_at_the_asked_snr(color):
    x = _tone()
    y = corpus.add_noise(x, 10.0, color, np.random.default_rng(0))
    snr = 10 * np.log10(np.mean(x.astype(np.float64) ** 2) / np.mean((y - x) ** 2))
    assert snr == pytest.approx(10.0, abs=0.01)


def test_colored_noise_spectra_slope_down():
    rng = np.random.default_rng(0)
    powers = {}
    for color in ("white", "pink", "brown"):
        spec = np.abs(np.fft.rfft(corpus.colored_noise(1 << 15, color, rng))) ** 2
        powers[color] = spec[100:1000].mean() / spec[5000:15000].mean()  # low band over high band
    assert powers["white"] < 2 < powers["pink"] < powers["brown"]


def test_augmentations_keep_length_level_and_are_deterministic():
    x = _tone()
    for kind in corpus.KINDS:
        aug = corpus.Augmentation(kind, snr_db=15, noise_color="pink", rt60_s=0.4, speed=1.1)
        a = corpus.augment(x, aug, np.random.default_rng(7))
        b = corpus.augment(x, aug, np.random.default_rng(7))
        assert a.dtype == np.float32 and np.array_equal(a, b)
        expected = len(x) / 1.1 if kind == "speed" else len(x)
        assert abs(len(a) - expected) <= 2
        assert np.isfinite(a).all() and 0.2 < np.sqrt(np.mean(a**2)) / np.sqrt(np.mean(x**2)) < 2.0
    with pytest.raises(ValueError, match="unknown augmentation"):
        corpus.augment(x, corpus.Augmentation("robot"), np.random.default_rng(0))


def test_telephone_removes_low_and_high_frequencies():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(corpus.SAMPLE_RATE).astype(np.float32) * 0.1
    y = corpus.telephone(x)
    spec = np.abs(np.fft.rfft(y)) ** 2
    f = np.fft.rfftfreq(len(y), 1 / corpus.SAMPLE_RATE)
    in_band = spec[(f > 500) & (f < 3000)].mean()
    assert spec[f > 4500].mean() < 1e-3 * in_band
    assert spec[f < 100].mean() < 0.05 * in_band


def test_drawn_augmentations_cover_every_kind_with_valid_settings():
    rng = np.random.default_rng(0)
    drawn = [corpus.draw_augmentation(rng) for _ in range(300)]
    assert {a.kind for a in drawn} == set(corpus.KINDS)
    assert all(5 <= a.snr_db <= 25 and 0.2 <= a.rt60_s <= 0.8 and 0.88 <= a.speed <= 1.12 for a in drawn)
    assert corpus.Augmentation("noise", snr_db=12.4, noise_color="pink").label() == "noise:pink12dB"


def _corpus_script():
    import importlib
    import sys
    from pathlib import Path

    scripts = str(Path(__file__).resolve().parent.parent / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    return importlib.import_module("make_draft_corpus"), importlib.import_module("kokoro_tts")


def test_kokoro_voice_specs_parse_and_refuse_the_evaluation_voices():
    _, kokoro = _corpus_script()
    assert kokoro.components("af_heart") == [("af_heart", 1.0)]
    assert kokoro.components(kokoro.blend_spec("af_heart", "bm_george", 0.3)) == [("af_heart", 0.7),
                                                                                  ("bm_george", 0.3)]
    for bad in ("af_heart+bm_george", "af_heart+bm_george@1.5", "af_sky", "af_heart+bm_fable@0.5"):
        with pytest.raises(ValueError, match="voice"):
            kokoro.components(bad)
    assert len(kokoro.USABLE_VOICES) == 22 and not set(kokoro.USABLE_VOICES) & kokoro.EXCLUDED_VOICES


@pytest.mark.parametrize("voice_set", ["debian", "kokoro", "all"])
def test_voice_sets_hold_out_voices_and_their_tables(voice_set):
    script, kokoro = _corpus_script()
    train, held = script.VOICE_SETS[voice_set]
    script.check_voices_disjoint(train, held)  # raises on any overlap
    names = [v.name for v in train + held]
    assert len(names) == len(set(names))
    for voice in train + held:
        if voice.engine == "kokoro":
            assert not {n for n, _ in kokoro.components(voice.voice)} & kokoro.EXCLUDED_VOICES
    texts = [f"Sentence number {i} is here." for i in range(400)]
    utterances = script.plan(texts, seed=1, held_out_fraction=0.1, max_held_out=50, voices=(train, held))
    assert {u.voice for u in utterances if u.split == "train"} <= set(train)
    assert {u.voice for u in utterances if u.split == "heldout"} <= set(held)
    assert not {u.text for u in utterances if u.split == "train"} & {u.text for u in utterances
                                                                      if u.split == "heldout"}


def test_a_blend_sharing_a_held_out_table_is_refused():
    script, kokoro = _corpus_script()
    train, held = script.VOICE_SETS["kokoro"]
    leaky = train + (script._kokoro(kokoro.blend_spec("af_heart", held[0].voice, 0.2)),)
    with pytest.raises(SystemExit, match="both in training and held out"):
        script.check_voices_disjoint(leaky, held)
