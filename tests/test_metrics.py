"""WER/CER against hand-counted alignments; sentence coverage and doubled n-grams on hand-made transcripts."""

import json
import math

import pytest

from asr_spec.eval import metrics
from asr_spec.eval.metrics import (
    Coverage,
    Doubled,
    Score,
    coverage,
    doubled_ngrams,
    english_normalizer,
    load_spelling_mapping,
    missing_sentences,
    normalize,
    reference_positions,
    score,
    sentence_coverage,
)

pytestmark = pytest.mark.filterwarnings("ignore:English text normaliser built without")


def test_counts_substitution_deletion_insertion():
    # the cat sat on the mat
    # the bat sat    the mat today   -> cat->bat (S), "on" deleted (D), "today" inserted (I); 3 edits / 6 words
    s = score(["the cat sat on the mat"], ["the bat sat the mat today"], normalized=True)
    assert (s.substitutions, s.deletions, s.insertions, s.n_words) == (1, 1, 1, 6)
    assert s.wer == pytest.approx(3 / 6)


def test_wer_is_corpus_level_not_mean_of_utterances():
    refs = ["the quick brown fox jumps over the lazy dog", "yes"]
    hyps = ["the quick brown fox jumps over the lazy dog", "no"]
    s = score(refs, hyps)
    assert s.n_words == 10 and s.substitutions == 1
    assert s.wer == pytest.approx(1 / 10)  # the mean of per-utterance rates would be 0.5


def test_cer_counts_characters_including_spaces():
    # "abc de" (6 chars) vs "abd de": one substitution; "xy" (2) vs "x": one deletion -> 2 / 8
    s = score(["abc de", "xy"], ["abd de", "x"], normalized=True)
    assert (s.n_chars, s.char_errors) == (8, 2)
    assert s.cer == pytest.approx(2 / 8)


def test_whisper_normaliser_is_applied_to_both_sides():
    refs = ["HELLO, WORLD! I DON'T KNOW.", "IT COST TWENTY FIVE DOLLARS", "MR SMITH SAID UM HELLO"]
    hyps = ["Hello world, I do not know", "It cost $25.", "Mister Smith said hello."]
    s = score(refs, hyps)
    assert s == Score(
        wer=0.0,
        cer=0.0,
        n_words=s.n_words,
        substitutions=0,
        deletions=0,
        insertions=0,
        n_chars=s.n_chars,
        char_errors=0,
    )
    assert normalize("Mr. Smith's 25 COLOURS!") == "mister smith is 25 colours"


def test_normalized_flag_skips_the_normaliser():
    assert score(["Hello"], ["hello"], normalized=True).substitutions == 1
    assert score(["Hello"], ["hello"]).wer == 0.0


def test_empty_references():
    # all-empty: nothing to get wrong
    assert score([""], [""]).wer == 0.0
    # an empty reference makes every hypothesis word an insertion ("uh" is dropped by the normaliser)
    s = score(["the cat sat", "[noise]"], ["the cat sat", "uh hello there"])
    assert (s.n_words, s.insertions, s.wer) == (3, 2, pytest.approx(2 / 3))
    assert s.char_errors == len("hello there")
    # no reference words at all but some hypothesis words: the rate is infinite, not a division error
    s = score([""], ["hello"])
    assert s.n_words == 0 and s.insertions == 1 and math.isinf(s.wer) and math.isinf(s.cer)
    # empty hypothesis: all deletions
    s = score(["a b"], [""], normalized=True)
    assert (s.deletions, s.wer) == (2, 1.0)


def test_no_utterances():
    assert score([], []) == Score(0.0, 0.0, 0, 0, 0, 0, 0, 0)


def test_bad_arguments():
    with pytest.raises(ValueError, match="2 references but 1 hypotheses"):
        score(["a", "b"], ["a"])
    with pytest.raises(TypeError):
        score("a b", "a b")


def test_spelling_mapping_from_dict_file_and_tokenizer_folder(tmp_path):
    mapping = {"colour": "color", "honour": "honor"}
    assert english_normalizer(mapping)("The Colour of Honour") == "the color of honor"
    (tmp_path / "normalizer.json").write_text(json.dumps(mapping))
    assert load_spelling_mapping(tmp_path) == mapping  # a tokenizer folder
    assert load_spelling_mapping(tmp_path / "normalizer.json") == mapping
    assert score(["colour"], ["color"], spelling=tmp_path).wer == 0.0
    assert score(["colour"], ["color"]).wer == 1.0  # default: no table
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="bad.json"):
        load_spelling_mapping(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="missing.json"):
        load_spelling_mapping(tmp_path / "missing.json")


