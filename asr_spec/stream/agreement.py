"""Pure token arithmetic of the streaming policy: text tokens, agreement of two hypotheses, Whisper's timestamp
segments, and the shift of a hypothesis's timestamps when its buffer is trimmed.

A hypothesis is the tokens the engine generated for a buffer in Whisper's timestamp mode (prompt excluded):
``<|0.00|> text... <|2.40|><|2.40|> text... <|5.00|> <|endoftext|>``. Timestamp tokens count
`TIME_PRECISION_S` seconds each from the buffer's first sample: ``timestamp_begin + i`` is ``i * 0.02`` s.
"""

from __future__ import annotations

import re
import unicodedata
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

# Unicode blocks of scripts written without spaces between words (Thai, Lao, Myanmar, Khmer, CJK symbols and kana,
# CJK ideographs, their compatibility forms, full-width forms, the supplementary ideographs): there every character
# may start a word, as openai-whisper splits the words of zh, ja, th, lo, my and yue on unicode characters
UNSPACED_BLOCKS = ((0x0E00, 0x0EFF), (0x1000, 0x109F), (0x1780, 0x17FF), (0x3000, 0x30FF), (0x3400, 0x4DBF),
                   (0x4E00, 0x9FFF), (0xF900, 0xFAFF), (0xFF00, 0xFFEF), (0x20000, 0x2FFFF))


def starts_word(piece: str) -> bool:
    """Whether a token whose decoded text is `piece` starts a word: a leading space, or a first character of a
    script written without spaces (`UNSPACED_BLOCKS`). The one rule of words: for their times
    (`transcribe.alignment.group_words`), for the seams of strided windows (`Assembler`: a word a seam cuts stays
    whole) and for live agreement (`driver.token_kinds`)."""
    if piece.startswith(" "):
        return True
    # a vowel sign or tone mark (Thai "ิ" after its consonant) is part of the character before it: a reviewer's
    # cues and json words opened with one
    return piece != "" and in_unspaced_script(piece[0]) and not _is_mark(piece[0])


def in_unspaced_script(char: str) -> bool:
    """Whether `char` lies in a block of a script written without spaces (`UNSPACED_BLOCKS`)."""
    return any(lo <= ord(char) <= hi for lo, hi in UNSPACED_BLOCKS)


def _is_mark(char: str) -> bool:
    """Whether `char` is a combining mark (Unicode categories Mn, Mc, Me)."""
    return unicodedata.category(char).startswith("M")


SAMPLE_RATE = 16_000
TIME_PRECISION_S = 0.02  # one Whisper timestamp token step
SAMPLES_PER_TIMESTAMP = 320  # TIME_PRECISION_S * SAMPLE_RATE
ANCHOR_EDITS = 2  # edits a hypothesis may add before the last committed word and still be read after it
MIN_LOOP_TOKENS = 4  # a segment at least this long written again token for token is a loop (not a repeated "Yes.")


@dataclass(frozen=True)
class TokenKinds:
    """What the policy needs to know of a vocabulary's token ids.

    eot: <|endoftext|>; every id >= eot is special (timestamps included), every id below is text.
    timestamp_begin: the id of <|0.00|>.
    word_start: (V,) bool, True where a text token begins a new word (Whisper's byte-level BPE: a leading space).
    max_prefix: the most tokens a decode's forced prefix may hold (`WhisperTokens.max_prompt_tokens`: 223 for
    Whisper's 448 positions).
    """

    eot: int
    timestamp_begin: int
    word_start: np.ndarray
    max_prefix: int = 223

    def is_text(self, token: int) -> bool:
        return token < self.eot

    def starts_word(self, token: int) -> bool:
        return bool(self.word_start[token]) if 0 <= token < len(self.word_start) else False


