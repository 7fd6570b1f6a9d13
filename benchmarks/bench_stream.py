#!/usr/bin/env python
"""Live transcription measured: hypothesis drafting against plain re-decoding, side by side on the same decodes.

N streams (slices of the long-form fixtures, tests/fixtures/longform/*.opus, or of `--fixtures DIR`) are fed in
lockstep, --step-s of audio each per tick, in simulated real time (no sleeping: compute is measured, not waited
for). Each tick's due decodes (`StreamRunner.due` / `requests`, the driver's own decisions) are encoded once
(`Engine.encode`), then decoded twice from that encoder output, in alternating order tick by tick: with each
stream's previous hypothesis offered (`ChunkRequest.hypothesis`) and without (plain re-decoding). Lossless means the
two give the same tokens (checked; mismatches are counted), so both configurations see the same decodes; the policy
takes the first's result.

Per configuration, over all streams: target passes per second of audio; CPU seconds (process time, all threads)
per second of audio, split into features + encoder (the same work in both: counted in both) and decoding. CPU
time is measured on one torch thread by default (--threads 1): on a machine shared with other work, two threads
burn CPU spin-waiting for each other and process time stops measuring compute. From it: the most real-time
streams a machine of --cores cores sustains, derived as cores / (CPU s per audio s, all N streams together, / N)
(assumes the cores are used as well as one; a measured N is the basis: a larger N batches a little better);
latency from a word's end (word timestamps of the offline transcript of the same slice, aligned to the committed
words) to its commit, p50 / p95: the audio heard when its decode was asked for plus that tick's compute (features,
encoder and that configuration's decoding) as CPU seconds / cores, i.e. on that machine unshared; time to the
first tentative text after the first word's start, likewise; and the committed transcript's WER against the
offline transcription of the same slice (`Transcriber.transcribe`, the same preset).

Also per run: decodes, generated and forced (a committed prefix, `StreamOptions.committed_prefix`; off with
--no-committed-prefix) tokens per decode, target passes per decode, each stream's WER against offline and the worst
(the --json file holds each stream's text and the offline one).

    python -m benchmarks.bench_stream --streams 8 --seconds 12 --json runs/stream8.json
    python -m benchmarks.bench_stream --streams 1 --seconds 24 --no-draft --json runs/stream1.json

--server: the same slices through `asr-spec serve`'s WebSocket instead (benchmarks/stream_server.py: the app in this
process on 127.0.0.1, uvicorn in a thread; its one engine shared by all streams), each sent by a client as vLLM's
example client sends (0.1 s appends), paced at --speed times real time in wall time, reading events as they come.
Per run: whether every connection ended with its text (no error, no close), how far behind the server got (the
largest transcription.lag), the wait from the last append to transcription.done, commit latency p50 / p95 in wall
time (a committed word's delta less the moment its end was sent, words aligned to the offline transcript's word
timestamps) and p95 per quarter of the audio (`latency_p95_by_quarter_s`: a tail growing quarter by quarter is a
server falling behind, one in the first quarter a start-up transient), first delta after the first word's end was
sent, WER against offline (each stream's too; the --json file holds each stream's text and the offline one),
re-decodes, whether it kept up (every stream finished and none had more than 2 s of audio waiting at a result), and
the process's peak RSS during the run (VmHWM, reset before each run; the clients live in the same process), and
where the engine's time went (`engine`: re-decodes submitted / replaced / taken / withdrawn / delivered, tokens and
target passes per re-decode, rows per step, encoder, step and admission seconds per re-decode, encoder calls and
windows per call, wait before the engine and time in it; `target_passes_per_audio_s` over all the audio sent).
--hypothesis/--no-hypothesis: the server re-decodes offering the
previous hypothesis as the draft or not (default: the server's); --no-committed-prefix: every re-decode generates
its whole buffer again (default: its committed words are forced, `StreamOptions.committed_prefix`);
--max-buffer-s: the streams' buffer bound (both modes); --context-s: the committed audio a trim keeps as left context
(`StreamOptions.context_s`, both modes); --group-wait-s: how long a waiting re-decode is held for others to be
encoded with it (0: each taken as soon as a row is free);
--plain-malloc: glibc's malloc left as it is (the server sets its thresholds and arenas:
`asr_spec.allocator`). The server has --batch-size engine rows (8, `asr-spec serve`'s default) whatever the
number of streams: they share the rows. The engine's state is allocated once for its rows and its pages become
resident as rows are first used (52-62 MB a row for whisper-base: `memory.row_bytes`), so a process keeps what its
busiest run touched: compare peak RSS across configurations in separate processes (one command each).
--fast-sender-s adds to the largest count's run one client sending that much audio as fast as it can (3600: the hour
sender; it ends with backlog_full and close code 1008 once --max-backlog-s, 120 s, waits).

    python -m benchmarks.bench_stream --server --streams 1,2,4,8 --seconds 60 --json runs/stream_ws.json
    python -m benchmarks.bench_stream --server --streams 1 --seconds 60 --json runs/rss_1.json
    python -m benchmarks.bench_stream --server --streams 16 --seconds 60 --fast-sender-s 3600 --json runs/rss_16.json
    python -m benchmarks.bench_stream --server --streams 1 --seconds 130 --speed 10
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from asr_spec import Transcriber
from asr_spec.audio.loading import SAMPLE_RATE, load_audio
from asr_spec.engine import ChunkRequest
from asr_spec.eval.metrics import normalize, score
from asr_spec.logs import trace_streams
from asr_spec.stream.decodes import GROUP_WAIT_S
from asr_spec.stream.policy import StreamOptions
from benchmarks import malloc
from benchmarks.stream_server import run_server

REPO = Path(__file__).resolve().parent.parent

FIXTURES = REPO / "tests" / "fixtures" / "longform"
CONFIGS = ("hypothesis", "plain")


def slices(n_streams: int, seconds: float, folder: Path = FIXTURES) -> list[tuple[str, np.ndarray]]:
    """N distinct audio slices of `seconds` from the .opus files of `folder` (the long-form fixtures, or a held-out
    set laid out alike): the files' first slices, then their next ones."""
    files = sorted(folder.glob("*.opus"))
    if not files:
        raise SystemExit(f"{folder}: no .opus files")
    audio = [load_audio(path) for path in files]
    n = int(seconds * SAMPLE_RATE)
    out = []
    for i in range(n_streams):
        f, part = i % len(files), i // len(files)
        piece = audio[f][part * n:(part + 1) * n]
        if len(piece) < n:
            raise SystemExit(f"{files[f].name}: shorter than {(part + 1) * seconds} s")
        out.append((f"{files[f].stem}@{part * seconds:g}s", piece))
    return out