def test_warns_once_without_spelling_table():
    metrics._warn_no_spelling.cache_clear()
    with pytest.warns(UserWarning, match="without the British->American spelling table"):
        normalize("x")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        normalize("y")  # second time: silent


SENTENCES = [
    "The little port was quiet when the first boats came back.",
    "Gulls followed them in, crying over the nets.",
    "On the pier an old woman was selling bread.",
    "Her grandson counted the coins.",
]


def test_a_fully_present_transcript_misses_nothing():
    hypothesis = " ".join(SENTENCES).lower().replace(",", "")
    assert missing_sentences(SENTENCES, hypothesis) == []
    assert sentence_coverage(SENTENCES, hypothesis) == [1.0] * 4


def test_a_dropped_sentence_is_found():
    hypothesis = " ".join(SENTENCES[:2] + SENTENCES[3:])
    assert missing_sentences(SENTENCES, hypothesis) == [2]
    assert sentence_coverage(SENTENCES, hypothesis)[2] == 0.0


def test_a_doubled_seam_word_does_not_hide_a_dropped_sentence():
    # chunk seam after sentence 1 repeats "nets"; sentence 3 is gone (its words "the" and "coins" are common)
    hypothesis = f"{SENTENCES[0]} {SENTENCES[1]} nets. {SENTENCES[2]}"
    assert missing_sentences(SENTENCES, hypothesis) == [3]
    # and with every sentence there, the doubled word costs none of them
    assert missing_sentences(SENTENCES, f"{SENTENCES[0]} {SENTENCES[1]} nets {SENTENCES[2]} {SENTENCES[3]}") == []


def test_a_partly_heard_sentence_counts_by_its_fraction_of_words():
    # the first sentence's first word lost: 10 of 11 words (0.91 >= 0.8); the last one cut to 2 of 5 words
    hypothesis = " ".join(SENTENCES[1:3])
    hypothesis = f"little port was quiet when the first boats came back {hypothesis} her grandson"
    coverage = sentence_coverage(SENTENCES, hypothesis)
    assert coverage[0] == pytest.approx(10 / 11) and coverage[3] == pytest.approx(2 / 5)
    assert missing_sentences(SENTENCES, hypothesis) == [3]
    assert missing_sentences(SENTENCES, hypothesis, min_fraction=0.4) == []


def test_words_out_of_order_are_not_matched():
    # every word of sentence 3 is there, but before sentence 0: an in-order alignment gives it nothing
    hypothesis = f"{SENTENCES[3]} {SENTENCES[0]} {SENTENCES[1]} {SENTENCES[2]}"
    assert missing_sentences(SENTENCES, hypothesis) == [3]


def test_sentence_coverage_of_empty_inputs():
    assert missing_sentences([], "anything at all") == []
    assert missing_sentences(SENTENCES, "") == [0, 1, 2, 3]
    assert missing_sentences(["", "Um.", "Hello there."], "") == [2]  # no words to miss in the first two
    assert sentence_coverage(["", "hello there"], "hello there", normalized=True) == [1.0, 1.0]


def test_sentence_coverage_bad_arguments():
    with pytest.raises(TypeError, match="sequence of sentences"):
        sentence_coverage("one string", "one string")
    with pytest.raises(ValueError, match="min_fraction"):
        missing_sentences(SENTENCES, "", min_fraction=0)


def test_a_seam_written_twice_is_doubled():
    # a stride seam kept from both windows: "crying over the nets" written twice
    hypothesis = f"{SENTENCES[0]} Gulls followed them in, crying over the nets, crying over the nets. {SENTENCES[2]}"
    found = doubled_ngrams(" ".join(SENTENCES), hypothesis)
    assert [d.words for d in found] == [("crying", "over", "the"), ("over", "the", "nets")]
    assert all(d.hyp_count == 2 and d.ref_count == 1 and d.extra == 1 for d in found)


def test_a_commit_written_twice_is_doubled():
    # dense_windows streamed before the second session's fix: "stars, the" committed, then "stars. The" again
    reference = "They watched the birds and the stars. The keeper climbed the stairs."
    found = doubled_ngrams(reference, "They watched the birds and the stars, the stars. The keeper climbed the stairs.")
    assert found == [Doubled(("the", "stars", "the"), 2, 1, 1)]