@dataclass(frozen=True)
class SegmentEnd:
    """A closed timestamp segment of a hypothesis.

    text_end: text tokens of the hypothesis up to and including this segment's;
    end_index: index (in the hypothesis) of its closing timestamp token; end_ts: that timestamp, in steps of
    TIME_PRECISION_S from the buffer's start; start_ts: its opening timestamp, likewise; words: the words of its
    text (text tokens that start one, and its first).
    """

    text_end: int
    end_index: int
    end_ts: int
    start_ts: int = 0
    words: int = 0

    @property
    def end_samples(self) -> int:
        return self.end_ts * SAMPLES_PER_TIMESTAMP

    @property
    def start_samples(self) -> int:
        return self.start_ts * SAMPLES_PER_TIMESTAMP


def text_of(tokens: Sequence[int], kinds: TokenKinds) -> list[int]:
    """The text tokens of a hypothesis, in order (timestamps and other special tokens left out)."""
    return [t for t in tokens if kinds.is_text(t)]


def agreed_words(previous: Sequence[int], new: Sequence[int], kinds: TokenKinds,
                 word_key: Callable[[tuple[int, ...]], object] = tuple) -> int:
    """LocalAgreement-2 on whole words: the number of leading text tokens of `new` (the newer hypothesis, whose
    wording is committed) that may be committed: those of the leading words both hypotheses say, compared by
    `word_key` (default: their tokens; the policy passes `spoken_word`, so "us," and "us." or "We" and "we" agree:
    two decodes that hear the same words and punctuate them apart commit them), each known whole in both: `new`
    goes on with another word after it, and `previous`'s last word (its buffer's end may have cut it) agrees only
    where it is not the first tokens of `new`'s word (a word cut short, said whole). Tokens before either's first
    word (what goes on with the word committed before them, e.g. a comma after it) must agree as well, and are
    committed with the first agreed word, not alone."""
    lead_prev, lead_new = _continuing(previous, kinds), _continuing(new, kinds)
    if (lead_prev or lead_new) and word_key(tuple(previous[:lead_prev])) != word_key(tuple(new[:lead_new])):
        return 0
    prev_words, new_words = _words(previous[lead_prev:], kinds), _words(new[lead_new:], kinds)
    n = 0
    for i, (said, word) in enumerate(zip(prev_words, new_words[:-1])):  # new's last word: nothing after it
        cut = i == len(prev_words) - 1 and len(said) < len(word) and word[:len(said)] == said
        if cut or word_key(said) != word_key(word):
            break
        n += len(word)
    return lead_new + n if n else 0


def _continuing(tokens: Sequence[int], kinds: TokenKinds) -> int:
    """How many leading tokens start no word (they go on with the word before them)."""
    return next((i for i, token in enumerate(tokens) if kinds.starts_word(token)), len(tokens))


def committed_prefix(previous: Sequence[int], committed: Sequence[int], kinds: TokenKinds) -> int:
    """How many leading tokens of `previous` (the last hypothesis of the buffer) the next decode of that buffer
    may take as given: its opening timestamp, then its tokens up to the last of the committed text tokens
    `committed` (timestamps as it has them), when it says them as committed; 0 when it does not (or nothing is
    committed, or it does not open with a timestamp and text). Within `kinds.max_prefix` tokens after the opening
    timestamp: a longer one is cut back to the end of a committed word within the limit (0 if none).

    The engine forces ``previous[1:n]`` after the <|0.00|> it adds (`ChunkRequest.prefix`) and decodes only what
    follows; ``previous[n:]`` is the hypothesis of that rest."""
    if not committed or len(previous) < 2 or previous[0] < kinds.timestamp_begin or not kinds.is_text(previous[1]):
        return 0
    ends = []  # n after each committed word's last text token: a word ends where the next committed token starts one
    n_text = 0
    for index, token in enumerate(previous):
        if not kinds.is_text(token):
            continue
        if n_text == len(committed):
            break
        if token != committed[n_text]:
            return 0
        n_text += 1
        if n_text == len(committed) or kinds.starts_word(committed[n_text]):
            ends.append(index + 1)
    return _within(ends, kinds.max_prefix) if n_text == len(committed) else 0