def offline(asr: Transcriber, items: list[tuple[str, np.ndarray]]) -> dict[str, tuple[str, list]]:
    """The offline transcript of each slice and its words (WordTiming: word, start, end)."""
    out = {}
    for (name, _audio), t in zip(items, asr.transcribe([a for _, a in items], progress=False)):
        out[name] = (t.text, [w for s in t.segments for w in s.words])
    return out


def decode_twice(runner, due, order: tuple[str, ...]) -> tuple[list, dict[str, float], dict[str, float], int]:
    """One tick's decodes: features + encoder once, then each configuration from the encoder output. Returns the
    hypothesis run's results, CPU and wall seconds per part, and the token mismatches between the two runs."""
    engine = runner.engine
    cpu, wall = {}, {}
    c0, w0 = time.process_time(), time.perf_counter()
    requests = runner.requests(due)
    encoded = engine.encode(torch.stack([r.features for r in requests]))
    cpu["front"], wall["front"] = time.process_time() - c0, time.perf_counter() - w0
    results = {}
    for config in order:
        reqs = [ChunkRequest(r.id, None, encoded=encoded[i], prefix=r.prefix,
                             hypothesis=r.hypothesis if config == "hypothesis" else ()) for i, r in enumerate(requests)]
        c0, w0 = time.process_time(), time.perf_counter()
        got = {r.id: r for r in engine.run(reqs, min(runner.batch_size, len(reqs)))}
        cpu[config], wall[config] = time.process_time() - c0, time.perf_counter() - w0
        results[config] = [got[r.id] for r in reqs]
    mismatches = sum(a.tokens != b.tokens for a, b in zip(results["hypothesis"], results["plain"]))
    return results, cpu, wall, mismatches


