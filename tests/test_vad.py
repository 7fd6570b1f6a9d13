"""Voice-activity chunking: the pure planner (no model) and, marked slow, silero-vad on real speech."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from asr_spec.audio.vad import (
    FRAME_SAMPLES,
    VadOptions,
    iter_vad_chunks,
    nearby_peak,
    pack_regions,
    pad_regions,
    plan_vad_chunks,
    speech_frames,
    speech_regions,
    split_long_regions,
)
from asr_spec.errors import InputError

SR = 16_000
OPTS = VadOptions()


def frames_of(*spans_s: tuple[float, float], total_s: float) -> np.ndarray:
    """Probabilities: 0.9 inside the given (start_s, end_s) spans, 0.05 elsewhere."""
    n = int(total_s * SR / FRAME_SAMPLES)
    p = np.full(n, 0.05, dtype=np.float32)
    for start, end in spans_s:
        p[int(start * SR / FRAME_SAMPLES): int(end * SR / FRAME_SAMPLES)] = 0.9
    return p


def test_regions_hysteresis_bridging_and_min_speech():
    p = np.array([0.1, 0.6, 0.4, 0.4, 0.2, 0.1, 0.1, 0.1, 0.1, 0.1, 0.9, 0.1] + [0.1] * 10, dtype=np.float32)
    opts = VadOptions(min_speech_s=0.0, min_silence_s=0.0)
    # 0.4 stays speech (above 0.5 - 0.15), 0.2 ends it
    assert speech_regions(p, opts).tolist() == [[1, 4], [10, 11]]
    # a one-frame burst is dropped by min_speech (0.25 s = 8 frames)
    assert speech_regions(p, VadOptions(min_silence_s=0.0)).tolist() == []
    # pauses under min_silence are bridged: 6 frames (0.19 s) < 0.2 s
    assert speech_regions(p, VadOptions(min_speech_s=0.0, min_silence_s=0.2)).tolist() == [[1, 11]]


def test_extend_onset_starts_at_the_run_above_the_lower_bar():
    # onset (>= 0.5) at frame 4; frames 2-3 are >= 0.35 (threshold - 0.15), frame 1 below it
    p = np.array([0.1, 0.2, 0.4, 0.45, 0.9, 0.9, 0.3, 0.1, 0.36, 0.4, 0.7, 0.8, 0.1], dtype=np.float32)
    opts = VadOptions(min_speech_s=0.0, min_silence_s=0.0)
    assert speech_regions(p, opts).tolist() == [[4, 6], [10, 12]]
    extended = VadOptions(min_speech_s=0.0, min_silence_s=0.0, extend_onset=True)
    assert speech_regions(p, extended).tolist() == [[2, 6], [8, 12]]
    # from the first frame when nothing before the onset is below the lower bar
    assert speech_regions(np.array([0.4, 0.4, 0.9, 0.9, 0.1]), extended).tolist() == [[0, 4]]
    # frames between the bars with no onset after them stay out
    assert speech_regions(np.array([0.4] * 20 + [0.1]), extended).tolist() == []


def test_regions_empty_and_all_silence():
    assert speech_regions(np.zeros(0), OPTS).shape == (0, 2)
    assert speech_regions(np.zeros(100), OPTS).shape == (0, 2)


def test_pad_stays_inside_the_file_and_between_neighbours():
    r = np.array([[100, 200], [260, 400], [5000, 5100]])
    out = pad_regions(r, 50, 5120)
    assert out.tolist() == [[50, 230], [230, 450], [4950, 5120]]
    assert pad_regions(np.zeros((0, 2)), 50, 10).shape == (0, 2)


def test_pack_merges_up_to_the_window_and_cuts_at_the_longest_pause():
    regions = [(0, 10), (12, 35), (40, 50), (51, 60), (62, 70)]
    chunks = pack_regions(np.array(regions), 60)
    assert chunks == [(0, 35), (40, 70)]  # the 5-sample pause, not the last one that would fit
    assert all(end - start <= 60 for start, end in chunks)
    assert pack_regions(np.zeros((0, 2)), 60) == []
    # everything fits: one chunk
    assert pack_regions(np.array(regions), 100) == [(0, 70)]


def test_pack_prefers_chunks_of_at_least_half_a_window():
    regions = [(0, 1), (5, 40), (41, 50), (52, 70)]  # longest pause after the first tiny region
    assert pack_regions(np.array(regions), 60) == [(0, 50), (52, 70)]


def test_pack_cut_within_the_last_seconds_of_a_full_chunk():
    regions = [(0, 32), (40, 50), (52, 70)]  # an 8-sample pause after 32, a 2-sample one after 50
    assert pack_regions(np.array(regions), 60) == [(0, 32), (40, 70)]  # the longest pause leaving >= 30
    assert pack_regions(np.array(regions), 60, min_cut_samples=45) == [(0, 50), (52, 70)]
    assert pack_regions(np.array(regions), 60, min_cut_samples=55) == [(0, 32), (40, 70)]  # none: the half rule
    # no pause in the last seconds: the longest pause leaving at least half, not a short chunk at a longer pause
    short_first = [(0, 10), (14, 20), (21, 50), (51, 70)]
    assert pack_regions(np.array(short_first), 60, min_cut_samples=55) == [(0, 50), (51, 70)]
    assert pack_regions(np.array([(0, 10), (14, 25), (26, 70)]), 60, min_cut_samples=55) == [(0, 10), (14, 70)]
    assert plan_vad_chunks(np.zeros(10), 10 * FRAME_SAMPLES, VadOptions(cut_within_s=3.0)) == []


def test_a_full_chunk_is_cut_in_its_last_half_by_default_or_its_last_cut_within_s_at_most_that_half():
    assert VadOptions().min_cut_samples == 15 * SR  # 30 s chunks: the last half
    assert VadOptions(cut_within_s=5.0).min_cut_samples == 25 * SR
    assert VadOptions(max_chunk_s=8.0, cut_within_s=5.0).min_cut_samples == 4 * SR  # more than half of 8: the half
    assert VadOptions(cut_within_s=40.0).min_cut_samples == 15 * SR


def test_split_long_region_at_its_quietest_frame():
    p = np.full(100, 0.9, dtype=np.float32)
    p[37] = 0.6
    out = split_long_regions(np.array([[0, 100]]), p, 40)
    assert out.tolist()[0] == [0, 37]
    assert all(e - s <= 40 for s, e in out.tolist()) and out[-1, 1] == 100
    assert all(a[1] == b[0] for a, b in zip(out[:-1], out[1:]))


def test_plan_spans_cover_all_speech_within_the_window():
    p = frames_of((1, 3), (4, 20), (21.5, 29), (45, 50), (50.5, 95), total_s=120)
    chunks = plan_vad_chunks(p, 120 * SR, OPTS)
    for start, end in chunks:
        assert 0 <= start < end <= 120 * SR and end - start <= 30 * SR
    assert all(a[1] <= b[0] for a, b in zip(chunks[:-1], chunks[1:]))
    regions = speech_regions(p, OPTS) * FRAME_SAMPLES
    for start, end in regions.tolist():
        assert any(cs <= start and end <= ce for cs, ce in chunks) or end - start > 29 * SR  # split ones
    assert len(chunks) == 3  # 1-29 s; 45-50 s with the first piece of the 44.5 s talk; the rest of it


@pytest.mark.parametrize("block_s", [0.7, 3.0, 60.0])
@pytest.mark.parametrize("options", [OPTS, VadOptions(extend_onset=True, cut_within_s=4.0)],
                         ids=["default", "extended"])
def test_streaming_equals_the_whole_plan(block_s, options):
    rng = np.random.default_rng(0)
    total_s = 200
    spans = [(s, s + d) for s, d in zip(np.cumsum(rng.uniform(0.3, 8, 80)), rng.uniform(0.2, 6, 80)) if s + d < total_s]
    p = frames_of(*spans, total_s=total_s)
    for start, _ in spans:  # 0.4 (between the bars) for up to 3 s before each onset: extend_onset reaches back
        onset = int(start * SR / FRAME_SAMPLES)
        shoulder = p[max(onset - int(rng.uniform(0, 3) * SR / FRAME_SAMPLES), 0): onset]
        shoulder[shoulder < 0.35] = 0.4
    n = total_s * SR
    signal = rng.standard_normal(n).astype(np.float32)
    seen = []

    def probs(samples):
        first = sum(len(x) for x in seen) // FRAME_SAMPLES
        seen.append(samples)
        return p[first: first + len(samples) // FRAME_SAMPLES]

    block = int(block_s * SR)
    out = list(iter_vad_chunks((signal[i: i + block] for i in range(0, n, block)), options, probs))
    expected = plan_vad_chunks(p, n, options)
    assert [(s.start_sample, s.end_sample) for s, _ in out] == expected
    for span, samples in out:
        np.testing.assert_array_equal(samples, signal[span.start_sample: span.end_sample])


def _streamed(probs: np.ndarray, cuts: list[int], options: VadOptions) -> tuple[list, np.ndarray]:
    """iter_vad_chunks over a noise signal of `probs`' frames, in blocks ending at the frames `cuts`."""
    signal = np.random.default_rng(0).uniform(-0.3, 0.3, len(probs) * FRAME_SAMPLES).astype(np.float32)
    edges = [0, *(c * FRAME_SAMPLES for c in cuts), len(signal)]
    fed = iter(probs)

    def probabilities(samples):
        return np.array([next(fed) for _ in range(len(samples) // FRAME_SAMPLES)], np.float32)

    return list(iter_vad_chunks([signal[a:b] for a, b in zip(edges, edges[1:])], options, probabilities)), signal


@pytest.mark.parametrize("case", ["padding shrinks", "a short burst bridged"])
def test_streaming_yields_no_chunk_later_audio_changes_nor_drops_samples_it_needs(case: str) -> None:
    """Two block edges the streaming plan got wrong. A region padded up to the audio's end did not fit the chunk
    before it, which was yielded as final; the next region, after a 0.32 s pause, left it half that pause as
    padding, it fit, and the whole plan's chunk ran on to it: its speech (29.4-30.3 s) was in no streamed chunk.
    And a 7-frame burst joined the speech after a 3-frame pause reached back further than the samples kept (a
    chunk of 0 samples: `FeatureBatcher` failed the whole run)."""
    probs = np.zeros(1400 if case == "padding shrinks" else 300, np.float32)
    spans, cut = ([(20, 300), (305, 915), (920, 946), (956, 1300)], 954) if case == "padding shrinks" else \
        ([(100, 107), (110, 200)], 110)
    for a, b in spans:
        probs[a:b] = 0.9
    streamed, signal = _streamed(probs, [cut], OPTS)
    assert [(s.start_sample, s.end_sample) for s, _ in streamed] == plan_vad_chunks(probs, len(signal), OPTS)
    for span, samples in streamed:
        np.testing.assert_array_equal(samples, signal[span.start_sample:span.end_sample])


@pytest.mark.parametrize("seed", range(40))
def test_streaming_equals_the_whole_plan_with_long_regions_still_growing(seed: int) -> None:
    """Talk with no 0.1 s pause for up to a minute (over music, a noisy broadcast), fed in blocks cut anywhere. A
    region longer than a window is split anew as it grows; its first piece then fit the chunk before it, which had
    been yielded as final: 15 s of speech (30.2-45.8 s of a 20-30 s + 31-80 s talk) was in no chunk."""
    rng = np.random.default_rng(seed)
    probs = np.zeros(int(rng.integers(1000, 5000)), np.float32)
    at = 0
    while at < len(probs):
        at += int(rng.exponential(40))
        length = int(rng.exponential(60) if rng.random() < 0.5 else rng.uniform(500, 1900))
        probs[at: at + length] = rng.uniform(0.5, 1.0)
        at += length
    probs[rng.integers(0, len(probs), 50)] = 0.36  # quiet frames inside, where a long region is split
    options = [OPTS, VadOptions(extend_onset=True, cut_within_s=4.0), VadOptions(min_silence_s=0.0)][seed % 3]
    cuts = sorted(set(rng.integers(1, len(probs), int(rng.integers(1, 12))).tolist()))
    streamed, signal = _streamed(probs, cuts, options)
    assert [(s.start_sample, s.end_sample) for s, _ in streamed] == plan_vad_chunks(probs, len(signal), options)
    for span, samples in streamed:
        np.testing.assert_array_equal(samples, signal[span.start_sample:span.end_sample])


def test_a_last_chunk_no_later_speech_can_reach_is_yielded_before_the_input_ends() -> None:
    """10 s of speech, then silence: the chunk was held (and every block after it kept and concatenated again)
    until the file ended: a recorder left running for two hours after a meeting held 900 MB."""
    read = []

    def blocks():
        for i in range(20):
            read.append(i)
            yield np.full(10 * SR, 0.5, np.float32) if i == 0 else np.zeros(60 * SR, np.float32)

    def probabilities(samples):
        return (np.abs(samples.reshape(-1, FRAME_SAMPLES)).max(axis=1) > 0.1).astype(np.float32) * 0.9

    chunks = iter_vad_chunks(blocks(), OPTS, probabilities)
    span, samples = next(chunks)
    assert span.start_sample == 0 and 10 * SR < span.end_sample <= 10 * SR + OPTS.pad_samples + FRAME_SAMPLES
    assert len(read) == 2  # yielded once the first minute of silence was read
    assert list(chunks) == [] and len(read) == 20


def test_no_speech_no_chunks():
    out = list(iter_vad_chunks([np.zeros(SR * 5, np.float32)], OPTS, lambda x: np.zeros(len(x) // FRAME_SAMPLES)))
    assert out == []


@pytest.mark.parametrize("bad", [dict(threshold=1.5), dict(min_silence_s=-1), dict(max_chunk_s=40),
                                 dict(speech_pad_s=float("nan")), dict(speech_pad_s=10), dict(extend_onset=1),
                                 dict(cut_within_s=0), dict(cut_within_s=-2.0), dict(cut_within_s="5")])
def test_bad_options_are_one_line_errors(bad):
    with pytest.raises(InputError, match="vad"):
        VadOptions(**bad)


@pytest.mark.slow
def test_silero_finds_the_speech_of_a_real_file():
    pytest.importorskip("silero_vad")
    from asr_spec.audio.loading import load_audio
    from asr_spec.audio.silero import SileroVad

    audio = load_audio("tests/fixtures/speech/long_75s.flac")
    silence = np.zeros(SR * 40, np.float32)
    signal = np.concatenate([silence, audio, silence])
    vad = SileroVad()
    chunks = list(iter_vad_chunks([signal[i: i + SR * 10] for i in range(0, len(signal), SR * 10)], OPTS, vad))
    assert chunks
    assert chunks[0][0].start_sample >= len(silence) - SR and chunks[-1][0].end_sample <= len(silence) + len(audio) + SR
    speech_s = sum(s.n_samples for s, _ in chunks) / SR
    assert 0.7 * len(audio) / SR < speech_s <= len(audio) / SR + 1


def test_loading_silero_leaves_torch_threads_alone():
    """silero_vad sets torch's thread count to 1 when imported; the encoder and decoder must keep theirs. A fresh
    process, so that the import really happens here."""
    pytest.importorskip("silero_vad")
    code = ("import torch; torch.set_num_threads(2); from asr_spec.audio.silero import SileroVad; SileroVad(); "
            "print(torch.get_num_threads())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split()[-1] == "2"


def test_batched_silero_equals_the_model_frame_by_frame_across_blocks_and_silence():
    """The front end over all frames at once and the LSTM over them in turn give the model's own per-frame
    probabilities, with the state carried across blocks of any size and across digital silence (its frames beyond
    `DIGITAL_SILENCE_S` into a stretch scored 0, what follows heard from the state `reset` gives)."""
    pytest.importorskip("silero_vad")
    from asr_spec.audio.loading import load_audio
    from asr_spec.audio.silero import SileroVad, levels, long_silence, rest_frames

    speech = load_audio("tests/fixtures/speech/short/festival-kal.flac")[: SR * 3]
    zeros = np.zeros(SR * 2, np.float32)
    signal = np.concatenate([speech, zeros[: SR // 2], speech[::-1], zeros[:700], speech, zeros, speech])
    signal = signal[: len(signal) // FRAME_SAMPLES * FRAME_SAMPLES]
    frames = signal.reshape(-1, FRAME_SAMPLES)
    vad = SileroVad()
    assert vad._parts is not None  # this silero-vad is laid out as expected: the batched path runs
    vad.reset()
    rest = rest_frames()
    skip, _ = long_silence(frames, quiet_before=len(rest))
    assert 25 <= skip.sum() <= 35  # the 2 s stretch beyond its first second, no other
    none = np.zeros(len(rest), bool)
    vad._frame_by_frame(rest, none, none)  # the model as `reset` leaves it: a second of zeros heard
    gain, fresh, _ = levels(frames)
    fresh |= np.r_[False, skip[:-1]]  # restarts: a second into a drop in level, after a long silence
    reference = vad._frame_by_frame(frames * gain[:, None], skip, fresh)  # a quiet start heard raised
    assert (reference > 0.5).any() and (reference[~skip] < 0.1).sum() >= 15  # speech, and silence heard as silence
    vad.reset()
    np.testing.assert_allclose(vad(signal), reference, atol=1e-4)
    rng = np.random.default_rng(0)
    silence_end = int(np.flatnonzero(skip)[-1]) + 1  # a block that starts right after the long silence, too
    for _ in range(2):  # the state is reset by reset() and carried from block to block
        vad.reset()
        cuts = np.union1d(rng.choice(np.arange(1, len(frames)), size=12, replace=False), [silence_end])
        got = np.concatenate([vad(block) for block in np.split(signal, cuts * FRAME_SAMPLES)])
        np.testing.assert_allclose(got, reference, atol=1e-4)


def test_the_model_fed_frame_by_frame_hears_as_the_batched_path_across_drops_in_level():
    """A silero-vad of another layout is fed frame by frame (`_parts` None): its restarts, at a drop in level inside
    audio as well as after a long silence, are the batched path's (the batched path heard a restarted frame with
    the audio before it, the model fed frame by frame with zeros: 0.05 apart), and a caller's buffer refilled in
    place after a call does not change what the next call hears (its last samples were kept as a view)."""
    pytest.importorskip("silero_vad")
    import copy

    from asr_spec.audio.loading import load_audio
    from asr_spec.audio.silero import SileroVad, levels

    speech = load_audio("tests/fixtures/speech/short/festival-kal.flac")
    speech = speech[: len(speech) // FRAME_SAMPLES * FRAME_SAMPLES] / np.abs(speech).max()
    noise = np.random.default_rng(1).standard_normal(2 * SR // FRAME_SAMPLES * FRAME_SAMPLES) * 10 ** (-66 / 20)
    silence = np.zeros(2 * SR // FRAME_SAMPLES * FRAME_SAMPLES)
    signal = np.r_[0.5 * speech, 0.01 * speech, noise, 0.01 * speech, silence, 0.5 * speech]
    signal = signal.astype(np.float32)
    assert levels(signal.reshape(-1, FRAME_SAMPLES))[1].sum() >= 2  # drops inside audio, not only silence
    batched = SileroVad()
    plain = copy.copy(batched)
    plain._parts = None
    plain.reset()
    np.testing.assert_allclose(plain(signal), batched(signal), atol=1e-4)
    batched.reset()
    block, heard = np.empty(8 * FRAME_SAMPLES, np.float32), []
    for start in range(0, len(signal) // len(block) * len(block), len(block)):
        block[:] = signal[start:start + len(block)]  # one buffer, refilled in place (a capture callback's)
        heard.append(batched(block))
    batched.reset()
    np.testing.assert_allclose(np.concatenate(heard), batched(signal[:sum(map(len, heard)) * FRAME_SAMPLES]),
                               atol=1e-4)


@pytest.mark.parametrize("lead_s", [0, 30])
@pytest.mark.parametrize(("peak_db", "share"), [(-45.0, 0.75), (-55.0, 0.2)])
def test_quiet_16_bit_speech_is_heard(peak_db: float, share: float, lead_s: int):
    """Speech peaking at -45 / -55 dBFS in 16-bit audio, whose quieter frames round to zero, at the start or after
    30 s of zeros: the VAD hears most / some of the frames it hears at full level (a reviewer's three sentences at
    -55 dBFS gave no word before: frames within 1e-4 were scored 0 and the model reset after them; -45 dBFS: 17 of
    96 frames here, now 87; after 30 s of zeros run through the model its state had drifted: 0 at -55 dBFS)."""
    pytest.importorskip("silero_vad")
    from asr_spec.audio.loading import load_audio
    from asr_spec.audio.silero import SileroVad

    speech = load_audio("tests/fixtures/speech/short/festival-kal.flac")
    speech = speech[: len(speech) // FRAME_SAMPLES * FRAME_SAMPLES] / np.abs(speech).max()
    quiet = (np.round(speech * 10 ** (peak_db / 20) * 32768) / 32768).astype(np.float32)
    lead = lead_s * SR // FRAME_SAMPLES * FRAME_SAMPLES
    vad, heard = SileroVad(), []
    for signal in (speech, quiet):
        vad.reset()
        heard.append(int((vad(np.r_[np.zeros(lead, np.float32), signal])[lead // FRAME_SAMPLES:] >= 0.5).sum()))
    assert heard[1] >= share * heard[0] > 0, heard


def test_quiet_speech_is_heard_alike_at_the_start_and_after_silence():
    """From its zero state silero heard little of quiet speech opening a file (a reviewer's -50 dBFS upload: no
    word; the same after half a second of silence: transcribed): a signal now starts as after a long silence."""
    pytest.importorskip("silero_vad")
    from asr_spec.audio.loading import load_audio
    from asr_spec.audio.silero import SileroVad

    speech = load_audio("tests/fixtures/speech/short/festival-slt-hts.flac")
    speech = speech[: len(speech) // FRAME_SAMPLES * FRAME_SAMPLES] / np.abs(speech).max()
    quiet = (np.round(speech * 10 ** (-50 / 20) * 32768) / 32768).astype(np.float32)
    vad, heard = SileroVad(), []
    for lead in (0, SR // 2 // FRAME_SAMPLES * FRAME_SAMPLES, 20 * SR):
        vad.reset()
        heard.append(vad(np.r_[np.zeros(lead, np.float32), quiet])[lead // FRAME_SAMPLES:])
    np.testing.assert_allclose(heard[0], heard[2], atol=1e-5)  # a start is a long silence
    assert (heard[0] >= 0.5).sum() >= 0.9 * (heard[1] >= 0.5).sum() > 0


def test_speech_below_minus_40_dbfs_is_heard_raised_to_it():
    """silero hears little of speech quieter than about -45 dBFS (a server reviewer's -50 dBFS English upload lost
    "Good morning everyone" and was detected as Welsh): the VAD hears a quiet signal raised to -40 dBFS, at most
    30 dB; a louder one as it is."""
    pytest.importorskip("silero_vad")
    from asr_spec.audio.loading import load_audio
    from asr_spec.audio.silero import MAX_GAIN, QUIET_PEAK, SileroVad, levels

    frames = np.zeros((4, FRAME_SAMPLES), np.float32)
    frames[1, 0], frames[2, 0], frames[3, 0] = 1e-4, 1e-3, 0.5  # -80, -60, -6 dBFS: the peak so far rises
    gain, _, after = levels(frames)
    np.testing.assert_allclose(gain, [MAX_GAIN, MAX_GAIN, QUIET_PEAK / 1e-3, 1.0], rtol=1e-5)
    assert after.peak == 0.5 and levels(frames[:1], after)[0].tolist() == [1.0]
    speech = load_audio("tests/fixtures/speech/short/festival-slt-hts.flac")
    speech = speech[: len(speech) // FRAME_SAMPLES * FRAME_SAMPLES] / np.abs(speech).max()
    vad, heard = SileroVad(), []
    for db in (0, -60):
        vad.reset()
        heard.append(int((vad((np.round(speech * 10 ** (db / 20) * 32768) / 32768).astype(np.float32)) >= 0.5).sum()))
    assert heard[1] >= 0.9 * heard[0] > 0, heard


def test_the_gain_is_measured_over_the_signal_so_far_whatever_the_blocks():
    """Measured over the last second, the gain raised a pause's background after a loud programme (a TV 49 dB
    under the host was transcribed) and a pause's room noise above a quiet speaker's onsets; the signal's loudest
    sample so far decides it, in blocks of any size as in one call."""
    from asr_spec.audio.silero import LEVEL_WINDOW_S, MAX_GAIN, QUIET_PEAK, levels

    window = round(LEVEL_WINDOW_S * SR / FRAME_SAMPLES)
    frames = np.zeros((3 * window, FRAME_SAMPLES), np.float32)
    frames[window, 0], frames[2 * window:, 0] = 0.5, 1e-3
    gain, _, _ = levels(frames)
    assert (gain[:window] == MAX_GAIN).all() and (gain[window:] == 1.0).all()
    np.testing.assert_allclose(levels(frames[2 * window:])[0], QUIET_PEAK / 1e-3, rtol=1e-5)  # alone: raised
    for seed in range(3):
        np.testing.assert_array_equal(_levels_in_blocks(frames, seed)[0], gain)


def test_quiet_speech_after_loud_speech_and_silence_is_heard_as_at_the_start():
    """A loud speaker, 1.5 s of digital silence, then a -45 dBFS one: the model's state, kept across the silence,
    heard the quiet speaker's first 2.5 s as silence ("The Great Fire of 1666" lost); what follows a long silence
    is now heard as a signal's start is."""
    pytest.importorskip("silero_vad")
    from asr_spec.audio.loading import load_audio
    from asr_spec.audio.silero import SileroVad

    speech = load_audio("tests/fixtures/speech/short/festival-kal.flac")
    speech = speech[: len(speech) // FRAME_SAMPLES * FRAME_SAMPLES] / np.abs(speech).max()
    quiet = (np.round(speech * 10 ** (-45 / 20) * 32768) / 32768).astype(np.float32)
    gap = np.zeros(3 * SR // 2 // FRAME_SAMPLES * FRAME_SAMPLES, np.float32)
    vad = SileroVad()
    alone = int((vad(quiet) >= 0.5).sum())  # raised 5 dB: the loudest sample so far is its own
    vad.reset()
    after = int((vad(np.r_[0.5 * speech, gap, quiet])[-len(quiet) // FRAME_SAMPLES:] >= 0.5).sum())  # not raised
    assert after >= 0.8 * alone > len(quiet) // FRAME_SAMPLES // 3, (after, alone)


def test_the_model_restarts_within_a_second_of_a_drop_in_level_not_after_a_slam_whatever_the_blocks():
    """A second's level is the 75th percentile of its frames' RMS: measured by its loudest sample, a door slam or a
    cough 20 dB above quiet speech restarted the model a second later, mid-sentence, and sentences were lost."""
    from asr_spec.audio.silero import LEVEL_DROP_DB, LEVEL_WINDOW_S, levels

    window = round(LEVEL_WINDOW_S * SR / FRAME_SAMPLES)
    frames = np.zeros((9 * window, FRAME_SAMPLES), np.float32)
    frames[: 2 * window, 0] = 0.5  # loud for 2 s, 2 s at -54 dB, loud for 1 s, then 3 s a little less than 20 dB down
    frames[2 * window: 4 * window, 0] = 1e-3
    frames[4 * window: 5 * window, 0] = 0.5
    frames[5 * window:, 0] = 0.5 * 10 ** (-LEVEL_DROP_DB / 20) * 1.01
    _, restart, _ = levels(frames)
    assert np.flatnonzero(restart).tolist() == [2 * window + 24]  # a quarter of the second loud no more
    for seed in range(3):
        np.testing.assert_array_equal(_levels_in_blocks(frames, seed)[1], restart)
    slam = np.full((6 * window, FRAME_SAMPLES), 1e-3, np.float32)
    slam[2 * window: 2 * window + 7] = 1e-2 * 1.01  # 0.22 s 20 dB up: no restart after it
    assert not levels(slam)[1].any()


def _levels_in_blocks(frames: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """`levels` of frames fed in random blocks, each call carrying the last one's levels: (gains, restarts)."""
    from asr_spec.audio.silero import levels

    cuts = np.sort(np.random.default_rng(seed).choice(np.arange(1, len(frames)), size=6, replace=False))
    parts, after = [], None
    for block in np.split(frames, cuts):
        gain, restart, after = levels(block, after)
        parts.append((gain, restart))
    return np.concatenate([g for g, _ in parts]), np.concatenate([r for _, r in parts])


def test_quiet_speech_after_loud_speech_and_room_noise_is_heard_as_after_the_noise_alone():
    """After loud speech silero's state stayed deaf for seconds to quieter speech, whatever lay between: a lecture's
    audience question at -35 dBFS 0.9 s after the lecturer was lost whole, and a -30 dB speaker after 15-20 s of
    room noise lost sentences (a reviewer's files; faster-whisper without its VAD kept them). The model now
    restarts from its rest state within a second of a drop of 20 dB in level (`levels`)."""
    pytest.importorskip("silero_vad")
    from asr_spec.audio.loading import load_audio
    from asr_spec.audio.silero import SileroVad

    speech = load_audio("tests/fixtures/speech/short/festival-kal.flac")
    speech = speech[: len(speech) // FRAME_SAMPLES * FRAME_SAMPLES] / np.abs(speech).max()
    noise = np.random.default_rng(0).standard_normal(2 * SR // FRAME_SAMPLES * FRAME_SAMPLES) * 10 ** (-66 / 20)
    quiet = speech * 10 ** (-40 / 20)
    vad, n = SileroVad(), len(quiet) // FRAME_SAMPLES
    alone = int((vad(np.r_[noise, quiet].astype(np.float32))[-n:] >= 0.5).sum())
    vad.reset()
    after = int((vad(np.r_[0.5 * speech, noise, quiet].astype(np.float32))[-n:] >= 0.5).sum())
    assert after >= 0.9 * alone > n // 2, (after, alone)  # 59 of 96 frames before


def test_long_silence_counts_its_stretch_across_calls():
    from asr_spec.audio.silero import DIGITAL_SILENCE_S, long_silence

    n = round(DIGITAL_SILENCE_S * SR / FRAME_SAMPLES)
    frames = np.zeros((n + 4, FRAME_SAMPLES), np.float32)
    frames[0, 5] = frames[-2, 0] = 0.01  # a loud frame, n quiet ones and one more, a loud one, a quiet one
    skip, after = long_silence(frames)
    assert skip.tolist() == [False] * (n + 1) + [True, False, False] and after == 1
    skip, after = long_silence(np.zeros((2, FRAME_SAMPLES), np.float32), quiet_before=n - 1)
    assert skip.tolist() == [False, True] and after == n + 1
    assert long_silence(np.zeros((0, FRAME_SAMPLES), np.float32), 7)[1] == 7


def _lstm_plain(gates_in, w_hh_t, state):
    """The LSTM cell's recurrence written as plain expressions, a new tensor per op (the loop `lstm_steps`
    replaced)."""
    n = w_hh_t.shape[0]
    h, c = state
    out = []
    for t in range(gates_in.shape[0]):
        g = torch.addmm(gates_in[t: t + 1], h, w_hh_t)
        s = g.sigmoid()
        c = s[:, n: 2 * n] * c + s[:, :n] * g[:, 2 * n: 3 * n].tanh()
        h = s[:, 3 * n:] * c.tanh()
        out.append(h)
    return torch.cat(out)[None], (h, c)


def test_the_lstm_steps_into_buffers_are_the_plain_expressions_bit_for_bit():
    """`lstm_steps` runs the same kernels on the same shapes as the plain expressions, only writing into buffers
    made once: the same bits on any CPU (so the VAD's probabilities, and every chunk, are unchanged); the
    caller's state is not written to, and a missing state is zeros."""
    from asr_spec.audio.silero import lstm_steps

    gen = torch.Generator().manual_seed(0)
    n = 128  # silero-vad's hidden size
    gates_in, w_hh_t = torch.randn(50, 4 * n, generator=gen), torch.randn(n, 4 * n, generator=gen) / n ** 0.5
    state = (torch.randn(1, n, generator=gen), torch.randn(1, n, generator=gen))
    kept = tuple(x.clone() for x in state)
    out, (h, c) = lstm_steps(gates_in, w_hh_t, state)
    want, (h_want, c_want) = _lstm_plain(gates_in, w_hh_t, state)
    assert out.shape == (1, 50, n)
    assert torch.equal(out, want) and torch.equal(h, h_want) and torch.equal(c, c_want)
    assert all(torch.equal(a, b) for a, b in zip(state, kept))
    zeros = (torch.zeros(1, n), torch.zeros(1, n))
    assert torch.equal(lstm_steps(gates_in, w_hh_t, None)[0], _lstm_plain(gates_in, w_hh_t, zeros)[0])


def test_nearby_peak_is_the_largest_value_within_reach() -> None:
    values = np.random.default_rng(0).random(37)
    for reach in (0, 1, 5, 40):
        expected = [values[max(i - reach, 0): i + reach + 1].max() for i in range(len(values))]
        np.testing.assert_array_equal(nearby_peak(values, reach), expected)
    assert nearby_peak(np.zeros(0), 3).shape == (0,)


def test_a_quieter_speaker_is_measured_against_their_own_loudness() -> None:
    """A word reviewer's second speaker 30 dB below the first was all pause to the word times but their loudest
    syllables (the floor was 40 dB below the chunk's loudest frame: "After" timed over 1.2 s): each frame is now
    measured against the loudest within 0.5 s. Loud speech 0-1 s, silence, then from 2 s a speaker 30 dB quieter
    whose syllables dip 15 dB between peaks (45 dB below the first speaker); the VAD says speech throughout."""
    t = np.arange(4 * SR) / SR
    quiet = 10 ** (-30 / 20) * np.where((t * 5) % 1 < 0.5, 1, 10 ** (-15 / 20))  # 5 syllables a second
    envelope = np.where(t < 1, 1.0, np.where(t < 2, 0.0, quiet))
    samples = (0.5 * envelope * np.sin(2 * np.pi * 220 * t) + 1e-6 * np.sin(2 * np.pi * 50 * t)).astype(np.float32)
    speech = speech_frames(samples, np.ones(4 * SR // FRAME_SAMPLES, np.float32), 0, 0.5)
    frame_s = 0.02
    assert speech[: int(1 / frame_s)].all()
    assert not speech[int(1 / frame_s): int(2 / frame_s)].any()  # silence near loud speech: a pause
    assert speech[int(2 / frame_s):].all()  # the quiet speaker's dips are speech too
