"""Word and character error rates, scored the way the Open ASR Leaderboard scores them.

Both texts go through Whisper's English normaliser (`EnglishTextNormalizer` from transformers: lower case,
punctuation and filler words removed, contractions expanded, numbers written as digits), then jiwer aligns them.
Rates are corpus-level: the sum of edits over the sum of reference words, never a mean of per-utterance rates.

Sentence coverage (`sentence_coverage`, `missing_sentences`) asks a different question than WER: is every reference
sentence in the transcript? A long-form pipeline that drops one sentence of a hundred moves WER by a point or two,
which a WER bound may hide; a dropped sentence shows here as one whose words are (nearly) all unmatched.
`doubled_ngrams` asks the other half: is a stretch of the transcript written twice (a seam kept from both windows,
a window looping)? `coverage` puts both in one result: nothing lost and nothing doubled.

British/American spelling: `EnglishTextNormalizer` also maps British spellings to American ones ("colour" ->
"color") through a ~1,700-entry table that openai/whisper ships as `english.json` and Hugging Face tokenizer
folders ship as `normalizer.json` (`WhisperTokenizer` loads it into `tokenizer.english_spelling_normalizer`; that is
all `tokenizer.normalize` adds). Nothing installed here carries that file, so by default the normaliser is built
with an empty table and a warning is given once. Pass `spelling=` (a mapping, a json file, or a tokenizer folder
holding `normalizer.json`) to `english_normalizer` / `score` to apply it; without it, a British spelling in a
reference counts as an error when the hypothesis spells it the American way (Whisper usually does).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import jiwer
from transformers.models.whisper.english_normalizer import EnglishTextNormalizer

from asr_spec.checks import positive_int

__all__ = ["Coverage", "Doubled", "Score", "coverage", "doubled_ngrams", "english_normalizer",
           "load_spelling_mapping", "missing_sentences", "normalize", "reference_positions", "score",
           "sentence_coverage"]

MIN_SENTENCE_FRACTION = 0.8  # a sentence is present when this share of its words is matched in order
DOUBLED_NGRAM = 3  # words: a repeated run this long is a doubling (a repeated pair of words is common speech)
# words: how far apart two copies written at one seam can be. A stride seam shares 10 s of audio (5 s of stride on
# each side) and compares segments up to 5 s beyond it (seams.SEAM_SLACK_S); a tail re-hears 5 s of context. 15 s
# of speech at ~2.7 words/s (160 words a minute) is 40 words.
DOUBLING_REACH_WORDS = 40
SPELLING_FILE = "normalizer.json"  # the name WhisperTokenizer gives the spelling table in a tokenizer folder

Spelling = Mapping[str, str] | str | os.PathLike | None


@dataclasses.dataclass(frozen=True)
class Score:
    """Corpus-level error counts and rates (after normalisation)."""

    wer: float  # (substitutions + deletions + insertions) / n_words; inf if n_words == 0 < insertions
    cer: float  # the same over characters (spaces count, as in jiwer)
    n_words: int  # reference words
    substitutions: int  # word substitutions
    deletions: int  # word deletions
    insertions: int  # word insertions
    n_chars: int  # reference characters
    char_errors: int  # character substitutions + deletions + insertions


def load_spelling_mapping(path: str | os.PathLike) -> dict[str, str]:
    """Read the British->American table from a json file or from a tokenizer folder's `normalizer.json`."""
    path = Path(path)
    if path.is_dir():
        path = path / SPELLING_FILE
    try:
        mapping = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: cannot read an English spelling table ({err})") from err
    if not isinstance(mapping, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()):
        raise ValueError(f"{path}: an English spelling table must be a json object of strings")
    return mapping


@functools.cache
def _warn_no_spelling() -> None:
    warnings.warn(
        "English text normaliser built without the British->American spelling table (no normalizer.json "
        "available offline); pass spelling= to asr_spec.metrics to apply one",
        stacklevel=3,
    )


@functools.cache
def _default_normalizer() -> EnglishTextNormalizer:
    return EnglishTextNormalizer({})


def english_normalizer(spelling: Spelling = None) -> Callable[[str], str]:
    """Whisper's English normaliser; `spelling` as described in the module docstring (None: empty table)."""
    if spelling is None:
        _warn_no_spelling()
        return _default_normalizer()
    if isinstance(spelling, Mapping):
        return EnglishTextNormalizer(dict(spelling))
    return EnglishTextNormalizer(load_spelling_mapping(spelling))


