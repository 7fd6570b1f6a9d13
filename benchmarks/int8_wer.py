#!/usr/bin/env python
"""What int8 costs in WER and buys in time on whole files, before any engine is built for it: whisper-base in fp32
and with its linear layers int8 (`torch.ao.quantization.quantize_dynamic`: per-channel int8 weights, activations
quantized per call, the path `benchmarks/bench_int8.py` found fastest on AVX2) through transformers' `generate`, on
asr-spec's own voice-activity chunks of each file (greedy, no timestamps, a file's chunk texts joined), side by
side in one run.

    python -m benchmarks.int8_wer --threads 1 --emulate-isa avx2 --scope all --audio \
    tests/fixtures/speech/long_75s.flac tests/fixtures/longform/{dense_windows,dialogue_pauses,monologue_speeds}.opus

--scope all: every linear layer; decoder: the decoder's and the head (the encoder stays fp32). References: each
audio file's `.txt` beside it. Prints per configuration the time of all its `generate` calls and the WER per file
and over all. The harness is transformers' decoding, not asr-spec's engine: its absolute WER is its own (its
batched no-timestamp windows lose text on `dialogue_pauses`); the difference between the columns is int8's.
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

SCOPES = ("all", "decoder")


def int8_copy(model: nn.Module, scope: str, engine: str) -> nn.Module:
    """A copy of a transformers Whisper model with the linear layers of `scope` dynamically quantized (int8
    weights, one scale per output channel) under torch's quantized `engine`."""
    if scope not in SCOPES:
        raise ValueError(f"--scope must be one of {', '.join(SCOPES)}, got {scope!r}")
    torch.backends.quantized.engine = engine
    spec = {nn.Linear: torch.ao.quantization.per_channel_dynamic_qconfig}
    out = copy.deepcopy(model)
    if scope == "all":
        return torch.ao.quantization.quantize_dynamic(out, spec, dtype=torch.qint8)
    out.model.decoder = torch.ao.quantization.quantize_dynamic(out.model.decoder, spec, dtype=torch.qint8)
    out.proj_out = torch.ao.quantization.quantize_dynamic(nn.Sequential(out.proj_out), spec, dtype=torch.qint8)[0]
    return out


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
    p.add_argument("--scope", default="all", choices=SCOPES, help="which linear layers are int8 (default all)")
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
    models = {"fp32": fp32.target, f"int8 ({args.scope}, {args.engine})": int8_copy(fp32.target, args.scope,
                                                                                    args.engine)}
    chunks = [torch.stack([r.features for r in fp32.prepare(run_inputs([a]))]) for a in args.audio]
    refs = [p.read_text() for p in refs_paths]
    print(f"capability {torch.backends.cpu.get_cpu_capability()}, threads {torch.get_num_threads()}; "
          f"chunks per file {[len(c) for c in chunks]}", flush=True)
    side_by_side(models, fp32.processor, dict(zip(args.audio, chunks)), refs, args.batch_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
