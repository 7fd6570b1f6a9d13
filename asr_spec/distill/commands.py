"""The commands of `asr-spec distill` (parsed by `asr_spec.cli.distill`): distil a speculative-decoding draft for a
Whisper target (cache pseudo-labels, train, evaluate), or all of it at once. Each `cmd_*` takes the parsed options
as one namespace (their names are the command's option names):

    asr-spec distill --model embedded:whisper-base run --audio /data/tts-train --layers 2 --out drafts/whisper-base

    # 1. pseudo-labels: the target's greedy transcripts of a LibriSpeech-layout corpus, utterances packed into
    #    29 s windows (training) or one window per utterance (held-out evaluation)
    asr-spec distill cache --corpus /data/tts-train --split train --out /data/cache-train
    asr-spec distill cache --corpus tests/fixtures/librispeech --split test-clean --no-pack \
        --enc-dtype float32 --out /data/cache-heldout
    # 2. train (resumable: rerun the same command to continue from work/ckpt.pt)
    asr-spec distill train --train-cache /data/cache-train --held-out-cache /data/cache-heldout \
        --work /data/work --layers 0,5 --vocab-size 4096 --steps 1500 --out drafts/whisper-base
    # 3. held-out agreement, tokens per target pass for several K, real speed-up vs greedy; other heads too
    asr-spec distill eval --draft drafts/whisper-base --held-out-cache /data/cache-heldout \
        --head-sizes 4096 8192 0 --train-cache /data/cache-train
    # a feature-conditioned (EAGLE-style) draft, one layer (from the target's first); side by side with another
    # draft, tokens per target pass counted by the engine itself
    asr-spec distill train --kind target-features --train-cache /data/cache-train --work /data/work-f \
        --steps 1500 --vocab-size 4096 --out /data/draft-features
    asr-spec distill eval --draft /data/draft-features --compare-draft drafts/whisper-base-2l \
        --held-out-cache /data/cache-heldout --engine-k 3 4 6 --no-speed
    # 4. keep the head the comparison chose
    asr-spec distill head --draft drafts/whisper-base --train-cache /data/cache-train --head-size 8192 \
        --out drafts/whisper-base-8k

The group takes --model (the target; default embedded:whisper-base) and --threads (default 1: leave cores to
others) before the command name. A cache records the audio it was made from and the target that labelled it
(meta.json "source", "target"): `run` labels afresh when either differs from what it is asked, and training and
`cache --from-cache` refuse a cache of another target. `cache`, `train`, `run` and `head` refuse an --out folder that
holds files unless --overwrite.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from asr_spec.distill import data as draft_data
from asr_spec.distill import evaluation
from asr_spec.distill import train as distill
from asr_spec.distill.arguments import check_cache_args, check_work_outside, head_size, spread, train_settings
from asr_spec.errors import AudioError, InputError, one_line
from asr_spec.logs import NOTICE
from asr_spec.models import drafts
from asr_spec.models.feature_draft import save_feature_draft
from asr_spec.models.loading import load_distilled

log = logging.getLogger(__name__)


def _target(name: str):
    from asr_spec.models.loading import load_model

    return load_model(name, torch.device("cpu"), torch.float32)


def target_name(name: str) -> str:
    """How a cache and a checkpoint name the target --model `name` loads: a local folder by its absolute path (so
    that ./m and /work/m are one target), anything else (embedded:whisper-base, a hub id) as given."""
    path = Path(name).expanduser()
    return str(path.resolve()) if path.exists() else name


def corpus_source(args) -> dict:
    """What a corpus cache records of the audio its windows hold (meta.json "source"; `run` compares it): the
    folder, how it was packed, and its files (`corpus_files`: utterances added to the folder were ignored)."""
    return {"corpus": str(Path(args.corpus).resolve()), "split": args.split, "window_s": args.window_s,
            "gap_s": args.gap_s, "max_utterances": args.max_utterances, "no_pack": bool(args.no_pack),
            **corpus_files(Path(args.corpus), args.split)}


def corpus_files(corpus: Path, split: str) -> dict:
    """{"files": how many, "files_digest": a digest of their paths and sizes} of the corpus's LibriSpeech files
    (.flac audio, .trans.txt transcripts) under its split folder (`corpus/split`, or `corpus` itself when it has no
    such folder, as `iter_local` reads it), symlinked folders followed as `iter_local` follows them; zero files
    where neither exists. Sizes, not times: a corpus copied again is the same corpus; other files (a work folder
    kept inside the corpus, a README) are not the corpus."""
    base = corpus / split if (corpus / split).is_dir() else corpus
    files = sorted(Path(folder, name) for folder, _, names in os.walk(base, followlinks=True) for name in names
                   if name.endswith((".flac", ".trans.txt")))
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.relative_to(base)}\t{path.stat().st_size}\n".encode())
    return {"files": len(files), "files_digest": digest.hexdigest()[:16]}


def cmd_cache(args) -> int:
    """Returns how many utterances were unreadable (skipped; each a warning line). An --out folder that holds files
    (another cache: hours of labelling) is refused unless --overwrite, as `train`, `run` and `head` refuse theirs."""
    check_cache_args(args)
    drafts.check_out_dir(args.out, args.overwrite)
    return _cache(args, _target(args.model))


def _cache(args, target) -> int:
    if args.from_cache:
        return _relabel(args, target)
    if args.long_file:
        return _cache_long_files(args, target)
    if args.corpus is None:
        raise InputError("cache: give --corpus (LibriSpeech layout), --long-file or --from-cache")
    return _cache_corpus(args, target)


def _cache_corpus(args, target) -> int:
    """Pseudo-labels of a LibriSpeech-layout corpus; an utterance whose audio cannot be read is left out of its
    window (a warning line) and the rest go on. Returns how many were."""
    from asr_spec.audio.features import N_SAMPLES, SAMPLE_RATE, log_mel_batch, make_feature_extractor
    from asr_spec.eval.librispeech import iter_local

    utts = list(iter_local(args.corpus, args.split))
    if not utts:
        raise InputError(f"{args.corpus}: no utterances in split {args.split!r} (LibriSpeech layout: "
                         f"{args.split}/<speaker>/<chapter>/ folders of numbers, each with "
                         "<speaker>-<chapter>.trans.txt and the .flac files it names)")
    if args.max_utterances:
        utts = utts[: args.max_utterances]
    window_s = N_SAMPLES / SAMPLE_RATE if args.no_pack else args.window_s  # unpacked: one encoder window each
    too_long = next((u for u in utts if u.duration_s > window_s), None)
    if too_long is not None:
        raise InputError(f"{too_long.audio}: {too_long.duration_s:.2f} s, longer than a {window_s:g} s "
                         + ("encoder window (--no-pack: one utterance a window)" if args.no_pack
                            else "training window (--window-s, at most 30)"))
    if args.no_pack:
        windows = [[i] for i in range(len(utts))]
    else:
        windows = draft_data.pack_windows([u.duration_s for u in utts], args.window_s, args.gap_s)
    fe = make_feature_extractor(target.config.num_mel_bins)
    unreadable: list[str] = []

    def batches():
        for group in draft_data.iter_batches(windows, args.batch_size):
            ids, audio = [], []
            for window in group:
                parts = [(utts[i].id, _readable(utts[i], unreadable)) for i in window]
                parts = [(utt_id, samples) for utt_id, samples in parts if samples is not None]
                if parts:  # a window none of whose audio can be read is left out
                    ids.append([utt_id for utt_id, _ in parts])
                    audio.append(draft_data.join_audio([samples for _, samples in parts], args.gap_s))
            if audio:
                yield ids, log_mel_batch(audio, fe)

    t0 = time.perf_counter()
    cache = draft_data.build_cache(target, batches(), len(windows), args.out, language=args.language,
                                   max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                                   enc_dtype=args.enc_dtype, timestamps=args.timestamps,
                                   hidden_dtype=args.hidden_dtype, source=corpus_source(args),
                                   target_name=target_name(args.model))
    skipped = set(unreadable)
    read = [u for u in utts if u.id not in skipped]
    print(json.dumps({"windows": len(cache), "utterances": len(read), "unreadable": len(unreadable),
                      "audio_s": round(sum(u.duration_s for u in read), 1),
                      "generated_tokens": cache.meta["generated_tokens"], "seconds": round(time.perf_counter() - t0)}))
    return len(unreadable)


def _readable(utt, unreadable: list[str]) -> np.ndarray | None:
    """The utterance's 16 kHz samples; None, with a warning line and its id added to `unreadable`, when its audio
    cannot be read (missing, corrupt, truncated: one bad file lost the whole cache before)."""
    from tqdm import tqdm

    from asr_spec.audio.features import SAMPLE_RATE

    try:
        return utt.load(SAMPLE_RATE)
    except AudioError as err:
        with tqdm.external_write_mode(file=sys.stderr):  # a line of its own, not the end of the progress bar's
            log.warning("%s; skipped", one_line(err))
        unreadable.append(utt.id)
        return None


def _cache_long_files(args, target) -> int:
    """Long recordings cut into plain consecutive 30 s windows (no overlap), as a long-form evaluation set."""
    from asr_spec.audio.features import N_SAMPLES, SAMPLE_RATE, log_mel_batch, make_feature_extractor
    from asr_spec.audio.loading import load_audio

    fe = make_feature_extractor(target.config.num_mel_bins)
    windows = []
    for path in args.long_file:
        audio = load_audio(str(path), SAMPLE_RATE)
        windows += [(f"{path.name}@{i // SAMPLE_RATE}s", audio[i: i + N_SAMPLES])
                    for i in range(0, len(audio), N_SAMPLES)]
    cache = draft_data.build_cache(target, (([w[0] for w in g], log_mel_batch([w[1] for w in g], fe))
                                         for g in draft_data.iter_batches(windows, args.batch_size)),
                                len(windows), args.out, language=args.language, max_new_tokens=args.max_new_tokens,
                                batch_size=args.batch_size, enc_dtype=args.enc_dtype, timestamps=args.timestamps,
                                hidden_dtype=args.hidden_dtype, target_name=target_name(args.model),
                                source={"long_files": [str(Path(p).resolve()) for p in args.long_file]})
    print(json.dumps({"windows": len(cache), "generated_tokens": cache.meta["generated_tokens"]}))
    return 0


def _relabel(args, target) -> int:
    """The windows of an existing cache labelled again (e.g. with --timestamps) from its stored encoder outputs: no
    audio is read and no encoder runs. The encoder outputs are stored as they were (same dtype). The source must
    have been made by this target (`_caches`): another's encoder outputs under this decoder are labels of nothing."""
    (src,) = _caches([args.from_cache], target, args.model)
    rows = list(range(len(src)))
    if args.max_windows and args.max_windows < len(src):  # spread over the whole cache, not its first voices
        rows = spread(args.max_windows, len(src))

    def batches():
        for group in draft_data.iter_batches(rows, args.batch_size):
            enc = torch.from_numpy(src.encoded[list(group)].astype("float32"))
            yield [src.meta["ids"][i] for i in group], enc

    t0 = time.perf_counter()
    cache = draft_data.build_cache(target, batches(), len(rows), args.out, language=src.meta["language"],
                                   max_new_tokens=src.meta["max_new_tokens"], batch_size=args.batch_size,
                                   enc_dtype=src.meta["enc_dtype"], timestamps=args.timestamps, pre_encoded=True,
                                   hidden_dtype=args.hidden_dtype, target_name=target_name(args.model),
                                   source={"from_cache": str(Path(args.from_cache).resolve()),
                                           "max_windows": args.max_windows})
    print(json.dumps({"windows": len(cache), "from": str(args.from_cache), "timestamps": args.timestamps,
                      "generated_tokens": cache.meta["generated_tokens"], "seconds": round(time.perf_counter() - t0)}))
    return 0


