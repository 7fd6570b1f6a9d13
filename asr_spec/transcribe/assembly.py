"""The back half of the pipeline: the chunks of one input, decoded, become its `Transcription`.

    ChunkResult per chunk (in chunk order) ──no-speech rule──► kept tokens ──stitch_chunks (stride: overlapping
    windows) / concat_chunks (vad: disjoint speech chunks)──► segments ──decode──► text, segments with words,
    language (the one most kept chunks were decoded in), summed statistics, a report per chunk

Pure of the models: it needs the tokenizer (to decode text), the tokens' ids and the options (chunking mode, the
no-speech rule). The words come from the aligner (`Transcriber.finish_chunk`), per chunk and segment.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from asr_spec.audio.chunking import ChunkSpan
from asr_spec.audio.loading import SAMPLE_RATE
from asr_spec.engine import ChunkResult, ChunkStats
from asr_spec.stream.agreement import starts_word
from asr_spec.transcribe.alignment import group_words, unicode_pieces
from asr_spec.transcribe.nospeech import NO_SPEECH
from asr_spec.transcribe.options import TranscribeOptions
from asr_spec.transcribe.results import ChunkReport, Transcription
from asr_spec.transcribe.segments import Segment, WordTiming
from asr_spec.transcribe.stitch import ChunkTokens, StitchResult, concat_chunks, stitch_chunks
from asr_spec.transcribe.tails import drop_repeated_head
from asr_spec.transcribe.word_times import seam_words

__all__ = ["Assembler"]

ChunkWords = Sequence[Sequence[WordTiming]]  # the words of each segment of one chunk


class Assembler:
    """Turns an input's chunk results into its `Transcription`.

    tokenizer: the target's tokenizer; tokens: its `WhisperTokens` (`Engine.tokens`); options: how it was chunked
    (stride or vad) and the no-speech rule.
    """

    def __init__(self, tokenizer: Any, tokens: Any, options: TranscribeOptions):
        self.tokenizer = tokenizer
        self.tokens = tokens
        self.options = options
        # language token id -> its code ("en"); empty for an English-only model
        self._code_of = {token_id: token.strip("<|>") for token, token_id in tokens.lang_to_id.items()}

    def assemble(self, source: str, spans: Sequence[ChunkSpan], results: Sequence[ChunkResult], audio_s: float,
                 wall_s: float, chunk_words: Sequence[ChunkWords] | None = None,
                 continues: Sequence[bool] | None = None) -> Transcription:
        """The `Transcription` of one input from its chunks' spans and engine results (both in chunk order):
        stitched text and segments, language, summed statistics. chunk_words: per chunk, the words of each of
        its segments (word timestamps), or None. continues: per chunk, whether it is a re-decoded tail of the
        chunk before it (tails.py): the words its head repeats from that chunk are left out, where that
        chunk's text is kept."""
        continues = [False] * len(results) if continues is None else list(continues)
        # a window dropped by the no-speech rule contributes no text, no segment and no word
        tokens, chunk_words, dropped = self._seams(results, spans, continues, chunk_words)
        schedule = self.options.temperature
        kept = [ChunkTokens(() if drop else t, span) for t, span, drop in zip(tokens, spans, dropped)]
        stitched = self.stitch(kept)
        if chunk_words is None:
            words: list[Sequence[WordTiming]] = [()] * len(stitched.segments)
        else:  # one list per segment, chunk by chunk: the order concat_chunks gives the segments
            words = [w for chunk, drop in zip(chunk_words, dropped) if not drop for w in chunk]
        languages = [self.language(r) for r in results]
        spoken = [lang for lang, drop in zip(languages, dropped) if not drop] or languages
        segments = tuple(Segment(*word_bounds(s.start_s, s.end_s, w), self.decode(s.token_ids), tuple(w), s.token_ids)
                         for s, w in zip(stitched.segments, words))
        return Transcription(
            source=source,
            text=self.decode(stitched.token_ids),
            segments=segments,
            language=Counter(spoken).most_common(1)[0][0] if spoken else self._given_language(),
            stats=ChunkStats.total(r.stats for r in results),
            audio_s=audio_s, wall_s=wall_s, chunks=_reports(spans, results, languages, dropped, continues),
            timestamped=stitched.timestamped,
            chunk_tokens=tuple(r.tokens for r in results),
            redecoded_tails=sum(continues),
            # a window kept at temperature t was decoded at every temperature of the schedule up to t
            fallback_windows=tuple((t, sum(r.temperature >= t for r in results)) for t in schedule[1:]),
        )

    def _seams(self, results: Sequence[ChunkResult], spans: Sequence[ChunkSpan], continues: Sequence[bool],
               chunk_words: Sequence[ChunkWords] | None) -> tuple[list[tuple[int, ...]], list | None, list[bool]]:
        """Each chunk's tokens and words once its seam is made, and whether the no-speech rule drops it (judged on
        that text), chunk by chunk: a tail loses the whole words at its head that repeat its parent's last ones,
        and its segments' words as many (`_seam`), only when its parent's text is kept; the tail of a dropped
        parent keeps its head, else the words it repeats would be written nowhere."""
        fallback = len(self.options.temperature) > 1
        out = [r.tokens for r in results]
        words = None if chunk_words is None else [list(w) for w in chunk_words]
        dropped: list[bool] = []
        for i, result in enumerate(results):
            if i and continues[i] and not dropped[i - 1]:
                self._seam(out, words, spans, i)
            text = self.decode(out[i])
            dropped.append(self.options.no_speech.drops(result.no_speech_prob, result.avg_logprob, text, fallback))
        return out, words, dropped

    def _seam(self, tokens: list[tuple[int, ...]], words: list | None, spans: Sequence[ChunkSpan], i: int) -> None:
        """Chunk i, a tail of chunk i - 1, without the whole words at its head that repeat its parent's last ones
        (`drop_repeated_head`), and its segments' words without as many words (`words_left`), in place; the
        parent's words end by the tail's start (`seam_words`)."""
        before = tokens[i]
        tokens[i], n_drop = drop_repeated_head(tokens[i - 1], before, self.tokens.eot, self._starts_word)
        if words is None:
            return
        if n_drop and words[i]:
            texts = [self._segment_texts(t, spans[i]) for t in (before, tokens[i])]
            words[i] = words_left(words[i], *texts, self._group_words)
        # the parent's last word may be timed past where its tail starts: it ends there, and times stay monotonic
        words[i - 1], words[i] = seam_words(words[i - 1], words[i], spans[i].start_sample / SAMPLE_RATE)

    def _segment_texts(self, token_ids: tuple[int, ...], span: ChunkSpan) -> list[tuple[int, ...]]:
        """The text tokens of each segment the chunk's tokens make alone (as its words were aligned to them)."""
        return [tuple(t for t in s.token_ids if t < self.tokens.eot)
                for s in self.stitch([ChunkTokens(token_ids, span)]).segments]

    def _group_words(self, token_ids: Sequence[int]) -> list[list[int]]:
        """Each word's token indices, as the aligner grouped a segment's text (`alignment.group_words`)."""
        return group_words(self.pieces(token_ids))

    def _starts_word(self, token_id: int) -> bool:
        return starts_word(self.piece(token_id))

    def stitch(self, chunks: Sequence[ChunkTokens]) -> StitchResult:
        """The chunks' tokens joined as the chunking mode says: stitched across strides (a seam cut by time keeps
        words whole), or concatenated."""
        ids = {"eot_id": self.tokens.eot, "timestamp_begin_id": self.tokens.timestamp_begin}
        if self.options.vad is None:
            return stitch_chunks(chunks, **ids, sampling_rate=SAMPLE_RATE, starts_word=self._starts_word)
        return concat_chunks(chunks, **ids, sampling_rate=SAMPLE_RATE)

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of `token_ids` (control and timestamp tokens left out; text that reads like one, a prefix's
        "<|2.00|>", kept: transformers' decode drops such text unless told the ids are filtered already)."""
        text_ids = [t for t in token_ids if t < self.tokens.eot]
        return self.tokenizer.decode(text_ids, skip_special_tokens=True, decode_with_timestamps=True).strip()

    def pieces(self, token_ids: Sequence[int]) -> list[str]:
        """Each text token's text as words are grouped and written (`alignment.unicode_pieces`: a character split
        over tokens decoded whole)."""
        return unicode_pieces(token_ids, lambda ids: self.tokenizer.decode(list(ids), skip_special_tokens=False))

    def piece(self, token_id: int) -> str:
        """The text of one token, as decoded alone (special tokens kept): how the aligner groups words."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _given_language(self) -> str | None:
        """The language the options decode in, as a code ("english" -> "en"), for an input without chunks (no
        speech): the one its chunks would have had; None where each chunk's is detected."""
        given = self.options.decode.language
        if given is None or not self._code_of:
            return None if given is None else "en"
        return self._code_of.get(self.tokens.language_id(given))

    def language(self, result: ChunkResult) -> str | None:
        """The language of a chunk from its prompt ([<|startofprev|> previous text] sot, language, task, ...): the
        token after sot (a prompt's first token is not the language); "en" for English-only models."""
        if not self._code_of:
            return "en"
        return self._code_of.get(self.tokens.language_in(result.prompt))


def words_left(words: Sequence[Sequence[WordTiming]], before: Sequence[Sequence[int]], after: Sequence[Sequence[int]],
               group: Callable[[Sequence[int]], list[list[int]]]) -> list[list[WordTiming]]:
    """A tail's words per segment once the words its head repeats were dropped (a prefix of its text): `before` and
    `after`, the text tokens of its segments before and after the drop. The segments the drop emptied go with their
    words (the stitcher leaves them out: their words stayed, and every later segment got the one before's); the
    first one left loses the words that started in its dropped tokens, as its words were grouped (group: a
    segment's text tokens -> each word's token indices, `alignment.group_words`: " well-known" is " well" and
    "-known", "3.5" two words too)."""
    if not after:  # the drop took all of its text
        return []
    gone = len(before) - len(after)
    if gone < 0 or len(words) != len(before):  # not segments of the words' own chunk: left as they were
        return [list(w) for w in words]
    n_cut = len(before[gone]) - len(after[0])
    n_words = sum(word[0] < n_cut for word in group(before[gone]))
    return [list(words[gone])[n_words:], *(list(w) for w in words[gone + 1:])]


def _reports(spans: Sequence[ChunkSpan], results: Sequence[ChunkResult], languages: Sequence[str | None],
             dropped: Sequence[bool], continues: Sequence[bool]) -> tuple[ChunkReport, ...]:
    """Where each chunk lies and how its decoding went."""
    reports = []
    for span, r, language, drop, tail in zip(spans, results, languages, dropped, continues):
        reports.append(ChunkReport(span.start_sample / SAMPLE_RATE, span.end_sample / SAMPLE_RATE, language,
                                   r.finish_reason, r.stats, r.no_speech_prob, r.avg_logprob,
                                   NO_SPEECH if drop else None, tail, r.temperature))
    return tuple(reports)


def word_bounds(start_s: float, end_s: float, words: Sequence[WordTiming]) -> tuple[float, float]:
    """A segment's (start_s, end_s): its timed words' span where it has words (openai-whisper's rule: the aligned
    words are the finer times, and a caption cut from them then agrees with its segment), else its timestamps."""
    return (words[0].start, words[-1].end) if words else (start_s, end_s)
