"""Stage times on a CPU: what `Engine.times` counts and how benchmarks/bench.py reports them beside each row."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_target

from asr_spec.engine import DecodeOptions, Engine, memory
from asr_spec.engine.stats import StageTimes
from asr_spec.models.cpu import CpuCapabilities
from asr_spec.models.presets import load_preset
from benchmarks.bench import default_plan
from benchmarks.bench_report import Result, speculation_bound, stage_table, table


def test_stage_times_count_only_where_enabled():
    times = StageTimes()
    with times.count("steps", True):
        pass
    with times.count("encoder", True):
        pass
    with times.count("steps", False):
        pass
    assert times.steps == 1 and times.steps_s >= 0 and times.encoder_s >= 0
    before = times.copy()
    with times.count("steps", True):
        pass
    assert times.minus(before).steps == 1 and before.steps == 1


def test_an_engine_run_counts_its_encoder_and_every_step():
    engine = Engine(tiny_target(), None, DecodeOptions(language="en", max_new_tokens=5))
    features = torch.randn(3, 16, 100, generator=torch.Generator().manual_seed(0))
    results = engine.decode(features, batch_size=2)
    assert engine.times.encoder_s > 0 and engine.times.steps_s > 0 and engine.times.admit_s > 0
    # the first fill encodes a micro-batch of batch_size windows, the refill the third alone
    assert (engine.times.encoder_calls, engine.times.encoder_windows) == (2, 3)
    # each step advances every live row by one token (greedy): at least the longest row's count of steps
    assert engine.times.steps >= max(len(r.tokens) for r in results) - 1


def test_a_cpu_engine_encodes_at_most_a_few_windows_a_call():
    """memory.encode_batch: a CPU run of 8 rows encodes its 8 windows MAX_ENCODE_BATCH_CPU at a time (the
    activations' bound), every window once; a GPU's calls may hold up to MAX_ENCODE_BATCH."""
    cap = memory.MAX_ENCODE_BATCH_CPU
    assert memory.encode_batch(2, torch.device("cpu")) == 2
    assert memory.encode_batch(64, torch.device("cuda")) == memory.MAX_ENCODE_BATCH > cap
    engine = Engine(tiny_target(), None, DecodeOptions(language="en", max_new_tokens=3))
    features = torch.randn(8, 16, 100, generator=torch.Generator().manual_seed(1))
    results = engine.decode(features, batch_size=8)
    assert len(results) == 8 and engine.times.encoder_windows == 8
    assert engine.times.encoder_calls == -(-8 // cap) > 1


def test_the_stage_table_gives_the_rest_and_the_ratio_to_greedy():
    greedy = Result("greedy", 8, 10.0, ["a"], tokens_per_target_pass=1.0,
                    stages={"encoder_s": 2.0, "steps_s": 6.0, "steps": 100})
    spec = Result("spec", 8, 7.0, ["a"], tokens_per_target_pass=3.0,
                  stages={"encoder_s": 2.0, "steps_s": 3.0, "steps": 30, "admit_s": 0.5})
    fw = Result("fw", 8, 5.0, ["a"])
    _, rows = table([greedy, spec, fw], 60.0, [None])
    by = {row["config"]: row["stages"] for row in rows}
    assert by["fw"] is None
    # the rest is what neither the encoder, the steps nor the admissions took (none counted: 0)
    assert by["spec"]["rest_s"] == 1.5 and by["greedy"]["rest_s"] == 2.0 and by["spec"]["ms_per_step"] == 100.0
    assert by["spec"]["steps_vs_greedy"] == 2.0 and by["greedy"]["steps_vs_greedy"] == 1.0
    # 3 tokens a pass at a greedy step's cost: greedy's 6 s of steps in 2 s, its other 4 s as they were
    assert by["spec"]["bound_vs_greedy"] == pytest.approx(10.0 / 6.0) and by["greedy"]["bound_vs_greedy"] == 1.0
    text = stage_table(rows)
    assert len(text.splitlines()) == 4 and "(4) asr-spec speculative" in text and "faster-whisper" not in text


def test_the_speculation_bound_is_amdahls_over_the_steps():
    assert speculation_bound(10.0, 0.0, 4.0) == 1.0  # nothing to speed up
    assert speculation_bound(10.0, 5.0, 1.0) == 1.0  # one token a pass: a greedy step
    assert speculation_bound(6.6, 2.4, 3.28) == pytest.approx(6.6 / (4.2 + 2.4 / 3.28))
    # more tokens a pass approach, never reach, the bound of free steps: wall / (wall - steps)
    assert speculation_bound(10.0, 4.0, 3.0) < speculation_bound(10.0, 4.0, 1e9) < 10.0 / 6.0
    for bad in ((10.0, 10.0, 3.0), (10.0, -1.0, 3.0), (10.0, 4.0, 0.5)):
        with pytest.raises(ValueError):
            speculation_bound(*bad)


def test_the_preset_default_column_decides_the_draft_for_the_runs_dtype():
    """benchmarks/bench.py's (7) with --dtype: the draft decodes the rows that dtype's class gives it, as the CLI
    decides (an AVX-512-BF16 CPU: bf16 runs of 8 rows, the int8 precision's 1, fp32's 4), not the preset dtype's."""
    base, cpu = load_preset("base"), CpuCapabilities(avx512_bf16=True, avx512_vnni=True, avx2=True)
    assert default_plan(base, "cpu", None, cpu=cpu).draft_max_rows == 8  # the preset's auto: bf16 here
    assert default_plan(base, "cpu", "int8", cpu=cpu).draft_max_rows == 1
    assert default_plan(base, "cpu", "float32", cpu=cpu).draft_max_rows == 4
