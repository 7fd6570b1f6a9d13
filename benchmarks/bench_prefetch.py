#!/usr/bin/env python
"""The kernel extension's prefetch distances, side by side in one process: `AHEAD` (asr_spec/engine/
cpu_attention_simd.h: every stream's lines asked this far ahead into L1) and the thin products' `FAR`
(asr_spec/engine/cpu_linear.h: their panels' lines also asked this far ahead into L2; 0 off). The extension is
built once per pair of distances (`-DCPU_ATTENTION_AHEAD=N -DCPU_LINEAR_FAR=M`, `cpu_attention.load`), then a
decode step's streaming kernels timed with each build in turn, repeats alternated between builds, medians kept.

    python -m benchmarks.bench_prefetch                         # AHEAD 0-1,024 bytes, FAR 2,048; bf16 and fp32
    python -m benchmarks.bench_prefetch --aheads 256 --fars 0,1024,2048,4096 --dtypes bfloat16

Kernels (whisper-base shapes, weights and caches larger than the caches, as in a batch-8 step): the audio's
cross-attention of 6 layers over 1,500 keys a row (1 query a row: a greedy step; 4: a K = 3 verify pass), the head
product (51,865 x 512) at 1 / 8 / 32 rows, and 12 FFN products (2,048 x 512) at 8 rows. Each build compiles
once per CPU kind (~1 min each on 2 cores; torch's extension cache keeps them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from asr_spec.engine import cpu_attention, cpu_linear

B, H, S, D, LAYERS = 8, 8, 1500, 64, 6  # batch rows, heads, audio keys, head_dim, decoder layers


def variant(ahead: int, far: int):
    """The extension built with prefetch distances `ahead` and `far` (its own name: one build per pair and
    source)."""
    return cpu_attention.load(f"{cpu_attention.build_name()}_ahead{ahead}_far{far}",
                              (f"CPU_ATTENTION_AHEAD={ahead}", f"CPU_LINEAR_FAR={far}"))


def kernels(ext, dtype: torch.dtype) -> dict:
    """name -> a no-argument call of `ext`'s kernels on fresh operands (audio keys/values stored (head_dim, S))."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    keys = [rand(B, H, D, S).transpose(-1, -2) for _ in range(LAYERS)]
    values = [rand(B, H, D, S).transpose(-1, -2) for _ in range(LAYERS)]
    queries = {t: rand(B, t, H, D) for t in (1, 4)}
    head = cpu_linear.pack_panels(rand(51865, 512))
    ffn = [cpu_linear.pack_panels(rand(2048, 512)) for _ in range(12)]
    rows = {m: rand(m, 512) for m in (1, 8, 32)}

    def attend(t):
        counts = torch.full((B, t), S, dtype=torch.int32)
        return lambda: [ext.attend(queries[t], k, v, counts, 1.0) for k, v in zip(keys, values)]

    def product(weights, m):
        return lambda: [ext.linear(rows[m], w.data, None, None, w.n_out, False) for w in weights]

    return {"cross_attention_q1": attend(1), "cross_attention_q4": attend(4), "head_rows1": product([head], 1),
            "head_rows8": product([head], 8), "head_rows32": product([head], 32), "ffn_rows8": product(ffn, 8)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--aheads", default="0,128,256,512,1024", help="comma list of L1 prefetch distances in bytes")
    ap.add_argument("--fars", default="2048", help="comma list of the thin products' L2 prefetch distances (0: off)")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    pairs = [(int(a), int(f)) for a in args.aheads.split(",") for f in args.fars.split(",")]  # (ahead, far) a build
    builds = {pair: variant(*pair) for pair in pairs}
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        calls = {pair: kernels(ext, dtype) for pair, ext in builds.items()}
        times: dict[tuple[tuple[int, int], str], list[float]] = {}
        for _ in range(args.repeats):
            for pair in pairs:
                for kernel, run in calls[pair].items():
                    run()  # a warm-up pass: the same operands, so the timed one reads them from memory as a step
                    t0 = time.perf_counter()
                    run()
                    times.setdefault((pair, kernel), []).append(time.perf_counter() - t0)
        for kernel in calls[pairs[0]]:
            ms = {f"{a}/{f}": statistics.median(times[((a, f), kernel)]) * 1e3 for a, f in pairs}  # "ahead/far"
            best = min(ms, key=ms.get)
            print(json.dumps({"dtype": name, "kernel": kernel, "ms": {k: round(v, 3) for k, v in ms.items()},
                              "best_ahead_far": best, "vs_best": {k: round(v / ms[best], 2) for k, v in ms.items()}}),
                  flush=True)


if __name__ == "__main__":
    main()