def _within(ends: list[int], max_prefix: int) -> int:
    """The last of `ends` (prefix lengths, the opening timestamp included) that forces at most `max_prefix` tokens."""
    return max((n for n in ends if n - 1 <= max_prefix), default=0)


def aligned_end(said: Sequence[int], text: Sequence[int], kinds: TokenKinds,
                word_key: Callable[[tuple[int, ...]], object] = tuple) -> int:
    """Where in `text` (text tokens of a hypothesis) the words of `said` (text tokens, whole words: what was
    committed of the same buffer) end: len(said) when `text` starts with them; else, as a hypothesis may reword,
    drop or insert words before the commit point, the end of the prefix of `text` nearest to `said` in edit
    distance over words, less ANCHOR_EDITS where the prefix ends with the last committed word (a hypothesis that
    says that word is read after it unless that costs more edits; on a tie the longer prefix: a word said
    differently counts as the committed one, an inserted one is passed). Text after it is new; text before it
    was said already. Words are compared by `word_key` (default: their tokens; the policy passes `spoken_word`,
    so "stars," and "stars." or "the" and "The" are one word: a re-punctuated commit point is found where it is,
    not at an earlier occurrence of its last word)."""
    if list(text[: len(said)]) == list(said):
        return len(said)
    said_words = [word_key(w) for w in _words(said, kinds)]
    text_keys = [word_key(w) for w in _words(text, kinds)]
    text_words = _words(text, kinds)
    row = list(range(len(text_words) + 1))  # edit distance of said's first i words to text's first j words
    for i, word in enumerate(said_words, 1):
        previous, row = row, [i] + [0] * len(text_words)
        for j, other in enumerate(text_keys, 1):
            row[j] = min(previous[j] + 1, row[j - 1] + 1, previous[j - 1] + (word != other))
    last = said_words[-1] if said_words else None
    cost = [row[j] - (ANCHOR_EDITS if j and text_keys[j - 1] == last else 0) for j in range(len(row))]
    best = min(range(len(row)), key=lambda j: (cost[j], -j))
    return sum(len(w) for w in text_words[:best])


def repeated_words(said: Sequence[int], text: Sequence[int], kinds: TokenKinds,
                   word_key: Callable[[tuple[int, ...]], object] = tuple) -> int:
    """How many leading text tokens of `text` (text tokens of a hypothesis) say again the last words of `said` (text
    tokens, whole words): those of the most words k whose first k words are said's last k, compared by `word_key`;
    0 when not even its first word is said's last."""
    said_words, text_words = _words(said, kinds), _words(text, kinds)
    for k in range(min(len(said_words), len(text_words)), 0, -1):
        if [word_key(w) for w in said_words[-k:]] == [word_key(w) for w in text_words[:k]]:
            return sum(len(w) for w in text_words[:k])
    return 0


def past_seam(hypothesis: tuple[int, ...], seam: Sequence[int], kinds: TokenKinds,
              word_key: Callable[[tuple[int, ...]], object] = tuple) -> tuple[int, ...]:
    """The hypothesis without the committed words of `seam` (text tokens, whole words) it says again at its start
    (`repeated_words`), its timestamps and the rest as they are; as it is with no seam. The policy's seam: the last
    cut of its buffer went back over speech into a committed segment, and until the next cut a hypothesis may still
    say those words before the new ones (without a forced prefix, or one that dropped them), where `aligned_end`
    would read them as new. A speaker who really says a word again right after such a cut loses the repeat;
    without this, every such cut doubled the words."""
    if not seam:
        return hypothesis
    return without_text(hypothesis, repeated_words(seam, text_of(hypothesis, kinds), kinds, word_key), kinds)


def without_text(tokens: Sequence[int], n_text: int, kinds: TokenKinds) -> tuple[int, ...]:
    """A hypothesis without its first `n_text` text tokens (its timestamps and the rest as they are)."""
    out, dropped = [], 0
    for token in tokens:
        if kinds.is_text(token) and dropped < n_text:
            dropped += 1
            continue
        out.append(token)
    return tuple(out)


