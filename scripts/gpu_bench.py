#!/usr/bin/env python
"""GPU check of the decode step (run by scripts/gpu_check.sh): large-v2-shaped random weights with a 2-layer draft
(distil-large-v2's shape), batch 1/4/16, greedy vs speculative, eager vs CUDA graphs; a table and a JSON file.

Random encoder outputs stand in for audio (decoding speed does not depend on their values); EOS is suppressed so
every row decodes --new-tokens tokens. Each configuration runs once as warm-up (CUDA graphs are captured there),
then --repeats timed runs (device synchronised); the median is kept. Checks printed with the figures: graphs give
the eager step's tokens exactly; speculative tokens vs greedy (fp16: may differ only at near-ties).

    python scripts/gpu_bench.py --json gpu_bench.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from asr_spec.engine import DecodeOptions, Engine
from asr_spec.models.loading import decoder_draft
from asr_spec.testing import random_whisper


def run(target, draft, enc, batch, n_new, k, graphs, repeats):
    opts = DecodeOptions(language="en", max_new_tokens=n_new, num_draft_tokens=k, cuda_graphs=graphs)
    engine = Engine(target, draft, opts)
    results = engine.decode(None, enc[:batch], batch)  # warm-up: captures the graphs
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        results = engine.decode(None, enc[:batch], batch)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    passes = sum(r.stats.target_passes for r in results)
    return seconds, [r.tokens for r in results], passes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="1,4,16")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--num-draft-tokens", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_bench.py needs a CUDA GPU")
    dtype = getattr(torch, args.dtype)
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    target = random_whisper("large-v2").to(dev, dtype).eval()
    draft = decoder_draft(random_whisper("distil-large-v2", seed=1).to(dev, dtype).eval())
    gen = target.generation_config
    gen.suppress_tokens = list(gen.suppress_tokens or []) + [gen.eos_token_id]
    load_s = time.perf_counter() - t0
    batches = [int(b) for b in args.batch_sizes.split(",")]
    enc = torch.randn(max(batches), target.config.max_source_positions, target.config.d_model,
                      generator=torch.Generator().manual_seed(0)).to(dev, dtype)
    rows = []
    print(f"# {torch.cuda.get_device_name()}  {args.dtype}  large-v2 shapes, 2-layer draft, K={args.num_draft_tokens}, "
          f"{args.new_tokens} tokens per row (models built in {load_s:.0f} s)")
    print(f"{'batch':>5} {'decoder':>11} {'step':>11} {'tok/s':>9} {'ms/pass':>8} {'same as eager':>14}")
    for b in batches:
        ref = {}
        for name, d in (("greedy", None), ("speculative", draft)):
            for graphs in (False, True):
                seconds, tokens, passes = run(target, d, enc, b, args.new_tokens, args.num_draft_tokens, graphs,
                                              args.repeats)
                same = None
                if graphs:
                    same = tokens == ref[name]
                else:
                    ref[name] = tokens
                row = {"batch": b, "decoder": name, "graphs": graphs, "seconds": seconds,
                       "tokens_per_s": b * args.new_tokens / seconds, "ms_per_target_pass": seconds / passes * b * 1e3,
                       "graphs_equal_eager": same}
                if name == "speculative" and not graphs:
                    row["rows_equal_greedy"] = sum(a == g for a, g in zip(tokens, ref["greedy"]))
                rows.append(row)
                print(f"{b:>5} {name:>11} {'graphs' if graphs else 'eager':>11} {row['tokens_per_s']:>9.1f} "
                      f"{row['ms_per_target_pass']:>8.2f} {'' if same is None else str(same):>14}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "dtype": args.dtype, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
