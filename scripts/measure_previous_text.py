#!/usr/bin/env python
"""Does conditioning on the previous text help? WER on the long-form fixtures, side by side in one run:

    independent   every chunk of a file decoded on its own (asr-spec's way: chunks batch freely)
    previous      chunk i + 1 of a file gets the text tokens of the chunks before it as its prompt (after
                  <|startofprev|>, the last 223 kept: openai-whisper's condition_on_previous_text), so it waits for
                  chunk i; the files still batch together (round j decodes chunk j of every file in one engine run)

Both from `Transcriber.from_preset(--preset)` with its chunking (voice activity), in timestamp mode, with tail
repair off in both (a tail would need its own conditioning; the comparison is of the conditioning alone), the same
front half (`Transcriber.prepare`) and assembly (`Transcriber.assemble`). WER with Whisper's English normaliser,
per file and over all of them (corpus). Model loading and the front half are outside the timings.

    python scripts/measure_previous_text.py                 # tests/fixtures/longform/*.opus with their .txt
    python scripts/measure_previous_text.py --only dense_windows --batch-size 4
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from asr_spec import Transcriber
from asr_spec.engine import ChunkRequest
from asr_spec.eval.metrics import score
from asr_spec.transcribe.inputs import Input

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "longform"


def prepared(asr: Transcriber, paths: list[Path]) -> tuple[list[Input], list[list[ChunkRequest]]]:
    """Every chunk's request of every file (features made once), grouped per file in chunk order."""
    inputs = [Input(i, str(p), str(p)) for i, p in enumerate(paths)]
    per_file: list[list[ChunkRequest]] = [[] for _ in paths]
    for req in asr.prepare(inputs, 8):
        per_file[req.id.owner].append(req)
    return inputs, per_file


def independent(asr: Transcriber, per_file: list[list[ChunkRequest]], batch_size: int) -> dict:
    requests = [req for reqs in per_file for req in reqs]
    return {r.id: r for r in asr.engine.run(requests, batch_size)}


def previous(asr: Transcriber, per_file: list[list[ChunkRequest]], batch_size: int) -> dict:
    """Round j: chunk j of every file, each prompted with its file's text so far (its last 223 tokens)."""
    eot, limit = asr.tokens.eot, asr.tokens.max_prompt_tokens
    history: list[list[int]] = [[] for _ in per_file]
    results = {}
    for j in range(max(len(reqs) for reqs in per_file)):
        batch = [ChunkRequest(reqs[j].id, reqs[j].features, prompt=tuple(history[f][-limit:]))
                 for f, reqs in enumerate(per_file) if j < len(reqs)]
        for result in asr.engine.run(batch, batch_size):
            results[result.id] = result
            history[result.id.owner].extend(t for t in result.tokens if t < eot)  # text tokens only
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="base")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--only", default=None, help="comma-separated fixture names")
    args = parser.parse_args()
    paths = sorted(FIXTURES.glob("*.opus"))
    if args.only:
        paths = [p for p in paths if p.stem in args.only.split(",")]
    asr = Transcriber.from_preset(args.preset, language="en", tail_repairs=0)
    inputs, per_file = prepared(asr, paths)
    refs = [p.with_suffix(".txt").read_text(encoding="utf-8") for p in paths]
    hyps: dict[str, list[str]] = {}
    for name, decode in (("independent", independent), ("previous", previous)):
        start = time.perf_counter()
        results = decode(asr, per_file, args.batch_size)
        wall_s = time.perf_counter() - start
        hyps[name] = [asr.assemble(item.name, item.spans, [results[r.id] for r in reqs], item.audio_s, 0.0).text
                      for item, reqs in zip(inputs, per_file)]
        print(f"{name}: decoded {sum(map(len, per_file))} chunks of {len(paths)} files in {wall_s:.1f} s, corpus WER "
              f"{score(refs, hyps[name]).wer:.2%}", flush=True)
    print("\n| file | chunks | WER independent | WER previous |\n|---|---|---|---|")
    for i, path in enumerate(paths):
        cells = [f"{score([refs[i]], [hyps[n][i]]).wer:.2%}" for n in ("independent", "previous")]
        print(f"| {path.stem} | {len(per_file[i])} | {cells[0]} | {cells[1]} |")
    total = [f"{score(refs, hyps[n]).wer:.2%}" for n in ("independent", "previous")]
    print(f"| all (corpus) | {sum(map(len, per_file))} | {total[0]} | {total[1]} |")


if __name__ == "__main__":
    main()
