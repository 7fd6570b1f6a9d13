"""benchmarks/bench_int8.py's pure parts: argument checks, shapes, the speed-up and per-pass tables on made-up
timings, and that every int8 path computes the product it stands for (never a wall time)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from benchmarks.bench_int8 import (
    N_AUDIO_CTX,
    Row,
    Shape,
    batch_effect,
    check_args,
    format_rows,
    format_totals,
    isa_line,
    parse_args,
    parse_counts,
    pass_totals,
    pick_paths,
    rows_of,
    shapes,
    weight_copies,
)
from benchmarks.int8_paths import PATHS, affine_params, quantize_weight


def test_counts_are_checked_and_name_the_option():
    assert parse_counts("1,8", "--encoder-batches") == [1, 8]
    for bad in ("0", "a", "", "1,-2"):
        with pytest.raises(ValueError, match="--decoder-rows"):
            parse_counts(bad, "--decoder-rows")


def test_arguments_are_checked_before_anything_runs():
    shapes_, paths = check_args(parse_args(["--encoder-batches", "", "--decoder-rows", "8"]))
    assert {s.stage for s in shapes_} == {"decoder"} and len(paths) == len(PATHS)
    for argv, option in ((["--repeats", "0"], "--repeats"), (["--stream-mb", "0"], "--stream-mb"),
                         (["--threads", "-1"], "--threads"), (["--paths", "int4"], "--paths"),
                         (["--encoder-batches", "", "--decoder-rows", ""], "both empty")):
        with pytest.raises(ValueError, match=option):
            check_args(parse_args(argv))


def test_picked_paths_keep_every_fp32_path_in_order():
    names = [p.name for p in pick_paths("_int_mm,dynamic onednn")]
    fp32 = [p.name for p in PATHS if not p.int8]
    assert names == [*fp32, "dynamic onednn", "_int_mm"]


def test_shapes_are_whisper_base_products_counted_per_pass():
    all_shapes = shapes([1, 8], [8])
    encoder = [s for s in all_shapes if s.stage == "encoder"]
    assert {s.rows for s in encoder} == {N_AUDIO_CTX, 8 * N_AUDIO_CTX}
    step = {s.name: s for s in all_shapes if s.stage == "decoder"}
    assert step["head"].d_out == 51_865 and step["head"].per_pass == 1
    assert step["q/k/v/out"].per_pass == 36 and step["fc2"].d_in == 2048
    # a whole encoder layer set: 4 projections + fc1 + fc2 per layer, 6 layers
    assert sum(s.per_pass for s in encoder if s.rows == N_AUDIO_CTX) == 36


def test_decoder_weights_stream_from_memory_and_encoder_ones_do_not():
    enc, head, small = Shape("encoder", "fc1", 1500, 512, 2048, 6), Shape("decoder", "head", 8, 512, 51_865, 1), \
        Shape("decoder", "fc1", 8, 512, 2048, 6)
    assert weight_copies(enc, 190) == 1
    assert weight_copies(head, 190) == 2  # 106 MB of fp32 a copy
    assert weight_copies(small, 190) == 46 and weight_copies(small, 0.001) == 1


def test_speedups_are_against_the_fastest_fp32_path():
    shape = Shape("decoder", "fc1", 8, 512, 2048, 6)
    paths = pick_paths("dynamic onednn")
    samples = {"fp32 F.linear": [3.0, 2.0, 9.0], "fp32 oneDNN": [4.0], "fp32 oneDNN packed": [2.5],
               "dynamic onednn": [1.0, 0.5, 2.0]}
    accuracy = dict.fromkeys(samples, (0.01, 0.0)) | {"dynamic onednn": (0.02, math.nan)}
    rows = {r.path: r for r in rows_of(shape, paths, samples, accuracy)}
    assert rows["fp32 F.linear"].ms == 3000.0 and rows["fp32 oneDNN packed"].speedup == 1.0
    assert rows["dynamic onednn"].speedup == 2.5 and rows["fp32 oneDNN"].speedup == 0.625
    text = format_rows(list(rows.values()))
    assert text.splitlines()[0] == shape.label and len(text.splitlines()) == 6
    assert text.splitlines()[-1].split()[-2:] == ["2.0e-02", "-"]  # a batch effect not measured


def test_pass_totals_weight_each_shape_by_its_count_and_skip_partly_timed_paths():
    a, b = Shape("decoder", "fc1", 8, 512, 2048, 6), Shape("decoder", "head", 8, 512, 51_865, 1)
    paths = pick_paths("dynamic onednn,weight-only int8")

    def row(shape, path, ms):
        return Row(shape.label, path, "x", ms, 1.0, 0.0, 0.0)

    rows = [row(a, "fp32 F.linear", 2.0), row(a, "fp32 oneDNN", 3.0), row(a, "fp32 oneDNN packed", 1.0),
            row(b, "fp32 F.linear", 10.0), row(b, "fp32 oneDNN", 20.0), row(b, "fp32 oneDNN packed", 30.0),
            row(a, "dynamic onednn", 0.5), row(b, "dynamic onednn", 4.0), row(a, "weight-only int8", 0.1)]
    (total,) = pass_totals([a, b], rows, paths)
    assert total["stage"] == "decoder" and total["rows"] == 8
    assert total["best_fp32_ms"] == 6 * 1.0 + 10.0  # the fastest fp32 path at each shape
    assert total["paths"]["dynamic onednn"] == {"ms": 7.0, "speedup": 16.0 / 7.0}
    assert total["paths"]["fp32 oneDNN packed"]["ms"] == 36.0
    assert "weight-only int8" not in total["paths"]  # not timed at the head
    text = format_totals([total])
    assert text.startswith("decode step at 8 rows: best fp32 16.00 ms")
    assert text.splitlines()[1].split()[:2] == ["dynamic", "onednn"]  # fastest first


def test_the_instructions_line_names_each_library_limit():
    line = isa_line({"ONEDNN_MAX_CPU_ISA": "AVX2", "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2"})
    assert line == "instructions: MKL native, oneDNN AVX2, fbgemm AVX2, ATen native"


def test_weights_quantize_per_channel_and_activations_keep_zero_exact():
    w = torch.tensor([[0.5, -1.27, 0.0], [0.0, 0.0, 0.0]])
    q, scales = quantize_weight(w)
    assert q.dtype == torch.int8 and q[0].tolist() == [50, -127, 0] and scales[1] == 1.0
    scale, zero = affine_params(torch.tensor([0.5, 2.0]))  # 7-bit activations: [0, 127]
    assert zero == 0 and scale == pytest.approx(2.0 / 127)
    scale, zero = affine_params(torch.tensor([-1.0, 0.27]))
    assert scale == pytest.approx(0.01) and zero == 100


@pytest.mark.parametrize("path", [p for p in PATHS if p.runs_at(8)], ids=lambda p: p.name)
def test_every_path_computes_the_linear_layer(path):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 64, generator=gen)
    w, b = torch.randn(48, 64, generator=gen) / 8, torch.randn(48, generator=gen) / 10
    y, reference = path.prepare(w, b, x)(x), F.linear(x, w, b)
    assert y.shape == reference.shape and y.dtype == torch.float32
    tolerance = 0.05 if path.int8 else 1e-5  # int8: a few quantization steps of the output's range
    assert (y - reference).abs().max() <= tolerance * reference.abs().max()


def test_the_wer_harness_quantizes_the_scope_it_names_and_nothing_else():
    from conftest import tiny_target

    from benchmarks.int8_wer import int8_copy

    model = tiny_target()
    dynamic = torch.ao.nn.quantized.dynamic.Linear
    decoder_only = int8_copy(model, "decoder", "x86")
    assert isinstance(decoder_only.proj_out, dynamic) and isinstance(decoder_only.model.decoder.layers[0].fc1, dynamic)
    assert type(decoder_only.model.encoder.layers[0].fc1) is torch.nn.Linear
    assert isinstance(int8_copy(model, "all", "x86").model.encoder.layers[0].fc1, dynamic)
    assert type(model.proj_out) is torch.nn.Linear  # the original is left as it was
    with pytest.raises(ValueError, match="--scope"):
        int8_copy(model, "encoder", "x86")


def test_static_int8_layers_take_their_calibrated_ranges_and_stay_close_to_fp32():
    from conftest import tiny_target

    from benchmarks.int8_wer import StaticLinear, decoder_linears, int8_copy

    model = tiny_target()
    with pytest.raises(ValueError, match="calibrated"):
        int8_copy(model, "decoder-static", "x86")
    x = torch.randn(2, 5, model.config.d_model, generator=torch.Generator().manual_seed(0))
    fc1 = model.model.decoder.layers[0].fc1
    reference = fc1(x)
    ranges = dict.fromkeys(decoder_linears(model), ((float(x.min()), float(x.max())),
                                                     (float(reference.min()), float(reference.max()))))
    static = int8_copy(model, "decoder-static", "x86", ranges)
    layer = static.model.decoder.layers[0].fc1
    assert isinstance(layer, StaticLinear) and isinstance(static.proj_out, StaticLinear)
    assert type(static.model.encoder.layers[0].fc1) is torch.nn.Linear
    y = layer(x)
    assert y.shape == reference.shape
    assert (y - reference).abs().max() <= 0.05 * reference.abs().max()
    assert torch.equal(layer(x[:1]), y[:1])  # a row's result does not depend on the rows beside it


def test_the_batch_effect_sees_a_row_that_depends_on_its_neighbours():
    x = torch.tensor([[1.0, -2.0], [30.0, 4.0]])

    def per_tensor(t):  # a product whose rounding step is set by the largest value of the whole call
        step = t.abs().max() / 7
        return torch.round(t / step) * step

    assert batch_effect(per_tensor, x, per_tensor(x)) > 0.01
    assert batch_effect(lambda t: t * 3, x, x * 3) == 0.0
    assert math.isnan(batch_effect(lambda _t: x, x, x))  # ignores its input
