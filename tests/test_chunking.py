"""Chunk planning: same seams as transformers' ``chunk_iter``; kept middles tile the signal; streaming == planning."""

from __future__ import annotations

import numpy as np
import pytest
from transformers.pipelines.automatic_speech_recognition import chunk_iter

from asr_spec.audio.chunking import ChunkingOptions, ChunkSpan, iter_chunks, plan_chunks, quiet_offset
from asr_spec.errors import InputError


class _IdentityFeatures:
    """Stands in for a feature extractor in ``chunk_iter``: reports which sample each chunk starts at."""

    sampling_rate = 16_000

    def __call__(self, chunk: np.ndarray, **_: object) -> dict[str, float]:
        return {"first": float(chunk[0]), "n": len(chunk)}


def _reference_plan(n: int, chunk: int, left: int, right: int) -> list[tuple[int, int, int, int, bool]]:
    signal = np.arange(n, dtype=np.float64)  # sample value == sample index
    out = []
    for item in chunk_iter(signal, _IdentityFeatures(), chunk, left, right):
        length, stride_left, stride_right = item["stride"]
        start = int(item["first"])
        out.append((start, start + length, stride_left, stride_right, item["is_last"]))
    return out


def _as_tuples(spans: list[ChunkSpan]) -> list[tuple[int, int, int, int, bool]]:
    return [(s.start_sample, s.end_sample, s.stride_left_samples, s.stride_right_samples, s.is_last) for s in spans]


CONFIGS = [(30, 5, 5), (30, 0, 0), (30, 7, 3), (30, 0, 9), (16, 5, 5), (7, 3, 3), (480, 80, 80)]


@pytest.mark.parametrize("chunk,left,right", CONFIGS)
def test_plan_matches_transformers_chunk_iter(chunk: int, left: int, right: int) -> None:
    rng = np.random.default_rng(chunk * 100 + left * 10 + right)
    lengths = list(range(0, 3 * chunk)) + [int(x) for x in rng.integers(1, 40 * chunk, size=40)]
    for n in lengths:
        assert _as_tuples(plan_chunks(n, chunk, left, right)) == _reference_plan(n, chunk, left, right), n


@pytest.mark.parametrize("chunk,left,right", CONFIGS)
def test_kept_middles_tile_the_signal_exactly(chunk: int, left: int, right: int) -> None:
    for n in [1, 2, chunk - 1, chunk, chunk + 1, 5 * chunk + 3, 17 * chunk]:
        spans = plan_chunks(n, chunk, left, right)
        owners = np.zeros(n, dtype=int)
        for span in spans:
            assert span.keep_start_sample < span.keep_end_sample
            owners[span.keep_start_sample : span.keep_end_sample] += 1
        assert (owners == 1).all(), (n, spans)
        assert spans[0].is_first and spans[0].start_sample == 0 and spans[0].stride_left_samples == 0
        assert spans[-1].is_last and spans[-1].end_sample == n and spans[-1].stride_right_samples == 0
        assert [s.is_last for s in spans].count(True) == 1
        assert [s.is_first for s in spans].count(True) == 1
        assert all(s.n_samples <= chunk for s in spans)


def test_empty_and_short_signals() -> None:
    assert plan_chunks(0, 480_000, 80_000, 80_000) == []
    (only,) = plan_chunks(1_600, 480_000, 80_000, 80_000)  # 0.1 s
    assert only == ChunkSpan(0, 1_600, 0, 0, is_first=True, is_last=True)
    (exact,) = plan_chunks(480_000, 480_000, 80_000, 80_000)
    assert exact.end_sample == 480_000 and exact.is_last


def test_two_hours_of_30s_chunks() -> None:
    spans = ChunkingOptions().plan(2 * 3600 * 16_000)
    assert len(spans) == 360  # 20 s step, the last chunk starts at 7180 s and runs 20 s to the end
    assert spans[1].start_sample == 20 * 16_000


@pytest.mark.parametrize(
    "args",
    [(-1, 30, 5, 5), (100, 30, -5, 5), (100, 30, 5, -1), (100, 10, 5, 5), (100, 10, 6, 5), (100, 0, 0, 0)],
)
def test_invalid_plans_raise_naming_the_values(args: tuple[int, int, int, int]) -> None:
    with pytest.raises(InputError) as err:
        plan_chunks(*args)
    assert any(str(v) in str(err.value) for v in args if v != 100)


