"""Bounds on the times of a chunk's words where chunks meet: pure functions of `WordTiming` lists.

A chunk whose text stops early is cut before its re-decoded tail (tails.py), and its words are aligned to the
whole chunk (`alignment.Aligner`): where its text ran on past speech it gave no token for, the warping path
stretched its last kept word over that speech. The words a parent keeps end where its kept text closes
(`words_until` with `alignment.spoken_until_s` of the kept tokens, in `Transcriber.finish_result`), and at the
seam the parent's words end by the tail's start, the tail's words start after the parent's last one
(`seam_words`, in `Assembler`): a parent's late word is cut down, never the tail's words pushed up onto it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from asr_spec.transcribe.segments import WordTiming

__all__ = ["seam_words", "words_from", "words_until"]

SegmentWords = Sequence[Sequence[WordTiming]]  # the words of each segment of one chunk


def words_until(segments: SegmentWords, limit_s: float) -> list[list[WordTiming]]:
    """The words of each segment with times lowered to at most `limit_s` seconds (infinity: unchanged), rounded
    to the millisecond as the aligner writes times."""
    limit_s = round(limit_s, 3)
    return [[dataclasses.replace(w, start=min(w.start, limit_s), end=min(w.end, limit_s)) for w in segment]
            for segment in segments]


def words_from(segments: SegmentWords, floor_s: float) -> list[list[WordTiming]]:
    """The words of each segment with times raised to at least `floor_s` seconds."""
    return [[dataclasses.replace(w, start=max(w.start, floor_s), end=max(w.end, floor_s)) for w in segment]
            for segment in segments]


def seam_words(parent: SegmentWords, tail: SegmentWords,
               tail_start_s: float) -> tuple[list[list[WordTiming]], list[list[WordTiming]]]:
    """The words of a parent chunk and of its tail (each per segment) where they meet: the parent's end by
    `tail_start_s` (the tail's start in the file), and the tail's start at the parent's last word's end or later,
    so the times stay monotonic across the seam."""
    parent = words_until(parent, tail_start_s)
    earlier = [w for segment in parent for w in segment]
    if not earlier:
        return parent, [list(segment) for segment in tail]
    return parent, words_from(tail, earlier[-1].end)
