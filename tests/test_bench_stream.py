"""benchmarks/bench_stream.py's helpers: commit latencies matched to offline words, their tail per quarter, the streams'
slices of a folder."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks.bench_stream import FIXTURES, latencies, matched, p95_by_quarter, slices


def word(text: str, end: float) -> SimpleNamespace:
    return SimpleNamespace(word=text, end=end)


def test_latencies_and_their_word_ends_come_in_the_same_order_for_the_matched_words_only():
    words = [word("one", 1.0), word("two", 2.0), word("three", 3.0)]
    commits = [("one", 2.5), ("extra", 2.6), ("three", 4.0)]  # "two" never committed, "extra" not said offline
    assert latencies(commits, words) == [1.5, 1.0]
    assert [end for _, end in matched(commits, words)] == [1.0, 3.0]


def test_each_quarter_gets_the_p95_of_its_own_words_and_an_empty_one_none():
    ends = [1.0, 2.0, 3.0, 11.0, 12.0, 39.9]  # audio of 40 s: quarters [0, 10), [10, 20), [20, 30), [30, 40]
    lat = [1.0, 1.0, 1.0, 5.0, 9.0, 2.0]
    first, second, third, fourth = p95_by_quarter(ends, lat, [40.0] * 6)
    assert first == pytest.approx(1.0) and third is None and fourth == pytest.approx(2.0)
    assert second == pytest.approx(8.8)  # numpy's linear p95 of (5, 9)


def test_a_word_ending_at_the_audio_end_counts_in_the_last_quarter():
    assert p95_by_quarter([40.0], [3.0], [40.0]) == [None, None, None, 3.0]


def test_each_word_falls_in_a_quarter_of_its_own_streams_audio():
    """A word 9 s into a 12 s stream is in that stream's last quarter, though a 60 s stream beside it is longer."""
    assert p95_by_quarter([9.0, 9.0], [4.0, 1.0], [12.0, 60.0]) == [1.0, None, None, 4.0]
    with pytest.raises(ValueError):  # one length a word
        p95_by_quarter([9.0, 9.0], [4.0, 1.0], [12.0])


def test_streams_are_the_folders_files_in_turn_then_their_next_slices_and_an_empty_folder_is_named(tmp_path):
    items = slices(5, 20.0, FIXTURES)  # the four long fixtures' first 20 s, then the first one's next 20 s
    names = sorted(path.stem for path in FIXTURES.glob("*.opus"))
    assert [name for name, _ in items] == [f"{n}@0s" for n in names] + [f"{names[0]}@20s"]
    assert all(len(audio) == 20 * 16_000 for _, audio in items)
    with pytest.raises(SystemExit, match=str(tmp_path)):
        slices(1, 20.0, tmp_path)