def normalize(text: str, spelling: Spelling = None) -> str:
    """One text through Whisper's English normaliser, e.g. "Mr. Smith's 25 COLOURS!" -> "mister smith is 25 colours"."""
    return english_normalizer(spelling)(text)


def score(refs: Sequence[str], hyps: Sequence[str], *, normalized: bool = False, spelling: Spelling = None) -> Score:
    """Corpus WER/CER of `hyps` against `refs` (paired by position).

    normalized: the texts are already normalised (skip the English normaliser).
    A reference that is empty after normalisation contributes no reference words and counts every hypothesis
    word (character) as an insertion. (The Open ASR Leaderboard drops such samples before scoring; drop them
    first to match it.)
    """
    if isinstance(refs, str) or isinstance(hyps, str):
        raise TypeError("score() takes sequences of texts, not a single string")
    if len(refs) != len(hyps):
        raise ValueError(f"score(): {len(refs)} references but {len(hyps)} hypotheses")
    if not normalized:
        norm = english_normalizer(spelling)
        refs, hyps = [norm(r) for r in refs], [norm(h) for h in hyps]
    refs, hyps = [" ".join(r.split()) for r in refs], [" ".join(h.split()) for h in hyps]

    # jiwer < 4 rejects empty references: align the non-empty ones, count the rest as pure insertions
    pairs = [(r, h) for r, h in zip(refs, hyps, strict=True) if r]
    extra_words = sum(len(h.split()) for r, h in zip(refs, hyps, strict=True) if not r)
    extra_chars = sum(len(h) for r, h in zip(refs, hyps, strict=True) if not r)
    s = d = i = n_words = char_errors = n_chars = 0
    if pairs:
        r_list, h_list = [p[0] for p in pairs], [p[1] for p in pairs]
        words = jiwer.process_words(r_list, h_list)
        chars = jiwer.process_characters(r_list, h_list)
        s, d, i = words.substitutions, words.deletions, words.insertions
        n_words = words.hits + s + d
        char_errors = chars.substitutions + chars.deletions + chars.insertions
        n_chars = chars.hits + chars.substitutions + chars.deletions
    i += extra_words
    char_errors += extra_chars
    return Score(
        wer=_rate(s + d + i, n_words),
        cer=_rate(char_errors, n_chars),
        n_words=n_words,
        substitutions=s,
        deletions=d,
        insertions=i,
        n_chars=n_chars,
        char_errors=char_errors,
    )


def _rate(errors: int, total: int) -> float:
    if total == 0:
        return 0.0 if errors == 0 else float("inf")
    return errors / total


def _unchanged(text: str) -> str:
    """Already normalised text, as it is."""
    return text


def sentence_coverage(sentences: Sequence[str], hypothesis: str, *, normalized: bool = False,
                      spelling: Spelling = None) -> list[float]:
    """For each reference sentence, the fraction of its words matched in order in `hypothesis` (1.0 for a
    sentence with no words after normalisation).

    The sentences (in the order spoken) are normalised one by one and joined into one word list; it is aligned with
    the normalised hypothesis by difflib's matching blocks (no junk heuristic), so every hypothesis word is matched
    to at most one reference position and matches never cross. A word doubled at a chunk seam is an insertion and
    costs no sentence anything; a dropped sentence's words find no partner in order.
    normalized: the texts are already normalised (skip the English normaliser).
    """
    if isinstance(sentences, str):
        raise TypeError("sentence_coverage() takes a sequence of sentences, not a single string")
    if normalized:
        norm = _unchanged
    else:
        norm = english_normalizer(spelling)
    words = [norm(sentence).split() for sentence in sentences]
    owner = [index for index, sentence_words in enumerate(words) for _ in sentence_words]
    ref = [word for sentence_words in words for word in sentence_words]
    matched = [0] * len(words)
    for tag, ref_from, ref_to, _, _ in _opcodes(ref, norm(hypothesis).split()):
        if tag == "equal":
            for position in range(ref_from, ref_to):
                matched[owner[position]] += 1
    return [m / len(w) if w else 1.0 for m, w in zip(matched, words, strict=True)]