def test_non_integer_sample_counts_are_rejected() -> None:
    with pytest.raises(InputError, match="n_samples"):
        plan_chunks(100.0, 30, 5, 5)  # type: ignore[arg-type]


def test_options_default_stride_is_a_sixth_per_side() -> None:
    options = ChunkingOptions()
    assert (options.chunk_samples, options.stride_left_samples, options.stride_right_samples) == (
        480_000,
        80_000,
        80_000,
    )
    options = ChunkingOptions(chunk_length_s=20.0, stride_length_s=(2.0, 3.0))
    assert (options.chunk_samples, options.stride_left_samples, options.stride_right_samples) == (
        320_000,
        32_000,
        48_000,
    )


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"chunk_length_s": 40.0}, "chunk_length_s"),
        ({"chunk_length_s": 0}, "chunk_length_s"),
        # the user's own fields named, not the samples they become (`stride_left_samples`, `chunk_samples`)
        ({"stride_length_s": 15.0}, r"stride_length_s 15.0: the strides \(15 \+ 15 s\) must be shorter than "
                                    r"chunk_length_s \(30 s\)"),
        ({"stride_length_s": (1.0, 2.0, 3.0)}, "stride_length_s"),
        ({"stride_length_s": -1.0}, "stride_length_s must be >= 0 seconds, got -1.0"),
        ({"stride_length_s": (2.0, -0.5)}, "stride_length_s must be >= 0 seconds"),
        ({"snap_to_quiet": "no"}, "snap_to_quiet must be true or false, got 'no'"),  # "no" is true: it snapped
        ({"stride_length_s": float("inf")}, "finite numbers of seconds"),  # an OverflowError traceback before
        ({"stride_length_s": (0.0, float("nan"))}, "finite numbers of seconds"),
        ({"sampling_rate": 0}, "sampling_rate"),
    ],
)
def test_options_are_validated(kwargs: dict, needle: str) -> None:
    with pytest.raises(InputError, match=needle):
        ChunkingOptions(**kwargs)


def _blocks(signal: np.ndarray, sizes: np.ndarray):
    position = 0
    for size in sizes:
        yield signal[position : position + size]
        position += size
        if position >= len(signal):
            return


@pytest.mark.parametrize("chunk,left,right", [(30, 5, 5), (30, 0, 0), (16, 5, 2), (480, 80, 80)])
def test_streaming_yields_the_planned_chunks(chunk: int, left: int, right: int) -> None:
    rng = np.random.default_rng(chunk + left)
    for n in [0, 1, chunk - 1, chunk, chunk + 1, 7 * chunk + 5] + [int(x) for x in rng.integers(1, 20 * chunk, 10)]:
        signal = rng.standard_normal(n).astype(np.float32)
        sizes = rng.integers(1, 3 * chunk, size=n + 1)  # random block sizes, some larger than a chunk
        pairs = list(iter_chunks(_blocks(signal, sizes), chunk, left, right))
        assert [span for span, _ in pairs] == plan_chunks(n, chunk, left, right)
        for span, samples in pairs:
            np.testing.assert_array_equal(samples, signal[span.start_sample : span.end_sample])
            assert samples.dtype == np.float32


def test_streaming_reads_only_about_one_chunk_ahead() -> None:
    chunk, block = 1_000, 300
    n_pulled = 0

    def source():
        nonlocal n_pulled
        for _ in range(50):  # 15 000 samples: 15 chunks' worth
            n_pulled += 1
            yield np.ones(block, dtype=np.float32)

    for span, _ in iter_chunks(source(), chunk, 100, 100):
        # to emit a chunk it needs its samples plus one more (is it the last?), never the rest of the stream
        assert n_pulled * block <= span.end_sample + 1 + block


def test_streaming_rejects_bad_blocks_and_bad_args() -> None:
    with pytest.raises(InputError, match="1-D"):
        list(iter_chunks([np.zeros((2, 5), dtype=np.float32)], 30, 5, 5))
    with pytest.raises(InputError, match="chunk_samples"):
        iter_chunks([], 10, 5, 5)  # raised at the call, not at the first next()


