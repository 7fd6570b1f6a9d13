"""The live policy against a decoder that jumps over an utterance (`hearing.skipped`): seen live, two step decodes in
a row wrote "...lost.<|3.00|><|9.00|> Is that what..." over a whole sentence's speech, the agreement committed what
followed the jump and the trim after it cut the sentence unheard. With the rule, text after such a jump waits, the
buffer restarts at the skipped speech once the segment before it is committed, and every word is committed once,
in order. The scripted decoder of test_stream_policy hears the words."""

from __future__ import annotations

import numpy as np
import pytest
from test_stream_policy import EOT, KINDS, SR, TS, detokenize, energy, hear, hear_given, speech, words_of

from asr_spec.stream.agreement import segments
from asr_spec.stream.policy import StreamOptions, StreamPolicy

SAID = list(range(1, 25))  # eight utterances of three words, each followed by a 0.5 s pause (none closes a buffer)
AUDIO = speech([w for i, x in enumerate(SAID) for w in ((x, None) if i % 3 == 2 else (x,))])


def jumping_over(first_words: set[int], anywhere: bool = False):
    """`hear`, but an utterance (segment) whose first word is in `first_words` is left out, its opening and closing
    timestamps with it, unless it is the buffer's first segment (with `anywhere`, there too): Whisper jumped over it
    mid-window, and hears it where the window starts with it."""

    def decoder(audio: np.ndarray) -> list[int]:
        heard = hear(audio)
        closed = segments(heard, KINDS)
        openings = [0] + [s.end_index + 1 for s in closed[:-1]]
        drop = set()
        for position, (opening, segment) in enumerate(zip(openings, closed)):
            first = heard[opening + 1]
            if (position or anywhere) and first < EOT and first // 2 in first_words:
                drop |= set(range(opening, segment.end_index + 1))
        return [t for i, t in enumerate(heard) if i not in drop]

    return decoder


def stream(options: StreamOptions, decoder, block: int = SR) -> tuple[str, list[float]]:
    """AUDIO through a policy in `block`s, every decode by `hear_given` over `decoder`: (the final text, each
    decode's start in the stream, in seconds)."""
    policy = StreamPolicy(KINDS, detokenize, options, energy)
    starts, final = [], None
    for i in range(0, len(AUDIO), block):
        policy.feed(AUDIO[i:i + block])
        while (d := policy.request()) is not None:
            starts.append(d.start_s)
            policy.accept(d, hear_given(d.audio, d.prefix, decoder))
    final = policy.finish()
    while (final is None or not final.final) and (d := policy.request()) is not None:
        starts.append(d.start_s)
        final = policy.accept(d, hear_given(d.audio, d.prefix, decoder))
    assert final is not None and final.final
    return final.text, starts


@pytest.mark.parametrize("settled_s", [None, 2.0])
@pytest.mark.parametrize("context_s", [0.0, 5.0])
@pytest.mark.parametrize("block_s", [1, 4])
def test_an_utterance_a_step_decode_jumps_over_is_heard_once_the_buffer_restarts_at_it(
        settled_s: float | None, context_s: float, block_s: int) -> None:
    """Step decodes jump over two utterances whenever another segment comes before them in the buffer; the stream
    is decoded every second, or every 4 s (a loaded server: more of each buffer is new). Every word is committed
    once, in order. (Without the rule the committed left context of `context_s` 5 s, the default, keeps the jumped
    utterances from ever starting a window, and they are lost; at 0 each trim after a commit happens to start one
    there.)"""
    options = StreamOptions(step_s=1.0, silence_s=0.8, context_s=context_s, settled_s=settled_s)
    text, _ = stream(options, jumping_over({7, 16}), block_s * SR)
    assert words_of(text) == [f"w{w}" for w in SAID], text


def test_a_close_decode_that_jumps_over_an_utterance_is_decoded_again_from_before_it() -> None:
    """A stream behind holds three utterances at its close decode, which jumps over the second: only the first is
    committed, the buffer restarts after it, and the next close decode hears the rest."""
    audio = speech([1, 2, 3, None, None, 4, 5, 6, None, None, 7, 8, 9, None, None, None])
    policy = StreamPolicy(KINDS, detokenize, StreamOptions(step_s=1.0, silence_s=0.8), energy)
    policy.feed(audio)  # all at once: the stream fell behind
    update, decodes = policy.finish(), 0
    while (update is None or not update.final) and (d := policy.request()) is not None:
        decodes += 1
        update = policy.accept(d, jumping_over({4})(d.audio))
    assert update.final and words_of(update.text) == [f"w{w}" for w in range(1, 10)], update.text
    assert decodes == 2


