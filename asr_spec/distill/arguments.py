"""The options of `asr-spec distill` checked before any work (a model loaded, a corpus labelled, a draft trained):
each bad value one InputError naming its flag. `asr_spec.distill.commands` runs the commands."""

from __future__ import annotations

import re
from pathlib import Path

from asr_spec.checks import int_at_least, is_int, positive_seconds, seconds_at_least_zero
from asr_spec.distill import train as distill
from asr_spec.errors import InputError

__all__ = ["check_cache_args", "check_work_outside", "flag_words", "head_size", "layer_ids", "spread",
           "train_settings"]


def check_cache_args(args) -> None:
    """InputError (one line naming the flag) for a `cache` or `run` number the labelling cannot use, before any
    model loads: --max-utterances -2 labelled all but the last two utterances, --max-windows -1 failed as "no
    windows to label", --batch-size 0 as range()'s error after the target loaded, a --window-s over Whisper's
    30 s window once its first long window came; --max-windows without --from-cache was ignored, and so was --corpus
    beside --long-file."""
    from asr_spec.audio.features import N_SAMPLES, SAMPLE_RATE

    given = [flag for flag, value in (("--corpus", args.corpus), ("--long-file", args.long_file),
                                      ("--from-cache", args.from_cache)) if value]
    if len(given) > 1:  # --long-file quietly left --corpus unread
        raise InputError(f"cache: {' and '.join(given)} given; give one of them")
    int_at_least(args.batch_size, "--batch-size", 1)
    int_at_least(args.max_new_tokens, "--max-new-tokens", 1)
    int_at_least(args.max_utterances, "--max-utterances", 0)  # 0: all
    max_windows = int_at_least(getattr(args, "max_windows", 0), "--max-windows", 0)  # 0: all (`run` has none)
    if max_windows and not args.from_cache:
        raise InputError(f"--max-windows {max_windows}: applies with --from-cache only")
    if args.from_cache and Path(args.from_cache).resolve() == Path(args.out).resolve():  # read as it is rewritten
        raise InputError(f"--from-cache {args.from_cache} and --out {args.out}: the same folder (relabel into another)")
    window_s, encoder_window_s = positive_seconds(args.window_s, "--window-s"), N_SAMPLES / SAMPLE_RATE
    if window_s > encoder_window_s:  # the encoder reads 30 s: log_mel_batch refuses a longer window
        raise InputError(f"--window-s must be at most {encoder_window_s:g} s (Whisper's window), got {window_s!r}")
    seconds_at_least_zero(args.gap_s, "--gap-s")


def check_work_outside(work: Path, out: Path) -> None:
    """InputError when the work folder (cache, checkpoints) is --out or inside it: the draft is written to --out as
    a whole at the end, which then failed as "already holds files" after all the work, and with --overwrite
    deleted the work folder."""
    work, out = Path(work).resolve(), Path(out).resolve()
    if work == out or out in work.parents:
        raise InputError(f"--work {work}: inside --out {out}, which the draft replaces as a whole; "
                         "put the work folder beside it")


def train_settings(args, target) -> tuple[distill.TrainConfig, list[int]]:
    """The training run `args` ask for, checked before any work (`run` checks it before labelling): its
    `TrainConfig` and the target layers the draft starts from, or InputError naming the flag (--steps 0,
    --kl-weight -1, --layers 0,7, --vocab-size -5 or beyond the target's vocabulary)."""
    fields = dict(steps=args.steps, batch_windows=args.batch_windows, lr=args.lr, seed=args.seed,
                  warmup_steps=args.warmup_steps, eval_every=args.eval_every, ckpt_every=args.ckpt_every,
                  kl_weight=args.kl_weight, ce_weight=args.ce_weight, kind=args.kind, reg_weight=args.reg_weight,
                  feature_noise=args.feature_noise, projection_lr_scale=args.projection_lr_scale)
    try:
        cfg = distill.TrainConfig(**fields)
    except ValueError as err:
        raise InputError(flag_words(str(err), fields)) from None
    head_size(args.vocab_size, "--vocab-size", target)
    n_layers = target.config.decoder_layers
    layers = layer_ids(args.layers, n_layers) if args.layers else distill.default_layers(n_layers, args.kind)
    return cfg, layers


def flag_words(message: str, names) -> str:
    """`message` with each field name of `names` written as its command-line flag (kl_weight -> --kl-weight)."""
    for name in names:
        message = re.sub(rf"\b{name}\b", "--" + name.replace("_", "-"), message)
    return message


def head_size(size: int, flag: str, target) -> int:
    """A restricted head's size as --vocab-size / --head-size give it: 0 (the whole vocabulary) up to the target's
    vocabulary, else InputError naming the flag (-5 dropped the five rarest tokens seen; 100000 gave 50,269)."""
    vocab = target.config.vocab_size
    if not is_int(size) or not 0 <= size <= vocab:
        raise InputError(f"{flag} must be an integer 0..{vocab} (0: the whole vocabulary of the target's {vocab} "
                         f"tokens), got {size!r}")
    return int(size)


def layer_ids(spec: str, n_layers: int) -> list[int]:
    """"0,5" -> [0, 5]; "5," -> [5] (one layer, by id); a bare count "2" -> that many target layers spread from the
    first to the last (distil-whisper keeps the first and the last for two)."""
    if "," in spec or not spec.isdigit():
        try:
            ids = [int(x) for x in spec.split(",") if x.strip()]
        except ValueError:
            ids = []
        if not ids or any(not 0 <= i < n_layers for i in ids):
            raise InputError(f"--layers {spec!r}: give layer ids 0..{n_layers - 1} (e.g. 0,5 or 5,) or a count")
        return ids
    count = int(spec)
    if not 1 <= count <= n_layers:
        raise InputError(f"--layers {count}: a count must be 1..{n_layers} (the target's decoder layers); "
                         "ids: 0,5 or 5,")
    return spread(count, n_layers)


def spread(count: int, n: int) -> list[int]:
    """`count` indices of range(n) spread evenly from the first to the last (fewer if they round together)."""
    return sorted({round(i * (n - 1) / max(count - 1, 1)) for i in range(count)})