def missing_sentences(sentences: Sequence[str], hypothesis: str, min_fraction: float = MIN_SENTENCE_FRACTION, *,
                      normalized: bool = False, spelling: Spelling = None) -> list[int]:
    """Indices of the reference `sentences` that `hypothesis` lacks: fewer than `min_fraction` of their words
    matched in order (see `sentence_coverage`). An empty hypothesis lacks every sentence that has words."""
    if not 0 < min_fraction <= 1:
        raise ValueError(f"min_fraction must be in (0, 1], got {min_fraction!r}")
    coverage = sentence_coverage(sentences, hypothesis, normalized=normalized, spelling=spelling)
    return [index for index, fraction in enumerate(coverage) if fraction < min_fraction]


@dataclasses.dataclass(frozen=True)
class Doubled:
    """An n-gram the hypothesis writes again within a seam's reach where the reference says it once."""

    words: tuple[str, ...]  # the n-gram, normalised
    hyp_count: int  # times in the hypothesis (>= 2)
    ref_count: int  # times in the reference
    extra: int  # occurrences that double an earlier one (see `doubled_ngrams`), >= 1


@dataclasses.dataclass(frozen=True)
class Coverage:
    """Nothing lost and nothing doubled: what `coverage` finds in one transcript."""

    missing: tuple[int, ...]  # indices of reference sentences with < MIN_SENTENCE_FRACTION of words matched
    doubled: tuple[Doubled, ...]  # n-grams written again at a seam or in a loop, in first-seen order
    n_sentences: int  # reference sentences

    @property
    def n_doubled(self) -> int:
        """Extra occurrences of doubled n-grams (a seam writing k >= n words twice gives k - n + 1 of them)."""
        return sum(d.extra for d in self.doubled)

    @property
    def complete(self) -> bool:
        """Every sentence present and no n-gram doubled."""
        return not self.missing and not self.doubled


