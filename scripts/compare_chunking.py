"""Voice-activity vs stride chunking side by side on one long file: WER, encoder passes (chunks), wall time, and
speculative == greedy token for token in each mode.

    python scripts/compare_chunking.py [--audio tests/fixtures/speech/long_75s.flac] [--reference ..._75s.txt]
                                       [--preset base-distilled] [--batch-size 4]

Each configuration is run twice after one warm-up, interleaved; the faster run is reported (the machine may be
shared). Model loading is excluded.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--audio", default=str(ROOT / "tests/fixtures/speech/long_75s.flac"))
    parser.add_argument("--reference", default=str(ROOT / "tests/fixtures/speech/long_75s.txt"))
    parser.add_argument("--preset", default="base-distilled")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    from asr_spec import Transcriber
    from asr_spec.eval.metrics import score

    reference = Path(args.reference).read_text()
    runs = {}
    for mode in ("stride", "vad"):
        spec = Transcriber.from_preset(args.preset, chunking=mode, batch_size=args.batch_size)
        greedy = Transcriber(spec.target, None, spec.processor, spec.options)
        runs[mode] = {"speculative": spec, "greedy": greedy}
        greedy.transcribe(args.audio, progress=False)  # warm-up (and the VAD model's load)
    best: dict[tuple[str, str], tuple[float, object]] = {}
    for _ in range(args.repeats):
        for mode, pair in runs.items():
            for kind, transcriber in pair.items():
                start = time.perf_counter()
                result = transcriber.transcribe(args.audio, progress=False)[0]
                wall = time.perf_counter() - start
                if (mode, kind) not in best or wall < best[mode, kind][0]:
                    best[mode, kind] = (wall, result)
    print(f"{'chunking':8} {'decoding':11} {'chunks':>6} {'WER':>6} {'wall s':>7}  same tokens as greedy")
    for (mode, kind), (wall, result) in best.items():
        same = result.chunk_tokens == best[mode, "greedy"][1].chunk_tokens
        wer = score([reference], [result.text]).wer
        print(f"{mode:8} {kind:11} {len(result.chunks):6d} {wer:6.1%} {wall:7.1f}  {same}")


if __name__ == "__main__":
    main()