def cmd_train(args) -> None:
    if args.out:  # before the training, not after it
        drafts.check_out_dir(args.out, args.overwrite)
        check_work_outside(args.work, args.out)
    _train(args, _target(args.model))


def _caches(paths, target, name: str) -> list[draft_data.PseudoLabelCache]:
    """The pseudo-label caches at `paths`, each checked to be labelled by `target` (loaded as --model `name`)."""
    caches = [draft_data.PseudoLabelCache(path) for path in paths]
    for cache in caches:
        cache.check_target(target, target_name(name))
    return caches


def _train(args, target) -> None:
    cfg, layers = train_settings(args, target)
    caches = _caches(args.train_cache, target, args.model)
    train = caches[0] if len(caches) == 1 else draft_data.CacheUnion(caches)
    held = _caches([args.held_out_cache], target, args.model)[0] if args.held_out_cache else None
    vocab = None
    if args.vocab_size:
        vocab = distill.choose_draft_vocab(train.token_counts(target.config.vocab_size), args.vocab_size, train.eot)
    t0 = time.perf_counter()
    res = distill.train_draft(target, train, cfg, work_dir=args.work, layers=layers, draft_vocab=vocab,
                              held_out=held, stop_after=args.stop_after, init_from=args.init_draft,
                              target_name=target_name(args.model))
    print(json.dumps({"history": res.history[-3:], "seconds": round(time.perf_counter() - t0)}))
    if not res.finished:  # a half-trained draft saved as --out could not be told from a finished one
        log.info("stopped at step %d of %d (--stop-after): nothing saved; the same command without --stop-after "
                 "(or with a larger one) goes on from %s", res.step, res.steps, Path(args.work) / "ckpt.pt",
                 extra=NOTICE)
    elif args.out:
        info = dict(target=args.model, layers=layers, train_cache=[str(p) for p in args.train_cache], train_meta=[{
            k: v for k, v in c.meta.items() if k != "ids"} for c in caches], config=asdict(cfg), history=res.history,
            init_draft=str(args.init_draft) if args.init_draft else None,
            command=" ".join(sys.argv), threads=torch.get_num_threads(), time=time.strftime("%Y-%m-%d"))
        if held is not None:
            info["held_out"] = asdict(evaluation.evaluate_agreement(target, res.draft, held))
        save_draft(res.draft, args.out, info, overwrite=args.overwrite)
        print(f"saved {args.out}")


