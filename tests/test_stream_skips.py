"""The live policy against a decoder that jumps over an utterance (`hearing.skipped`): seen live, two step decodes in
a row wrote "...lost.<|3.00|><|9.00|> Is that what..." over a whole sentence's speech, the agreement committed what
followed the jump and the trim after it cut the sentence unheard. With the rule, text after such a jump waits, the
buffer restarts at the skipped speech once the segment before it is committed, and every word is committed once,
in order. The scripted decoder of test_stream_policy hears the words."""

from __future__ import annotations

import numpy as np
import pytest
from test_stream_policy import EOT, KINDS, SR, detokenize, energy, hear, hear_given, speech, words_of

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


def stream(options: StreamOptions, decoder, block: int = SR) -> tuple[str, int]:
    """AUDIO through a policy in `block`s, every decode by `hear_given` over `decoder`: (the final text, decodes)."""
    policy = StreamPolicy(KINDS, detokenize, options, energy)
    decodes, final = 0, None
    for i in range(0, len(AUDIO), block):
        policy.feed(AUDIO[i:i + block])
        while (d := policy.request()) is not None:
            decodes += 1
            policy.accept(d, hear_given(d.audio, d.prefix, decoder))
    final = policy.finish()
    while (final is None or not final.final) and (d := policy.request()) is not None:
        decodes += 1
        final = policy.accept(d, hear_given(d.audio, d.prefix, decoder))
    assert final is not None and final.final
    return final.text, decodes


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
    and the text after it is still committed (each restart moves the buffer on), every other word once, in order."""

    text, _ = stream(StreamOptions(step_s=1.0, silence_s=0.8), jumping_over({7}, anywhere=True))
    assert words_of(text) == [f"w{w}" for w in SAID if w not in (7, 8, 9)], text