def test_quiet_offset_picks_the_frame_with_least_energy() -> None:
    samples = np.ones(100, dtype=np.float32)
    samples[40:50] = 0.01  # the quiet frame: [40, 50)
    samples[55:60] = 0.0  # half a frame of silence counts less than a whole quiet frame
    assert quiet_offset(samples, 10) == 40
    assert quiet_offset(samples[:45], 10) == 0  # only whole frames: [40, 50) does not fit; a tie -> the earliest
    assert quiet_offset(samples, 0) == 0 and quiet_offset(samples[:5], 10) == 0


def _pauses_signal(n: int, pause_every: int, rng: np.random.Generator) -> np.ndarray:
    signal = rng.standard_normal(n).astype(np.float32)
    for at in range(pause_every // 2, n, pause_every):
        signal[at : at + 20] *= 1e-3  # a 20-sample pause
    return signal


@pytest.mark.parametrize("chunk,left,right", [(300, 50, 50), (300, 70, 30), (160, 50, 20)])
def test_snapped_windows_start_at_a_pause_and_keep_the_grids_kept_parts(chunk: int, left: int, right: int) -> None:
    rng = np.random.default_rng(chunk + left)
    for n in [1, chunk, chunk + 1, chunk + left + 7, 7 * chunk + 5] + [int(x) for x in rng.integers(1, 20 * chunk, 8)]:
        signal = _pauses_signal(n, 37, rng)
        sizes = rng.integers(1, 3 * chunk, size=n + 1)
        pairs = list(iter_chunks(_blocks(signal, sizes), chunk, left, right, quiet_frame_samples=10))
        grid = plan_chunks(n, chunk, left, right)
        spans = [span for span, _ in pairs]
        # the kept parts start where the grid's do (the last may reach the end a window early) and tile [0, n)
        assert [s.keep_start_sample for s in spans] == [g.keep_start_sample for g in grid[: len(spans)]]
        owners = np.zeros(n, dtype=int)
        for span in spans:
            owners[span.keep_start_sample : span.keep_end_sample] += 1
        assert (owners == 1).all()
        assert spans[-1].is_last and spans[-1].end_sample == n and spans[-1].stride_right_samples == 0
        for span, samples in pairs:
            np.testing.assert_array_equal(samples, signal[span.start_sample : span.end_sample])
            assert span.n_samples <= chunk and span.stride_left_samples >= 0
            if not span.is_first:  # the start is the quietest whole 10-sample frame of the grid's left stride
                grid_start = span.keep_start_sample - left
                expected = grid_start + quiet_offset(signal[grid_start : span.keep_start_sample], 10)
                assert span.start_sample == expected
                assert span.n_samples == min(chunk, n - span.start_sample)


def test_snapped_window_opens_in_the_pause_not_inside_a_word() -> None:
    signal = np.ones(1000, dtype=np.float32)
    signal[230:250] = 0.0  # the only pause in the second window's left stride [200, 250)
    spans = [span for span, _ in iter_chunks([signal], 300, 50, 50, quiet_frame_samples=10)]
    assert spans[1].start_sample == 230 and spans[1].stride_left_samples == 20
    assert spans[1].end_sample == 530 and spans[1].stride_right_samples == 80  # full length: the right stride grows
    assert spans[1].keep_start_sample == 250 and spans[1].keep_end_sample == 450  # the grid's kept part
    fixed = [span for span, _ in iter_chunks([signal], 300, 50, 50)]
    assert fixed == plan_chunks(1000, 300, 50, 50)  # 0 (the default of the function) keeps the fixed grid


def test_options_snap_by_default_and_can_keep_the_grid() -> None:
    assert ChunkingOptions().quiet_frame_samples == 1600  # 100 ms at 16 kHz
    assert ChunkingOptions(snap_to_quiet=False).quiet_frame_samples == 0
    with pytest.raises(InputError, match="quiet_frame_samples"):
        iter_chunks([], 30, 5, 5, quiet_frame_samples=-1)