def test_a_decoder_that_never_hears_the_jumped_utterance_still_commits_the_rest() -> None:
    """Whisper jumps over an utterance wherever it is (even first in the window): the rule cannot make it heard,
    and the text after it is still committed (each restart moves the buffer on), every other word once, in order.
    A guard of the rule's progress (it passes without the rule too): a jump it cannot repair stalls nothing."""

    text, _ = stream(StreamOptions(step_s=1.0, silence_s=0.8), jumping_over({7}, anywhere=True))
    assert words_of(text) == [f"w{w}" for w in SAID if w not in (7, 8, 9)], text


def test_a_restart_after_a_segment_timed_early_cuts_at_the_first_pause_after_its_words() -> None:
    """The segment before the jump ends 0.6 s early, inside its own words (no pause within PAUSE_SEARCH_S of that
    end): the buffer restarts at the first pause after the end (not only once a full buffer is trimmed by force),
    its last words said again there are dropped, and every word is committed once, in order."""

    def early_and_jumping(audio: np.ndarray) -> list[int]:
        heard = jumping_over({7})(audio)
        ends = {s.end_index for s in segments(heard, KINDS)[:-1]}
        return [t - 30 if i in ends else t for i, t in enumerate(heard)]  # 30 steps: 0.6 s

    text, starts = stream(StreamOptions(step_s=1.0, silence_s=0.8), early_and_jumping)
    assert words_of(text) == [f"w{w}" for w in SAID], text
    pause = (3.5, 4.0)  # after w4 w5 w6 (2.0-3.5 s); w7 starts at 4.0 s
    assert any(pause[0] < s < pause[1] for s in starts), starts  # a decode started at the pause before w7


def test_a_close_decode_that_jumps_over_words_steps_committed_does_not_commit_them_again() -> None:
    """Steps commit the first utterance and part of the second; the last step words the second differently, so the
    close decode gets no forced prefix, and it jumps over the second utterance. It stops short after the first; the
    buffer restarts there, and the words of the second that steps committed are not committed again when the next
    close decode hears them."""
    audio = speech([1, 2, 3, None, 4, 5, 6, None, 7, 8, 9, None, None, None, None])
    first, second, third = ((2 * w, 2 * w + 1) for w in (1, 2, 3)), ((2 * w, 2 * w + 1) for w in (4, 5, 6)), \
        ((2 * w, 2 * w + 1) for w in (7, 8, 9))
    first, second, third = ([t for word in part for t in word] for part in (first, second, third))

    def ts(seconds: float) -> int:
        return TS + int(round(seconds / 0.02))

    def scripted(decode) -> list[int]:
        n = len(decode.audio) / SR
        if decode.kind == "close" and decode.start_s == 0:  # the whole buffer, nothing forced: jumps over w4-w6
            return [ts(0), *first, ts(1.5), ts(4.0), *third, ts(5.5), EOT]
        if decode.start_s > 0:  # restarted after the first utterance: hears the rest
            return [ts(0), *second, ts(3.5 - decode.start_s), ts(4.0 - decode.start_s), *third,
                    ts(5.5 - decode.start_s), EOT]
        if n >= 5.9:  # the last step words w5 differently ("w20"): its words are not forced next
            return [ts(0), *first, ts(1.5), ts(2.0), 8, 9, 40, 41, 12, 13, ts(3.5), EOT]
        out = [ts(0), *first, ts(1.5)] if n >= 1.5 else [ts(0)]
        return out + ([ts(2.0), *second, ts(3.5)] if n >= 3.5 else []) + [EOT]

    policy = StreamPolicy(KINDS, detokenize, StreamOptions(step_s=1.0, silence_s=0.8), energy)
    for i in range(0, len(audio), SR // 2):
        policy.feed(audio[i:i + SR // 2])
        while (d := policy.request()) is not None:
            policy.accept(d, scripted(d))
    final = policy.finish()
    while (final is None or not final.final) and (d := policy.request()) is not None:
        final = policy.accept(d, scripted(d))
    assert words_of(final.text) == [f"w{w}" for w in range(1, 10)], final.text