def test_a_mishearing_that_recreates_a_nearby_phrase_is_not_doubled():
    # dense_windows: "That summer the fog" heard "That some of the fog" a sentence after "Only of the fog": the
    # hypothesis has "of the fog" twice and the reference once, 12 words apart, but the second replaces "summer"
    # rather than writing anything again
    reference = ("Only of the fog, he said, because the fog hides everything. "
                 "That summer the fog came early and stayed for days.")
    assert doubled_ngrams(reference, reference.replace("That summer", "That some of")) == []
    # the same phrase really written twice at that place is one
    twice = reference.replace("That summer the fog came early", "That summer the fog came early, the fog came early")
    assert [d.words for d in doubled_ngrams(reference, twice)] == [("the", "fog", "came"), ("fog", "came", "early")]


def test_a_loop_counts_every_repeat():
    # whisper-base looping in one stride window: "the work was hard" three times for once
    looped = doubled_ngrams("the work was hard.", "The work was hard, the work was hard, the work was hard.")
    by_words = {d.words: d for d in looped}
    assert by_words[("the", "work", "was")] == Doubled(("the", "work", "was"), 3, 1, 2)
    assert sum(d.extra for d in looped) == 8 - 2  # 8 words written again: 6 of their 3-grams start in them
    assert doubled_ngrams("a b c", "x y z x y z", normalized=True) == [Doubled(("x", "y", "z"), 2, 0, 1)]


def test_a_phrase_the_reference_repeats_is_not_doubled():
    reference = "the work was hard and the work was hard again"
    assert doubled_ngrams(reference, reference) == []
    # with unrelated words inserted between its copies it is still said as often as the reference says it
    assert doubled_ngrams(reference, "the work was hard you know and the work was hard again") == []
    looped = "the work was hard and the work was hard and the work was hard again"
    (d,) = [d for d in doubled_ngrams(reference, looped) if d.words == ("the", "work", "was")]
    assert (d.hyp_count, d.ref_count, d.extra) == (3, 2, 1)


def test_repeats_beyond_a_seams_reach_are_not_doubled():
    words = [f"w{i}" for i in range(60)]
    reference = " ".join(words)
    far = " ".join(words[:50] + ["a", "b", "c"] + words[50:55] + ["a", "b", "c"] + words[55:])
    assert [d.words for d in doubled_ngrams(reference, far, normalized=True)] == [("a", "b", "c")]
    assert doubled_ngrams(reference, far, normalized=True, reach=4) == []


def test_reference_positions_map_hypothesis_boundaries():
    ref, hyp = "a b c d".split(), "a b x c d d".split()
    # "x" inserted after b, the last "d" inserted at the end; equal runs map word for word
    assert reference_positions(ref, hyp) == [0, 1, 2, 2, 3, 4, 4]
    # a replaced run is spread over the words it replaces
    assert reference_positions("a b c".split(), "x y z x y z".split()) == [0, 0.5, 1, 1.5, 2, 2.5, 3]
    assert reference_positions([], "a b".split()) == [0, 0, 0]
    assert reference_positions(ref, []) == [4]


def test_doubled_ngrams_are_counted_after_normalisation():
    # "Nets." and "nets" are one word once normalised; a repeated pair of words is not a doubling
    assert doubled_ngrams("over the nets", "Over the Nets. over the nets!") != []
    assert doubled_ngrams("the nets", "the nets the nets") == []
    assert doubled_ngrams("the nets", "the nets the nets", n=2) == [Doubled(("the", "nets"), 2, 1, 1)]


def test_coverage_reports_lost_and_doubled_together():
    complete = coverage(SENTENCES, " ".join(SENTENCES))
    assert complete == Coverage((), (), 4) and complete.complete and complete.n_doubled == 0
    # sentence 2 lost, sentence 1 written twice: both show
    hypothesis = " ".join([SENTENCES[0], SENTENCES[1], SENTENCES[1], SENTENCES[3]])
    found = coverage(SENTENCES, hypothesis)
    assert found.missing == (2,) and not found.complete
    assert found.n_doubled == len("gulls followed them in crying over the nets".split()) - 2
    assert coverage(SENTENCES, "").missing == (0, 1, 2, 3)


def test_coverage_bad_arguments():
    with pytest.raises(TypeError, match="sequence of sentences"):
        coverage("one string", "one string")
    with pytest.raises(ValueError, match="positive integer number of words"):
        doubled_ngrams("a b c", "a b c", n=0)
    with pytest.raises(ValueError, match="reach"):
        doubled_ngrams("a b c", "a b c", reach=0)
    with pytest.raises(ValueError, match="min_fraction"):
        coverage(SENTENCES, "", min_fraction=1.5)
