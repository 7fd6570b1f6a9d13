"""The long-form fixtures (scripts/make_longform_fixtures.py) are what their README says: no model needed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from asr_spec.audio.loading import load_audio

LONGFORM = Path(__file__).parent / "fixtures" / "longform"
LONG_FILES = ["dense_windows", "dialogue_pauses", "ends_mid_sentence", "monologue_speeds"]
WEAK_WORDS = {"A", "An", "The", "In", "Of", "At", "As", "To"}  # the first words of the weak-onset clips


def sentence_rows(name: str) -> list[tuple[float, float, str]]:
    lines = (LONGFORM / f"{name}.sentences.tsv").read_text(encoding="utf-8").splitlines()
    assert lines[0] == "start_s\tend_s\tsentence"
    return [(float(a), float(b), text) for a, b, text in (line.split("\t") for line in lines[1:])]


@pytest.mark.parametrize("name", LONG_FILES)
def test_long_file_is_two_minutes_with_ordered_sentences_that_make_its_reference(name):
    audio = load_audio(LONGFORM / f"{name}.opus")
    rows = sentence_rows(name)
    assert len(audio) / 16_000 >= 120
    assert " ".join(text for _, _, text in rows) == (LONGFORM / f"{name}.txt").read_text(encoding="utf-8").strip()
    starts, ends = np.array([r[0] for r in rows]), np.array([r[1] for r in rows])
    assert (starts < ends).all() and (ends[:-1] <= starts[1:]).all() and ends[-1] <= len(audio) / 16_000 + 0.01


def test_dense_file_pauses_and_the_cut_file_ends_in_its_last_sentence():
    rows = sentence_rows("dense_windows")
    pauses = np.array([b[0] - a[1] for a, b in zip(rows[:-1], rows[1:])])
    assert pauses.min() >= 0.19 and pauses.max() <= 0.46
    last_end = sentence_rows("ends_mid_sentence")[-1][1]
    assert len(load_audio(LONGFORM / "ends_mid_sentence.opus")) / 16_000 == pytest.approx(last_end, abs=0.01)


def test_weak_onset_clips_start_speaking_at_a_fifth_of_a_second():
    clips = sorted((LONGFORM / "clips").glob("weak_*.opus"))
    assert 4 <= len(clips) <= 8
    for path in clips:
        audio = load_audio(path)
        frame = 160  # 10 ms
        rms = np.sqrt(np.mean(audio[: len(audio) // frame * frame].reshape(-1, frame) ** 2, axis=1))
        onset_s = np.flatnonzero(rms > 0.01 * rms.max())[0] * frame / 16_000
        assert 0.15 <= onset_s <= 0.3, path.name
        assert path.with_suffix(".txt").read_text().split()[0] in WEAK_WORDS


def voices_of(file_set) -> set[str]:
    return {*file_set.dense, *file_set.dialogue, *file_set.garden, file_set.bridges, *file_set.clips}


def test_every_held_out_set_speaks_other_texts_in_the_fixtures_structures_and_no_evaluation_voice():
    from conftest import script_module

    with script_module("make_longform_fixtures") as maker, script_module("kokoro_tts") as tts:
        fixtures = maker.SETS["fixtures"]
        held_out = [file_set for name, file_set in maker.SETS.items() if name != "fixtures"]
        assert len(held_out) >= 2
        sets = [fixtures, *held_out]
        for i, file_set in enumerate(sets):
            texts = file_set.load_texts()
            assert len(texts.weak_onsets) == len(fixtures.clips) == len(file_set.clips)
            assert {t.split()[0] for t in texts.weak_onsets} <= WEAK_WORDS
            assert texts.last_sentence.startswith(texts.last_spoken + ",")
            assert all(t[-1] in ".?" for t in file_set.every_text())
            assert not voices_of(file_set) & tts.EXCLUDED_VOICES
            for other in sets[:i]:  # other texts, another seed, other speakers at the dense file's window edges
                assert not set(file_set.every_text()) & set(other.every_text())
                assert file_set.seed != other.seed
                assert not set(file_set.dense) & set(other.dense)
