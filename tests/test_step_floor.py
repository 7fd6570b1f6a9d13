"""benchmarks/step_floor.py's per-stage table: the stages' floors add up to the step's, and every stage is timed."""

from __future__ import annotations

import pytest
import torch

from asr_spec.engine.decoder import Decoder
from asr_spec.testing import random_whisper
from benchmarks import step_floor as sf


@pytest.mark.parametrize("weight_itemsize", [None, 2])
def test_the_stage_floors_add_up_to_the_step_floor(weight_itemsize):
    """The same bytes split by stage: weights and caches of every layer, the head; the stages count the final
    LayerNorm besides (the step floor leaves it out); with bf16 weights (the int8 precision's) too."""
    model = random_whisper("test")
    rates = {"read_GB_s": 2.0, "matmul_GFLOP_s": 1e9}  # memory-bound: the floor is the bytes' time
    for batch, n_keys in ((1, 32), (8, 64)):
        stages = sf.stage_floor_ms(model, batch, n_keys, rates["read_GB_s"], weight_itemsize=weight_itemsize)
        step = sf.step_floor_ms(model, batch, 1, n_keys, rates, weight_itemsize=weight_itemsize)
        final_norm = sum(p.numel() for p in model.model.decoder.layer_norm.parameters()) * 4 / 2e9 * 1e3
        assert sum(stages.values()) == pytest.approx(step["mem_ms"] + final_norm, rel=1e-9)
        assert set(stages) == set(sf.STAGES)


def test_bf16_weights_count_two_bytes_a_linear_weight_and_four_the_rest():
    layer = random_whisper("test").model.decoder.layers[0]
    linear = sum(m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear))
    rest = sum(p.numel() for p in layer.parameters()) - linear
    assert sf.module_bytes([layer], 4) == 4 * (linear + rest)
    assert sf.module_bytes([layer], 4, 2) == 2 * linear + 4 * rest


def test_every_stage_is_timed_through_the_decoder():
    model = random_whisper("test").eval()
    dec = Decoder(model.model.decoder, model.proj_out)
    enc = torch.randn(3, model.config.max_source_positions, model.config.d_model)
    ms = sf.stage_ms(dec, enc, 2, 5, 32, repeats=2)
    assert set(ms) == set(sf.STAGES) and all(v > 0 for v in ms.values())


def test_the_layers_are_timed_as_the_step_runs_them(monkeypatch):
    """`layers_ms` runs `Decoder.run_layers` (the one extension call where the decoder has it), once a repeat and
    once to warm up."""
    model = random_whisper("test").eval()
    dec = Decoder(model.model.decoder, model.proj_out)
    enc = torch.randn(3, model.config.max_source_positions, model.config.d_model)
    calls = []
    run = dec.run_layers
    monkeypatch.setattr(dec, "run_layers", lambda *args: calls.append(args[0].shape) or run(*args))
    assert sf.layers_ms(dec, enc, 2, 5, 32, repeats=3) > 0
    assert calls == [torch.Size((2, 1, model.config.d_model))] * 4


def test_rates_around_a_timing_are_the_mean_of_the_rates_just_before_and_just_after_it():
    calls = []
    rates = iter([{"read_GB_s": 20.0, "matmul_GFLOP_s": 300.0}, {"read_GB_s": 30.0, "matmul_GFLOP_s": 100.0}])

    def rates_of():
        calls.append("rates")
        return next(rates)

    def measure():
        calls.append("measure")
        return 12.5

    result, around = sf.rates_around(measure, rates_of)
    assert result == 12.5 and calls == ["rates", "measure", "rates"]
    assert around == {"read_GB_s": 25.0, "matmul_GFLOP_s": 200.0}