def _ngrams(words: Sequence[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]


def _opcodes(reference: Sequence[str], hypothesis: Sequence[str]) -> list[tuple[str, int, int, int, int]]:
    """difflib's opcodes turning `reference` into `hypothesis`, no junk heuristic: the one alignment of the coverage
    measures (`sentence_coverage`'s matched words are its "equal" runs)."""
    return difflib.SequenceMatcher(None, list(reference), list(hypothesis), autojunk=False).get_opcodes()


def reference_positions(reference: Sequence[str], hypothesis: Sequence[str]) -> list[float]:
    """Where each word boundary of `hypothesis` falls in `reference`: element p (0 <= p <= len(hypothesis)) is the
    reference boundary that hypothesis boundary p is aligned to, by difflib's opcodes. Equal runs map word for word,
    inserted words all to the boundary where they were inserted, a replaced run proportionally onto the words it
    replaces (so a value may be fractional). Shape: (len(hypothesis) + 1,), non-decreasing, 0 to len(reference)."""
    return _positions(_opcodes(reference, hypothesis), len(reference), len(hypothesis))


def _positions(opcodes: Sequence[tuple[str, int, int, int, int]], n_ref: int, n_hyp: int) -> list[float]:
    positions = [0.0] * (n_hyp + 1)
    for _, ref_from, ref_to, hyp_from, hyp_to in opcodes:
        scale = (ref_to - ref_from) / (hyp_to - hyp_from) if hyp_to > hyp_from else 0.0
        for p in range(hyp_from, hyp_to + 1):
            positions[p] = ref_from + (p - hyp_from) * scale
    positions[-1] = float(n_ref)
    return positions


def _matched(opcodes: Sequence[tuple[str, int, int, int, int]], n_hyp: int) -> list[bool]:
    """Per hypothesis word, whether the alignment matches it to an equal reference word. Shape: (n_hyp,)."""
    matched = [False] * n_hyp
    for tag, _, _, hyp_from, hyp_to in opcodes:
        if tag == "equal":
            matched[hyp_from:hyp_to] = [True] * (hyp_to - hyp_from)
    return matched


def _occurrences(words: Sequence[str], n: int) -> dict[tuple[str, ...], list[int]]:
    """Each n-gram of `words` with the positions it starts at, in order of first occurrence."""
    found: dict[tuple[str, ...], list[int]] = {}
    for position, gram in enumerate(_ngrams(words, n)):
        found.setdefault(gram, []).append(position)
    return found


def doubled_ngrams(reference: str, hypothesis: str, n: int = DOUBLED_NGRAM, *, reach: int = DOUBLING_REACH_WORDS,
                   normalized: bool = False, spelling: Spelling = None) -> list[Doubled]:
    """The n-grams `hypothesis` writes twice at a seam or in a loop, against `reference` (both normalised unless
    `normalized`), in the order of their first occurrence.

    An occurrence of an n-gram at hypothesis word j doubles the previous occurrence, at word i, when all of:
    - they are close: j - i <= `reach` words (a seam's reach, `DOUBLING_REACH_WORDS`);
    - the reference does not say it as often there: the reference words aligned to the hypothesis words i .. j+n
      (`reference_positions`) hold fewer occurrences of the n-gram than those hypothesis words do;
    - the repeat is a copy, not a mishearing: the hypothesis words i .. j+n outnumber the reference words aligned
      to them by at least min(j - i, n) (a copy of d words written twice adds d words), or one of the two
      occurrences has fewer than half its words matched to equal reference words (a copy written where other
      words were lost: a stray "the" of the copy may still match).
      A mishearing that happens to recreate a phrase said nearby ("That summer the fog" heard "That some of the
      fog" a sentence after "of the fog") replaces words, adds at most a word or two and keeps most of its words
      matched.
    "the stars, the stars" against "the stars" doubles ("the", "stars", "the") once; "a b c a b c a b c" against
    "a b c" doubles each of its 3-grams as often as it repeats it; a phrase the reference itself repeats nearby is not
    doubled when written as often as the reference has it.
    """
    positive_int(n, "doubled_ngrams: n", "words")
    positive_int(reach, "doubled_ngrams: reach", "words")
    norm = _unchanged if normalized else english_normalizer(spelling)
    ref, hyp = norm(reference).split(), norm(hypothesis).split()
    opcodes = _opcodes(ref, hyp)
    at_ref, matched = _positions(opcodes, len(ref), len(hyp)), _matched(opcodes, len(hyp))
    ref_starts = _occurrences(ref, n)
    found = []
    for gram, starts in _occurrences(hyp, n).items():
        extra = sum(_doubles(first, then, n, reach, at_ref, matched, ref_starts.get(gram, []))
                    for first, then in zip(starts, starts[1:], strict=False))
        if extra:
            found.append(Doubled(gram, len(starts), len(ref_starts.get(gram, [])), extra))
    return found


def _doubles(first: int, then: int, n: int, reach: int, at_ref: Sequence[float], matched: Sequence[bool],
             ref_starts: Sequence[int]) -> bool:
    """Whether the occurrence at hypothesis word `then` doubles the one at `first` (the rule of `doubled_ngrams`);
    `at_ref` and `matched` as `_positions` and `_matched` give them, `ref_starts` the n-gram's reference starts."""
    period = then - first
    if period > reach:
        return False
    ref_from, ref_to = at_ref[first], at_ref[then + n]
    in_reference = sum(1 for start in ref_starts if ref_from - 0.5 <= start and start + n <= ref_to + 0.5)
    added = (then + n - first) - (ref_to - ref_from)
    unmatched_copy = min(sum(matched[first:first + n]), sum(matched[then:then + n])) < n / 2
    return in_reference < 2 and (added >= min(period, n) or unmatched_copy)


def coverage(sentences: Sequence[str], hypothesis: str, *, min_fraction: float = MIN_SENTENCE_FRACTION,
             n: int = DOUBLED_NGRAM, normalized: bool = False, spelling: Spelling = None) -> Coverage:
    """Which reference `sentences` (in the order spoken) `hypothesis` lacks (`missing_sentences`) and which
    n-grams it doubles against their text (`doubled_ngrams`): the one coverage measure of every mode."""
    if isinstance(sentences, str):
        raise TypeError("coverage() takes a sequence of sentences, not a single string")
    norm = _unchanged if normalized else english_normalizer(spelling)
    sentences = [norm(sentence) for sentence in sentences]
    hypothesis = norm(hypothesis)
    missing = missing_sentences(sentences, hypothesis, min_fraction, normalized=True)
    doubled = doubled_ngrams(" ".join(sentences), hypothesis, n, normalized=True)
    return Coverage(tuple(missing), tuple(doubled), len(sentences))
