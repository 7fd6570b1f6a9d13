"""Temperature fallback: openai-whisper's test and ranker as pure functions, and end to end through the Transcriber
with a tiny real-vocabulary model: only the window that fails the thresholds is decoded again, in the same engine
run, the others stay token-identical to greedy, and the sampled window is the same at batch 1 and 8, alone or among
other files."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools

import pytest
import torch
from test_transcribe import LONG, SHORT, transcriber

from asr_spec import TranscribeOptions
from asr_spec.engine import ChunkRequest, ChunkResult, ChunkStats
from asr_spec.errors import InputError
from asr_spec.transcribe.fallback import best_candidate, content_digest, needs_fallback, row_key
from asr_spec.transcribe.nospeech import NoSpeechRule

RULE = NoSpeechRule()  # Whisper's thresholds: no speech 0.6, log-probability -1.0, compression ratio 2.4
EOT = 50257


def test_needs_fallback_is_whispers_test():
    assert not needs_fallback(RULE, "a plain sentence of speech", -0.3, 0.1)
    assert needs_fallback(RULE, "a plain sentence of speech", -1.2, 0.1)  # unsure
    assert needs_fallback(RULE, "yes " * 40, -0.2, 0.1)  # repetitive, however confident
    assert not needs_fallback(RULE, "mm", -1.5, 0.9)  # unsure but silent: Whisper does not fall back
    assert needs_fallback(RULE, "yes " * 40, -0.2, 0.9)  # confident repetition over silence still does
    off = NoSpeechRule(logprob_threshold=None, compression_ratio_threshold=None)
    assert not needs_fallback(off, "yes " * 40, -5.0, 0.1)


def _result(tokens, avg_logprob, finish="eos"):
    return ChunkResult(0, tuple(tokens), (), finish, ChunkStats(), 0.0, avg_logprob)


def test_best_candidate_is_the_highest_sum_logprob_per_text_token():
    # sum_logprob = avg_logprob * (len + 0 at eos); per text token: a: -2.0 * 3 / 2 = -3.0, b: -2.5 * 5 / 4 = -3.125
    a, b = _result([1, 2, EOT], -2.0), _result([1, 2, 3, 4, EOT], -2.5)
    assert best_candidate([a, b], EOT) is a
    assert best_candidate([b, a], EOT) is a
    c = _result([5, 6, 7, 8], -0.5, finish="length")  # no <|endoftext|>: divisor len + 1, text tokens 4
    assert best_candidate([a, b, c], EOT) is c


def test_row_keys_differ_per_pass_candidate_seed_and_audio():
    keys = {row_key(s, a, p, c) for s in (0, 1) for a in (b"x", b"y") for p in (1, 2) for c in range(5)}
    assert len(keys) == 40 and all(0 <= k < 2 ** 32 for k in keys)


def test_temperature_options_are_checked_in_one_place():
    assert TranscribeOptions.from_values(temperature="0, 0.2,0.4").temperature == (0.0, 0.2, 0.4)
    assert TranscribeOptions.from_values(temperature=0.5).temperature == (0.5,)
    for bad in ("0.4,0.2", "1.5", "", "x", True, (0, 0)):
        with pytest.raises(InputError, match="temperature"):
            TranscribeOptions.from_values(temperature=bad)
    with pytest.raises(InputError, match="best_of"):
        TranscribeOptions.from_values(best_of=0)
    with pytest.raises(InputError, match="seed"):
        TranscribeOptions.from_values(seed=-1)


@functools.cache
def _greedy():
    return transcriber(speculative=True, no_speech_threshold=None).transcribe(str(LONG), progress=False)[0]


def _threshold_failing_one(greedy) -> float:
    """A log-probability threshold between the least and the second least confident windows: exactly one fails."""
    lps = sorted(c.avg_logprob for c in greedy.chunks)
    assert lps[0] < lps[1], lps
    return (lps[0] + lps[1]) / 2


def _with_fallback(batch_size: int, files, **values):
    threshold = _threshold_failing_one(_greedy())
    t = transcriber(speculative=True, no_speech_threshold=None, logprob_threshold=threshold,
                    compression_ratio_threshold=None, temperature=(0.0, 0.5, 1.0), best_of=3, **values)
    return t.transcribe(files, batch_size=batch_size, progress=False)


@pytest.mark.slow
def test_only_the_failing_window_is_decoded_again_and_the_others_stay_greedy():
    greedy = _greedy()
    failing = min(range(len(greedy.chunks)), key=lambda i: greedy.chunks[i].avg_logprob)
    result = _with_fallback(4, str(LONG))[0]
    assert result.chunks[failing].temperature > 0
    for i, (g, f) in enumerate(zip(greedy.chunks, result.chunks)):
        if i != failing:  # passed at temperature 0: the greedy tokens, the greedy cost
            assert f.temperature == 0.0
            assert result.chunk_tokens[i] == greedy.chunk_tokens[i]
            assert dataclasses.asdict(f.stats) == dataclasses.asdict(g.stats)
    assert dict(result.fallback_windows)[0.5] == 1
    assert result.chunks[failing].stats.generated_tokens > greedy.chunks[failing].stats.generated_tokens
    assert result.chunk_tokens[failing] != greedy.chunk_tokens[failing]


@pytest.mark.slow
def test_sampled_windows_do_not_depend_on_batch_size_or_other_files():
    """The promise docs/decoding.md makes ("Randomness"): target and draft in one precision. The draft's bf16 copy
    beside the fp32 target (`draft_bf16`, on by default where oneDNN has native bf16, whatever the suite's pinned
    class) rounds the fp32 encoder output, whose last bits may move with the encoder's batch of windows, so a draw
    may move on such a CPU (docs/cpu.md, "Sampled windows (temperature fallback) and the batch": 8 of 40 windows on
    an AMX Xeon). This test held with the copy on an AVX-512-BF16 EPYC, by the luck of its rounding."""
    alone_1 = _with_fallback(1, str(LONG), draft_bf16=False)[0]
    among_8 = _with_fallback(8, [*map(str, SHORT[:2]), str(LONG)], draft_bf16=False)[2]
    assert alone_1.chunk_tokens == among_8.chunk_tokens
    assert [c.temperature for c in alone_1.chunks] == [c.temperature for c in among_8.chunks]
    other_seed = _with_fallback(4, str(LONG), seed=1, draft_bf16=False)[0]
    assert other_seed.chunk_tokens != alone_1.chunk_tokens  # the seed does change the sampled window


def test_a_bfloat16_run_falls_back_too():
    """A bf16 run's features are bf16 (`--dtype auto` on AMX and AVX-512-BF16 CPUs): the window's content digest,
    the sampled rows' key, read them through numpy, which has no bfloat16 (TypeError at the first fallback, the
    whole run failed). The digest is of the tensor's bytes, whatever its dtype; in fp32 the same as before."""
    t = transcriber(speculative=True, precision="bfloat16", no_speech_threshold=None, logprob_threshold=0.0,
                    compression_ratio_threshold=None, temperature=(0.0, 0.5), best_of=2)
    [result] = t.transcribe(str(SHORT[0]), progress=False)
    assert result.error is None and dict(result.fallback_windows)[0.5] >= 1
    features = torch.linspace(-1, 1, 80 * 3000).view(80, 3000)
    digest = content_digest(ChunkRequest("x", features))
    assert digest == hashlib.blake2b(features.numpy().tobytes(), digest_size=16).digest()  # fp32: unchanged
    assert content_digest(ChunkRequest("x", features.bfloat16())) != digest


def test_greedy_only_windows_pass_through_untracked():
    """A window with no fallback (schedule (0,)) is not tracked: one whose result never comes back (a stream's
    re-decode withdrawn when its client left) must not keep the engine's source yielding None forever — that kept a
    server's engine thread spinning after shutdown, holding the GIL."""
    from asr_spec.chunk_id import ChunkId, StreamKey
    from asr_spec.engine import ChunkRequest
    from asr_spec.transcribe.fallback import Fallback

    fallback = Fallback(lambda _id: (0.0,), NoSpeechRule(), lambda ids: "", 50257, best_of=2, seed=0)
    requests = [ChunkRequest(ChunkId(StreamKey(1), n), None) for n in range(3)]
    out = list(itertools.islice(fallback.run(iter(requests)), 10))
    assert out == requests and not fallback.windows
