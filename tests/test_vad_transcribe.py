"""Voice-activity chunking and word timestamps through the Transcriber (tiny random Whisper with the real vocabulary,
real silero-vad on the committed speech fixtures), plus the options and caption cues they bring."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from test_transcribe import LONG, SHORT, transcriber

from asr_spec import TranscribeOptions
from asr_spec.audio.loading import SAMPLE_RATE, load_audio
from asr_spec.errors import InputError
from asr_spec.transcribe.captions import wrap_lines
from asr_spec.transcribe.outputs import CueOptions, render_json, render_srt, render_vtt

pytest.importorskip("silero_vad")


@pytest.fixture(scope="module")
def padded_long(tmp_path_factory) -> Path:
    """The long clip between 20 s and 35 s of digital silence (two pauses a stride plan would still encode)."""
    audio = load_audio(str(LONG))
    path = tmp_path_factory.mktemp("vad") / "padded.flac"
    sf.write(path, np.concatenate([np.zeros(20 * SAMPLE_RATE), audio, np.zeros(35 * SAMPLE_RATE)]), SAMPLE_RATE)
    return path


def test_vad_chunks_skip_silence_and_speculative_equals_greedy(padded_long: Path) -> None:
    greedy = transcriber(speculative=False, chunking="vad", timestamps=True)
    spec = transcriber(speculative=True, chunking="vad", timestamps=True)
    stride = transcriber(speculative=False, chunking="stride", timestamps=True)
    g, s = greedy.transcribe(str(padded_long), progress=False)[0], spec.transcribe(str(padded_long), progress=False)[0]
    assert g.ok and s.ok
    assert s.chunk_tokens == g.chunk_tokens and s.text == g.text
    assert s.stats.drafted_tokens > 0
    spans = [(c.start_s, c.end_s) for c in g.chunks]
    assert spans[0][0] >= 19.0 and spans[-1][1] <= 20 + 78.5  # the silences are not decoded
    assert all(b[0] >= a[1] for a, b in zip(spans, spans[1:]))  # disjoint, in order
    assert all(end - start <= 30.0 for start, end in spans)
    assert len(g.chunks) < len(stride.transcribe(str(padded_long), progress=False)[0].chunks)
    assert g.audio_s == pytest.approx(20 + 77.7 + 35, abs=0.1)
    times = [t for seg in g.segments for t in (seg.start_s, seg.end_s)]
    assert times == sorted(times) and times[0] >= spans[0][0] and times[-1] <= spans[-1][1]


def test_a_file_without_speech_is_an_empty_transcript(tmp_path: Path) -> None:
    path = tmp_path / "silence.flac"
    sf.write(path, np.zeros(600 * SAMPLE_RATE, np.float32), SAMPLE_RATE)  # 10 minutes
    out = transcriber(speculative=False, chunking="vad").transcribe([str(path), str(SHORT[0])], progress=False)
    silent, speech = out
    assert silent.ok and silent.text == "" and silent.segments == () and silent.chunks == ()
    assert silent.audio_s == pytest.approx(600.0)
    assert speech.ok and speech.chunks


def test_word_timestamps_do_not_depend_on_the_draft(padded_long: Path) -> None:
    words = {}
    for speculative in (False, True):
        t = transcriber(speculative=speculative, chunking="vad", timestamps=True, word_timestamps=True)
        result = t.transcribe(str(padded_long), progress=False)[0]
        words[speculative] = [w for seg in result.segments for w in seg.words]
        spans = [(c.start_s, c.end_s) for c in result.chunks]
        for w in words[speculative]:  # inside a chunk (the words of a random model need not fit its segments)
            assert any(start <= w.start <= w.end <= end for start, end in spans), w
    assert words[True] == words[False] and words[False]
    starts = [w.start for w in words[False]]
    assert starts == sorted(starts) and all(19.0 <= w.start <= w.end <= 20 + 78.0 for w in words[False])
    assert "".join(w.word for w in words[False]).strip()


def test_options_for_chunking_and_words() -> None:
    vad = TranscribeOptions.from_values(chunking="vad", chunk_length_s=20)
    assert vad.chunking_mode == "vad" and vad.vad.max_chunk_s == 20
    assert TranscribeOptions.from_values(vad, chunk_length_s=25).vad.max_chunk_s == 25
    assert TranscribeOptions.from_values(vad, chunking="stride").vad is None
    for bad, cause in [(dict(chunking="silence"), "chunking must be one of"),
                       (dict(chunking="vad", stride_length_s=3), "stride_length_s applies"),
                       (dict(chunking="stride", word_timestamps=True), "word_timestamps need chunking 'vad'"),
                       (dict(chunking="vad", max_words_per_cue=3), "needs word_timestamps"),
                       (dict(chunking="vad", word_timestamps=True, max_words_per_cue=0), "max_words_per_cue must"),
                       (dict(chunking="vad", max_line_width=42, max_line_count=2), "max_line_count needs word_t"),
                       (dict(chunking="vad", word_timestamps=True, max_line_count=2), "needs max_line_width"),
                       (dict(max_line_width=0), "max_line_width must"),
                       # the field the caller set, not the VAD's own max_chunk_s that it becomes
                       (dict(chunking="vad", chunk_length_s=0.5),
                        r"^chunk_length_s 0.5 with chunking 'vad': .*\[1, 30\]")]:
        with pytest.raises(InputError, match=cause):
            TranscribeOptions.from_values(**bad)


RESULT = {
    "text": "Hello there world. Yes.",
    "segments": [
        {"start_s": 0.0, "end_s": 2.0, "text": " Hello there world.",
         "words": [{"word": " Hello", "start": 0.1, "end": 0.5, "probability": 0.9},
                   {"word": " there", "start": 0.5, "end": 1.0, "probability": 0.8},
                   {"word": " world.", "start": 1.1, "end": 1.9, "probability": 0.7}]},
        {"start_s": 2.5, "end_s": 3.0, "text": " Yes.", "words": []},
    ],
}


def test_caption_cues_of_n_words_and_words_in_json() -> None:
    srt = render_srt(RESULT, CueOptions(max_words_per_cue=2))
    assert "00:00:00,100 --> 00:00:01,000\nHello there" in srt and "00:00:01,100 --> 00:00:01,900\nworld." in srt
    assert "00:00:02,500 --> 00:00:03,000\nYes." in srt  # a segment without words stays one cue
    assert render_vtt(RESULT).count("-->") == 2  # one cue per segment by default
    data = json.loads(render_json(RESULT))
    assert data["segments"][0]["words"][2] == {"word": " world.", "start": 1.1, "end": 1.9, "probability": 0.7}
    assert "words" not in data["segments"][1]  # empty word lists are left out


def test_a_word_cue_ends_at_a_pause_of_a_second_or_more() -> None:
    """A word reviewer's "I went to the market to buy some Apple's and" was one cue of 10 words across a 3.3 s
    silence (some ends 1.76 s, Apple's starts 5.06 s): its last words were shown 3.3 s before they were said."""
    words = [{"word": f" w{i}", "start": start, "end": start + 0.3, "probability": 0.9}
             for i, start in enumerate([0.0, 0.4, 0.8, 1.2, 4.5, 4.9, 5.3, 6.0, 6.4])]  # pauses of 3.0 s and 0.4 s
    result = {"text": "", "segments": [{"start_s": 0.0, "end_s": 6.7, "text": " ...", "words": words}]}
    cues = [cue.split("\n") for cue in render_srt(result, CueOptions(max_words_per_cue=10)).strip().split("\n\n")]
    assert [(c[1], c[2]) for c in cues] == [("00:00:00,000 --> 00:00:01,500", "w0 w1 w2 w3"),
                                          ("00:00:04,500 --> 00:00:06,700", "w4 w5 w6 w7 w8")]
    just_under = [dict(w, start=w["start"] - 2.01) if i >= 4 else w for i, w in enumerate(words)]  # 0.99 s
    assert render_vtt({**result, "segments": [{**result["segments"][0], "words": just_under}]},
                      CueOptions(max_words_per_cue=10)).count("-->") == 1


def test_wrap_lines_breaks_at_spaces_and_between_the_characters_of_an_unspaced_script() -> None:
    text = " The quick brown fox jumps over the lazy dog, antidisestablishmentarianism and  well-known ends."
    assert wrap_lines(text, 16) == ["The quick brown", "fox jumps over", "the lazy dog,",
                                    "antidisestablishmentarianism", "and well-known", "ends."]  # a long word whole
    # an unspaced script is one "word" a line: a reviewer's 38 Chinese characters stayed on one line at width 16;
    # then a diff reviewer's lines cut "12.5%" and "iPhone" and opened with "，"
    chinese = "我们今天讨论的是过去三年的数字以及它们对明年意味着什么以及我们应该怎么做"
    assert wrap_lines(chinese, 16) == [chinese[:16], chinese[16:32], chinese[32:]]
    assert wrap_lines("今天价格上涨了12.5%。我们昨天买了iPhone手机。", 8) == [
        "今天价格上涨了", "12.5%。我们", "昨天买了", "iPhone手", "机。"]
    assert wrap_lines("价格上涨了12.5%，我们用iPhone拍照。", 10) == ["价格上涨了", "12.5%，我们用", "iPhone拍照。"]
    assert wrap_lines(" a\n\n b ", None) == ["a", "b"] and wrap_lines(" a\n\n b ", 10) == ["a b"]
    assert wrap_lines("", 10) == []


def test_a_cue_is_never_cut_inside_a_written_word() -> None:
    """Whisper's words split at punctuation: two reviewers' word cues "by 12" / ".5%", "from $1" / ",299 to",
    "six o" / "'clock,", "long" / "-term"; a Thai vowel sign opened a cue. A word that starts with no space stays
    with the one before where their meeting is not letter to letter (Chinese words, a character each, still part)."""
    pieces = [" by", " 12", ".5%", " from", " $1", ",299", " o", "'clock", " long", "-term", " R", "&", "D", " ",
              " 你", "好", "。", " ก", "ิ", "น"]
    words = [{"word": w, "start": 0.2 * i, "end": 0.2 * i + 0.1, "probability": 0.9} for i, w in enumerate(pieces)]
    result = {"text": "", "segments": [{"start_s": 0.0, "end_s": 4.0, "text": "".join(pieces), "words": words}]}
    cues = [cue.split("\n")[2] for cue in render_srt(result, CueOptions(max_words_per_cue=1)).strip().split("\n\n")]
    assert cues == ["by", "12.5%", "from", "$1,299", "o'clock", "long-term", "R&D", "你", "好。", "กิ", "น"]
    # a written word grows to a line at most, so that cues still hold their line count: a diff reviewer's
    # hallucinated "金1,1,1,...,5" was one cue of 28 lines at --max-line-width 16 --max-line-count 2
    chain = [{"word": w, "start": 0.1 * i, "end": 0.1 * i + 0.1, "probability": 0.9}
             for i, w in enumerate(["金", *["1", ","] * 40, "5"])]
    chained = {"text": "", "segments": [{"start_s": 0.0, "end_s": 9.0, "text": "", "words": chain}]}
    srt = render_srt(chained, CueOptions(max_line_width=16, max_line_count=2)).strip().split("\n\n")
    lines = [cue.split("\n")[2:] for cue in srt]
    assert all(len(cue) <= 2 and all(len(line) <= 16 for line in cue) for cue in lines) and len(srt) >= 5
SPOKEN = ("So this is the part of the talk where we look at the numbers from the last three years, and what they "
          "tell us about the next one.")


def test_caption_lines_wrap_at_a_width_and_cues_hold_a_count_of_lines() -> None:
    """A caption reviewer's cues of 115-217 characters on one line: `max_line_width` wraps a cue's text (no word
    times needed); with `max_line_count` a cue that would take more lines ends, the next starting at its first
    word's time."""
    words = [{"word": f" {w}", "start": 0.3 * i, "end": 0.3 * i + 0.25, "probability": 0.9}
             for i, w in enumerate(SPOKEN.split())]
    result = {"text": SPOKEN, "segments": [{"start_s": 0.0, "end_s": 9.0, "text": " " + SPOKEN, "words": words}]}
    wrapped = render_srt(result, CueOptions(max_line_width=42)).strip().split("\n")
    assert wrapped[:2] == ["1", "00:00:00,000 --> 00:00:09,000"] and " ".join(wrapped[2:]) == SPOKEN
    assert len(wrapped) == 2 + 4 and all(len(line) <= 42 for line in wrapped[2:])
    cues = [cue.split("\n") for cue in render_vtt(result, CueOptions(max_line_width=42, max_line_count=2))
            .removeprefix("WEBVTT\n\n").strip().split("\n\n")]
    assert [len(cue) - 1 for cue in cues] == [2, 2] and all(len(line) <= 42 for cue in cues for line in cue[1:])
    assert " ".join(" ".join(cue[1:]) for cue in cues) == SPOKEN
    second = len(" ".join(cues[0][1:]).split())  # the index of the second cue's first word
    assert cues[1][0] == f"00:00:{0.3 * second:06.3f} --> 00:00:{0.3 * (len(words) - 1) + 0.25:06.3f}"


# -- real whisper-base on speech whose word boundaries are known (scripts/make_word_fixtures.py) --------------------

WORDS = Path(__file__).parent / "fixtures" / "words"


def _matched_starts(truth: list[dict], words: list) -> list[tuple[float, float]]:
    """(true start, predicted start) of the words the recogniser got right, paired by a sequence alignment."""
    import difflib

    def key(text: str) -> str:
        return "".join(ch for ch in text.lower() if ch.isalnum())

    matcher = difflib.SequenceMatcher(a=[key(t["word"]) for t in truth], b=[key(w.word) for w in words],
                                      autojunk=False)
    return [(truth[block.a + i]["start"], words[block.b + i].start)
            for block in matcher.get_matching_blocks() for i in range(block.size)]


@pytest.mark.real
@pytest.mark.slow
def test_real_word_timestamps_on_known_boundaries() -> None:
    from test_transcribe import _real_base

    from asr_spec.models.loading import decoder_draft
    from asr_spec.transcribe import Transcriber

    target, processor = _real_base()
    options = TranscribeOptions.from_values(language="en", batch_size=3, timestamps=True, chunking="vad",
                                            word_timestamps=True)
    files = sorted(WORDS.glob("*.flac"))
    greedy = Transcriber(target, None, processor, options).transcribe([str(f) for f in files], progress=False)
    draft = decoder_draft(target, [0, target.config.decoder_layers - 1])
    spec = Transcriber(target, draft, processor, options).transcribe([str(f) for f in files], progress=False)
    errors = []
    for path, g, s in zip(files, greedy, spec):
        truth = json.loads(path.with_suffix(".json").read_text())
        words = [w for seg in g.segments for w in seg.words]
        assert words == [w for seg in s.segments for w in seg.words]  # the draft never matters
        assert s.stats.drafted_tokens > 0
        assert all(0 <= w.start <= w.end <= truth["duration_s"] for w in words)
        assert [w.start for w in words] == sorted(w.start for w in words)
        pairs = _matched_starts(truth["words"], words)
        assert len(pairs) >= 0.6 * len(truth["words"]), (path.name, g.text)
        errors += [abs(a - b) for a, b in pairs]
    assert float(np.median(errors)) <= 0.2, errors
