"""Word-level timestamps the way Whisper computes them: cross-attention of the alignment heads, aligned by DTW.

After a chunk is decoded, its text tokens are fed once more, teacher-forced, behind the prompt
``sot [language task] <|notimestamps|>`` (one target pass; the draft plays no part, so speculative decoding stays
lossless). The pre-softmax cross-attention scores of the model's alignment heads (generation_config.alignment_heads,
else every head of the second half of the decoder layers, as transformers does) are

    softmaxed over the chunk's own audio frames (20 ms each) -> normalised per head over tokens (x - mean) / std
    -> median-filtered along time (width 7) -> averaged over heads -> dynamic time warping of tokens vs frames.

Row i of the matrix is the position that *produces* text token i (the ``<|notimestamps|>`` position produces the
first one), so the frame where the warping path first reaches row i is token i's start and row i + 1's its end.
Tokens are grouped into words as Whisper does: a new word at a leading space or a punctuation token, then leading
punctuation (``"'“¿([{-``) joins the next word and trailing punctuation the previous one. A word's probability is
the mean probability of its tokens under the same pass.
"""

from __future__ import annotations

import string
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from asr_spec.errors import InputError
from asr_spec.stream.agreement import starts_word
from asr_spec.transcribe.segments import WordTiming
from asr_spec.transcribe.tails import closed_segments

__all__ = ["Aligner", "WordTiming", "alignment_heads", "dtw_path", "fit_positions", "median_filter",
           "token_jump_times", "group_words", "snap_to_speech", "spoken_until_s", "unicode_pieces",
           "word_stretch"]

FRAME_S = 0.02  # seconds per encoder frame: 30 s window / 1500 positions
MEDIAN_WIDTH = 7  # frames (Whisper's medfilt_width)
PREPEND_PUNCTUATION = "\"'“¿([{-"
APPEND_PUNCTUATION = "\"'.。,，!！?？:：”)]}、"
SAMPLES_PER_FRAME = 320  # 16 kHz samples per encoder frame (FRAME_S)


# -- pure maths ------------------------------------------------------------------------------------------------

def median_filter(x: torch.Tensor, width: int = MEDIAN_WIDTH) -> torch.Tensor:
    """Median over a sliding window of odd `width` along the last axis, reflect-padded; shape kept."""
    if width % 2 != 1 or width < 1:
        raise InputError(f"median filter width must be odd and >= 1, got {width}")
    pad = width // 2
    if x.shape[-1] <= pad:
        return x
    lead = x.shape[:-1]
    flat = torch.nn.functional.pad(x.reshape(-1, 1, x.shape[-1]), (pad, pad), mode="reflect")
    return flat.unfold(-1, width, 1).median(dim=-1).values.reshape(*lead, x.shape[-1])