def run_streams(asr: Transcriber, items, options: StreamOptions, vad: bool, cores: int) -> dict:
    """Feed every slice in lockstep, each stream re-decoded every `options.step_s` (the streams' policy options);
    returns the measurements (see the module docstring)."""
    runner = asr.streams(options, vad=vad, batch_size=len(items))
    streams = [runner.open(name) for name, _ in items]
    step = int(options.step_s * SAMPLE_RATE)
    n_ticks = -(-max(len(a) for _, a in items) // step)
    totals = {c: {"passes": 0, "generated": 0, "cpu": 0.0, "decodes": 0} for c in CONFIGS}
    front_cpu, mismatches, forced = 0.0, 0, 0  # forced: prefix tokens given to the decodes (not generated)
    commits = {name: {c: [] for c in CONFIGS} for name, _ in items}  # (word, commit time s)
    first_tentative = {name: {c: None for c in CONFIGS} for name, _ in items}
    for tick in range(n_ticks + 1):
        for stream, (_, audio) in zip(streams, items):
            if stream.id in runner.streams:
                if tick < n_ticks:
                    stream.feed(audio[tick * step:(tick + 1) * step])
                elif not stream.policy.finished:
                    stream.finish()
        order = CONFIGS if tick % 2 == 0 else CONFIGS[::-1]
        while due := runner.due():
            results, cpu, wall, bad = decode_twice(runner, due, order)
            mismatches += bad
            front_cpu += cpu["front"]
            forced += sum(len(decode.prefix) for _, decode in due)
            for c in CONFIGS:
                totals[c]["passes"] += sum(r.stats.target_passes for r in results[c])
                totals[c]["generated"] += sum(r.stats.generated_tokens for r in results[c])
                totals[c]["cpu"] += cpu[c]
                totals[c]["decodes"] += len(due)
            updates = runner.deliver(due, results["hypothesis"])
            for stream, update in updates:
                for c in CONFIGS:
                    when = update.heard_s + (cpu["front"] + cpu[c]) / cores
                    commits[stream.id][c] += [(w, when) for w in update.delta.split()]
                    if first_tentative[stream.id][c] is None and (update.tentative.strip() or update.delta.strip()):
                        first_tentative[stream.id][c] = when
        runner.pump()  # finished streams' final updates without a decode
    audio_s = sum(len(a) for _, a in items) / SAMPLE_RATE
    return dict(audio_s=audio_s, totals=totals, front_cpu=front_cpu, mismatches=mismatches,
                texts={s.id: s.text for s in streams}, commits=commits, first_tentative=first_tentative,
                forced=forced)


def matched(commits: list[tuple[str, float]], words: list) -> list[tuple[float, float]]:
    """(commit time, the offline word's end) of each committed word matched (in order) to an offline word."""
    ours = [normalize(w) for w, _ in commits]
    theirs = [normalize(w.word) for w in words]
    out = []
    for block in difflib.SequenceMatcher(None, ours, theirs, autojunk=False).get_matching_blocks():
        for k in range(block.size):
            out.append((commits[block.a + k][1], words[block.b + k].end))
    return out


def latencies(commits: list[tuple[str, float]], words: list) -> list[float]:
    """Commit time less the offline word's end, for the committed words matched (in order) to offline words."""
    return [commit - end for commit, end in matched(commits, words)]


def p95_by_quarter(ends: list[float], lat: list[float], audio_s: list[float]) -> list[float | None]:
    """Commit latency p95 of the words ending in each quarter of their own stream's audio (None where none did):
    ends, lat and audio_s one entry a word (its end, its latency, the length of its stream's audio, so that streams
    of unequal length each count their own quarters). A tail that grows quarter by quarter is a server falling
    behind, one in the first quarter a start-up transient."""
    quarters: list[list[float]] = [[], [], [], []]
    for end, x, length in zip(ends, lat, audio_s, strict=True):
        quarters[min(int(4 * end / length), 3) if length > 0 else 0].append(x)
    return [round(float(np.percentile(q, 95)), 2) if q else None for q in quarters]


def summarise(n: int, run: dict, reference: dict, cores: int) -> dict:
    out = {"streams": n, "audio_s": run["audio_s"], "token_mismatches": run["mismatches"]}
    texts = [run["texts"][name] for name in reference]
    refs = [reference[name][0] for name in reference]
    out["wer_vs_offline"] = score(refs, texts).wer
    out["per_stream_wer_vs_offline"] = {name: score([r], [t]).wer for name, r, t in zip(reference, refs, texts)}
    out["worst_stream_wer_vs_offline"] = max(out["per_stream_wer_vs_offline"].values())
    decodes = max(run["totals"]["plain"]["decodes"], 1)
    out["decodes"] = run["totals"]["plain"]["decodes"]
    out["forced_tokens_per_decode"] = run["forced"] / decodes  # a committed prefix, fed in one pass
    out["tokens_per_decode"] = run["totals"]["plain"]["generated"] / decodes  # generated (the same in both)
    for c in CONFIGS:
        t = run["totals"][c]
        lat = [x for name in reference for x in latencies(run["commits"][name][c], reference[name][1])]
        onset = [run["first_tentative"][name][c] - reference[name][1][0].start for name in reference
                 if run["first_tentative"][name][c] is not None and reference[name][1]]
        cpu_per_s = (run["front_cpu"] + t["cpu"]) / run["audio_s"]
        out[c] = dict(target_passes_per_audio_s=t["passes"] / run["audio_s"],
                      decode_cpu_per_audio_s=t["cpu"] / run["audio_s"],
                      front_cpu_per_audio_s=run["front_cpu"] / run["audio_s"], cpu_per_audio_s=cpu_per_s,
                      sustained_streams=cores / cpu_per_s, tokens_per_pass=t["generated"] / max(t["passes"], 1),
                      latency_p50_s=float(np.percentile(lat, 50)) if lat else None,
                      latency_p95_s=float(np.percentile(lat, 95)) if lat else None,
                      first_tentative_s=float(np.mean(onset)) if onset else None, decodes=t["decodes"],
                      passes_per_decode=t["passes"] / max(t["decodes"], 1))
    out["passes_ratio"] = out["hypothesis"]["target_passes_per_audio_s"] / out["plain"]["target_passes_per_audio_s"]
    out["decode_cpu_ratio"] = out["hypothesis"]["decode_cpu_per_audio_s"] / out["plain"]["decode_cpu_per_audio_s"]
    return out


# -- through the server's WebSocket (the server and its clients: stream_server.py) ------------------------------
KEPT_UP_BEHIND_S = 2.0  # a run kept up when no stream had more than this much audio waiting at a result


def summarise_server(n: int, speed: float, run: dict, reference: dict, audio_s: float) -> dict:
    """One server run's figures (see the module doc); audio_s: the seconds of audio its clients sent in all."""
    streams = run["streams"]
    texts = [streams[name]["text"] or "" for name in reference]
    lat, ends, lengths, first, per_stream_wer = [], [], [], [], {}
    for name, (ref_text, words) in reference.items():
        got = streams[name]
        commits = [(w, t * speed) for delta, t in got["deltas"] for w in delta.split()]  # in audio seconds
        pairs = matched(commits, words)
        lat += [(commit - end) / speed for commit, end in pairs]
        ends += [end for _, end in pairs]
        lengths += [words[-1].end] * len(pairs) if pairs else []  # the stream's audio: its last offline word's end
        if got["deltas"] and words:
            first.append(got["deltas"][0][1] - words[0].end / speed)
        per_stream_wer[name] = score([ref_text], [got["text"] or ""]).wer
    finished = [s["text"] is not None and s["error"] is None and s["closed"] is None for s in streams.values()]
    max_behind_s = max(s["behind_s"] for s in streams.values())
    return {"streams": n, "speed": speed, "all_finished": all(finished), "n_finished": sum(finished),
            "kept_up": all(finished) and max_behind_s <= KEPT_UP_BEHIND_S,
            "errors": sorted({str(s["error"] or s["closed"]) for s in streams.values() if s["error"] or s["closed"]}),
            "max_behind_s": max_behind_s,
            "final_wait_s": max((s["done"] - s["last_sent"]) for s in streams.values() if s["text"] is not None)
            if any(finished) else None,
            "latency_p50_s": float(np.percentile(lat, 50)) if lat else None,
            "latency_p95_s": float(np.percentile(lat, 95)) if lat else None,
            "latency_p95_by_quarter_s": p95_by_quarter(ends, lat, lengths),
            "first_delta_s": float(np.mean(first)) if first else None,
            "wer_vs_offline": score([reference[k][0] for k in reference], texts).wer,
            "worst_stream_wer_vs_offline": max(per_stream_wer.values()), "per_stream_wer_vs_offline": per_stream_wer,
            "redecodes": run["redecodes"],
            "target_passes_per_audio_s": run["engine"]["target_passes"] / audio_s, "engine": run["engine"],
            "peak_rss_mib": run["peak_rss_mib"], "fast_sender": run["fast_sender"], "load_average": os.getloadavg()}


def parse_args() -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="base")
    parser.add_argument("--streams", default="1,8", help="comma-separated numbers of concurrent streams")
    parser.add_argument("--seconds", type=float, default=40.0, help="audio per stream")
    parser.add_argument("--step-s", type=float, default=StreamOptions().step_s,
                        help="re-decode a stream after this much new audio (StreamOptions.step_s)")
    parser.add_argument("--max-buffer-s", type=float, default=StreamOptions().max_buffer_s,
                        help="the streams' buffer bound (StreamOptions.max_buffer_s)")
    parser.add_argument("--context-s", type=float, default=StreamOptions().context_s,
                        help="committed audio a trim keeps before what is new, its words forced (StreamOptions."
                        "context_s; 0: none)")
    parser.add_argument("--settled-s", type=float, default=StreamOptions().settled_s,
                        help="commit a closed segment ending this much before its decode's audio on that one decode "
                        "(StreamOptions.settled_s; both modes)")
    parser.add_argument("--silence-s", type=float, default=StreamOptions().silence_s,
                        help="non-speech after speech that closes an utterance (StreamOptions.silence_s)")
    parser.add_argument("--committed-prefix", action=argparse.BooleanOptionalAction,
                        default=StreamOptions().committed_prefix, help="a re-decode forces its buffer's committed "
                        "words as the engine's prefix and generates only what follows (StreamOptions."
                        "committed_prefix); off: it generates the whole buffer again")
    parser.add_argument("--group-wait-s", type=float, default=GROUP_WAIT_S, help="--server: the longest a waiting "
                        "re-decode is held for others to be encoded with it (`asr-spec serve --group-wait-s`; 0: "
                        "never)")
    parser.add_argument("--no-vad", action="store_true")
    parser.add_argument("--threads", type=int, default=1, help="torch threads while measuring")
    parser.add_argument("--cores", type=int, default=2, help="cores of the machine the derived figures are for")
    parser.add_argument("--no-draft", action="store_true", help="no model draft (else the preset's decision)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--fixtures", type=Path, default=FIXTURES,
                        help="the folder whose .opus files are sliced into streams (default tests/fixtures/longform; "
                             "e.g. a held-out set of scripts/make_longform_fixtures.py)")
    parser.add_argument("--server", action="store_true", help="through the server's WebSocket (see above)")
    parser.add_argument("--speed", type=float, default=1.0, help="--server: senders' pace, x real time")
    parser.add_argument("--batch-size", type=int, default=8, help="--server: the server's engine rows, shared by "
                        "the streams (asr-spec serve's default: 8)")
    malloc.add_option(parser, scope="--server: ")
    parser.add_argument("--hypothesis", action=argparse.BooleanOptionalAction, default=None,
                        help="--server: offer each stream's previous hypothesis as the draft (`asr-spec serve "
                        "--hypothesis`) or not (default: the server's, RealtimeOptions.hypothesis)")
    parser.add_argument("--fast-sender-s", type=float, default=0.0, help="--server: one more client sending this "
                        "much audio as fast as it can beside the streams (3600: the hour sender)")
    parser.add_argument("--trace", type=Path, default=None, help="write every re-decode's result (the policy's "
                        "DEBUG lines: its audio, hypothesis with timestamps, what it committed) to this file")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    counts = [int(x) for x in args.streams.split(",")]
    if args.trace:
        trace_streams(args.trace)
    if args.server:  # as `asr-spec serve` does, before the models load
        malloc.pin_unless_plain(args)
    stream = StreamOptions(step_s=args.step_s, max_buffer_s=args.max_buffer_s,
                           committed_prefix=args.committed_prefix, context_s=args.context_s, settled_s=args.settled_s,
                           silence_s=args.silence_s)
    draft = {"draft": None} if args.no_draft else {}
    rows = args.batch_size if args.server else max(counts)
    asr = Transcriber.from_preset(args.preset, word_timestamps=True, batch_size=rows, **draft)
    if args.server:
        return main_server(args, asr, counts, stream)
    torch.set_num_threads(args.threads)  # after loading: silero-vad's import sets it too
    cores = args.cores
    report = {"preset": args.preset, "draft": "none" if args.no_draft else "preset", "step_s": args.step_s,
              "max_buffer_s": args.max_buffer_s, "committed_prefix": args.committed_prefix,
              "context_s": args.context_s, "settled_s": args.settled_s, "silence_s": args.silence_s,
              "threads": args.threads, "cores": cores, "cpu_count": os.cpu_count(), "fixtures": str(args.fixtures),
              "runs": []}
    for n in counts:
        items = slices(n, args.seconds, args.fixtures)
        reference = offline(asr, items)
        run = run_streams(asr, items, stream, not args.no_vad, cores)
        summary = summarise(n, run, reference, cores)
        texts = {name: {"stream": run["texts"][name], "offline": reference[name][0]} for name in reference}
        report["runs"].append({**summary, "texts": texts})  # the texts in the --json file only
        print(json.dumps(summary, indent=1), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))


