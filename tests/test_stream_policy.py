"""The streaming policy without a model: a scripted decoder that hears words in the audio, a stream fed block by
block, and the invariants: committed text only grows, every word is committed once, in order, and the decoded
buffer never exceeds one window."""

from __future__ import annotations

import functools
import logging

import numpy as np
import pytest

from asr_spec.errors import AudioError, InputError
from asr_spec.stream import hearing
from asr_spec.stream.agreement import (
    TokenKinds,
    agreed_words,
    committed_prefix,
    compression_ratio,
    first_repeat,
    last_words,
    n_words,
    rendered,
    repeated_words,
    segments,
    shifted,
    text_of,
    without_text,
)
from asr_spec.stream.hearing import LOOP_COMPRESSION_RATIO, PAUSE_SEARCH_S
from asr_spec.stream.policy import WINDOW_S, StreamOptions, StreamPolicy

SR = 16_000
EOT, TS = 50, 60  # text ids < 50 (even: a word's first token, odd: its second), timestamps from 60
KINDS = TokenKinds(EOT, TS, np.arange(EOT + 1) % 2 == 0)
WORD_SAMPLES = 8000  # 0.5 s a word: 25 timestamp steps


def detokenize(tokens) -> str:
    return "".join(f" w{t // 2}" if t % 2 == 0 else "+" for t in tokens)


def speech(words: list[int | None]) -> np.ndarray:
    """Audio of `words` (None: 0.5 s of silence), each word a run of the constant (w + 1) / 100."""
    return np.concatenate([np.full(WORD_SAMPLES, 0.0 if w is None else (w + 1) / 100, np.float32) for w in words])