def dtw_path(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Minimum-cost monotonic path through (N, M) `cost` from (0, 0) to (N-1, M-1) with steps down, right and
    diagonal; returns (row indices, column indices) along the path. Each row of the accumulated cost is computed
    at once: D[i, j] = min_k<=j (a_k + sum c[i, k..j]) with a_k = min(D[i-1, k-1], D[i-1, k]), a running minimum
    over prefix sums."""
    c = np.asarray(cost, dtype=np.float64)
    n, m = c.shape
    acc = np.full((n + 1, m + 1), np.inf)
    acc[0, 0] = 0.0
    for i in range(1, n + 1):
        above = np.minimum(acc[i - 1, :-1], acc[i - 1, 1:])  # a_j for j = 1..m
        prefix = np.cumsum(c[i - 1])
        shifted = np.concatenate([[0.0], prefix[:-1]])
        acc[i, 1:] = prefix + np.minimum.accumulate(above - shifted)
    return _backtrace(acc)


def _backtrace(acc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    i, j = acc.shape[0] - 1, acc.shape[1] - 1
    rows, cols = [], []
    while i > 0 and j > 0:
        rows.append(i - 1)
        cols.append(j - 1)
        diagonal, up, left = acc[i - 1, j - 1], acc[i - 1, j], acc[i, j - 1]
        if diagonal <= up and diagonal <= left:
            i, j = i - 1, j - 1
        elif up < left:
            i -= 1
        else:
            j -= 1
    return np.array(rows[::-1], dtype=np.int64), np.array(cols[::-1], dtype=np.int64)


def token_jump_times(scores: torch.Tensor, n_frames: int, first_row: int, n_text: int | None = None) -> np.ndarray:
    """(heads, T, n_audio_ctx) pre-softmax cross-attention scores of a teacher-forced pass -> (n_text + 1,) seconds
    where the warping path enters each of the rows first_row .. first_row + n_text (the positions producing the
    n_text text tokens and then eot); n_text None: T - 2 - first_row (the sequence ends with its eot, whose own row
    produces nothing). Only the first `n_frames` encoder frames (the chunk's audio) take part."""
    last_row = scores.shape[1] - 2 if n_text is None else first_row + n_text
    w = scores[:, :, :max(n_frames, 1)].float().softmax(dim=-1)
    std, mean = torch.std_mean(w, dim=-2, keepdim=True, unbiased=False)
    w = median_filter((w - mean) / std.clamp(min=1e-8))
    matrix = w.mean(dim=0)[first_row:last_row + 1]
    rows, cols = dtw_path(-matrix.numpy())
    jumps = np.concatenate([[True], np.diff(rows) == 1])
    return cols[jumps] * FRAME_S


def encoder_frames(n_samples: int) -> int:
    """The encoder frames `n_samples` 16 kHz samples fill, a part frame counted (in integers: 2,240 samples are 7
    frames, where the float ceil of 2240 / 16000 / 0.02 gives 8)."""
    return -(-n_samples // SAMPLES_PER_FRAME)


MAX_CHARACTER_TOKENS = 8  # tokens joined at most to decode one split character (UTF-8: at most 4 bytes a character)


def unicode_pieces(token_ids: Sequence[int], decode: Callable[[Sequence[int]], str]) -> list[str]:
    """The text of each token as words are grouped and written: a character whose UTF-8 bytes are split over
    several tokens (Chinese, Japanese, curly quotes, emoji: "\ufffd" decoded one token at a time) is decoded from
    its tokens together, its text on the first of them and "" on the others (which then join its word). A
    "\ufffd" the whole text has too (a byte that never makes a character) ends its piece there, as
    openai-whisper's `split_tokens_on_unicode` reads it (it glued up to MAX_CHARACTER_TOKENS tokens into one
    word); a run still broken after MAX_CHARACTER_TOKENS tokens is taken as it decodes. decode: ids -> text."""
    full = decode(token_ids)
    pieces: list[str] = []
    start, offset = 0, 0
    for end in range(1, len(token_ids) + 1):
        text = decode(token_ids[start:end])
        broken = text.find("\ufffd")
        genuine = broken >= 0 and full[offset + broken:offset + broken + 1] == "\ufffd"
        if broken < 0 or genuine or end - start >= MAX_CHARACTER_TOKENS or end == len(token_ids):
            pieces += [text] + [""] * (end - start - 1)
            start, offset = end, offset + len(text)
    return pieces


def group_words(pieces: Sequence[str]) -> list[list[int]]:
    """Token indices of each word, from the decoded text of each token (Whisper's split on spaces, or on every
    character of an unspaced script, `stream.agreement.starts_word`; then its punctuation merge). Tokens that
    decode to nothing join the word before them; a word of spaces only is the start of the word after it (" " then
    "ก": a reviewer's json held a word " ")."""
    words: list[list[int]] = []
    texts: list[str] = []
    for index, piece in enumerate(pieces):
        starts = starts_word(piece) or piece.strip() in string.punctuation and piece.strip() != ""
        if (starts and not (texts and not texts[-1].strip())) or not words:
            words.append([index])
            texts.append(piece)
        else:
            words[-1].append(index)
            texts[-1] += piece
    return _merge_punctuation(words, texts)


def _merge_punctuation(words: list[list[int]], texts: list[str]) -> list[list[int]]:
    i = len(words) - 2  # leading punctuation joins the word after it
    while i >= 0:
        if texts[i].startswith(" ") and texts[i].strip() and texts[i].strip() in PREPEND_PUNCTUATION:
            words[i + 1], texts[i + 1] = words[i] + words[i + 1], texts[i] + texts[i + 1]
            del words[i], texts[i]
        i -= 1
    out_words, out_texts = words[:1], texts[:1]  # trailing punctuation joins the word before it
    for word, text in zip(words[1:], texts[1:]):
        if not out_texts[-1].endswith(" ") and text in APPEND_PUNCTUATION and text:
            out_words[-1], out_texts[-1] = out_words[-1] + word, out_texts[-1] + text
        else:
            out_words.append(word)
            out_texts.append(text)
    return out_words


def spoken_until_s(generated: Sequence[int], eot_id: int, timestamp_begin_id: int,
                   time_precision_s: float = FRAME_S) -> float:
    """Chunk seconds up to which the target transcribed: the end timestamp of its last closed segment
    (`... text <|b|> [<|c|>] <|endoftext|>`: b), else infinity (its last segment is left open and runs on to the
    chunk's end, or it wrote no timestamp). Read by `tails.closed_segments`, as the tail decision reads it. No
    word's aligned time may pass it: the warping path enters <|endoftext|> late when the target stopped early,
    and the last word then claimed frames the target gave no token for."""
    closed, open_start = closed_segments(generated, eot_id, timestamp_begin_id)
    if open_start is not None or not closed:
        return float("inf")
    return closed[-1][1] * time_precision_s


def fit_positions(head: Sequence[int], n_text: int, sot: int, max_positions: int) -> tuple[list[int], bool]:
    """The head of the teacher-forced sequence ``head + text + [eot]`` made to fit the decoder's `max_positions`
    with `n_text` text tokens behind it, and whether the eot still fits after them.

    A window stopped at the token limit (finish_reason "length") filled every position its decode had, and the
    head is as long as that decode's prompt without timestamps (with its <|notimestamps|>), so the sequence is one
    position too long. Where it does not fit, the eot is left out (such a window wrote none; the row that would
    produce it, the last text token's, is still there and ends the last word), then the previous text of the head
    (``<|startofprev|> previous text``, before `sot`) loses its oldest tokens, all of it with its <|startofprev|>
    where one is not enough room. The SOT sequence and the text are never cut: a decode fits them, so a sequence
    they do not fit is not one of a decode's (InputError)."""
    head = list(head)
    if len(head) + n_text + 1 <= max_positions:
        return head, True
    at = head.index(sot) if sot in head else 0
    previous, start = head[:at], head[at:]
    room = max_positions - len(start) - n_text
    if room < 0:
        raise InputError(f"word alignment: the SOT sequence ({len(start)} tokens) and the text ({n_text}) "
                         f"exceed the decoder's {max_positions} positions")
    if len(previous) > room:  # the most recent previous text is kept, behind its <|startofprev|>
        previous = previous[:1] + previous[len(previous) - room + 1:] if room > 1 else []
    return previous + start, False


MIN_PAUSE_S = 0.1  # a shorter run of non-speech inside a word (a stop consonant's closure) is not a pause
# a voiced stretch this long at the start of a word's span is the word's own speech, not the end of the word before:
# the path gives a word up to about 0.25 s of the word before with the pause before it (measured on
# tests/fixtures/words, where 0.1 s took such ends for the words and doubled the mean start error, 0.2 s some), and
# most words that are not function words last longer. A shorter word is placed as before, after its longest pause.
MIN_WORD_S = 0.3
# a voiced stretch shorter than this (one or two speech frames) is a blip, not a word of LONG_WORD_LETTERS letters
# or more: where a longer stretch is in its span, the blip is not chosen (" collecting" was timed 56.336-56.356 s,
# the next word's first frame after the longest pause, "orchestra" one frame of 20 ms); a short word keeps it
# ("the" and "on" of tests/fixtures/words are such blips, and are timed right by them)
MIN_STRETCH_S, LONG_WORD_LETTERS = 0.06, 5
# A word's span at least this long with no speech frame in it is a pause the warping path gave the word, not the
# word (`share_with_next` moves it): " my" over 1.8 s of silence, " The" over 14.7 s of music. Shorter spans stay:
# speech silero misses (a second speaker 26 dB down, probability 0.02-0.39) gave " Thanks." 1.0 s, and at 0.3 s
# (a word's length) those words were moved 1.2 s late into the next word's 53 ms
PAUSE_SPAN_S = 1.2


def snap_to_speech(starts: np.ndarray, ends: np.ndarray, speech: np.ndarray, frame_s: float,
                   letters: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Trim the pauses the warping path gives to words.

    A word's span is cut into voiced stretches at its pauses (>= MIN_PAUSE_S of non-speech), and the word is timed
    as one of them (`word_stretch`): from its first speech frame to its last, never across a pause. The path
    gives the pause before a word to that word (its token is the one being waited for), often with the tail of the
    word before, so after a pause a start is early by about the pause; but where the text runs on past speech the
    target gave no token for (a sentence it skipped), the path stretches a word over the pause after it into the
    next speech, and a start taken after the longest pause lands on words that are not this one. starts, ends:
    (W,) chunk seconds; speech: (F,) bool per `frame_s` frame of the chunk; letters: (W,) each word's letters
    (a word of LONG_WORD_LETTERS or more is not timed as a blip), None: all short. A span of PAUSE_SPAN_S or more
    with no speech inside is a pause, not a word: from such a word on, the words without speech share the time of
    the next word with speech (`share_with_next`); a shorter word without speech before it (a word of no length at
    the end of another's speech) stays as it is."""
    new_starts, new_ends = np.array(starts, dtype=np.float64), np.array(ends, dtype=np.float64)
    min_pause = max(int(round(MIN_PAUSE_S / frame_s)), 1)
    min_word = max(int(round(MIN_WORD_S / frame_s)), 1)
    blip = max(int(round(MIN_STRETCH_S / frame_s)), 1)
    pause_span = max(int(round(PAUSE_SPAN_S / frame_s)), 1)
    long_word = np.zeros(len(new_starts), bool) if letters is None else np.asarray(letters) >= LONG_WORD_LETTERS
    has_speech, silent = np.zeros(len(new_starts), bool), np.zeros(len(new_starts), bool)
    for index, (start, end) in enumerate(zip(new_starts.tolist(), new_ends.tolist())):
        first, stop = int(start / frame_s), min(int(np.ceil(end / frame_s)), len(speech))
        voiced = np.flatnonzero(speech[first:stop])
        has_speech[index] = len(voiced) > 0
        if not len(voiced):
            silent[index] = stop - first >= pause_span  # a span that long with no speech is a pause, not a word
            continue
        onset, last = word_stretch(voiced, min_pause, min_word, blip if long_word[index] else 1)
        new_starts[index] = max(start, (first + onset) * frame_s)
        new_ends[index] = max(min(end, (first + last + 1) * frame_s), new_starts[index])
    return share_with_next(new_starts, new_ends, has_speech, silent,
                           np.ones(len(silent)) if letters is None else letters)


def share_with_next(starts: np.ndarray, ends: np.ndarray, has_speech: np.ndarray, silent: np.ndarray,
                    letters: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Words timed where there is no speech moved into the time of the next word with speech (has_speech), that
    time split among them in proportion to their letters (at least one each): from the first `silent` one (a span
    of a pause, not of a word) of each run without speech on, the shorter ones after it going along so that the
    words stay in order; those before it stay (the end of the speech before). The warping path put a reviewer's
    " my" of "Yes, my grandmother" over 1.8 s of silence (9.32-11.12 s) and " grandmother" where both were said
    (13.22-13.84 s). A run stays where it is when no word with speech follows, or that word has no length.
    starts, ends, has_speech, silent, letters: (W,); returns new (W,) starts and ends."""
    starts, ends = np.array(starts, dtype=np.float64), np.array(ends, dtype=np.float64)
    run: list[int] = []  # the words without speech since the last word with some
    for index in range(len(starts)):
        if not has_speech[index]:
            run.append(index)
            continue
        moving = run[next((k for k, i in enumerate(run) if silent[i]), len(run)):]
        if moving and ends[index] > starts[index]:
            group = [*moving, index]
            weights = np.maximum(np.asarray(letters, dtype=np.float64)[group], 1.0)
            shares = np.concatenate([[0.0], np.cumsum(weights)]) / weights.sum()  # (len(group) + 1,) from 0 to 1
            edges = starts[index] + (ends[index] - starts[index]) * shares
            starts[group], ends[group] = edges[:-1], edges[1:]
        run = []
    return starts, ends


def word_stretch(voiced: np.ndarray, min_pause: int, min_word: int, min_stretch: int = 1) -> tuple[int, int]:
    """(first, last) frame of the voiced stretch that is a word, from the (V,) increasing indices of its span's
    speech frames: stretches are cut where `min_pause` or more non-speech frames part two speech frames, and those
    shorter than `min_stretch` frames are left out where a longer one is there (blips). The word is the first
    stretch of at least `min_word` frames (a shorter one is the end of the word before); where none is that long,
    the stretch after the longest pause (the latest of equal ones)."""
    cuts = np.flatnonzero(np.diff(voiced) - 1 >= min_pause)  # stretch k ends at voiced[cuts[k]]
    firsts = voiced[np.concatenate([[0], cuts + 1])]
    lasts = voiced[np.concatenate([cuts, [len(voiced) - 1]])]
    kept = lasts - firsts + 1 >= min_stretch
    if kept.any():
        firsts, lasts = firsts[kept], lasts[kept]
    long_enough = np.flatnonzero(lasts - firsts + 1 >= min_word)
    if len(long_enough):
        chosen = int(long_enough[0])
    else:
        pauses = firsts[1:] - lasts[:-1] - 1
        chosen = len(pauses) - int(np.argmax(pauses[::-1])) if len(pauses) else 0
    return int(firsts[chosen]), int(lasts[chosen])


# -- the teacher-forced pass -----------------------------------------------------------------------------------

def alignment_heads(model) -> list[tuple[int, int]]:
    """(layer, head) pairs: the generation config's alignment_heads, else all heads of the decoder's second half."""
    heads = getattr(model.generation_config, "alignment_heads", None)
    if heads:
        return [(int(layer), int(head)) for layer, head in heads]
    n_layers, n_heads = model.config.decoder_layers, model.config.decoder_attention_heads
    return [(layer, head) for layer in range(n_layers // 2, n_layers) for head in range(n_heads)]


class Aligner:
    """Word timings of decoded chunks with one teacher-forced pass of the target per chunk.

    target: `WhisperForConditionalGeneration`; eot: its end-of-text id; notimestamps: its <|notimestamps|> id;
    pieces: a segment's text token ids -> each token's text as words are grouped and written (`unicode_pieces`).
    """

    def __init__(self, target, eot: int, notimestamps: int, pieces: Callable[[Sequence[int]], list[str]]):
        self.target = target
        self.eot = eot
        self.notimestamps = notimestamps
        self.pieces = pieces
        self.sot = target.generation_config.decoder_start_token_id
        self.max_positions = target.config.max_target_positions  # the teacher-forced sequence fits these
        self.heads = alignment_heads(target)
        layers = target.model.decoder.layers
        self.layers = sorted({layer for layer, _ in self.heads})
        if any(not 0 <= layer < len(layers) for layer in self.layers):
            raise InputError(f"alignment heads {self.heads} name layers the decoder ({len(layers)}) does not have")
        self.attention = {layer: layers[layer].encoder_attn for layer in self.layers}

    @torch.inference_mode()
    def align(self, encoded: torch.Tensor, prompt: Sequence[int], segments: Sequence[Sequence[int]],
              n_samples: int, offset_s: float, speech: tuple[np.ndarray, float] | None = None,
              generated: Sequence[int] = ()) -> list[list[WordTiming]]:
        """Words of each segment of one chunk, in file time.

        encoded: (n_audio_ctx, d_model) target encoder output of the chunk; prompt: its decoder prompt; segments:
        the text token ids of each segment in order; n_samples: the chunk's audio length (16 kHz); offset_s: the
        chunk's start in the file; speech: ((F,) bool speech mask of the chunk's frames, frame length in seconds),
        to trim the pauses off the words (`snap_to_speech`), or None; generated: the chunk's decoded tokens with
        their timestamps: no word's time passes the timestamp that closes its last text (`spoken_until_s`).
        """
        text = [int(t) for segment in segments for t in segment]
        if not text:
            return [[] for _ in segments]
        head = [t for t in prompt if t != self.notimestamps] + [self.notimestamps]
        head, with_eot = fit_positions(head, len(text), self.sot, self.max_positions)
        ids = torch.tensor([head + text + [self.eot] * with_eot], device=encoded.device)
        scores, logits = self._scores(encoded[None], ids)  # (heads, T, S), (T, vocab)
        n_frames = encoder_frames(n_samples)
        jumps = token_jump_times(scores, n_frames, len(head) - 1, len(text))
        rows = torch.arange(len(head) - 1, len(head) - 1 + len(text))
        probs = logits[rows].float()[:, : self.eot].softmax(-1)[torch.arange(len(text)), torch.tensor(text)]
        words, pieces = self._words(segments)
        lo, hi = np.array([w[0] for _, w in words]), np.array([w[-1] + 1 for _, w in words])
        # Whisper's layout: the timestamps follow <|notimestamps|> (`WhisperTokens.timestamp_begin`)
        limit_s = min(n_samples / 16_000, spoken_until_s(generated, self.eot, self.notimestamps + 1))
        starts, ends = np.minimum(jumps[lo], limit_s), np.minimum(jumps[hi], limit_s)
        texts = ["".join(pieces[i] for i in tokens) for _, tokens in words]
        if speech is not None:
            letters = np.array([sum(ch.isalpha() for ch in word) for word in texts])
            starts, ends = snap_to_speech(starts, ends, *speech, letters)
        mean_probs = np.add.reduceat(probs.numpy(), lo) / (hi - lo)
        out: list[list[WordTiming]] = [[] for _ in segments]
        for (segment, _), word, start, end, prob in zip(words, texts, starts.tolist(), ends.tolist(),
                                                         mean_probs.tolist()):
            out[segment].append(WordTiming(word, round(offset_s + start, 3), round(offset_s + end, 3),
                                           round(prob, 4)))
        return out

    def _scores(self, audio: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """audio (1, S, d), ids (1, T) -> alignment-head scores (heads, T, S) and logits (T, vocab)."""
        queries: dict[int, torch.Tensor] = {}  # layer -> (1, T, d) the queries its cross-attention computed
        # the modules are the target's, shared by every thread's runs: a hook keeps the queries of its own thread's
        # pass only (another thread's alignment pass, between this one and its read, gave it its queries: a
        # "stack expects each tensor to be equal size" error, or word times of another chunk)
        caller = threading.get_ident()

        def keep_queries(layer: int) -> Callable[..., None]:
            def hook(module: torch.nn.Module, args: Any, out: torch.Tensor) -> None:
                if threading.get_ident() == caller:
                    queries[layer] = out
            return hook

        hooks = [self.attention[layer].q_proj.register_forward_hook(keep_queries(layer)) for layer in self.layers]
        try:
            hidden = self.target.model.decoder(input_ids=ids, encoder_hidden_states=audio,
                                               use_cache=False).last_hidden_state
        finally:
            for hook in hooks:
                hook.remove()
        picked = []
        for layer, index in self.heads:
            attn = self.attention[layer]
            dim = attn.head_dim
            q = queries[layer][0, :, index * dim : (index + 1) * dim]  # (T, head_dim)
            k = attn.k_proj(audio[0])[:, index * dim : (index + 1) * dim]  # (S, head_dim)
            picked.append((q * attn.scaling) @ k.T)
        return torch.stack(picked), self.target.proj_out(hidden)[0]

    def _words(self, segments: Sequence[Sequence[int]]) -> tuple[list[tuple[int, list[int]]], list[str]]:
        """(segment index, indices into the chunk's text tokens) of every word, in order; each token's text."""
        out, first, texts = [], 0, []
        for index, segment in enumerate(segments):
            pieces = self.pieces([int(t) for t in segment])
            for word in group_words(pieces):
                out.append((index, [first + i for i in word]))
            first += len(segment)
            texts += pieces
        return out, texts
