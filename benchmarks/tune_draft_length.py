#!/usr/bin/env python
"""Choose the draft length K by measurement: decode the same chunks with several K side by side.

Prints, per setting: target passes per generated token, acceptance rate, time (best of --repeats) and the speed
ratio to greedy decoding on the same encoder outputs; checks every setting's tokens equal greedy's.

    python -m benchmarks.tune_draft_length --model embedded:whisper-base --draft-layers 0,1,2,3,5 \\
        --audio tests/fixtures/speech/short/*.flac --batch-size 4 --clock process
"""

from __future__ import annotations

import argparse
import json
import time

from asr_spec.audio.features import log_mel_batch, make_feature_extractor
from asr_spec.audio.loading import load_audio
from asr_spec.engine import ChunkStats, DecodeOptions, Engine
from asr_spec.models.loading import decoder_draft, load_draft, load_model, resolve_device, resolve_dtype
from benchmarks.bench_engine import timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded:whisper-base")
    ap.add_argument("--draft", help="draft model (directory or hub id); default: --draft-layers cut from --model")
    ap.add_argument("--draft-layers", default="0,1,2,3,5")
    ap.add_argument("--audio", nargs="+", required=True, help="clips of at most 30 s")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--ks", default="2,3,4,5,6,8")
    ap.add_argument("--language", default="en")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--clock", choices=["wall", "process"], default="wall")
    args = ap.parse_args()
    clock = time.process_time if args.clock == "process" else time.perf_counter
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    target = load_model(args.model, device, dtype)
    draft = (load_draft(args.draft, target, device, dtype) if args.draft
             else decoder_draft(target, [int(i) for i in args.draft_layers.split(",")]))
    feats = log_mel_batch([load_audio(a) for a in args.audio], make_feature_extractor(target.config.num_mel_bins))
    greedy_engine = Engine(target, None, DecodeOptions(language=args.language))
    enc = greedy_engine.encode(feats, args.batch_size)

    def best(engine):
        return timed(lambda: engine.decode(None, enc, args.batch_size), device, args.repeats, clock)

    t_greedy, greedy = best(greedy_engine)
    print(json.dumps({"setting": "greedy", "time_s": round(t_greedy, 3)}), flush=True)
    for k in (int(k) for k in args.ks.split(",")):
        opts = DecodeOptions(language=args.language, num_draft_tokens=k)
        t_spec, res = best(Engine(target, draft, opts))
        stats = ChunkStats.total(r.stats for r in res)
        print(json.dumps({
            "setting": f"K={k}", "time_s": round(t_spec, 3),
            "speedup_vs_greedy": round(t_greedy / t_spec, 3),
            "target_passes_per_token": round(1 / stats.tokens_per_target_pass, 3),
            "acceptance": round(stats.acceptance_rate, 3),
            "equal_to_greedy": [r.tokens for r in res] == [r.tokens for r in greedy],
        }), flush=True)


if __name__ == "__main__":
    main()
