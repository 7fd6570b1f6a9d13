#!/usr/bin/env python
"""Where an offline run's time goes outside the encoder and the decode steps ("admit" and "rest" in
benchmarks/bench.py's stage table), from cProfile's cumulative times of the functions that do that work.

    python -m benchmarks.profile_outside --threads 1                       # the three long fixtures, bf16, batch 8
    python -m benchmarks.profile_outside --threads 2 --dtype float32 --audio a.flac b.flac

One transcription of --audio (default: tests/fixtures/longform/{dense_windows,dialogue_pauses,monologue_speeds}
.opus, 423 s), `Transcriber.from_preset(--preset)` as `bench.py`'s default configuration decodes it, warmed up once,
then run once under cProfile. Printed: the wall and CPU seconds of the profiled run, `Engine.times`' stages and
each part below as cProfile counts it (cumulative seconds and calls; parts may nest: the VAD's model inside the
VAD). cProfile adds a few microseconds to every Python call, so the parts made of many small calls (the VAD's
LSTM loop: one call a 32 ms frame) read high; compare runs of the same tool, not its figures with bench.py's.
The audio is decoded before the timed run (as bench.py gives arrays): file decoding and resampling are not in it.
"""

from __future__ import annotations

import argparse
import cProfile
import logging
import pstats
import sys
import time
import warnings
from pathlib import Path

import torch

from asr_spec import Transcriber
from asr_spec.audio.loading import SAMPLE_RATE, load_audio

LONGFORM = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "longform"
DEFAULT_AUDIO = [str(LONGFORM / f"{name}.opus") for name in ("dense_windows", "dialogue_pauses", "monologue_speeds")]
# (stage, part, (file suffix, function name)): the functions whose cumulative time is each part's
PARTS = (
    ("rest", "voice activity (silero + planning)", ("asr_spec/audio/vad.py", "iter_vad_chunks")),
    ("rest", "  silero model", ("asr_spec/audio/silero.py", "__call__")),
    ("rest", "    its front end (convolutions)", ("asr_spec/audio/silero.py", "front")),
    ("rest", "    its LSTM loop", ("asr_spec/audio/silero.py", "lstm")),
    ("rest", "log-mel features", ("asr_spec/audio/features.py", "log_mel_batch")),
    ("rest", "  transformers' torch extractor", ("feature_extraction_whisper.py", "_torch_extract_fbank_features")),
    ("rest", "finished rows read back", ("asr_spec/engine/results.py", "read_rows")),
    ("rest", "finish (words, tail decision)", ("asr_spec/transcribe/transcriber.py", "finish_result")),
    ("rest", "assemble (stitch, text)", ("asr_spec/transcribe/transcriber.py", "assemble")),
    ("admit", "admission", ("asr_spec/engine/admission.py", "__call__")),
    ("admit", "  audio keys/values (target + draft)", ("asr_spec/engine/decoder_layout.py", "write_audio")),
    ("admit", "  prompt prefill (target + draft)", ("asr_spec/engine/admission.py", "prefill")),
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="base")
    p.add_argument("--audio", nargs="+", default=DEFAULT_AUDIO)
    p.add_argument("--dtype", default="bfloat16", help="auto, float32, bfloat16 (default bfloat16)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--language", default="en")
    return p.parse_args(argv)


def part_times(stats: pstats.Stats) -> list[tuple[str, str, float, int]]:
    """(stage, part, cumulative s, calls) of each of PARTS, summed over the functions that match it."""
    out = []
    for stage, part, (suffix, name) in PARTS:
        seconds, calls = 0.0, 0
        for (path, _line, func), (_cc, n_calls, _tt, cumulative, _callers) in stats.stats.items():
            if func == name and path.replace("\\", "/").endswith(suffix):
                seconds, calls = seconds + cumulative, calls + n_calls
        out.append((stage, part, seconds, calls))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.getLogger("asr_spec").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="English text normaliser built without")
    clips = [{"array": load_audio(path), "sampling_rate": SAMPLE_RATE} for path in args.audio]
    audio_s = sum(len(c["array"]) for c in clips) / SAMPLE_RATE
    transcriber = Transcriber.from_preset(args.preset, dtype=args.dtype, language=args.language)
    transcriber.transcribe(clips, batch_size=args.batch_size, progress=False)  # warm-up
    before = transcriber.engine.times.copy()
    profile = cProfile.Profile()
    wall, cpu = time.perf_counter(), time.process_time()
    profile.runcall(transcriber.transcribe, clips, batch_size=args.batch_size, progress=False)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    stages = transcriber.engine.times.minus(before)
    print(f"{len(clips)} inputs, {audio_s:.1f} s of audio; {args.dtype}, batch {args.batch_size}, "
          f"{torch.get_num_threads()} threads; under cProfile: wall {wall:.2f} s, CPU {cpu:.2f} s")
    rest = wall - stages.encoder_s - stages.steps_s - stages.admit_s
    print(f"stages: encoder {stages.encoder_s:.2f} s ({stages.encoder_calls} calls, {stages.encoder_windows} "
          f"windows), steps {stages.steps_s:.2f} s ({stages.steps}), admit {stages.admit_s:.2f} s, rest {rest:.2f} s")
    for stage, part, seconds, calls in part_times(pstats.Stats(profile)):
        print(f"  {stage:<6} {part:<40} {seconds:7.3f} s {calls:7d} calls")
    return 0


if __name__ == "__main__":
    sys.exit(main())
