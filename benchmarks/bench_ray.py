"""Throughput of the Ray runner with 1 and 2 CPU workers, side by side in one run (one local Ray instance).

    python -m benchmarks.bench_ray --preset base --workers 1 2 --repeats 2 \
        'tests/fixtures/speech/**/*.flac' 'tests/fixtures/librispeech/**/*.flac'

Each configuration transcribes every file into a fresh JSONL (so nothing is skipped); the order of configurations
alternates between repeats. Wall time is from submitting the pipeline to its last record: it includes starting the
actors and loading the models in them, as a real run does. Throughput = seconds of audio / wall second (RTFx).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from asr_spec import distributed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", help="audio files or glob patterns")
    p.add_argument("--preset", default="base")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--threads-per-worker", type=int, default=1)
    p.add_argument("--files-per-batch", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()

    import json

    import ray

    inputs = distributed.file_inputs(args.files)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path.cwd()), os.environ.get("PYTHONPATH")]))
    need = max(args.workers) * args.threads_per_worker + 1
    ray.init(num_cpus=need, include_dashboard=False, log_to_driver=False, configure_logging=False)
    walls: dict[int, list[float]] = {n: [] for n in args.workers}
    audio_s = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            order = args.workers if rep % 2 == 0 else list(reversed(args.workers))
            for n in order:
                out = Path(tmp) / f"w{n}-r{rep}.jsonl"
                options = distributed.RayOptions(workers=n, threads_per_worker=args.threads_per_worker,
                                                 files_per_batch=args.files_per_batch, progress=False)
                report = distributed.transcribe_dataset(inputs, out, preset=args.preset, options=options, device="cpu")
                records = [json.loads(line) for line in out.read_text().splitlines()]
                audio_s = sum(r["audio_s"] for r in records)
                busy_s = sum(r["wall_s"] for r in records)  # actor time spent transcribing, summed over actors
                walls[n].append(report.wall_s)
                print(f"repeat {rep} workers {n}: {len(records)} files ({report.n_failed} failed), {audio_s:.1f} s "
                      f"audio in {report.wall_s:.1f} s wall: RTFx {audio_s / report.wall_s:.2f}; actors busy "
                      f"{busy_s:.1f} s (transcribing in parallel {busy_s / report.wall_s:.2f} of the wall time)",
                      flush=True)
    ray.shutdown()
    base = statistics.median(walls[args.workers[0]])
    print(f"\n{len(inputs)} files, {audio_s:.1f} s of audio, preset {args.preset}, {args.threads_per_worker} torch "
          f"thread(s) per worker, {args.files_per_batch} files per actor call; median of {args.repeats}")
    print("| workers | wall s | RTFx | throughput vs 1 worker |\n|---|---|---|---|")
    for n in args.workers:
        wall = statistics.median(walls[n])
        print(f"| {n} | {wall:.1f} | {audio_s / wall:.2f} | {base / wall:.2f}x |")


if __name__ == "__main__":
    main()