def save_draft(draft, out: Path, info: dict, *, overwrite: bool = False) -> None:
    """Save a trained draft in the drafts/ format of its kind, as the folder `out` (written beside it, then
    renamed; InputError when it holds files, unless `overwrite`)."""
    if evaluation.reads_features(draft):
        save_feature_draft(draft, out, info=info, overwrite=overwrite)
    else:
        drafts.save_trained_draft(draft, out, info=info, overwrite=overwrite)


def cmd_eval(args) -> None:
    target = _target(args.model)
    (held,) = _caches([args.held_out_cache], target, args.model)
    out = {"held_out": str(args.held_out_cache), "windows": len(held)}
    candidates = {}
    if args.draft:
        candidates["trained"] = load_distilled(args.draft, target)
        if args.also_full_head and getattr(candidates["trained"], "draft_vocab_ids", None) is not None:
            full = copy.copy(candidates["trained"])  # same layers, scoring the whole vocabulary
            full.draft_vocab_ids = None
            candidates["trained-full-head"] = full
        if args.head_sizes:
            for size in args.head_sizes:
                head_size(size, "--head-sizes", target)
            if args.train_cache is None:
                raise InputError("eval --head-sizes: give --train-cache (its token counts choose each head's tokens)")
            candidates.update(_head_variants(candidates["trained"], args.head_sizes,
                                             _caches(args.train_cache, target, args.model), target))
    for path in args.compare_draft or []:  # side by side on the same held-out windows, named by their folder
        name = Path(path).name if Path(path).name not in candidates else str(path)  # two folders of one name
        candidates[name] = load_distilled(path, target)
    for spec in args.untrained or []:
        candidates[f"untrained{spec}"] = distill.init_draft(target, [int(x) for x in spec.split(",")])
    n_ctx = target.config.max_source_positions
    step_ms = evaluation.decoder_step_ms(target, args.batch_size, n_ctx)
    out[f"step_ms_b{args.batch_size}"] = {"target": round(step_ms, 1)}
    encoded = torch.from_numpy(held.encoded[: args.speed_windows or len(held)].astype("float32"))
    sim_k = tuple(sorted({*args.sim_k, *args.k}))
    for name, draft in candidates.items():
        rep = evaluation.evaluate_agreement(target, draft, held, ks=sim_k)
        line = {"agreement": round(rep.agreement, 4), "tokens": rep.tokens,
                "vocab_coverage": round(rep.vocab_coverage, 4),
                "accepted_per_step": {k: round(v, 3) for k, v in rep.accepted_per_step.items()},
                "tokens_per_pass": {k: round(v, 3) for k, v in rep.tokens_per_pass.items()}}
        line["draft_step_ms"] = round(evaluation.decoder_step_ms(draft, args.batch_size, n_ctx), 1)
        for k in args.engine_k or []:  # the engine's own count: exact for either kind (the module doc)
            line[f"engine_k{k}"] = evaluation.engine_tokens_per_pass(target, draft, held, k, args.batch_size)
        if getattr(draft, "draft_vocab_ids", None) is not None:
            full_head = copy.copy(draft)  # same layers, scoring the whole vocabulary
            full_head.draft_vocab_ids = None
            line["draft_step_ms_full_head"] = round(evaluation.decoder_step_ms(full_head, args.batch_size, n_ctx), 1)
        for k in [] if args.no_speed else (args.k if name != "trained-full-head" else args.k[-1:]):
            sp = evaluation.benchmark(target, draft, encoded, batch_size=args.batch_size, k=k, repeats=args.repeats,
                                   language=held.meta["language"], max_new_tokens=held.meta["max_new_tokens"],
                                   timestamps=held.timestamps)
            key = f"speed_k{k}"
            line[key] = {"greedy_s": round(sp.greedy_s, 2), "speculative_s": round(sp.speculative_s, 2),
                         "speedup": round(sp.speedup, 3), "tokens": sp.generated_tokens,
                         "tokens_per_target_pass": round(sp.tokens_per_target_pass, 3),
                         "acceptance_rate": round(sp.acceptance_rate, 3), "identical": sp.identical}
        out[name] = line
        print(json.dumps({name: line}), flush=True)
    print(json.dumps(out))


