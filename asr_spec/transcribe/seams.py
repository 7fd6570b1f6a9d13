"""Pure seam merging: where two overlapping readings of the same audio are joined, so that no word is doubled or lost.

By text (`overlap_cut`, `merge_overlapping`): the head of the right sequence slides under the tail of the left one,
the offset with the best match fraction wins (ties broken toward longer overlaps), and both are cut at the middle of
that overlap, as transformers' ASR pipeline does (``_find_longest_common_sequence``). With each token's time
(`token_times`, interpolated between the timestamps around it), `seam_cut` cuts a credible common run where both
readings agree nearest the seam, and a seam whose readings share no credible run by time (`time_cut`): the left
reading keeps what it heard before the seam, the right what it heard from it on (and each what it heard where the
other wrote nothing, the left up to where the chunk after the right starts: a re-decoded tail, or with wide strides
the next window, says that part itself). Where the right's reading
ends inside the run (a window that stopped early), the left keeps what it heard after it before the seam.
`stitch.py` reads the chunks and calls `seam_cut` at each seam.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from asr_spec.errors import InputError

__all__ = ["HEARD_TOLERANCE_S", "LOOP_FACTOR", "LOOP_MIN_TOKENS", "MAX_CLOSING_TOKENS", "MAX_SKEW_S", "SEAM_SLACK_S",
           "SURE_RUN_MIN", "SURE_RUN_TOKENS", "StartsWord", "TimedPiece", "merge_overlapping", "merge_with_shares",
           "overlap_cut", "repeated_head", "run_lengths", "seam_cut", "time_cut", "token_times"]

_TIE_BREAK_PER_TOKEN = 1e-4  # added per overlapping token to the match fraction: prefer long perfect matches

# seconds two readings' times of a common run may differ by on average: token times are interpolated inside
# segments of a few seconds (`token_times`), so a true run is off by about a second; a spurious one ("." " He"
# matched across two sentences) by the several seconds between them
MAX_SKEW_S = 2.5
# equal aligned tokens, in runs of at least SURE_RUN_MIN in a row, that make a run whatever the times say:
# whisper-base may time one sentence 3-5 s apart in two windows (dialogue_pauses; its two readings may differ in a
# token: "Mr."/"Mister"), while a spurious match is a punctuation mark and a word or two. Counted however scattered,
# "an arrow pointing at a sheep." and "the arrow is pointing at the sheep." 6.5 s later shared four ("pointing at",
# "sheep .") and the second sentence's head was lost (a seams reviewer's spliced dialogue); counted only in a row,
# a sentence read "1 2 3 90 5 6 7" and "1 2 3 80 5 6 7" 4 s apart was written twice (a diff reviewer's)
SURE_RUN_TOKENS = 4
SURE_RUN_MIN = 3
# seconds beyond the audio two windows share within which either's text is compared at their seam: whisper-base
# timed dialogue_pauses' "Only because the path was flooded after the rain." 5 s early in one window (35-40 s,
# where the next window heard it at 40-44 s); the segment is taken whole when it reaches into this margin
SEAM_SLACK_S = 5.0
# seconds a token may be timed outside the audio of a window and still count as heard by it: a window's first
# timestamp is its start and a closed segment's last token is timed half its share (about 0.15 s) before the
# segment's end, so a word the window heard at its edge is timed within about a quarter second of it. Tight on
# purpose: windows may share little audio before a seam (window starts moved to pauses were tried, one opening
# 0.3 s before its seam: docs/long-form-measurements.md), and there " from above" ending a sentence in the left
# window (~44 s) and the right's next sentence (44.7 s on) counted as a common run, four words lost
HEARD_TOLERANCE_S = 0.25
# tokens that start no word (". ", "?") a reading that stopped early may end a common run with where the other
# reads on ("he went home." against "he went home and slept"): the run still ends the right's reading
MAX_CLOSING_TOKENS = 2
# a run cut whose left keeps at least LOOP_MIN_TOKENS past the seam, more than LOOP_FACTOR times the right's for the
# same audio, is a loop's (`_outwritten`): a 10 s window that heard "I will believe that when I see it" in its last
# second repeated it to its token limit, 440 tokens timed within half a second, and the run cut at the loop's last
# repetition kept ~60 of them (a seams reviewer's runs: 502 of 576 doubled words, two loops; 3-4x, 12-30 tokens,
# all the same there)
LOOP_MIN_TOKENS = 20
# seconds from a window's audio start within which its first token lies when the window opened on it (Whisper's
# first timestamp is 0.00 there; a first token is timed at its middle, about 0.2 s on)
OPENING_S = 0.5
LOOP_FACTOR = 3.0
StartsWord = Callable[[int], bool]  # whether a text token starts a word (its text begins with a space)


# ---------------------------------------------------------------------------------------------------------------
# Text merge
# ---------------------------------------------------------------------------------------------------------------


def overlap_cut(left: Sequence[int], right: Sequence[int]) -> tuple[int, int]:
    """Where to join ``left`` and ``right``: returns ``(n_left_kept, n_right_dropped)``.

    The merged sequence is ``left[:n_left_kept] + right[n_right_dropped:]``. Every offset at which the head of
    ``right`` overlaps the tail of ``left`` by ``shift`` tokens (``shift`` in ``1 .. len(left) + len(right) - 1``,
    the overlap being shorter than ``shift`` once ``right`` slides past ``left``'s start) is scored
    ``matches / shift + shift * 1e-4``; offsets with fewer than two equal aligned tokens do not count. Both sides
    are cut at the middle of the best overlap. With no acceptable offset, everything is kept (plain concatenation).
    """
    best = _best_overlap(left, right)
    if best is None:
        return len(left), 0
    left_start, left_stop, right_start, right_stop = best
    return (left_start + left_stop) // 2, (right_start + right_stop) // 2


Overlap = tuple[int, int, int, int]  # (left_start, left_stop, right_start, right_stop) of an aligned overlap


def _best_overlap(left: Sequence[int], right: Sequence[int],
                  credible: Callable[[Overlap], bool] | None = None) -> Overlap | None:
    """(left_start, left_stop, right_start, right_stop) of the best-scoring overlap (see `overlap_cut`), or None
    when no offset has two equal aligned tokens; given `credible`, only the overlaps it accepts count."""
    left_ids = np.asarray(left, dtype=np.int64)
    right_ids = np.asarray(right, dtype=np.int64)
    n_left, n_right = len(left_ids), len(right_ids)
    best_score = 0.0
    best = None
    for shift in range(1, n_left + n_right):
        left_start, left_stop = max(0, n_left - shift), min(n_left, n_left + n_right - shift)
        right_start, right_stop = max(0, shift - n_left), min(n_right, shift)
        matches = int(np.count_nonzero(left_ids[left_start:left_stop] == right_ids[right_start:right_stop]))
        score = matches / shift + shift * _TIE_BREAK_PER_TOKEN
        overlap = (left_start, left_stop, right_start, right_stop)
        if matches > 1 and score > best_score and (credible is None or credible(overlap)):
            best_score = score
            best = overlap
    return best


def merge_with_shares(pieces: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """Merge pieces left to right; also return how many merged tokens each piece contributed."""
    if not pieces:
        return [], []
    merged: list[int] = []
    shares: list[int] = []
    carry = list(pieces[0])  # the not-yet-committed tail: everything kept so far from the latest piece
    for piece in pieces[1:]:
        n_keep, n_drop = overlap_cut(carry, piece)
        merged.extend(carry[:n_keep])
        shares.append(n_keep)
        carry = list(piece[n_drop:])
    merged.extend(carry)
    shares.append(len(carry))
    return merged, shares


def merge_overlapping(pieces: Sequence[Sequence[int]]) -> list[int]:
    """Merge token sequences of consecutive overlapping chunks into one (see ``overlap_cut``)."""
    return merge_with_shares(pieces)[0]


# ---------------------------------------------------------------------------------------------------------------
# Time merge: seams whose readings share no run
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TimedPiece:
    """One chunk's text of a segment that runs across a seam, with where each token was heard."""

    tokens: tuple[int, ...]  # text tokens
    times_s: tuple[float, ...]  # per token, file seconds, non-decreasing (`token_times`)
    seam_s: float  # file seconds where the next chunk takes over: this chunk's keep end
    heard_from_s: float = -np.inf  # file seconds where the chunk's audio starts (-inf: not known)
    heard_to_s: float = np.inf  # file seconds where it ends (inf: not known)
    # file seconds where the chunk after this one starts (inf: none, or not known): it reads the audio from there
    # itself (a re-decoded tail of this one, or with strides wider than a sixth of a window the next window)
    next_from_s: float = np.inf

    def heard(self, times_s: np.ndarray) -> np.ndarray:
        """(n,) bool: whether this chunk's audio holds each of `times_s` (n,), within HEARD_TOLERANCE_S."""
        return (times_s >= self.heard_from_s - HEARD_TOLERANCE_S) & (times_s <= self.heard_to_s + HEARD_TOLERANCE_S)


def token_times(n_tokens: int, anchors: Sequence[tuple[int, float]]) -> np.ndarray:
    """(n_tokens,) seconds at which each text token was heard, from `anchors`: (position, time_s) of the
    timestamps around the text, position p standing before token p, in order (at least one, at position 0).
    Token i lies between the last anchor at or before position i and the first at or after position i + 1 (two
    anchors at one position: the earlier time ends the text before them, the later starts the text after them),
    interpolated at its middle; after the last anchor it is at that anchor. Anchor times are made
    non-decreasing first."""
    if not anchors or anchors[0][0] != 0:
        raise InputError(f"token_times needs an anchor at position 0, got {list(anchors)[:3]}")
    positions = np.array([p for p, _ in anchors], dtype=np.int64)
    times = np.maximum.accumulate(np.array([t for _, t in anchors], dtype=np.float64))
    index = np.arange(n_tokens)
    lo = np.searchsorted(positions, index, side="right") - 1  # the last anchor at or before i
    hi = np.minimum(np.searchsorted(positions, index + 1, side="left"), len(positions) - 1)  # first at/after i + 1
    span = positions[hi] - positions[lo]
    fraction = np.where(span > 0, (index + 0.5 - positions[lo]) / np.maximum(span, 1), 0.0)
    return times[lo] + np.clip(fraction, 0.0, 1.0) * (times[hi] - times[lo])


def time_cut(left: TimedPiece, right: TimedPiece, starts_word: StartsWord | None = None) -> tuple[int, int]:
    """Where to join two readings of a seam by time: (n_left_kept, n_right_dropped), as `overlap_cut` returns.
    The left keeps its tokens heard before left.seam_s, the right its tokens from it on; and each keeps what it
    heard where the other transcribed nothing: the left its tokens up to MAX_SKEW_S before the right's first one
    after the seam, the right its tokens more than MAX_SKEW_S after the left's last kept one (a window that
    stopped early, heard silence or was dropped takes no words with it) and all its tokens when that one lies
    outside the right's audio (`TimedPiece.heard`: the right cannot have written again what it never heard),
    its tokens heard after that one kept unless they repeat the left's (`_dropped_head`).
    Given `starts_word`, a word the seam cuts stays whole in the left and its rest leaves the right (no half
    words)."""
    left_s, right_s = np.asarray(left.times_s), np.asarray(right.times_s)
    after = right_s[right_s >= left.seam_s]
    keep_before_s = max(left.seam_s, float(after[0]) - MAX_SKEW_S) if len(after) else _unread_from_s(left, right)
    n_keep = int(np.searchsorted(left_s, keep_before_s, side="left"))
    n_drop = _dropped_head(left, right, n_keep)
    if starts_word is not None:
        n_keep = _word_end(left.tokens, n_keep, starts_word)
        n_drop = _word_end(right.tokens, n_drop, starts_word)
    return n_keep, n_drop


def _dropped_head(left: TimedPiece, right: TimedPiece, n_keep: int) -> int:
    """How many of the right's first tokens a time cut drops as the left's reading of the same audio: none where
    the left's last kept token lies outside the right's audio; else those before the seam heard up to that token,
    and of those up to MAX_SKEW_S after it, as many as repeat the left's last kept tokens (`repeated_head`: the
    right may have timed the same words later). A window opening in a pause times its first
    words early ("<0.00> Here is the gate" over 2.3 s of silence: "Here" interpolated at 88.1 s for 90.2 s), and
    they were dropped as the left's, which had said nothing there (a seams reviewer's 56 stride runs with pauses,
    re-stitched: 267 words lost, 203 after)."""
    left_s, right_s = np.asarray(left.times_s), np.asarray(right.times_s)
    if not n_keep or not right.heard(left_s[n_keep - 1 : n_keep])[0]:
        return 0
    last_s = float(left_s[n_keep - 1])
    before_seam = int(np.searchsorted(right_s, left.seam_s, side="left"))
    n_same = min(int(np.searchsorted(right_s, last_s, side="right")), before_seam)
    if n_same and _opened_unread(left, right, n_keep):
        n_same = 0
    n_skewed = int(np.searchsorted(right_s, min(left.seam_s, last_s + MAX_SKEW_S), side="left"))
    skewed = right.tokens[n_same:n_skewed]
    return n_same + repeated_head(skewed, left.tokens[:n_keep])


def _opened_unread(left: TimedPiece, right: TimedPiece, n_keep: int) -> bool:
    """Whether the right's reading opens at its audio's start (its first token within OPENING_S of it), reads on
    past the seam, and opens with words none of which the left's first `n_keep` tokens timed from MAX_SKEW_S before
    them say: a window that opens in a pause times its first words early, from its start, and they are no reading
    of the left's words there (a right reading that stops before the seam is still cut by time: a window that
    stopped early may have read the left's words its own way). A left
    window that stretched its last segment 2.8 s past its speech ("averaged 27 members." timed up to 25.45 s for
    speech ending at 22.9 s) against a right one opening in the pause after it ("The spring sportive", said from
    25.6 s, timed from 23.9 s, before the left's last token): those words were dropped as the left's reading, a
    sentence's first three words lost at a 30 s window's seam (a long-form reviewer's)."""
    right_s, left_s = np.asarray(right.times_s), np.asarray(left.times_s[:n_keep])
    if not len(right_s) or right_s[0] > right.heard_from_s + OPENING_S or right_s[-1] < left.seam_s:
        return False
    n_same = int(np.searchsorted(right_s, left_s[-1], side="right"))
    said_there = left.tokens[int(np.searchsorted(left_s, right_s[0] - MAX_SKEW_S, side="left")):n_keep]
    return not set(right.tokens[:n_same]) & set(said_there)


def repeated_head(tokens: Sequence[int], end: Sequence[int], max_tokens: int | None = None,
                  starts_word: StartsWord | None = None) -> int:
    """How many of `tokens`' first tokens repeat the last ones of `end` (a reading's last tokens kept): the largest
    k (at most `max_tokens`, None: any) with tokens[:k] == end[-k:] and, given `starts_word`, tokens[k] starting a
    word (the repetition is whole words); 0 for none. Not a bag of tokens: a right reading opening "the man." after
    a left one ending "to the door." shares " the" but repeats nothing."""
    tokens, end = list(tokens), list(end)
    most = min(len(tokens), len(end)) if max_tokens is None else min(max_tokens, len(tokens), len(end))
    for k in range(most, 0, -1):
        whole = starts_word is None or k == len(tokens) or starts_word(tokens[k])
        if tokens[:k] == end[-k:] and whole:
            return k
    return 0


def _unread_from_s(left: TimedPiece, right: TimedPiece) -> float:
    """File seconds from which a time cut keeps nothing the left heard, where the right wrote nothing after the
    seam: where the chunk after the right starts (inf: none). A window that stopped early takes no words with it,
    but the chunk after it reads that audio again (a re-decoded tail from where the right was cut,
    `tails.trim_span`; with wide strides the next window, which overlaps the left): the left's words there would
    be written twice."""
    return max(left.seam_s, min(right.heard_to_s, right.next_from_s))


def _word_end(tokens: Sequence[int], position: int, starts_word: StartsWord) -> int:
    """`position` moved on to the next token that starts a word (or the end): a cut there keeps words whole."""
    while position < len(tokens) and not starts_word(tokens[position]):
        position += 1
    return position


def _heard_together(left: TimedPiece, right: TimedPiece, overlap: Overlap) -> bool:
    """Whether the equal tokens an overlap aligns are a common run: SURE_RUN_TOKENS of them in runs of at least
    SURE_RUN_MIN in a row, or heard at about the same time by both chunks (their times differ by at most
    MAX_SKEW_S on average) in audio both chunks have (`TimedPiece.heard`): ". He" at the end of one reading and
    ". He" seven seconds earlier at the start of the other are no common run, nor is " from above" the left heard
    before the right's audio starts."""
    left_start, left_stop, right_start, right_stop = overlap
    equal = np.asarray(left.tokens[left_start:left_stop]) == np.asarray(right.tokens[right_start:right_stop])
    left_s = np.asarray(left.times_s[left_start:left_stop])[equal]
    right_s = np.asarray(right.times_s[right_start:right_stop])[equal]
    runs = run_lengths(equal)
    if runs[runs >= SURE_RUN_MIN].sum() >= SURE_RUN_TOKENS:
        return True
    both_heard = bool(right.heard(left_s).all() and left.heard(right_s).all())
    return both_heard and bool(abs(float((left_s - right_s).mean())) <= MAX_SKEW_S)


def run_lengths(flags: np.ndarray) -> np.ndarray:
    """(k,) int: the lengths of the runs of consecutive True values of the (n,) bool `flags`, in order."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], np.asarray(flags, dtype=np.int8), [0]])))
    return edges[1::2] - edges[::2]


def seam_cut(left: TimedPiece, right: TimedPiece, starts_word: StartsWord | None = None) -> tuple[int, int]:
    """Where to join two readings of one seam: (n_left_kept, n_right_dropped), as `overlap_cut` returns. Where
    the readings share a run heard at about the same time by both (`_heard_together`, the overlap `overlap_cut`
    would take), at the aligned token both agree on nearest the seam (`_agreeing_cut`); by time (`time_cut`)
    where they share none."""
    best = _best_overlap(left.tokens, right.tokens, functools.partial(_heard_together, left, right))
    if best is None:
        return time_cut(left, right, starts_word)
    n_keep, n_drop = _agreeing_cut(left, right, best)
    if _outwritten(left, right, n_keep):
        return time_cut(left, right, starts_word)
    return _past_the_right(left, right, n_keep, n_drop, starts_word) or (n_keep, n_drop)


def _outwritten(left: TimedPiece, right: TimedPiece, n_keep: int) -> bool:
    """Whether a cut keeping the left's first `n_keep` tokens keeps a loop past the seam: at least
    LOOP_MIN_TOKENS of them timed from the seam on, more than LOOP_FACTOR times as many as the right wrote for the
    same audio (from the seam to the left's last kept token). The right's reading is then the one past the seam."""
    left_s, right_s = np.asarray(left.times_s), np.asarray(right.times_s)
    n_past = n_keep - int(np.searchsorted(left_s, left.seam_s, side="left"))
    if n_past < LOOP_MIN_TOKENS:
        return False
    n_right = int(np.searchsorted(right_s, left_s[n_keep - 1], side="right")
                  - np.searchsorted(right_s, left.seam_s, side="left"))
    return n_past > LOOP_FACTOR * max(n_right, 1)


def _past_the_right(left: TimedPiece, right: TimedPiece, n_keep: int, n_drop: int,
                    starts_word: StartsWord | None) -> tuple[int, int] | None:
    """The cut when the right's reading ends inside the common run (its tokens from the cut on are the left's
    aligned ones, but for up to MAX_CLOSING_TOKENS that start no word: a "." where the other reads on) and the left
    heard more after it before the seam: the left's reading through what it heard before the seam (words kept
    whole), the right's dropped; None otherwise. A 20-50 s window whose text stops at 22 s inside the 0-30 s
    window's: cut inside the run, the left's 22-25 s were nobody's. What the left heard past the seam stays the
    right window's (or its re-decoded tail's) to say: kept, it was written twice, or a left window's guess at its
    edge over audio the right heard as silence."""
    rest = right.tokens[n_drop:]
    run_end = n_keep + _common_head(rest, left.tokens[n_keep:])
    closing = rest[run_end - n_keep:]
    if closing and (starts_word is None or len(closing) > MAX_CLOSING_TOKENS or any(map(starts_word, closing))):
        return None
    kept = run_end + int(np.searchsorted(np.asarray(left.times_s[run_end:]), left.seam_s, side="left"))
    if starts_word is not None:
        kept = _word_end(left.tokens, kept, starts_word)
    return (kept, len(right.tokens)) if kept > run_end else None


def _common_head(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens `a` and `b` share from their first on."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if len(differ) else n


def _agreeing_cut(left: TimedPiece, right: TimedPiece, overlap: Overlap) -> tuple[int, int]:
    """The cut inside an aligned overlap: before the aligned position k whose tokens and the ones before them
    both readings agree on (else whose tokens alone agree), left.times_s[k] nearest the seam. The left is trusted
    before the seam and the right after it, and the join cannot double or drop a word where one reading has a
    token the other lacks (ends_mid_sentence: "days," against "days": cut at the overlap's middle, one shift off
    after the comma, it wrote "On rainy days days he sat"; and "so we built" in the left's own middle became the
    right stride's "so he built")."""
    left_start, left_stop, right_start, right_stop = overlap
    equal = np.asarray(left.tokens[left_start:left_stop]) == np.asarray(right.tokens[right_start:right_stop])
    both = equal & np.concatenate([[False], equal[:-1]])
    candidates = np.flatnonzero(both if both.any() else equal)
    distance = np.abs(np.asarray(left.times_s[left_start:left_stop])[candidates] - left.seam_s)
    k = int(candidates[int(np.argmin(distance))])
    return left_start + k, right_start + k
