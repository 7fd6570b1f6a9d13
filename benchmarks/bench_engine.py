#!/usr/bin/env python
"""Engine benchmark: transformers greedy vs our greedy vs our speculative decoding, side by side in one run.

Random-weight models with the real shapes of whisper-base and of large-v2 + distil-large-v2 (d_model 1280,
32 vs 2 decoder layers), and the converted real whisper-base when available. Encoder outputs are computed once
(random ones for the random-weight shapes) and shared by every configuration, so the figures compare decoding.
Every row decodes exactly --new-tokens tokens (EOS is suppressed for the random models) so tokens/s compare like
with like.

    python -m benchmarks.bench_engine --shapes base --batch-sizes 1,4,16 --new-tokens 48
    python -m benchmarks.bench_engine --device cuda --dtype fp16 --shapes base,large-v2   # on a GPU
    python -m benchmarks.bench_engine --steps --shapes real-base --batch-sizes 1,4,8      # ms per step vs the floor
    python -m benchmarks.bench_engine --head                                               # output-head layouts
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import torch
from transformers.modeling_outputs import BaseModelOutput

from asr_spec.engine import ChunkStats, DecodeOptions, Engine, int8
from asr_spec.models.cpu import INT8, resolve_precision, torch_dtype
from asr_spec.models.loading import decoder_draft, resolve_device
from asr_spec.testing import SHAPES, random_whisper


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


def bench_steps(name, target, draft, batch_sizes, n_new, device, k, compile_step, rounds):
    """ms per step (greedy, and speculative with `draft`) next to the roofline floor, per batch size. The greedy
    step is timed in `rounds` rounds, each between two measurements of the machine's rates (`rates_around`): the
    ratio to the floor is each round's step over that round's floor, and the line reports their median and all
    of them (the read rate of this shared VM moves 20-40 % from minute to minute)."""
    from benchmarks import step_floor as sf

    gen = target.generation_config
    gen.suppress_tokens = list(gen.suppress_tokens or []) + [gen.eos_token_id]  # every row runs n_new tokens
    rng = torch.Generator().manual_seed(0)
    enc = torch.randn(max(batch_sizes), target.config.max_source_positions, target.config.d_model, generator=rng)
    enc = enc.to(device, target.dtype)
    n_keys = 64  # the bucket of a row ~48 tokens in
    for b in batch_sizes:
        line = {"model": name, "batch": b, "n_new": n_new}
        engines: list = []
        timed = [sf.rates_around(lambda: sf.step_ms(target, None, enc, b, n_new, 0, sf.TimedRunner(), engines),
                                 lambda: sf.machine_rates(device, target.dtype)) for _ in range(rounds)]
        dec = engines[0].target_dec
        audio = dec.audio_dtype.itemsize  # 1 where the audio is held in int8 (bf16 decoders, the int8 precision)
        weights = 2 if dec.bf16_weights else None  # the int8 precision's bf16 weights, its head's too
        floor = functools.partial(sf.step_floor_ms, audio_itemsize=audio, weight_itemsize=weights,
                                  head_itemsize=weights)
        floors = [floor(target, b, 1, n_keys, r)["floor_ms"] for _, r in timed]
        ratios = [ms / floor for (ms, _), floor in zip(timed, floors)]
        rates = {key: statistics.median(r[key] for _, r in timed) for key in timed[0][1]}
        line["read_GB_s"] = [round(r["read_GB_s"], 1) for _, r in timed]
        line["greedy_ms"] = statistics.median(ms for ms, _ in timed)
        line["greedy_floor_ms"] = statistics.median(floors)
        line["greedy_vs_floor"] = statistics.median(ratios)
        line["greedy_vs_floor_rounds"] = [round(x, 2) for x in ratios]
        head = engines[0].target_dec.certified
        if head is not None:  # the head read in bf16 (engine.head): the floor of the bytes really read, too
            line["greedy_floor_bf16_head_ms"] = sf.step_floor_ms(target, b, 1, n_keys, rates, 2, audio)["floor_ms"]
            line["greedy_vs_bf16_head_floor"] = line["greedy_ms"] / line["greedy_floor_bf16_head_ms"]
            line["head_fallback"] = f"{head.n_fallback}/{head.n_rows}"
        line["stages"] = stage_table(target, dec, enc, b, n_keys, rates, line["greedy_ms"],
                                     2 if head is not None or weights else None, weights)
        if compile_step:
            t0 = time.perf_counter()
            runner = sf.inductor_runner()
            line["greedy_inductor_ms"] = sf.step_ms(target, None, enc, b, n_new, 0, runner)
            line["inductor_compiles"] = len({key for key, _ in runner.times})
            line["inductor_run_s_incl_compile"] = time.perf_counter() - t0
        if draft is not None:
            line[f"spec_k{k}_ms"] = sf.step_ms(target, draft, enc, b, n_new, k, sf.TimedRunner())
            line[f"verify_k{k}_floor_ms"] = floor(target, b, k + 1, n_keys, rates)["floor_ms"]
        print(json.dumps({key: (round(v, 2) if isinstance(v, float) else v) for key, v in line.items()}), flush=True)


def stage_table(target, dec, enc, batch: int, n_keys: int, rates: dict[str, float], greedy_ms: float,
                head_itemsize: int | None, weight_itemsize: int | None = None) -> dict[str, list[float]]:
    """{stage: [ms, floor ms, ratio]} of a greedy step at `batch` rows, a row ~48 tokens in (`step_floor.stage_ms`
    next to `stage_floor_ms`: each stage through the decoder's Python methods, one by one); "layers": every layer
    as the step runs them (`step_floor.layers_ms`: in one extension call where the decoder has its `layer_loop`,
    whose pieces cannot be timed apart) against the three layer stages' floors; and "other": the step's ms outside
    the layers and the head (embeddings, rules, the choice of tokens, bookkeeping), whose floor is ~0."""
    from benchmarks import step_floor as sf

    measured = sf.stage_ms(dec, enc, batch, n_keys - 16, n_keys)
    floors = sf.stage_floor_ms(target, batch, n_keys, rates["read_GB_s"], head_itemsize, dec.audio_dtype.itemsize,
                               weight_itemsize)
    table = {name: [round(measured[name], 2), round(floors[name], 2), round(measured[name] / floors[name], 2)]
             for name in sf.STAGES}
    layers = sf.layers_ms(dec, enc, batch, n_keys - 16, n_keys)
    layers_floor = sum(floors[name] for name in sf.STAGES if name != "head")
    table["layers"] = [round(layers, 2), round(layers_floor, 2), round(layers / layers_floor, 2)]
    table["other"] = [round(greedy_ms - layers - measured["head"], 2), 0.0, None]
    return table


def bench_head(batch_sizes, device, repeats=7):
    """The 51,865 x 512 output head in each layout, side by side (median ms)."""
    import torch.nn.functional as F
    import torch.utils.mkldnn as mkldnn

    w = torch.randn(51865, 512, device=device) * 0.02
    w_t = w.t().contiguous()
    lin = torch.nn.Linear(512, 51865, bias=False).to(device)
    lin.weight.data = w
    packed = mkldnn.to_mkldnn(torch.nn.Sequential(lin)) if device.type == "cpu" else None
    for b in batch_sizes:
        x = torch.randn(b, 512, device=device)
        ways = {"x @ W^T (W^T stored d x V)": lambda: x @ w_t, "F.linear (W stored V x d)": lambda: F.linear(x, w),
                "W @ x^T (W stored V x d)": lambda: (w @ x.t()).t()}
        if packed is not None:
            ways["oneDNN prepacked"] = lambda: packed(x.to_mkldnn()).to_dense()
        times = {key: [] for key in ways}
        with torch.inference_mode():
            for fn in ways.values():
                fn()
            for _ in range(repeats):  # interleaved, so load from other jobs hits every layout alike
                for key, fn in ways.items():
                    sync(device)
                    t0 = time.perf_counter()
                    fn()
                    sync(device)
                    times[key].append((time.perf_counter() - t0) * 1e3)
        print(json.dumps({"head_rows": b, **{key: round(sorted(v)[len(v) // 2], 2) for key, v in times.items()}}),
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="base", help="comma list of: base, large-v2, real-base")
    ap.add_argument("--batch-sizes", default="1,4,16")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--num-draft-tokens", type=int, default=DecodeOptions.num_draft_tokens,
                    help="K (default: DecodeOptions'; README's engine table used 5)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto",
                    help="auto (as the CLI: int8 on an AVX2-only CPU), float32, bfloat16, float16 or int8")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    ap.add_argument("--clock", choices=["wall", "process"], default="wall",
                    help="wall time, or this process's CPU time (CPU only: steadier when other jobs share the cores)")
    ap.add_argument("--steps", action="store_true", help="ms per step next to the floor (greedy + speculative)")
    ap.add_argument("--compile", action="store_true", help="with --steps: also the step through inductor")
    ap.add_argument("--rounds", type=int, default=5,
                    help="with --steps: greedy timings, each between two measurements of the machine's rates")
    ap.add_argument("--head", action="store_true", help="time the output head's layouts and exit")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    clock = time.process_time if args.clock == "process" else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    precision = resolve_precision(args.dtype, device)  # "int8" (auto on an AVX2-only CPU): fp32 weights
    dtype = torch_dtype(precision)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.head:
        bench_head(batch_sizes, device)
        return
    print(json.dumps({"device": str(device), "dtype": str(dtype), "precision": precision,
                      "threads": torch.get_num_threads(),
                      "clock": args.clock, "new_tokens": args.new_tokens, "K": args.num_draft_tokens}))
    for shape in args.shapes.split(","):
        if shape == "real-base":
            from asr_spec.models.loading import load_model
            target = load_model("embedded:whisper-base", device, precision)
            drafts = {"target-as-draft": decoder_draft(target), "first+last-cut": decoder_draft(target, [0, 5])}
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
        # the int8 precision: a random model marked as the loader marks a loaded one (real-base, already marked):
        # int8 encoder products, the decoder's audio keys/values and weights in bf16
        if precision == INT8 and shape != "real-base":
            int8.request(target.model.encoder)
        if args.steps:
            bench_steps(shape, target.eval(), list(drafts.values())[-1], batch_sizes, args.new_tokens, device,
                        args.num_draft_tokens, args.compile, args.rounds)
            continue
        bench_pair(shape, target.eval(), drafts, batch_sizes, args.new_tokens, args.repeats, device,
                   args.num_draft_tokens, run_encoder=shape == "real-base", clock=clock)


if __name__ == "__main__":
    main()
