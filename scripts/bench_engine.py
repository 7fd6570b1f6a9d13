#!/usr/bin/env python
"""Engine benchmark: transformers greedy vs our greedy vs our speculative decoding, side by side in one run.

Random-weight models with the real shapes of whisper-base and of large-v2 + distil-large-v2 (d_model 1280,
32 vs 2 decoder layers), and the converted real whisper-base when available. Encoder outputs are computed once
(random ones for the random-weight shapes) and shared by every configuration, so the figures compare decoding. Every row decodes exactly
--new-tokens tokens (EOS is suppressed for the random models) so tokens/s compare like with like.

    python scripts/bench_engine.py --shapes base --batch-sizes 1,4,16 --new-tokens 48
    python scripts/bench_engine.py --device cuda --dtype fp16 --shapes base,large-v2   # on a GPU
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers.modeling_outputs import BaseModelOutput

from asr_spec.engine import ChunkStats, DecodeOptions, Engine
from asr_spec.testing import SHAPES, random_whisper
from asr_spec.models.loading import decoder_draft, resolve_device, resolve_dtype


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, repeats: int, clock=time.perf_counter):
    """Best time of `repeats` runs after one warm-up; returns (seconds, last result).

    clock: time.perf_counter (wall), or time.process_time (this process's CPU time, steadier on a shared CPU).
    """
    out = fn()
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = clock()
        out = fn()
        sync(device)
        best = min(best, clock() - t0)
    return best, out


def bench_pair(name, target, drafts, batch_sizes, n_new, repeats, device, k, run_encoder, clock):
    gen = target.generation_config
    gen.suppress_tokens = list(gen.suppress_tokens or []) + [gen.eos_token_id]  # fixed-length rows
    rng = torch.Generator().manual_seed(0)
    n = max(batch_sizes)
    if run_encoder:
        feats = torch.randn(n, target.config.num_mel_bins, 2 * target.config.max_source_positions, generator=rng)
        engine = Engine(target, None, DecodeOptions(language="en", max_new_tokens=n_new))
        enc = engine.encode(feats.to(device, target.dtype), n)
    else:  # decoding speed does not depend on the encoder's values: skip a random encoder's cost
        enc = torch.randn(n, target.config.max_source_positions, target.config.d_model, generator=rng)
        enc = enc.to(device, target.dtype)
    rows = []
    for b in batch_sizes:
        e = enc[:b]
        line = {"model": name, "batch": b}

        def hf():
            with torch.inference_mode():
                return target.generate(encoder_outputs=BaseModelOutput(last_hidden_state=e), language="en",
                                       task="transcribe", max_new_tokens=n_new, force_unique_generate_call=True,
                                       return_dict_in_generate=True).sequences

        t_hf, seq = timed(hf, device, repeats, clock)
        line["hf_greedy_tok_s"] = b * n_new / t_hf
        eng = Engine(target, None, DecodeOptions(language="en", max_new_tokens=n_new))
        t_ours, res = timed(lambda: eng.decode(None, e, b), device, repeats, clock)
        line["our_greedy_tok_s"] = b * n_new / t_ours
        line["greedy_equal_to_hf"] = all(tuple(seq[i, 4:].tolist()) == r.tokens for i, r in enumerate(res))
        for dname, draft in drafts.items():
            opts = DecodeOptions(language="en", max_new_tokens=n_new, num_draft_tokens=k)
            eng = Engine(target, draft, opts)
            t_spec, sres = timed(lambda: eng.decode(None, e, b), device, repeats, clock)
            stats = ChunkStats.total(r.stats for r in sres)
            line[f"spec[{dname}]_tok_s"] = b * n_new / t_spec
            line[f"spec[{dname}]_passes_per_token"] = stats.target_passes / (b * n_new)
            line[f"spec[{dname}]_equal"] = [r.tokens for r in sres] == [r.tokens for r in res]
        rows.append(line)
        ratios = {key: round(val / line["hf_greedy_tok_s"], 2) for key, val in line.items() if key.endswith("tok_s")}
        print(json.dumps({**{k2: (round(v, 3) if isinstance(v, float) else v) for k2, v in line.items()},
                          "ratio_vs_hf": ratios}), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="base", help="comma list of: base, large-v2, real-base")
    ap.add_argument("--batch-sizes", default="1,4,16")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--num-draft-tokens", type=int, default=DecodeOptions.num_draft_tokens,
                    help="K (default: DecodeOptions'; README's engine table used 5)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    ap.add_argument("--clock", choices=["wall", "process"], default="wall",
                    help="wall time, or this process's CPU time (CPU only: steadier when other jobs share the cores)")
    args = ap.parse_args()
    clock = time.process_time if args.clock == "process" else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    print(json.dumps({"device": str(device), "dtype": str(dtype), "threads": torch.get_num_threads(), "clock": args.clock,
                      "new_tokens": args.new_tokens, "K": args.num_draft_tokens}))
    for shape in args.shapes.split(","):
        if shape == "real-base":
            from asr_spec.models.loading import load_model
            target = load_model("embedded:whisper-base", device, dtype)
            drafts = {"target-as-draft": decoder_draft(target)}
        elif shape == "large-v2":
            target = random_whisper("large-v2").to(device, dtype)
            distil = random_whisper("distil-large-v2", seed=1).to(device, dtype)
            drafts = {"target-as-draft": decoder_draft(target), "distil-shape-2-layer": decoder_draft(distil)}
        elif shape in SHAPES:
            target = random_whisper(shape).to(device, dtype)
            last = target.config.decoder_layers - 1  # distil-whisper keeps the first and the last layer
            drafts = {"target-as-draft": decoder_draft(target), "first+last-cut": decoder_draft(target, [0, last])}
        else:
            raise SystemExit(f"unknown shape {shape!r}")
        bench_pair(shape, target.eval(), drafts, batch_sizes, args.new_tokens, args.repeats, device,
                   args.num_draft_tokens, run_encoder=shape == "real-base", clock=clock)


if __name__ == "__main__":
    main()