def main_server(args: argparse.Namespace, asr: Transcriber, counts: list[int], stream: StreamOptions) -> None:
    """--server: each count of streams through the WebSocket, one after another, the server's default threads;
    stream: the streams' policy options."""
    from asr_spec.serve.realtime import RealtimeOptions

    hypothesis = RealtimeOptions().hypothesis if args.hypothesis is None else args.hypothesis
    report = {"preset": args.preset, "server": True, "speed": args.speed, "rows": args.batch_size,
              "step_s": args.step_s, "max_buffer_s": args.max_buffer_s, "hypothesis": hypothesis,
              "committed_prefix": args.committed_prefix, "context_s": args.context_s,
              "settled_s": args.settled_s, "silence_s": args.silence_s, "group_wait_s": args.group_wait_s,
              "malloc_pinned": not args.plain_malloc,
              "cpu_count": os.cpu_count(), "fixtures": str(args.fixtures), "runs": []}
    print(json.dumps({key: value for key, value in report.items() if key != "runs"}), flush=True)
    for n in counts:
        items = slices(n, args.seconds, args.fixtures)
        reference = offline(asr, items)
        flood_s = args.fast_sender_s if n == max(counts) else 0.0
        run = run_server(asr, items, args.speed, args.batch_size, stream, flood_s, hypothesis, args.group_wait_s)
        fast_sent_s = run["fast_sender"]["sent_s"] if run["fast_sender"] else 0.0
        summary = summarise_server(n, args.speed, run, reference, n * args.seconds + fast_sent_s)
        texts = {name: {"stream": run["streams"][name]["text"], "offline": reference[name][0]} for name in reference}
        report["runs"].append({**summary, "texts": texts})  # the texts in the --json file only
        print(json.dumps(summary), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