def hear(audio: np.ndarray, words_per_segment: int = 3) -> list[int]:
    """The scripted decoder: every whole word in the buffer as two tokens, a word cut by the buffer's end as its
    first token only (one cut at its start is not heard); a segment per `words_per_segment` words, timestamps at
    the words' edges, then <|endoftext|>."""
    edges = np.flatnonzero(np.diff(audio, prepend=np.float32(-1), append=np.float32(-1)))
    tokens, n_words, seg_open = [], 0, False
    for start, end in zip(edges[:-1], edges[1:]):
        if audio[start] == 0 or (start == 0 and end - start < WORD_SAMPLES):
            continue
        w = int(round(audio[start] * 100)) - 1
        if not seg_open:
            tokens.append(TS + start // 320)
            seg_open = True
        whole = end - start >= WORD_SAMPLES
        tokens += [2 * w, 2 * w + 1] if whole else [2 * w]
        n_words += 1
        if n_words % words_per_segment == 0 and whole:
            tokens.append(TS + end // 320)
            seg_open = False
    if seg_open:
        tokens.append(TS + len(audio) // 320)
    return tokens + [EOT]


def hear_given(audio: np.ndarray, prefix: tuple[int, ...] = (), hearing=None) -> list[int]:
    """The scripted decoder as the engine decodes a request with a forced prefix (`ChunkRequest.prefix`): <|0.00|>,
    the prefix (its timestamps as given), then what `hear` hears after the prefix's last word: where that word is
    heard nearest to its place in the prefix (a model reads on from where the forced words end in the audio), else
    after as many text tokens as the prefix holds (a forced word it does not hear). hearing: what hears the audio
    (default `hear`)."""
    heard = (hear if hearing is None else hearing)(audio)
    text = [t for t in prefix if t < EOT]
    if not text:
        return heard
    last = text[max(i for i, t in enumerate(text) if t % 2 == 0):]  # the prefix's last word's tokens
    heard_text = [i for i, t in enumerate(heard) if t < EOT]  # the index in `heard` of each text token
    words = [j for j in range(len(heard_text)) if [heard[i] for i in heard_text[j:j + len(last)]] == last]
    if words:
        j = min(words, key=lambda j: abs(j + len(last) - len(text)))
        after = heard_text[j + len(last) - 1] + 1
    else:
        after = heard_text[len(text) - 1] + 1 if len(text) <= len(heard_text) else len(heard) - 1
    return [TS, *prefix, *heard[after:]]


def energy(samples: np.ndarray) -> np.ndarray:
    return (np.abs(samples.reshape(-1, 512)).max(1) > 0).astype(np.float32)


def run_stream(audio: np.ndarray, options: StreamOptions, voice=None, block_s: float = 0.25, decodes=None,
               decoder=None):
    """Stream `audio` in blocks through a policy decoded by `hear_given` (or `decoder`: Decode -> tokens); decodes:
    a list that gets each Decode with the tokens committed in its buffer when it was asked for and the number of
    words committed in all."""
    policy = StreamPolicy(KINDS, detokenize, options, voice)
    updates, longest = [], 0
    block = int(block_s * SR)

    def serve() -> None:
        nonlocal longest
        while (decode := policy.request()) is not None:
            longest = max(longest, len(decode.audio))
            if decodes is not None:
                decodes.append((decode, list(policy._committed), len(words_of(policy._text))))
            tokens = hear_given(decode.audio, decode.prefix) if decoder is None else decoder(decode)
            updates.append(policy.accept(decode, tokens))

    for i in range(0, len(audio), block):
        policy.feed(audio[i:i + block])
        serve()
    final = policy.finish()
    if final is None:
        serve()
    else:
        updates.append(final)
    return policy, updates, longest


def words_of(text: str) -> list[str]:
    return text.replace("+", "").split()


def test_agreement_helpers() -> None:
    # a0 a1 | b0 (cut) vs a0 a1 b0 b1 c0: b is not known whole in both: commit a only
    assert agreed_words([0, 1, 2], [0, 1, 2, 3, 4], KINDS) == 2
    # both go on with a new word after a0 a1 b0 b1
    assert agreed_words([0, 1, 2, 3, 6], [0, 1, 2, 3, 4], KINDS) == 4
    assert agreed_words([0, 1], [8, 9], KINDS) == 0
    assert agreed_words([0, 1, 2, 3], [0, 1, 2, 3, 4], KINDS) == 4  # previous stopped at a word end
    assert agreed_words([0, 1, 2, 3], [0, 1, 2, 3], KINDS) == 2  # new's last word: nothing after it, maybe cut
    assert agreed_words([], [0, 1, 2, 3], KINDS) == 0
    hyp = [TS, 0, 1, TS + 25, TS + 25, 2, 3, TS + 50, EOT]
    assert text_of(hyp, KINDS) == [0, 1, 2, 3]
    assert [(s.text_end, s.end_index, s.end_ts) for s in segments(hyp, KINDS)] == [(2, 3, 25), (4, 7, 50)]
    assert [(s.start_ts, s.words) for s in segments(hyp, KINDS)] == [(0, 1), (25, 1)]
    assert [s.words for s in segments([TS, 1, 2, 3, 4, TS + 9, EOT], KINDS)] == [3]  # a first token mid-word: one
    assert shifted(hyp[4:], 25, KINDS) == (TS, 2, 3, TS + 25, EOT)
    assert rendered(hyp + [55], KINDS, detokenize) == "<|0.00|> w0+<|0.50|><|0.50|> w1+<|1.00|><|eot|><|55|>"
    assert rendered([0, 2], KINDS, detokenize) == " w0 w1"  # an open run of text at the end
    assert last_words([1, 2, 3, 4, 6, 7], 2, KINDS) == [4, 6, 7] and last_words([1, 2, 3], 5, KINDS) == [1, 2, 3]
    assert n_words([1, 2, 3, 4, 6, 7], KINDS) == 4 and n_words([], KINDS) == 0  # "1": a first token mid-word


def test_each_result_is_traced_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    """One DEBUG line per result: the policy, the decode, its hypothesis with timestamps, what it committed."""
    policy = StreamPolicy(KINDS, detokenize, StreamOptions(step_s=1.0, silence_s=0.8), energy)
    policy.feed(speech([1, 2, 3, None, None]))
    with caplog.at_level(logging.DEBUG, logger="asr_spec.stream.policy"):
        update, decodes = close_all(policy, hear)
    assert update.final and decodes == 1
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == (f"{policy.label} decode 1 (close) of 0.00-2.50 s, heard 2.50 s: <|0.00|> w1+ w2+ w3+<|1.50|><|eot|>"
                    " | committed ' w1+ w2+ w3+', buffer from 2.50 s, final")


def test_words_said_again_after_a_cut_are_found_and_dropped() -> None:
    said = [0, 1, 2, 4, 5]  # a0 a1 b0 c0 c1: words a, b, c
    assert repeated_words(said, [4, 5, 6, 7], KINDS) == 2  # c said again, then d
    assert repeated_words(said, [2, 4, 5, 6], KINDS) == 3  # b c said again
    assert repeated_words(said, [6, 7, 4, 5], KINDS) == 0  # c later on is not a repeat at the start
    assert repeated_words(said, [4, 7], KINDS) == 0  # c0 c1 against c0 + another token: another word
    assert repeated_words([], [4, 5], KINDS) == 0
    assert without_text([TS, 4, 5, TS + 10, TS + 10, 6, EOT], 2, KINDS) == (TS, TS + 10, TS + 10, 6, EOT)


@pytest.mark.parametrize("settled_s", [None, 1.0])
@pytest.mark.parametrize("block_s", [0.1, 0.25, 1.3])
def test_every_word_committed_once_in_order(block_s: float, settled_s: float | None) -> None:
    words = list(range(20)) + list(range(5))  # 12.5 s of speech without a pause
    options = StreamOptions(step_s=1.0, context_s=0.0, settled_s=settled_s)
    policy, updates, longest = run_stream(speech(words), options, block_s=block_s)
    assert updates[-1].final and policy.done
    assert words_of(updates[-1].text) == [f"w{w}" for w in words]
    texts = [u.text for u in updates]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # committed text only grows
    assert "".join(u.delta for u in updates) == updates[-1].text
    assert sum(bool(u.delta) for u in updates[:-1]) >= 5  # text became stable while the stream went on
    assert longest <= 8 * SR  # trimmed at committed segment ends, no context kept: the buffer stays short


def test_committed_prefix_is_the_previous_hypothesis_up_to_the_last_committed_word() -> None:
    hyp = (TS, 0, 1, TS + 25, TS + 25, 2, 3, 4, TS + 60, EOT)  # w0+ | w1+ w2 (w2 cut)
    assert committed_prefix(hyp, [0, 1, 2, 3], KINDS) == 7  # timestamps within it as the hypothesis has them
    assert committed_prefix(hyp, [0, 1], KINDS) == 3  # ends at the last committed token, before the segment end
    assert committed_prefix(hyp, [], KINDS) == 0
    assert committed_prefix(hyp, [0, 1, 6, 7], KINDS) == 0  # it words the committed text differently
    assert committed_prefix(hyp, [0, 1, 2, 3, 4, 5], KINDS) == 0  # it does not say all of it
    assert committed_prefix(hyp[1:], [0, 1], KINDS) == 0  # no opening timestamp
    assert committed_prefix((TS, TS, 0, 1), [0, 1], KINDS) == 0  # no text after it
    short = TokenKinds(EOT, TS, KINDS.word_start, max_prefix=5)  # cut back to a committed word's end within 5
    assert committed_prefix(hyp, [0, 1, 2, 3], short) == 3
    assert committed_prefix(hyp, [0, 1, 2, 3], TokenKinds(EOT, TS, KINDS.word_start, max_prefix=1)) == 0


@pytest.mark.parametrize("voice", [None, energy])
def test_a_redecode_forces_the_committed_words_and_the_text_is_the_same_without(voice) -> None:
    """Each re-decode's request carries the buffer's committed words as its prefix (the last hypothesis up to them,
    timestamps and all), the scripted decoder then generates only what follows; the committed text is the same as
    when every re-decode generates the whole buffer, and far fewer tokens are generated."""
    words = [w for i in range(30) for w in ((i % 24 + 1, None, None) if voice and i % 7 == 6 else (i % 24 + 1,))]
    texts, generated = {}, {}
    for on in (True, False):
        decodes = []
        policy, updates, longest = run_stream(speech(words), StreamOptions(step_s=1.0, committed_prefix=on), voice,
                                              decodes=decodes)
        texts[on] = updates[-1].text
        generated[on] = sum(len(hear_given(d.audio, d.prefix)) - 1 - len(d.prefix) for d, *_ in decodes)
        for decode, committed, _ in decodes:
            assert text_of(decode.prefix, KINDS) == (committed if on else [])
            assert decode.hypothesis == () or decode.hypothesis[0] != TS or not decode.prefix
        if on:
            assert sum(bool(d.prefix) for d, *_ in decodes) >= len(decodes) // 2
    assert words_of(texts[True]) == [f"w{w}" for w in words if w is not None]
    assert texts[True] == texts[False]
    assert generated[True] < 0.9 * generated[False], generated  # the committed part of each buffer, not again


def test_a_pause_closes_the_utterance_and_silence_is_never_decoded() -> None:
    words = [1, 2, 3, 4, None, None, None, None, 5, 6, 7]
    decoded = []
    policy = StreamPolicy(KINDS, detokenize, StreamOptions(step_s=1.0, silence_s=0.8), energy)
    audio = speech(words)
    updates = []
    for i in range(0, len(audio), 4000):
        policy.feed(audio[i:i + 4000])
        while (d := policy.request()) is not None:
            decoded.append(d)
            updates.append(policy.accept(d, hear(d.audio)))
    assert any(d.kind == "close" for d in decoded)
    closed = next(u for d, u in zip(decoded, updates) if d.kind == "close")
    assert words_of(closed.text) == ["w1", "w2", "w3", "w4"] and closed.tentative == ""
    assert all(np.abs(d.audio).max() > 0 for d in decoded)  # no decode of silence alone
    final = policy.finish()
    while (final is None or not final.final) and (d := policy.request()) is not None:
        final = policy.accept(d, hear(d.audio))
    assert final.final and words_of(final.text) == ["w1", "w2", "w3", "w4", "w5", "w6", "w7"]


def test_options_and_misuse_are_refused() -> None:
    with pytest.raises(InputError, match="step_s"):
        StreamOptions(step_s=0)
    with pytest.raises(InputError, match="max_buffer_s"):
        StreamOptions(max_buffer_s=29.5)
    for context_s in (-1.0, 12.5, float("nan")):
        with pytest.raises(InputError, match="context_s"):
            StreamOptions(context_s=context_s)
    for settled_s in (0.0, -1.0, 24.5, float("nan"), "2"):
        with pytest.raises(InputError, match="settled_s"):
            StreamOptions(settled_s=settled_s)
    policy = StreamPolicy(KINDS, detokenize)
    policy.feed(speech([1, 2, 3]))
    d = policy.request()
    with pytest.raises(InputError, match="not the one in flight"):
        policy.accept(type(d)(99, d.audio, (), "step", 0.0, 0.0), [EOT])
    with pytest.raises(InputError, match="NaN"):
        policy.feed(np.array([np.nan], np.float32))
    assert policy.finish() is None
    with pytest.raises(InputError, match="after finish"):
        policy.feed(speech([1]))


def test_a_late_segment_end_is_cut_at_the_pause_not_in_the_next_word() -> None:
    """Whisper's segment ends can be late: here 0.6 s, inside the next word. With a voice function the buffer is
    cut at the pause before it, and that word is still heard whole; cutting at the timestamp would lose it (each
    cut at the last committed segment's end: no context kept)."""
    late = 30  # timestamp steps: 0.6 s

    def hear_late(audio: np.ndarray) -> list[int]:
        tokens, seen = [], 0
        for t in hear(audio):
            if t > TS:
                seen += 1
                t = t + late if seen % 2 == 0 and t != TS + len(audio) // 320 else t  # every segment end
            tokens.append(t)
        return tokens

    words = [w for i in range(1, 13) for w in ((i, None) if i % 3 == 0 else (i,))]  # pauses after segments
    for voice, complete in ((energy, True), (None, False)):
        policy = StreamPolicy(KINDS, detokenize, StreamOptions(step_s=1.0, silence_s=0.8, context_s=0.0), voice)
        audio = speech(words)
        for i in range(0, len(audio), 4000):
            policy.feed(audio[i:i + 4000])
            while (d := policy.request()) is not None:
                policy.accept(d, hear_late(d.audio))
        final = policy.finish()
        while (final is None or not final.final) and (d := policy.request()) is not None:
            final = policy.accept(d, hear_late(d.audio))
        got = words_of(final.text)
        assert (got == [f"w{i}" for i in range(1, 13)]) == complete, (voice, got)


# -- the commit policy against an adversarial decoder (issue 36) ---------------------------------------------------
TRUE_WORDS = range(1, 17)  # what is said: 16 distinct words, 8 s
NOISE_WORDS = range(17, 25)  # what an adversarial decoder says instead of, or besides, them


def adversary(rng: np.random.Generator, max_edits: int):
    """A decoder that hears the buffer (`hear`) and then, in up to `max_edits` edits anywhere in its text (across
    commit points), rewords a word (a noise word instead), inserts a noise word, drops a word, or stops early;
    returns (decode, the true words each call did not say as heard)."""
    perturbed: set[int] = set()

    def decode(audio: np.ndarray, honest: bool = False, prefix: tuple[int, ...] = ()) -> list[int]:
        tokens = hear_given(audio, prefix)[:-1]  # without <|endoftext|>
        given = 1 + len(prefix) if prefix else 0  # a forced prefix is not edited (the engine forces it)
        for _ in range(0 if honest else int(rng.integers(0, max_edits + 1))):
            starts = [i for i, t in enumerate(tokens) if t < EOT and t % 2 == 0 and i >= given]
            if not starts:
                break
            i = starts[int(rng.integers(len(starts)))]
            end = i + 1 + (i + 1 < len(tokens) and tokens[i + 1] < EOT and tokens[i + 1] % 2 == 1)
            noise = 2 * int(rng.choice(NOISE_WORDS))
            kind = rng.choice(["reword", "insert", "drop", "stop"])
            lost = [t // 2 for t in (tokens[i:end] if kind != "stop" else tokens[i:]) if t < EOT and t % 2 == 0]
            if kind == "reword":
                tokens[i:end] = [noise, noise + 1]
            elif kind == "insert":
                tokens[i:i] = [noise, noise + 1]
                lost = []
            elif kind == "drop":
                del tokens[i:end]
            else:
                tokens = tokens[:i]
            perturbed.update(w for w in lost if w in TRUE_WORDS)
        return tokens + [EOT]

    return decode, perturbed


def misheard_after(word: str, text: list[str]) -> bool:
    """`word` is in `text` and a noise word follows it."""
    i = text.index(word) if word in text else -2
    return 0 <= i < len(text) - 1 and int(text[i + 1][1:]) in NOISE_WORDS


def contiguous(part: list[str], whole: list[str]) -> bool:
    return not part or any(whole[i:i + len(part)] == part for i in range(len(whole) - len(part) + 1))


@pytest.mark.parametrize(("context_s", "settled_s"), [(0.0, None), (1.0, None), (1.0, 1.0)])
@pytest.mark.parametrize("max_edits", [1, 2])
@pytest.mark.parametrize("forced", [False, True])
def test_commits_never_take_back_double_or_lose_a_word_against_an_adversarial_decoder(max_edits: int, forced: bool,
                                                                                       context_s: float,
                                                                                       settled_s: float | None) -> None:
    """A few hundred seeded streams: the committed text only grows; each delta is a run of words of the
    hypothesis that committed it; no word said is committed twice, nor out of order; a word no decode misheard
    is never lost; the words of the last full-buffer hypothesis (the closing decode, heard right) after the
    last one committed before it are all in the final text. forced: the decoder keeps each decode's forced prefix
    (the committed words) and edits only what follows, as the engine does; else it ignores it (any hypothesis).
    context_s: committed audio kept before what is new at each trim (its words in the buffer, forced); settled_s:
    segments that end this much before their decode's audio committed on that one decode."""
    for seed in range(150):
        rng = np.random.default_rng(seed)
        said = [int(w) for w in rng.permutation(TRUE_WORDS)]
        decode, perturbed = adversary(rng, max_edits)
        options = StreamOptions(step_s=float(rng.choice([0.5, 1.0])), max_buffer_s=float(rng.choice([3.0, 5.0])),
                                context_s=context_s, settled_s=settled_s)
        policy = StreamPolicy(KINDS, detokenize, options)
        audio, block = speech(said), int(rng.integers(800, 12_000))
        texts, last_hypothesis, committed_before = [""], [], []
        for i in range(0, len(audio) + block, block):
            if i >= len(audio) and policy.finish() is not None:
                break
            if i < len(audio):
                policy.feed(audio[i:i + block])
            while (d := policy.request()) is not None:
                final = d.kind == "close" and policy.finished
                tokens = decode(d.audio, honest=final, prefix=d.prefix if forced else ())
                if final:
                    last_hypothesis = words_of(detokenize(t for t in tokens if t < EOT))
                    committed_before = words_of(policy._text)
                update = policy.accept(d, tokens)
                assert contiguous(words_of(update.delta), words_of(detokenize(t for t in tokens if t < EOT))), seed
                assert update.text.startswith(texts[-1]), seed  # never taken back
                texts.append(update.text)
            if policy.finished:
                break
        assert policy.done, seed
        got = words_of(texts[-1])
        true_got = [w for w in got if int(w[1:]) in TRUE_WORDS]
        assert len(true_got) == len(set(true_got)), (seed, got)  # no word doubled
        assert true_got == [f"w{w}" for w in said if f"w{w}" in true_got], (seed, got)  # in the order said
        # a word no decode misheard is never lost, but one right after a committed word that decodes then left
        # out, or after a committed misheard word: read as that word said differently (a rewording, a dropped
        # word and an inserted one look alike)
        missing = [w for i, w in enumerate(said) if w not in perturbed and f"w{w}" not in got
                   and not (i and (said[i - 1] in perturbed or misheard_after(f"w{said[i - 1]}", got)))]
        assert not missing, (seed, missing, got)
        # after the last word of it committed before, the last hypothesis's words are all in the text, but one
        # that stands where a misheard word was committed after that word (read as it, said differently); before
        # it, a word two agreeing decodes left out or misheard stays out: committed text is never taken back
        after = max((i + 1 for i, w in enumerate(last_hypothesis) if w in committed_before), default=0)
        anchor = max((committed_before.index(w) + 1 for w in last_hypothesis[:after] if w in committed_before),
                     default=0)
        misheard = [w for w in committed_before[anchor:] if int(w[1:]) in NOISE_WORDS]
        lost = [w for w in last_hypothesis[after:] if w not in got]
        assert len(lost) <= len(misheard), (seed, last_hypothesis, got)


def test_a_repunctuated_commit_point_is_found_where_it_is_not_at_an_earlier_the() -> None:
    """dense_windows streamed (2026-12-02): "… the birds and the stars, the" committed, the next hypothesis said
    "… the birds and the stars. The keeper …". Compared token for token, the cheapest alignment ended at the earlier
    "the" (its last-word bonus) and "stars. The" was committed again ("the stars, the stars"); compared as spoken
    words the commit point is after "The"."""
    from asr_spec.stream.agreement import aligned_end, spoken_word

    vocab = [" birds", " and", " the", " stars", ",", ".", " The", " keeper"]
    kinds = TokenKinds(len(vocab), len(vocab) + 10, np.array([t.startswith(" ") for t in vocab] + [False]))
    said = [0, 1, 2, 3, 4, 2]  # birds and the stars, the
    hypothesis = [0, 1, 2, 3, 5, 6, 7]  # birds and the stars. The keeper
    as_spoken = spoken_word(lambda tokens: "".join(vocab[t] for t in tokens))
    assert aligned_end(said, hypothesis, kinds) == 3  # token for token: after "birds and the" (the defect)
    assert aligned_end(said, hypothesis, kinds, as_spoken) == 6  # as spoken: after "The", before "keeper"
    # a hypothesis that really rewords keeps its reading: "birds and a star" for "birds and the stars, the"
    assert aligned_end(said, [0, 1, 2, 7], kinds, as_spoken) == 3


def test_two_hypotheses_that_punctuate_the_same_words_apart_agree_on_them() -> None:
    """dense_windows streamed (2026-12-06, eight streams): "... for us, we left a saucer" then "... for us. We left a
    saucer": compared token for token nothing from "us" on was agreed, twice in a row, and 24 words waited two more
    rounds. Compared as spoken words they agree, and the newer hypothesis's wording is committed; a word the buffer's
    end cut short ("sau" for "saucer") still agrees with nothing, and new's last word waits for a word after it."""
    from asr_spec.stream.agreement import spoken_word

    vocab = [" for", " us", ",", ".", " we", " We", " left", " a", " sau", " saucer"]
    kinds = TokenKinds(len(vocab), len(vocab) + 10, np.array([t.startswith(" ") for t in vocab] + [False]))
    as_spoken = spoken_word(lambda tokens: "".join(vocab[t] for t in tokens))
    previous = [0, 1, 2, 4, 6, 7, 8]  # for us, we left a sau
    new = [0, 1, 3, 5, 6, 7, 9, 0]  # for us. We left a saucer for
    assert agreed_words(previous, new, kinds) == 1  # token for token: "for" ("us," and "us." differ)
    assert agreed_words(previous, new, kinds, as_spoken) == 6  # "for us. We left a": "sau" was cut short
    assert agreed_words([0, 1, 2, 4, 6, 7, 9], new, kinds, as_spoken) == 7  # "saucer" said whole in both
    assert agreed_words([0, 1, 3, 5], [0, 1, 2, 4], kinds, as_spoken) == 3  # "we" is new's last word: it waits
    # previous's last word longer than new's ("us." at its buffer's end, "us we" now): the same word, agreed
    assert agreed_words([0, 1, 3], [0, 1, 4], kinds, as_spoken) == 2


def test_decoders_that_punctuate_every_other_decode_apart_still_commit_each_word_on_two_decodes() -> None:
    """A decoder whose every other decode writes each word's second token as another one of the same text (the
    scripted vocabulary's "+": a comma for a full stop): each word is committed once, in order, as when every
    decode says it alike; compared token for token no two decodes agreed on a word until the buffer was full."""

    def repunctuated(token: int) -> int:  # w's "+" written as (w + 1)'s: the same text, another token
        return (token + 2) % EOT if token < EOT and token % 2 else token

    options = StreamOptions(step_s=1.0, max_buffer_s=12.0, context_s=0.0)
    audio = speech(list(range(16)))  # 8 s: the buffer never fills
    texts = []
    for punctuate_apart in (False, True):
        policy, n = StreamPolicy(KINDS, detokenize, options), 0
        for i in range(0, len(audio), SR):
            policy.feed(audio[i:i + SR])
            while (d := policy.request()) is not None:
                n += 1
                tokens = hear_given(d.audio, d.prefix)
                if punctuate_apart and n % 2:  # the forced prefix as given, what follows "punctuated" apart
                    tokens = tokens[:1 + len(d.prefix)] + [repunctuated(t) for t in tokens[1 + len(d.prefix):]]
                policy.accept(d, tokens)
        texts.append(words_of(policy._text))
    assert texts[0] == [f"w{w}" for w in range(len(texts[0]))] and len(texts[0]) >= 12
    assert texts[1] == texts[0]


@pytest.mark.parametrize("flip_at", [0, 1])
def test_a_word_that_flips_between_decodes_blocks_no_later_word(flip_at: int) -> None:
    """Every other decode says the first (flip_at 0) or second (1) word after the committed ones as another word
    (w24: "could not" / "cannot" / "could not"): two successive decodes never agree there, but every second one
    does with the one before the last (two of the last three; with flip_at 1 the last one committed the word
    before the flip, so the one before it is read after the committed words too), so the words go on being
    committed, each once, in order, in the wording of the two decodes that agree (the word itself or w24; with
    flip_at 1, the word itself: a flip falls on the word after the one flipped before), and none by force: the
    buffer never fills."""
    options = StreamOptions(step_s=1.0, max_buffer_s=6.0, context_s=0.0)
    audio = speech(list(range(20)))  # 10 s: without the two of three, a full buffer's forced trim
    texts = []
    for flips in (False, True):
        policy, n, kinds = StreamPolicy(KINDS, detokenize, options), 0, []
        for i in range(0, len(audio), SR):
            policy.feed(audio[i:i + SR])
            while (d := policy.request()) is not None:
                n += 1
                tokens = hear_given(d.audio, d.prefix)
                generated = [i for i in range(1 + len(d.prefix), len(tokens)) if tokens[i] < EOT]
                starts = [i for i in generated if tokens[i] % 2 == 0]  # the generated words' first tokens
                if flips and n % 2 and len(starts) > flip_at:
                    tokens[starts[flip_at]] = 48  # w24's first token, the word's own second token after it
                kinds.append(d.kind)
                policy.accept(d, tokens)
        assert "overflow" not in kinds
        texts.append(words_of(policy._text))
    plain, flipped = texts
    assert plain == [f"w{w}" for w in range(len(plain))] and len(plain) >= 14
    assert len(flipped) >= 14 and all(f in (p, "w24") for p, f in zip(plain, flipped)), flipped
    # flip_at 0: the flipped wording committed where two of three said it; 1: each flip falls on another word
    assert ("w24" in flipped) == (flip_at == 0)


def test_a_withdrawn_decode_is_asked_for_again_over_the_audio_fed_since() -> None:
    """`withdraw`: a decode that waited for the engine is given back and asked for again after the audio that
    arrived meanwhile is fed: the new one covers it (same kind and forced prefix), the withdrawn one is no longer
    the one in flight, and one withdrawn with nothing fed since is asked for again as it was."""
    policy = StreamPolicy(KINDS, detokenize, StreamOptions(step_s=1.0))
    audio = speech(list(range(12)))
    policy.feed(audio[:2 * SR])
    first = policy.request()
    policy.accept(first, hear_given(first.audio, first.prefix))
    policy.feed(audio[2 * SR:3 * SR])
    waiting = policy.request()
    policy.withdraw(waiting)
    again = policy.request()  # nothing fed since: the same decode, asked again
    assert len(again.audio) == len(waiting.audio) and again.prefix == waiting.prefix
    policy.feed(audio[3 * SR:4 * SR])  # arrived while it waited
    policy.withdraw(again)
    with pytest.raises(InputError, match="not the one in flight"):
        policy.withdraw(again)
    renewed = policy.request()
    assert len(renewed.audio) == 4 * SR and renewed.kind == waiting.kind and renewed.prefix == waiting.prefix
    with pytest.raises(InputError, match="not the one in flight"):
        policy.accept(waiting, hear_given(waiting.audio, waiting.prefix))
    update = policy.accept(renewed, hear_given(renewed.audio, renewed.prefix))
    assert words_of(update.text) == ["w0", "w1", "w2", "w3"]  # the first decode heard these 4
    assert policy.request() is None  # the next step is due a step after the renewed one's audio


def test_a_cut_at_the_pause_before_a_committed_segments_last_word_does_not_commit_it_twice() -> None:
    """Whisper can end a segment inside speech (an early end, or a comma with no pause): the buffer is then cut at
    the pause nearest that end, which may lie before the segment's last word. That word, committed, stays in the
    buffer and the next free decode hears it again ("... did not last. Fire, | Fire, rot and high water"): it must
    not be committed twice. Here the segment "w1 w2 w3" ends at 1.8 s, inside w3 (1.5-2.0 s), after a pause
    (1.0-1.5 s); the second decode agrees on it alone, the buffer is cut in the pause, and the decoder hears w3 again
    at the new buffer's start."""
    audio = speech([1, 2, None, 3, 4, 5, 6, None, None])
    w = [[2 * i, 2 * i + 1] for i in range(8)]
    first = [TS, *w[1], *w[2], *w[3], TS + 90, TS + 90, *w[4], *w[5], TS + 150, EOT]
    second = [TS, *w[1], *w[2], *w[3], TS + 90, TS + 90, *w[7], *w[5], *w[6], TS + 175, EOT]  # agrees up to w3
    scripted = [first, second]
    decodes = []
    policy = StreamPolicy(KINDS, detokenize, StreamOptions(step_s=0.5, silence_s=0.8, context_s=0.0), energy)
    for start in (0, 24000, 32000, 40000):  # 1.5 s, then 0.5 s at a time
        policy.feed(audio[start:start + (24000 if start == 0 else 8000)])
        while (d := policy.request()) is not None:
            decodes.append(d)
            policy.accept(d, scripted.pop(0) if scripted else hear_given(d.audio, d.prefix))
    assert decodes[2].start_s < 1.5 and not decodes[2].prefix  # cut before w3, nothing forced: w3 heard again
    policy.feed(audio[48000:])
    final = policy.finish()
    while (final is None or not final.final) and (d := policy.request()) is not None:
        final = policy.accept(d, hear_given(d.audio, d.prefix))
    assert words_of(final.text) == ["w1", "w2", "w3", "w4", "w5", "w6"]


# -- committed audio kept as left context (issue 37) ---------------------------------------------------------------
def word_ends_s(words: list[int | None]) -> list[float]:
    """Stream time at which each spoken word of `speech(words)` ends."""
    return [(i + 1) * WORD_SAMPLES / SR for i, w in enumerate(words) if w is not None]


@pytest.mark.parametrize("voice", [None, energy])
def test_a_trim_keeps_context_s_of_committed_audio_before_what_is_new(voice) -> None:
    """With context_s, every decode after the first trim starts at least context_s of committed speech before
    the new words (whole committed segments: 1.5 s each here), those words forced as its prefix; with 0 the buffer
    starts at the last committed segment's end, and some decodes hear less than that before the new words. (With a
    voice function a 0.5 s pause after each segment, where its buffer is cut: at most PAUSE_SEARCH_S from its end.)"""
    said = list(range(1, 25)) * 2  # 24 s of words
    words = [w for i, x in enumerate(said) for w in ((x, None) if voice and i % 3 == 2 else (x,))]
    least = {}
    for context_s in (0.0, 2.0):
        decodes = []
        policy, updates, longest = run_stream(speech(words), StreamOptions(step_s=1.0, context_s=context_s), voice,
                                              decodes=decodes)
        assert words_of(updates[-1].text) == [f"w{w}" for w in said]
        trimmed = [(d, c, n) for d, c, n in decodes if d.start_s > 0 and d.kind != "close"]
        assert len({d.start_s for d, *_ in trimmed}) >= 5  # many trims
        for decode, committed, _ in trimmed:
            assert text_of(decode.prefix, KINDS) == committed
        ends = word_ends_s(words)  # committed audio: from the buffer's start to the last committed word's end
        least[context_s] = min(ends[n - 1] - d.start_s for d, _, n in trimmed)
    slack = PAUSE_SEARCH_S if voice else 0.0  # the cut is at a pause near the segment's end
    assert least[2.0] >= 2.0 - slack and 1.5 > least[0.0], least


@pytest.mark.parametrize("context_s", [0.0, 1.0, 2.5, 5.0])
@pytest.mark.parametrize("voice", [None, energy])
def test_with_context_every_word_is_committed_once_across_many_trims(context_s: float, voice) -> None:
    """Long speech with pauses now and then: the same words, once each, in order, whatever context_s; the buffer
    stays within max_buffer_s and a step (the forced trim still bounds it)."""
    words = [w for i in range(80) for w in ((i % 24 + 1, None, None) if voice and i % 11 == 10 else (i % 24 + 1,))]
    options = StreamOptions(step_s=1.0, max_buffer_s=10.0, context_s=context_s)
    decodes = []
    policy, updates, longest = run_stream(speech(words), options, voice, decodes=decodes)
    assert words_of(updates[-1].text) == [f"w{w}" for w in words if w is not None]
    texts = [u.text for u in updates]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert len({d.start_s for d, *_ in decodes}) >= 8
    assert longest <= (options.max_buffer_s + options.step_s) * SR
    if voice is not None:  # the speech frames kept are the buffer's (a stream of hours holds no more)
        assert len(policy._frames.speech) * 512 <= policy._received - policy._start + 512


@pytest.mark.parametrize("context_s", [0.0, 3.0])
def test_a_decoder_that_never_agrees_still_commits_and_the_window_holds(context_s: float) -> None:
    """Every decode words its first generated word differently from the last three: only the overflow (forced)
    trim commits; the buffer never exceeds max_buffer_s + one step, and never one window, without context and with
    half the bound as context."""
    options = StreamOptions(step_s=1.0, max_buffer_s=6.0, context_s=context_s)
    policy = StreamPolicy(KINDS, detokenize, options)
    audio = speech(list(range(24)) * 2)
    longest, n = 0, 0
    for i in range(0, len(audio), SR):
        policy.feed(audio[i:i + SR])
        while (d := policy.request()) is not None:
            n += 1
            tokens = hear_given(d.audio, d.prefix)
            if n % 4:  # a different first generated word each time: no two of the last three decodes agree
                i_first = 1 + len(d.prefix)
                tokens = [t if j != i_first or t >= EOT else (t + 2 * (n % 4)) % EOT for j, t in enumerate(tokens)]
            longest = max(longest, len(d.audio))
            policy.accept(d, tokens)
    assert longest <= (options.max_buffer_s + options.step_s) * SR < WINDOW_S * SR
    assert len(words_of(policy._text)) > 20


def test_a_full_buffers_loop_past_its_audio_is_not_committed() -> None:
    """Seen live: a full buffer's decode wrote its last sentence five times, timed past its audio, and the forced
    trim committed four of them. Here every decode words its first generated word apart (no agreement: only the
    forced trims commit) and every overflow decode's hypothesis goes on with w23 (a word the audio never says) in
    segments of 1 s from 0.5 s past its audio: w23 is never committed, nor more words than the audio says."""
    options = StreamOptions(step_s=1.0, max_buffer_s=6.0, context_s=0.0)
    policy, n, forced = StreamPolicy(KINDS, detokenize, options), 0, 0
    audio = speech(list(range(20)) * 2)
    for i in range(0, len(audio), SR):
        policy.feed(audio[i:i + SR])
        while (d := policy.request()) is not None:
            n += 1
            tokens = hear_given(d.audio, d.prefix)
            if n % 4:  # as in the test above: no two of the last three decodes agree
                i_first = 1 + len(d.prefix)
                tokens = [t if j != i_first or t >= EOT else (t + 2 * (n % 4)) % EOT for j, t in enumerate(tokens)]
            if d.kind == "overflow":
                forced += 1
                end = len(d.audio) // 320 + 25
                loop = [t for k in range(4) for t in (TS + end + 50 * k, 46, 47, TS + end + 50 * k + 50)]
                tokens = [*tokens[:-1], *loop, EOT]
            policy.accept(d, tokens)
    committed = words_of(policy._text)  # a forced commit takes the words as its decode worded them
    assert forced >= 3 and 20 < len(committed) <= 40 and "w23" not in committed


@pytest.mark.parametrize("context_s", [0.0, 1.0, 3.0])
@pytest.mark.parametrize(("pause_before", "early"), [(2, 15), (0, 60)])
def test_with_context_a_cut_back_over_speech_commits_no_word_twice(context_s: float, pause_before: int,
                                                                    early: int) -> None:
    """Every segment ends early (`early` timestamp steps) inside its words that follow a pause (before its word
    `pause_before` of 3): 0.3 s, inside its last word; or 1.2 s, inside the first of its three (a timestamp early by
    a few tenths and a pause searched 0.4 s before it: seen live, "When he grew" said twice). Each cut goes back
    over speech to that pause and leaves the segment's last one or three committed words in the buffer. With or
    without committed context after it (forced as the prefix), every word is committed once, in order."""

    def hear_early(audio: np.ndarray) -> list[int]:
        tokens = hear(audio)
        ends = {s.end_index for s in segments(tokens, KINDS) if s.end_index != len(tokens) - 2}
        return [t - early if i in ends else t for i, t in enumerate(tokens)]

    said = list(range(1, 25)) * 2
    words = [w for i, x in enumerate(said) for w in ((None, x) if i % 3 == pause_before else (x,))]
    policy = StreamPolicy(KINDS, detokenize, StreamOptions(step_s=1.0, context_s=context_s), energy)
    audio, cuts = speech(words), set()
    for i in range(0, len(audio), 4000):
        policy.feed(audio[i:i + 4000])
        while (d := policy.request()) is not None:
            cuts.add(d.start_s)
            policy.accept(d, hear_given(d.audio, d.prefix, hear_early))
    final = policy.finish()
    while (final is None or not final.final) and (d := policy.request()) is not None:
        final = policy.accept(d, hear_given(d.audio, d.prefix, hear_early))
    assert words_of(final.text) == [f"w{w}" for w in said]
    assert len(cuts) >= 4  # the buffer was cut again and again


def stopping_short(open_tail: bool):
    """A decoder that, in a buffer holding speech after its first segment (a pause: a stream behind holds several
    utterances), hears only that segment, then gives up (<|endoftext|>) or, with `open_tail`, opens the next
    segment with the next word's first token and gives up there (Whisper's open last segment); a buffer of one
    segment is heard whole (`hear`)."""

    def decoder(buffer: np.ndarray) -> list[int]:
        heard = hear(buffer)
        closed = segments(heard, KINDS)
        if len(closed) < 2:
            return heard
        rest = heard[closed[0].end_index + 1:]
        tail = [rest[0], next(t for t in rest if t < EOT)] if open_tail else []
        return heard[:closed[0].end_index + 1] + tail + [EOT]

    decoder.__name__ = f"stopping_short(open_tail={open_tail})"
    return decoder


def close_all(policy: StreamPolicy, decoder) -> tuple[object, int]:
    """finish() and the close decodes that follow, by `decoder`: (the final Update, decodes run)."""
    update, decodes = policy.finish(), 0
    while (update is None or not update.final) and (d := policy.request()) is not None:
        decodes += 1
        update = policy.accept(d, decoder(d.audio))
    return update, decodes


@pytest.mark.parametrize("open_tail", [False, True])
def test_a_close_decode_that_stops_short_is_decoded_again_from_where_it_stopped_until_all_is_heard(
        open_tail: bool) -> None:
    """A stream behind holds three utterances when its close decode comes, and the decoder stops after the first
    each time (after the pause, or with its last segment left open): the buffer restarts at the end of what it
    heard, again and again, so every word is committed once, in order (the live server lost "Fine, but you will
    carry the lamp." so, and later a stream's last three sentences, where a restart was granted only once)."""
    audio = speech([1, 2, 3, None, None, None, 4, 5, 6, None, None, None, 7, 8, 9, None, None, None])
    policy = StreamPolicy(KINDS, detokenize, StreamOptions(step_s=1.0, silence_s=0.8), energy)
    policy.feed(audio)  # all at once: the stream fell behind
    update, decodes = close_all(policy, stopping_short(open_tail))
    assert update.final and words_of(update.text) == [f"w{w}" for w in range(1, 10)], update.text
    assert decodes == 3


def test_a_close_decode_that_hears_nothing_more_ends_the_restarts() -> None:
    """Restarts end: a decoder deaf to the later utterances hears nothing past its restart point, so their audio
    is dropped (not decoded again and again), and a hypothesis with no closed segment is committed whole."""
    audio = speech([1, 2, 3, None, None, None, 4, 5, 6, None, None, None, 7, 8, 9, None, None, None])

    def deaf_to_the_later(buffer: np.ndarray) -> list[int]:
        return [t for t in stopping_short(False)(buffer) if not (t < EOT and t // 2 >= 4)]

    def never_closes(buffer: np.ndarray) -> list[int]:  # one open segment holding the first word only
        return [TS, 2, EOT] if np.any(buffer) else [EOT]

    for decoder, expected, most in ((deaf_to_the_later, ["w1", "w2", "w3"], 3), (never_closes, ["w1"], 1)):
        policy = StreamPolicy(KINDS, detokenize, StreamOptions(step_s=1.0, silence_s=0.8), energy)
        policy.feed(audio)
        update, decodes = close_all(policy, decoder)
        assert update.final and words_of(update.text) == expected, (decoder, update.text)
        assert decodes <= most


def drifting_once(at_decode: int, shift_s: float):
    """`hear_given`, but decode number `at_decode` times its first closed segment's end `shift_s` late, and every
    timestamp after it as late (Whisper's timestamps drifting: one sentence timed over the next ones' speech); and
    so does every later decode given a prefix (it reads on from the drifted timestamps forced), until one is given
    none (it times the buffer afresh)."""
    count, drifting = 0, False

    def decoder(audio: np.ndarray, prefix: tuple[int, ...]) -> list[int]:
        nonlocal count, drifting
        count += 1
        tokens = hear_given(audio, prefix)
        closed = segments(tokens, KINDS)
        drifting = count == at_decode or (drifting and bool(prefix))
        if not drifting or not closed:
            return tokens
        first = closed[0].end_index if count == at_decode else 1 + len(prefix)  # a forced prefix drifted already
        shift = int(shift_s * SR) // 320
        return [t + shift if t >= TS and i >= first else t for i, t in enumerate(tokens)]

    return decoder


@pytest.mark.parametrize("at_decode", [3, 5, 8])
def test_a_hypothesis_whose_timestamps_drifted_cuts_no_speech_unheard(at_decode: int) -> None:
    """One decode times a segment 8 s late, over the next sentences' speech, and every later segment as late (seen
    live). Its timestamps are not trusted: no trim at them, none forced as the next decode's prefix, so no speech
    is cut before it is heard and every word is committed once, in order."""
    said = list(range(1, 25))
    audio = speech([w for i, x in enumerate(said) for w in ((x, None) if i % 3 == 2 else (x,))])  # 3 words, a pause
    policy = StreamPolicy(KINDS, detokenize, StreamOptions(step_s=1.0, silence_s=0.8), energy)
    decoder = drifting_once(at_decode, 8.0)
    for i in range(0, len(audio), SR):
        policy.feed(audio[i:i + SR])
        while (d := policy.request()) is not None:
            policy.accept(d, decoder(d.audio, d.prefix))
    update, _ = close_all(policy, lambda buffer: hear(buffer))
    assert update.final and words_of(update.text) == [f"w{w}" for w in said], update.text


def test_a_close_decode_whose_timestamps_drifted_over_later_speech_is_decoded_again_from_before_them() -> None:
    """A close decode's second segment runs on over three later utterances it does not transcribe (its end timed
    where the last one ends): its timing drifted, so the decode stops short before it, and that speech is decoded
    again instead of being taken as heard."""
    audio = speech([w for u in range(5) for w in (3 * u + 1, 3 * u + 2, 3 * u + 3, None, None, None)])
    count = 0

    def drifts_once(buffer: np.ndarray) -> list[int]:
        nonlocal count
        count += 1
        heard = hear(buffer)
        closed = segments(heard, KINDS)
        if count > 1 or len(closed) < 3:
            return heard
        return heard[:closed[1].end_index] + [heard[closed[-1].end_index], EOT]

    policy = StreamPolicy(KINDS, detokenize, StreamOptions(step_s=1.0, silence_s=0.8), energy)
    policy.feed(audio)  # all at once: the stream fell behind
    update, decodes = close_all(policy, drifts_once)
    assert update.final and words_of(update.text) == [f"w{w}" for w in range(1, 16)], update.text
    assert decodes == 2


def test_a_forced_close_decode_whose_one_segment_drifted_over_unsaid_speech_is_decoded_again_unforced() -> None:
    """A stream 6 s behind at its end (12 s of words, the last 6 s fed at once): its close decode forces the 10
    committed words and says one more, then closes its only segment at the audio's end, 12 s of speech for 11 words
    (`hearing.drifted` at its first segment). Nothing of it is timed, so where it stopped is not known: taken as
    heard, it ended the stream 13 words short (one run of eight real-time streams lost a stream's last 12 s so,
    after "... from the old barn."). It commits nothing and is decoded again without the prefix: every word, once."""
    audio = speech(list(range(24)))
    policy = StreamPolicy(KINDS, detokenize, StreamOptions(step_s=1.0), energy)
    for i in range(0, 6 * SR, SR):
        policy.feed(audio[i:i + SR])
        while (d := policy.request()) is not None:
            policy.accept(d, hear_given(d.audio, d.prefix))
    assert words_of(policy._text) == [f"w{w}" for w in range(10)]
    policy.feed(audio[6 * SR:])
    assert policy.finish() is None
    prefixes = []
    while (d := policy.request()) is not None:
        tokens = hear_given(d.audio, d.prefix)
        prefixes.append(d.prefix)
        if len(prefixes) == 1:  # the forced words and one more, its one segment closed at the audio's end
            said = [t for t in d.prefix if t < EOT]
            tokens = [TS, *said, *[t for t in tokens if t < EOT][len(said):len(said) + 2], TS + len(d.audio) // 320,
                      EOT]
        update = policy.accept(d, tokens)
    assert update.final and words_of(update.text) == [f"w{w}" for w in range(24)]
    assert prefixes[0] and not prefixes[1]  # decoded again unforced


def test_an_unforced_close_decode_that_says_a_few_words_over_all_its_speech_is_decoded_again_shorter() -> None:
    """A decoder that, given 12 words or more, says the first three and closes that one segment at the audio's end
    (Whisper on a live buffer after a trim mid-sentence: "from the old barn." over 12 s of speech, unforced, as the
    stream's last decode: taken as heard, the stream ended 12 s short). Nothing of it is timed, so it commits
    nothing and the buffer is decoded again to a pause after what its words could say, unforced and heard from the
    buffer's start, then the rest after it: every word, once, and each shorter decode ends at a pause."""
    said = list(range(1, 16))
    audio = speech([w for i, x in enumerate(said) for w in ((x, None) if i % 3 == 2 else (x,))])  # 3 words, a pause

    def says_little(buffer: np.ndarray) -> list[int]:
        heard = hear(buffer)
        text = [t for t in heard if t < EOT]
        if len(text) < 24:  # under 12 words: heard as they are
            return heard
        return [TS, *text[:6], TS + len(buffer) // 320, EOT]

    policy = StreamPolicy(KINDS, detokenize, StreamOptions(step_s=1.0, silence_s=0.8), energy)
    policy.feed(audio)  # all at once: a stream behind at its end
    update, asked = policy.finish(), []
    while (update is None or not update.final) and (d := policy.request()) is not None:
        asked.append(d)
        update = policy.accept(d, says_little(d.audio))
    assert update.final and words_of(update.text) == [f"w{w}" for w in said], update.text
    assert [d.kind for d in asked] == ["close"] * 5 and not any(d.prefix for d in asked)
    shorter = [d for d, before in zip(asked[1:], asked) if d.start_s == before.start_s]
    assert len(shorter) == 2 and all(not d.audio[-320:].any() for d in shorter)  # each ends in a pause


@pytest.mark.parametrize("committed_prefix", [False, True])
def test_committed_words_a_shorter_close_did_not_say_are_not_committed_again_after_it(committed_prefix: bool) -> None:
    """Steps commit w1-w14 of one utterance; its close decode says only "w4 w5 w6" (the buffer's first words since
    its last trim) in one segment over all its speech: the buffer is closed again shorter, to the pause after w6,
    and restarts there with w7-w14, committed already, still in it. Said again by the next close, they are dropped
    (the review of the shorter close found them committed twice: w1-w14 w7-w14 w15)."""
    said = list(range(1, 16))
    audio = speech([w for i, x in enumerate(said) for w in ((x, None) if i % 3 == 2 else (x,))] + [None] * 4)
    drifted = False

    def decoder(d) -> list[int]:
        nonlocal drifted
        heard = hear_given(d.audio, d.prefix)
        if d.kind != "close" or drifted:
            return heard
        drifted = True
        return [TS, *[t for t in hear(d.audio) if t < EOT][:6], TS + len(d.audio) // 320, EOT]

    options = StreamOptions(step_s=1.0, silence_s=0.8, committed_prefix=committed_prefix)
    policy, updates, _ = run_stream(audio, options, energy, decoder=decoder)
    assert drifted and words_of(updates[-1].text) == [f"w{w}" for w in said], updates[-1].text


def test_a_close_decode_that_loops_commits_the_looped_segment_once() -> None:
    """A close decode says its one utterance, then the same segment six times more over the silence after it (a
    loop, as Whisper wrote a stream's cut last line eight times): committed once. A segment said again in text that
    does not loop (a compression ratio within Whisper's threshold) is kept."""
    policy = StreamPolicy(KINDS, detokenize, StreamOptions(step_s=1.0, silence_s=0.8), energy)
    policy.feed(speech([1, 2, 3, None, None, None, None, None, None, None, None, None]))

    def loops(buffer: np.ndarray) -> list[int]:
        heard = hear(buffer)[:-1]  # <|0.00|> w1 w2 w3 <|1.50|>
        return heard + [t for k in range(1, 7) for t in (TS + 75 * k, 2, 3, 4, 5, 6, 7, TS + 75 * k + 60)] + [EOT]

    update, decodes = close_all(policy, loops)
    assert update.final and words_of(update.text) == ["w1", "w2", "w3"] and decodes == 1, update.text

    once_again = [TS, 2, 3, 4, 5, 6, 7, TS + 75, TS + 75, *range(8, 26), TS + 300, TS + 300, 2, 3, 4, 5, 6, 7,
                  TS + 375, EOT]
    assert compression_ratio(detokenize(text_of(once_again, KINDS))) <= LOOP_COMPRESSION_RATIO
    assert first_repeat(once_again, segments(once_again, KINDS), KINDS) == 2
    policy = StreamPolicy(KINDS, detokenize, StreamOptions(step_s=1.0, silence_s=0.8), energy)
    policy.feed(speech([1, 2, 3, None, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 3, None, None, None]))
    update, _ = close_all(policy, lambda buffer: once_again)
    assert words_of(update.text) == [f"w{w}" for w in (1, 2, 3, *range(4, 13), 1, 2, 3)], update.text


def test_a_buffer_whose_every_hypothesis_drifted_is_still_bounded_and_loses_no_word() -> None:
    """A decoder whose timing drifts in every decode (prefix or not): nothing is trimmed at its timestamps, so the
    buffer grows until it is as long as it may get; then its text is committed whole and the buffer starts afresh
    (its timestamps would have cut speech unheard): every word once, in order, and no decode over one window."""
    said = list(range(1, 25)) * 2
    audio = speech([w for i, x in enumerate(said) for w in ((x, None) if i % 3 == 2 else (x,))])
    policy = StreamPolicy(KINDS, detokenize, StreamOptions(step_s=1.0, silence_s=0.8), energy)
    shift = int(8.0 * SR) // 320

    def always_drifts(buffer: np.ndarray, prefix: tuple[int, ...]) -> list[int]:
        tokens = hear_given(buffer, prefix)
        closed = segments(tokens, KINDS)
        first = closed[0].end_index if closed and not prefix else 1 + len(prefix)
        return [t + shift if t >= TS and i >= first else t for i, t in enumerate(tokens)]

    longest = 0
    for i in range(0, len(audio), SR):
        policy.feed(audio[i:i + SR])
        while (d := policy.request()) is not None:
            longest = max(longest, len(d.audio))
            policy.accept(d, always_drifts(d.audio, d.prefix))
    update, _ = close_all(policy, hear)
    assert update.final and words_of(update.text) == [f"w{w}" for w in said], update.text
    assert longest <= WINDOW_S * SR



def test_a_segment_heard_with_settled_s_after_it_is_committed_on_one_decode() -> None:
    """With `settled_s`, a closed segment that ends that much before its decode's audio is committed by that decode
    alone (without: only once a second decode agrees); the segment at the buffer's edge still waits for agreement."""
    audio = speech([1, 2, 3, None, 4, 5, 6, None, 7, 8])  # segments end at 1.5 and 3.5 s; 5.0 s of audio
    for settled_s, expected in ((None, []), (1.0, ["w1", "w2", "w3", "w4", "w5", "w6"]), (2.0, ["w1", "w2", "w3"])):
        policy = StreamPolicy(KINDS, detokenize, StreamOptions(step_s=1.0, silence_s=0.8, settled_s=settled_s),
                              energy)
        policy.feed(audio)
        decode = policy.request()
        assert decode.kind == "step"
        update = policy.accept(decode, hear_given(decode.audio, decode.prefix))
        assert words_of(update.delta) == expected, settled_s


def test_a_last_segment_guessed_past_a_cut_off_stream_is_not_committed() -> None:
    """The stream ends 0.15 s into a word; its close decode hears that word's start and writes a guessed rest of
    the sentence, timed 1.5 s past the audio (the slices' cut last line, "Because you are the one who can't carry
    the lamp." for "Because"): that segment is left out. A last segment of words that are there, timed a little
    past the audio, is committed."""
    cut_off = np.concatenate([speech([1, 2, 3, None, None]), speech([4])[:2400]])  # 2.5 s, then 0.15 s of w4
    n_ts = len(cut_off) // 320

    def guesses(buffer: np.ndarray) -> list[int]:
        heard = hear(buffer)[:-1]  # <|0.00|> w1 w2 w3 <|1.50|> <|2.50|> w4's first token <|2.65|>
        return heard[:-1] + [9, 30, 31, 32, 33, 34, 35, TS + n_ts + 75, EOT]  # "... w4+ w15+ w16+ w17+" to +1.5 s

    def there(buffer: np.ndarray) -> list[int]:
        heard = hear(buffer)[:-1]
        return heard[:-1] + [TS + n_ts + 10, EOT]  # w4's first token, timed 0.2 s past the audio

    for decoder, expected in ((guesses, ["w1", "w2", "w3"]), (there, ["w1", "w2", "w3", "w4"])):
        policy = StreamPolicy(KINDS, detokenize, StreamOptions(step_s=1.0, silence_s=5.0), energy)
        policy.feed(cut_off)
        update, decodes = close_all(policy, decoder)
        assert update.final and words_of(update.text) == expected and decodes == 1, (decoder, update.text)


@pytest.mark.parametrize("more", [(), (18, 19, None, None)])
@pytest.mark.parametrize("forced", [True, False])
def test_a_cut_back_over_five_words_at_a_pause_inside_the_segment_commits_none_twice(forced: bool, more) -> None:
    """Whisper-base times segment ends to the second: a segment of nine words with a pause after its fourth ends
    2.2 s early, and the trim after it goes back to that pause, leaving its last five committed words in the buffer
    (seen live: "... and worked with his hands. and worked with his hands."). They are said again and dropped, by
    every hypothesis until the next cut: with the committed prefix forced (the one that dropped them forces
    nothing next) and without."""
    said = [1, 2, 3, 4, None, 5, 6, 7, 8, 9, None, None, 10, 11, 12, 13, None, None, 14, 15, 16, 17, None, None,
            *more]  # with a sentence more, a close decode stops short inside a live seam (kept across the restart)
    audio = speech(said)

    def sentences_early(buffer: np.ndarray) -> list[int]:
        """A segment a sentence (closed at a pause of 1 s), its end timed 2.2 s early; the buffer's last one open."""
        tokens, spoken, silent, opened = [], [], 0, False
        for k in range(len(buffer) // WORD_SAMPLES):
            word = int(round(buffer[k * WORD_SAMPLES] * 100)) - 1
            if word < 0:
                silent += 1
                if silent == 2 and opened:
                    tokens.append(TS + max(spoken[-1] * 25 - 110, 0))  # 2.2 s before the last word's end
                    opened = False
                continue
            if not opened:
                tokens.append(TS + k * 25)
                opened = True
            tokens += [2 * word, 2 * word + 1]
            spoken, silent = [*spoken, k + 1], 0
        return [*tokens, *([TS + len(buffer) // 320] if opened else []), EOT]

    options = StreamOptions(step_s=1.0, silence_s=5.0, context_s=0.0, committed_prefix=forced)
    policy = StreamPolicy(KINDS, detokenize, options, energy)
    for i in range(0, len(audio), SR):
        policy.feed(audio[i:i + SR])
        while (d := policy.request()) is not None:
            policy.accept(d, hear_given(d.audio, d.prefix, sentences_early))
    update, _ = close_all(policy, sentences_early)
    assert words_of(update.text) == [f"w{w}" for w in said if w is not None], update.text


def test_a_late_last_segment_at_a_close_at_silence_is_kept() -> None:
    """The guess rule is for a stream's last audio only: a close at silence ends in a pause, and a last segment
    timed 0.9 s late there, past its audio on little speech by its timestamps, is real words timed late."""

    def late_last(buffer: np.ndarray) -> list[int]:
        tokens = hear(buffer)[:-1]
        stamps = [i for i, t in enumerate(tokens) if t >= TS]
        tokens[stamps[-2]] += 45
        tokens[stamps[-1]] += 45
        return [*tokens, EOT]

    said = [1, 2, 3, 4, None, None, None, 5, 6, 7, 8, None, None, None]
    policy = StreamPolicy(KINDS, detokenize, StreamOptions(step_s=1.0, silence_s=0.8), energy)
    policy.feed(speech(said))  # all at once: a stream behind, closed at the silence (not finished)
    while (d := policy.request()) is not None:
        policy.accept(d, late_last(d.audio))
    assert not policy.finished and words_of(policy._text) == [f"w{w}" for w in said if w], policy._text



def test_a_forced_trim_without_a_timed_segment_keeps_the_audio_it_did_not_decode() -> None:
    """A caller feeding 40 s in one block (the policy takes any block size): the overflow decode reads one window
    (30 s), its hypothesis has no closed segment, so its text is committed and the buffer starts afresh after the
    audio that decode read, not after all 40 s (the last 10 s were dropped unheard)."""
    policy = StreamPolicy(KINDS, detokenize, StreamOptions())
    policy.feed(speech(list(range(80))))  # 40 s of words
    decode = policy.request()
    assert decode is not None and decode.kind == "overflow" and len(decode.audio) == WINDOW_S * SR
    policy.accept(decode, [TS, 2, 4, 6, EOT])  # no closed segment: committed by force
    assert words_of(policy._text) == ["w1", "w2", "w3"]
    assert policy._start == WINDOW_S * SR and len(policy._buffer) == 10 * SR  # the 10 s after it, still to decode


def test_a_second_finish_gives_no_second_final_update() -> None:
    """`Stream.finish()` called twice queued two final updates: the policy gives its final one once."""
    policy = StreamPolicy(KINDS, detokenize, StreamOptions())
    policy.feed(speech([1, 2, 3]))
    updates = [policy.finish()]
    while (d := policy.request()) is not None:
        updates.append(policy.accept(d, hear_given(d.audio, d.prefix)))
    assert policy.done and [u.final for u in updates if u is not None].count(True) == 1
    assert policy.finish() is None


@pytest.mark.parametrize("n_words_each", [10, 12, 14])
def test_a_restart_after_a_close_that_stopped_short_says_no_committed_word_twice(n_words_each: int) -> None:
    """A forced close decode leaves its last segment open (Whisper does) over words steps committed: it stopped
    short, and the buffer restarts at its last closed segment's end. Every committed word after that point is in
    the seam the restarted decode is read past, not only the last eight (12-word segments: four said twice)."""
    hearing = functools.partial(hear, words_per_segment=n_words_each)  # Whisper writes segments of 10-20 words

    def decoder(decode):
        tokens = hear_given(decode.audio, decode.prefix, hearing=hearing)
        if decode.kind == "close" and decode.prefix and tokens[-2] >= TS and tokens[-3] < EOT:
            tokens = tokens[:-2] + [EOT]  # the last segment left open
        return tokens

    words = [w % 24 + 1 for w in range(24)] + [None] * 3  # 12 s of speech, then a pause
    _, updates, _ = run_stream(speech(words), StreamOptions(), energy, block_s=0.1, decoder=decoder)
    assert words_of(updates[-1].text) == [f"w{w}" for w in words if w is not None]


@pytest.mark.parametrize("options", [StreamOptions(committed_prefix=False), StreamOptions()],
                         ids=["unforced", "forced"])
def test_a_close_that_gives_up_after_a_sentence_says_no_committed_word_twice(options: StreamOptions) -> None:
    """An unforced close decode (no committed prefix, or a drifted last hypothesis) gives up after its first
    sentence, before the words the steps committed: the restart's seam counted only the committed words the
    close's own hypothesis said, so past eight the rest were said again and committed twice (w4 .. w12 doubled)."""
    def decoder(decode):
        tokens = hear_given(decode.audio, decode.prefix)
        if decode.kind == "close" and not decode.prefix and decode.start_s == 0:  # stops after its first segment
            tokens = tokens[:segments(tokens, KINDS)[0].end_index + 1] + [EOT]
        return tokens

    words = list(range(1, 15)) + [None, None]  # 7 s without a pause, then 1 s of silence
    _, updates, _ = run_stream(speech(words), options, energy, block_s=0.1, decoder=decoder)
    assert words_of(updates[-1].text) == [f"w{w}" for w in words if w is not None]


@pytest.mark.parametrize("voice", [None, energy])
def test_a_close_over_more_than_a_window_commits_no_word_cut_at_the_windows_edge(voice, monkeypatch) -> None:
    """40 s of speech fed as one block (`Transcriber.stream([samples])`): a close decode reads a window at most,
    and one that committed all it read committed the word its 30 s cut in two (the next buffer began inside it). A
    full buffer's decode trims it first. (The scripted words cycle through 24 ids, which reads as a loop: the loop
    rule is set aside.)"""
    monkeypatch.setattr(hearing, "LOOP_COMPRESSION_RATIO", 1e9)
    words = [w % 24 + 1 for w in range(80)]  # a word from 29.75 s to 30.25 s
    audio = np.concatenate([np.zeros(4000, np.float32), speech([*words, None, None, None])])
    policy, updates, longest = run_stream(audio, StreamOptions(), voice, block_s=len(audio) / SR)
    assert words_of(updates[-1].text) == [f"w{w}" for w in words]
    assert all(word.endswith("+") for word in updates[-1].text.split())  # every word whole
    assert longest <= WINDOW_S * SR


def test_a_block_that_is_not_mono_float_audio_is_refused() -> None:
    """A (n, 2) block (two channels, as sounddevice gives them) was read interleaved, twice as long, and int16
    samples unscaled (up to 32767): garbage text, no error."""
    policy = StreamPolicy(KINDS, detokenize, StreamOptions(), energy)
    for block in (np.zeros((1600, 2), np.float32), np.full(1600, 20000, np.int16)):
        with pytest.raises(InputError, match="stream: audio blocks must be 1-D float samples"):
            policy.feed(block)
    policy.feed(np.zeros(1600, np.float64))  # float64 is taken
    # int16 values given as floats, refused as a whole input's are: they were decoded into invented words
    with pytest.raises(AudioError, match=r"stream: audio block: float samples peak at 2e\+04.*divide by 32768"):
        policy.feed(np.full(1600, 20000.0, np.float32))
    with pytest.raises(InputError, match="NaN or infinite"):
        policy.feed(np.full(10, np.nan, np.float32))


def test_a_close_decode_that_loops_from_its_first_segment_is_decoded_again_shorter():
    """A French-then-English stream's close decode of 11.5 s looped from its first segment ("Shakimosh, ...
    bufufufu..." to its budget): the loop heard nothing, so it committed nothing, and the buffer started afresh
    after its audio, an English sentence in it lost. It is now decoded again shorter, as a close whose one segment
    drifted is, and every word is committed."""
    words = [w for i, x in enumerate(range(1, 16)) for w in ((x, None) if i % 3 == 2 else (x,))]
    policy = StreamPolicy(KINDS, detokenize, StreamOptions(step_s=1.0), energy)
    policy.feed(speech(words + [None] * 2))  # fed at once: the utterance and a pause that closes it
    close = policy.request()
    assert close.kind == "close"
    loop = [TS, *[2, 3] * 60]  # its first segment one word over and over, cut at its budget
    assert compression_ratio(detokenize(loop[1:])) > LOOP_COMPRESSION_RATIO
    assert policy.accept(close, loop).delta == "" and policy.closing_short
    shorter = policy.request()
    assert shorter.kind == "close" and len(shorter.audio) < len(close.audio)
    policy.accept(shorter, hear_given(shorter.audio, shorter.prefix))
    policy.finish()
    while (decode := policy.request()) is not None:
        policy.accept(decode, hear_given(decode.audio, decode.prefix))
    assert words_of(policy._text) == [f"w{x}" for x in range(1, 16)]


def test_an_unscored_stream_opening_on_silence_commits_no_word_twice() -> None:
    """Without voice activity the buffer is cut where the timestamps say, and a stream that opens on 10 s of
    digital silence gets its segments timed from 0.00 (Whisper-base timed a sentence at 10-14 s 0.00-7.00): the
    forced trim after them cut at 12 s, inside what they said, and the next decode said 19 committed words again.
    Each cut's committed words are now a seam, its repeats dropped."""

    def timed_from_zero(buffer: np.ndarray) -> list[int]:
        tokens = hear(buffer)
        stamps = [t for t in tokens if t >= TS]
        lead = stamps[0] - TS if stamps else 0  # every timestamp that much early: the first segment at 0.00
        return [t - lead if t >= TS else t for t in tokens]

    said = [*[None] * 20, *range(1, 25)]  # 10 s of silence, then 12 s of words
    policy, updates, _ = run_stream(speech(said), StreamOptions(step_s=1.0, context_s=0.0),
                                    decoder=lambda d: timed_from_zero(d.audio) if not d.prefix
                                    else hear_given(d.audio, d.prefix, timed_from_zero))
    assert words_of(updates[-1].text) == [f"w{w}" for w in said if w is not None], updates[-1].text


def test_an_unscored_stream_of_digital_silence_is_never_decoded() -> None:
    """Without voice activity, digital silence is still known to hold no speech: 10 s of zeros asks for no decode
    (Whisper-base wrote "you" over them) and keeps only `speech_pad_s` of them."""
    policy = StreamPolicy(KINDS, detokenize, StreamOptions(step_s=1.0))
    for _ in range(10):
        policy.feed(np.zeros(SR, np.float32))
        assert policy.request() is None
    assert len(policy._buffer) == round(StreamOptions().speech_pad_s * SR)
    final = policy.finish()
    assert final is not None and final.final and final.text == ""