def _head_variants(draft, head_sizes: list[int], caches: list[draft_data.PseudoLabelCache], target) -> dict:
    """The trained draft's layers with other restricted heads: the N most frequent tokens of the `caches`'
    pseudo-labels for each N of `head_sizes` (0 = the whole vocabulary), by name. The head is the target's own
    (tied), so a restriction only removes candidates; it changes no score."""
    train = draft_data.CacheUnion(caches)
    counts = train.token_counts(target.config.vocab_size)
    out = {}
    for size in head_sizes:
        variant = copy.copy(draft)
        variant.draft_vocab_ids = distill.choose_draft_vocab(counts, size, train.eot) if size else None
        out[f"trained-head-{size or 'full'}"] = variant
    return out


def cmd_head(args) -> None:
    """Save a trained draft again with another restricted head (its layers unchanged): the head a comparison of
    `eval --head-sizes` chose."""
    drafts.check_out_dir(args.out, args.overwrite)
    target = _target(args.model)
    head_size(args.head_size, "--head-size", target)
    trained = load_distilled(args.draft, target)
    caches = _caches(args.train_cache, target, args.model)
    (draft,) = _head_variants(trained, [args.head_size], caches, target).values()
    info = json.loads((Path(args.draft) / drafts.INFO_FILE).read_text())
    info["head"] = {"size": args.head_size or "full", "from": str(args.draft),
                    "counts_from": [str(p) for p in args.train_cache],
                    "command": " ".join(sys.argv)}
    save_draft(draft, args.out, info, overwrite=args.overwrite)
    print(f"saved {args.out} (head: {args.head_size or 'full vocabulary'})")