def spoken_word(detokenize: Callable[[Sequence[int]], str]) -> Callable[[tuple[int, ...]], str]:
    """A word's key for `aligned_end`: its text lower-cased without punctuation or spaces (the word as spoken)."""
    return lambda word: re.sub(r"[^\w']+", "", detokenize(word).lower())


def last_words(text: Sequence[int], n_words: int, kinds: TokenKinds) -> list[int]:
    """The text tokens of the last `n_words` words of the text tokens `text` (all of them when it has fewer)."""
    return [token for word in _words(text, kinds)[-n_words:] for token in word]


def n_words(text: Sequence[int], kinds: TokenKinds) -> int:
    """How many words the text tokens `text` hold (its first token starts one)."""
    return len(_words(text, kinds))


def _words(tokens: Sequence[int], kinds: TokenKinds) -> list[tuple[int, ...]]:
    """Text tokens grouped in words (a word starts at a token that starts one, or at the first token)."""
    out: list[list[int]] = []
    for token in tokens:
        if not out or kinds.starts_word(token):
            out.append([])
        out[-1].append(token)
    return [tuple(w) for w in out]


def segments(tokens: Sequence[int], kinds: TokenKinds) -> list[SegmentEnd]:
    """The closed segments of a hypothesis, in order: a timestamp opens a segment, the next one closes it
    (Whisper writes a segment boundary as a pair: the end of one, the start of the next)."""
    out, is_open, n_text, opened, words = [], False, 0, 0, 0
    for index, token in enumerate(tokens):
        if token >= kinds.timestamp_begin:
            if is_open:
                out.append(SegmentEnd(n_text, index, token - kinds.timestamp_begin, opened, words))
            else:
                opened, words = token - kinds.timestamp_begin, 0
            is_open = not is_open
        elif kinds.is_text(token):
            n_text += 1
            words += words == 0 or kinds.starts_word(token)
    return out


def compression_ratio(text: str) -> float:
    """Bytes of `text` (UTF-8) over bytes of its zlib compression, as Whisper computes it (0 for no text)."""
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data)) if data else 0.0


def first_repeat(tokens: Sequence[int], closed: Sequence[SegmentEnd], kinds: TokenKinds,
                 min_tokens: int = MIN_LOOP_TOKENS) -> int | None:
    """The position in `closed` (`segments(tokens)`) of the first segment whose text (at least `min_tokens` text
    tokens) says an earlier segment's again token for token: where a hypothesis that loops starts writing its
    loop; None when none does."""
    text, seen, begin = text_of(tokens, kinds), set(), 0
    for position, segment in enumerate(closed):
        said = tuple(text[begin:segment.text_end])
        if len(said) >= min_tokens and said in seen:
            return position
        seen.add(said)
        begin = segment.text_end
    return None


def rendered(tokens: Sequence[int], kinds: TokenKinds, detokenize: Callable[[Sequence[int]], str]) -> str:
    """A hypothesis as text with its timestamps written in, e.g. ``<|0.00|> Hello there.<|1.24|><|eot|>`` (for
    traces: every run of text tokens detokenized together, every timestamp in seconds, other specials by id)."""
    out, run = [], []
    for token in tokens:
        if kinds.is_text(token):
            run.append(token)
            continue
        if run:
            out.append(detokenize(run))
            run = []
        if token >= kinds.timestamp_begin:
            out.append(f"<|{(token - kinds.timestamp_begin) * TIME_PRECISION_S:.2f}|>")
        else:
            out.append("<|eot|>" if token == kinds.eot else f"<|{token}|>")
    if run:
        out.append(detokenize(run))
    return "".join(out)


def shifted(tokens: Sequence[int], ts_steps: int, kinds: TokenKinds) -> tuple[int, ...]:
    """A hypothesis's tokens re-expressed for its buffer trimmed by `ts_steps` timestamp steps at the start:
    every timestamp moved back by that much (none below <|0.00|>), other tokens as they are."""
    begin = kinds.timestamp_begin
    return tuple(max(t - ts_steps, begin) if t >= begin else t for t in tokens)
