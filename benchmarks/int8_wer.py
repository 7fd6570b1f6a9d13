#!/usr/bin/env python
"""What int8 costs in WER and buys in time on whole files, before any engine is built for it: whisper-base in fp32
and with its linear layers int8 (`torch.ao.quantization.quantize_dynamic`: per-channel int8 weights, activations
quantized per call, the path `benchmarks/bench_int8.py` found fastest on AVX2) through transformers' `generate`, on
asr-spec's own voice-activity chunks of each file (greedy, no timestamps, a file's chunk texts joined), side by
side in one run.

    python -m benchmarks.int8_wer --threads 1 --emulate-isa avx2 --scope all --audio \
    tests/fixtures/speech/long_75s.flac tests/fixtures/longform/{dense_windows,dialogue_pauses,monologue_speeds}.opus

--scope all: every linear layer; decoder: the decoder's and the head (the encoder stays fp32); decoder-static: the
same at fixed activation scales (`int8_paths.static_product`, row-independent: the candidate for a lossless int8
engine), each layer's input and output ranges calibrated on the LibriSpeech fixture utterances (not the files
scored). References: each audio file's `.txt` beside it. Prints per configuration the time of all its `generate`
calls and the WER per file and over all. The harness is transformers' decoding, not asr-spec's engine: its
absolute WER is its own (its batched no-timestamp windows lose text on `dialogue_pauses`); the difference between
the columns is int8's.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

from asr_spec import Transcriber
from asr_spec.eval.metrics import score
from asr_spec.transcribe.inputs import run_inputs
from benchmarks.bench import EMULATED_ISA, emulate
from benchmarks.int8_paths import static_product

SCOPES = ("all", "decoder", "decoder-static")
CALIBRATION = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "librispeech"
Ranges = dict[str, tuple[tuple[float, float], tuple[float, float]]]  # layer -> ((x low, high), (y low, high))


class StaticLinear(nn.Module):
    """An nn.Linear's product through `int8_paths.static_product` at calibrated ranges. (..., d_in) -> (..., d_out)"""

    def __init__(self, linear: nn.Linear, x_range: tuple[float, float], y_range: tuple[float, float], engine: str):
        super().__init__()
        self.d_out = linear.out_features
        bias = None if linear.bias is None else linear.bias.detach()
        self.product = static_product(engine, linear.weight.detach(), bias, x_range, y_range)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x.reshape(-1, x.shape[-1]).contiguous()).view(*x.shape[:-1], self.d_out)


def decoder_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The decoder's linear layers and the head, by their names in `model`."""
    found = {f"model.decoder.{n}": m for n, m in model.model.decoder.named_modules() if isinstance(m, nn.Linear)}
    return found | {"proj_out": model.proj_out}


def calibrate(model: nn.Module, processor, features: torch.Tensor) -> Ranges:
    """Each decoder linear layer's input and output range over greedy decoding of `features` (n, mels, frames)."""
    ranges: Ranges = {}

    def hook(name: str):
        def record(_module, inputs, output) -> None:
            (xl, xh), (yl, yh) = ranges.get(name, ((0.0, 0.0), (0.0, 0.0)))
            x = inputs[0]
            ranges[name] = ((min(xl, x.min().item()), max(xh, x.max().item())),
                            (min(yl, output.min().item()), max(yh, output.max().item())))
        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in decoder_linears(model).items()]
    try:
        decode(model, processor, features, 8)
    finally:
        for h in handles:
            h.remove()
    return ranges


def int8_copy(model: nn.Module, scope: str, engine: str, ranges: Ranges | None = None) -> nn.Module:
    """A copy of a transformers Whisper model with the linear layers of `scope` int8 (weights one scale per output
    channel) under torch's quantized `engine`: dynamically quantized, or for decoder-static at the `ranges` of
    `calibrate`."""
    if scope not in SCOPES:
        raise ValueError(f"--scope must be one of {', '.join(SCOPES)}, got {scope!r}")
    torch.backends.quantized.engine = engine
    spec = {nn.Linear: torch.ao.quantization.per_channel_dynamic_qconfig}
    out = copy.deepcopy(model)
    if scope == "all":
        return torch.ao.quantization.quantize_dynamic(out, spec, dtype=torch.qint8)
    if scope == "decoder":
        out.model.decoder = torch.ao.quantization.quantize_dynamic(out.model.decoder, spec, dtype=torch.qint8)
        out.proj_out = torch.ao.quantization.quantize_dynamic(nn.Sequential(out.proj_out), spec, dtype=torch.qint8)[0]
        return out
    if ranges is None:
        raise ValueError("--scope decoder-static needs calibrated ranges")
    for name, linear in decoder_linears(out).items():
        parent, _, attr = name.rpartition(".")
        setattr(out.get_submodule(parent), attr, StaticLinear(linear, *ranges[name], engine))
    return out