def cache_difference(meta: dict, args, target) -> str | None:
    """Why a whole pseudo-label cache (its meta.json) cannot serve `run`'s `args`: the first field of its labelling
    (language, timestamp mode, token limit, storage, the target: `target_identity`) or of its audio (`corpus_source`)
    that differs, as `first_difference` words it; None when it was made as asked (a cache that predates these
    records differs: it is labelled again)."""
    wanted = {"language": args.language, "timestamps": bool(args.timestamps), "max_new_tokens": args.max_new_tokens,
              "enc_dtype": args.enc_dtype, "hidden_dtype": args.hidden_dtype,
              "target": draft_data.target_identity(target, target_name(args.model)), "source": corpus_source(args)}
    if isinstance(meta.get("source"), dict) and "corpus" in meta["source"] and "files" not in meta["source"]:
        return "it predates the record of its corpus's files (forty-third session)"
    return draft_data.first_difference(meta, wanted)


def cmd_run(args) -> int:
    """cache + train + save in one go: pseudo-labels of --audio (LibriSpeech layout) in --work, then the draft.
    The work folder's cache is reused only when it was made as asked (`cache_difference`); a cache made again
    discards the checkpoint trained on the old one. Returns how many utterances were unreadable (skipped)."""
    drafts.check_out_dir(args.out, args.overwrite)  # before hours of labelling and training, not after them
    work = Path(args.work or Path(args.out).with_name(Path(args.out).name + ".work"))
    check_work_outside(work, args.out)
    cache_args = SimpleNamespace(**{**vars(args), "corpus": args.audio, "out": work / "cache", "long_file": None,
                                    "from_cache": None, "no_pack": False})
    check_cache_args(cache_args)
    target = _target(args.model)
    train_settings(args, target)
    meta = work / "cache" / "meta.json"
    why = cache_difference(json.loads(meta.read_text()), cache_args, target) if meta.is_file() else "none yet"
    unreadable = 0
    if why is not None:
        if meta.is_file():
            log.info("%s: labelling again (%s)", work / "cache", why, extra=NOTICE)
        unreadable = _cache(cache_args, target)
        (work / "train" / "ckpt.pt").unlink(missing_ok=True)  # trained on the labels just replaced
    train_args = SimpleNamespace(**{**vars(args), "train_cache": [work / "cache"], "held_out_cache": None,
                                    "init_draft": None, "work": work / "train"})
    _train(train_args, target)
    return unreadable
