"""benchmarks/ab_switch.py's pure parts: the word-by-word difference of two transcripts and its arguments' checks
(the benchmark itself loads whisper-base twice and is run by hand: docs/cpu.md)."""

from __future__ import annotations

import pytest

from benchmarks.ab_switch import parse_args, word_changes


def test_word_changes_name_each_replaced_inserted_and_deleted_run():
    assert word_changes("a b c", "a b c") == []
    assert word_changes("you, and we learned", "you. And we learned,") == ["you, and -> you. And",
                                                                         "learned -> learned,"]
    assert word_changes("a b", "a x b") == [" -> x"]
    assert word_changes("a x b", "a b") == ["x -> "]


def test_the_arguments_are_checked(monkeypatch, capsys):
    monkeypatch.delenv("ASR_SPEC_NO_BF16_WEIGHTS", raising=False)
    args = parse_args(["--switch", "ASR_SPEC_NO_BF16_WEIGHTS", "--audio", "a.wav", "--refs", "a.txt"])
    assert args.repeats == 3 and args.batch_size == 8
    for bad, message in ((["--switch", "OMP_NUM_THREADS", "--audio", "a.wav"], "ASR_SPEC_NO_"),
                         (["--switch", "ASR_SPEC_NO_X", "--audio", "a.wav", "b.wav", "--refs", "a.txt"], "--refs")):
        with pytest.raises(SystemExit):
            parse_args(bad)
        assert message in capsys.readouterr().err
    monkeypatch.setenv("ASR_SPEC_NO_X", "1")
    with pytest.raises(SystemExit):
        parse_args(["--switch", "ASR_SPEC_NO_X", "--audio", "a.wav"])
    assert "is set in this environment" in capsys.readouterr().err