def features_of(transcriber: Transcriber, audio: list[str]) -> torch.Tensor:
    """The log-mel features of the files' chunks as asr-spec cuts them (voice activity). (n, mels, frames)"""
    return torch.stack([r.features for r in transcriber.prepare(run_inputs(audio))])


def decode(model: nn.Module, processor, features: torch.Tensor, batch_size: int) -> str:
    """One file's chunks (n, n_mels, n_frames) decoded greedily in batches, their texts joined."""
    texts = []
    for batch in features.split(batch_size):
        ids = model.generate(input_features=batch, language="en", task="transcribe", num_beams=1, do_sample=False)
        texts += processor.batch_decode(ids, skip_special_tokens=True)
    return " ".join(t.strip() for t in texts)


def side_by_side(models: dict[str, nn.Module], processor, chunks: dict[str, torch.Tensor], refs: list[str],
                 batch_size: int) -> None:
    """Each model over every file's chunks (after one warm-up call each), its time and WER printed."""
    for model in models.values():
        decode(model, processor, next(iter(chunks.values()))[:1], 1)
    for name, model in models.items():
        start = time.perf_counter()
        hyps = [decode(model, processor, c, batch_size) for c in chunks.values()]
        seconds = time.perf_counter() - start
        per_file = ", ".join(f"{Path(a).stem} {score([r], [h]).wer * 100:.2f}" for a, r, h in zip(chunks, refs, hyps))
        print(f"{name:<22} generate {seconds:7.1f} s   WER {score(refs, hyps).wer * 100:.2f} %   ({per_file})",
              flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--audio", nargs="+", required=True, help="audio files, each with its reference .txt beside it")
    p.add_argument("--scope", default="all", choices=SCOPES,
                   help="which linear layers are int8, and how (default all)")
    p.add_argument("--calibration", nargs="+",
                   help="audio whose chunks calibrate --scope decoder-static (default: the LibriSpeech fixtures)")
    p.add_argument("--engine", default="x86", choices=("x86", "onednn"), help="torch's quantized engine (x86: fbgemm)")
    p.add_argument("--batch-size", type=int, default=8, help="chunks per generate call (default 8)")
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0 = torch's default")
    p.add_argument("--emulate-isa", choices=sorted(EMULATED_ISA), help="run as on a CPU of this class")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.emulate_isa:
        emulate(args.emulate_isa, argv, "benchmarks.int8_wer")
    refs_paths = [Path(a).with_suffix(".txt") for a in args.audio]
    missing = [str(p) for p in refs_paths if not p.is_file()]
    if missing:
        print(f"error: --audio: no reference {', '.join(missing)}", file=sys.stderr)
        return 2
    if args.batch_size < 1:
        print(f"error: --batch-size must be >= 1, got {args.batch_size}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    fp32 = Transcriber.from_preset("base", language="en", dtype="float32", draft=None)
    ranges = None
    if args.scope == "decoder-static":
        calibration = args.calibration or [str(f) for f in sorted(CALIBRATION.rglob("*.flac"))]
        ranges = calibrate(fp32.target, fp32.processor, features_of(fp32, calibration))
    models = {"fp32": fp32.target,
              f"int8 ({args.scope}, {args.engine})": int8_copy(fp32.target, args.scope, args.engine, ranges)}
    chunks = [features_of(fp32, [a]) for a in args.audio]
    refs = [p.read_text() for p in refs_paths]
    print(f"capability {torch.backends.cpu.get_cpu_capability()}, threads {torch.get_num_threads()}; "
          f"chunks per file {[len(c) for c in chunks]}", flush=True)
    side_by_side(models, fp32.processor, dict(zip(args.audio, chunks)), refs, args.batch_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
