"""`asr-spec distill`: a typer group over `asr_spec.distill.commands` (cache | train |
eval | head | run; see that module for the workflow). The group takes --model (the target; default
embedded:whisper-base) and --threads (default 1: leave cores to others) before the command name.

Options that several commands share are declared once below. A few take several values (``--k 4 8``,
``--train-cache A B``, ``--head-sizes 4096 0``, ``--sim-k 3 4``); click options take one value each, so
`expand_variadic` turns those into repeated options (``--k 4 --k 8``) before parsing.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import typer

__all__ = ["VARIADIC", "distill_app", "distill_main", "expand_variadic"]

# options that take one or more values
VARIADIC = ("--train-cache", "--k", "--sim-k", "--head-sizes", "--compare-draft", "--engine-k")


class EncDtype(str, enum.Enum):
    """How cached encoder outputs (and the target's final states) are stored."""

    float16 = "float16"
    float32 = "float32"


class DraftKindName(str, enum.Enum):
    """The kind of draft `train` makes (asr_spec.models.drafts / feature_draft)."""

    decoder = "decoder"
    target_features = "target-features"


def expand_variadic(argv: Sequence[str]) -> list[str]:
    """``--k 4 8`` -> ``--k 4 --k 8`` for the options in VARIADIC (their values run up to the next ``-`` token);
    every other token unchanged."""
    out: list[str] = []
    option, n_values = None, 0
    for arg in argv:
        if arg in VARIADIC:
            option, n_values = arg, 0
            out.append(arg)
        elif option is not None and not arg.startswith("-"):
            if n_values:
                out.append(option)
            out.append(arg)
            n_values += 1
        else:
            option = None
            out.append(arg)
    return out


distill_app = typer.Typer(name="distill", help="Train a draft for a target by distillation (run | cache | train | "
                          "eval | head).", add_completion=False, no_args_is_help=True,
                          pretty_exceptions_enable=False, rich_markup_mode=None)


@distill_app.callback()
def _group(ctx: typer.Context,
           model: str = typer.Option("embedded:whisper-base", help="The target to distil a draft for."),
           threads: int = typer.Option(1, help="torch CPU threads (default 1: leave cores to others).")) -> None:
    from asr_spec.cli.options import use_threads

    use_threads(threads)
    ctx.obj = {"model": model}


def _call(command: Callable[[Any], int | None], ctx: typer.Context, params: dict[str, Any]) -> None:
    """Run `command` on the group's --model and a command's parameters (its `locals()` on entry); an error the
    user's input caused (a model, cache or checkpoint that cannot be read, a bad value) is one `error:` line. A
    command that returns a count of inputs it skipped (`cache`, `run`: unreadable utterances) exits 1 when some
    were, having done the rest. A Ctrl-C is one `interrupted` line, exit 130."""
    from asr_spec.cli.options import EXIT_FAILED, EXIT_INTERRUPTED, USER_ERRORS, fail
    from asr_spec.errors import one_line

    values = {name: value for name, value in params.items() if name != "ctx"}
    for name in ("enc_dtype", "hidden_dtype", "kind"):
        if isinstance(values.get(name), enum.Enum):
            values[name] = values[name].value
    try:
        skipped = command(SimpleNamespace(model=ctx.obj["model"], **values))
    except USER_ERRORS as err:
        fail(one_line(err), EXIT_FAILED)
    except KeyboardInterrupt:  # typer's exit 130 said nothing; training goes on from its last checkpoint
        typer.echo("interrupted (training: the same command goes on from its last checkpoint; labelling: starts "
                   "again)", err=True)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    if skipped:
        raise typer.Exit(EXIT_FAILED)


# -- options shared by several commands (each declared once) -----------------------------------------------------
SPLIT = typer.Option("train", help="Folder of the LibriSpeech-layout tree.")
WINDOW_S = typer.Option(29.0, help="Seconds per packed training window.")
GAP_S = typer.Option(0.4, help="Seconds of silence between packed utterances.")
MAX_UTTERANCES = typer.Option(0, help="First N utterances only (0 = all).")
LABEL_BATCH = typer.Option(4, "--batch-size", help="Windows pseudo-labelled together.")
LANGUAGE = typer.Option("en", help="Language of the pseudo-labels.")
MAX_NEW_TOKENS = typer.Option(256, help="Most tokens per pseudo-label.")
ENC_DTYPE = typer.Option(EncDtype.float16, help="How the cached encoder outputs are stored.")
TIMESTAMPS = typer.Option(False, "--timestamps", help="Pseudo-labels in timestamp mode (transcription's default).")
BATCH_WINDOWS = typer.Option(4, help="Windows per training step.")
LR = typer.Option(3e-4, help="Peak learning rate.")
WARMUP_STEPS = typer.Option(30, help="Linear warm-up steps.")
KL_WEIGHT = typer.Option(1.0, help="Weight of the KL divergence to the target.")
CE_WEIGHT = typer.Option(1.0, help="Weight of the cross-entropy on the pseudo-labels.")
SEED = typer.Option(0, help="Seed of initialisation and window order.")
CKPT_EVERY = typer.Option(50, help="Steps between checkpoints.")
STOP_AFTER = typer.Option(None, help="Stop once this many steps are done (resume later).")
HIDDEN_DTYPE = typer.Option(EncDtype.float16, help="How the target's cached final states are stored.")
KIND = typer.Option(DraftKindName.decoder, help="decoder: a decoder-only draft; target-features: EAGLE-style, "
                    "reading the target's final states.")
REG_WEIGHT = typer.Option(None, help="target-features: weight of the smooth-L1 feature regression (default 1).")
FEATURE_NOISE = typer.Option(0.0, help="target-features: U(-a, a) noise on the input states in training.")
OVERWRITE = typer.Option(False, "--overwrite", help="Replace --out when it already holds files (else an error).")
PROJECTION_LR_SCALE = typer.Option(1.0, help="target-features: the input projection's learning rate as a share of "
                                   "--lr (the target's states are far larger than its embeddings; whisper-base: "
                                   "0.002 evens their steps).")


@distill_app.command("cache")
def cache(  # long function: typer declares each of its 17 options as a parameter
    ctx: typer.Context,
    corpus: Path | None = typer.Option(None, help="LibriSpeech-layout tree."),
    long_file: list[Path] | None = typer.Option(None, help="A long recording, cut into 30 s windows "
                                                   "(repeatable)."),
    split: str = SPLIT,
    out: Path = typer.Option(..., help="The cache folder to write."),
    overwrite: bool = OVERWRITE,
    no_pack: bool = typer.Option(False, "--no-pack", help="One window per utterance (default: pack into windows)."),
    window_s: float = WINDOW_S,
    gap_s: float = GAP_S,
    max_utterances: int = MAX_UTTERANCES,
    batch_size: int = LABEL_BATCH,
    language: str = LANGUAGE,
    max_new_tokens: int = MAX_NEW_TOKENS,
    enc_dtype: EncDtype = ENC_DTYPE,
    timestamps: bool = TIMESTAMPS,
    from_cache: Path | None = typer.Option(None, help="Label the windows of this cache again (its encoder "
                                              "outputs)."),
    max_windows: int = typer.Option(0, help="With --from-cache: this many windows, evenly spread."),
    hidden_dtype: EncDtype = HIDDEN_DTYPE,
) -> None:
    """Encode + pseudo-label a LibriSpeech-layout corpus."""
    params = dict(locals())  # first: the parameters only
    from asr_spec.distill.commands import cmd_cache

    _call(cmd_cache, ctx, params)


@distill_app.command("train")
def train(  # long function: typer declares each of its 23 options as a parameter
    ctx: typer.Context,
    train_cache: list[Path] = typer.Option(..., help="One cache, or several trained on as one."),
    init_draft: Path | None = typer.Option(None, help="Start from this trained draft's layers (same layer "
                                              "count; with --kind target-features it may be a plain distilled draft: "
                                              "a warm start from its proposals, and its head unless --vocab-size)."),
    held_out_cache: Path | None = typer.Option(None, help="Held-out cache for agreement during training."),
    work: Path = typer.Option(..., help="Checkpoint folder (resumes when ckpt.pt is there)."),
    out: Path | None = typer.Option(None, help="Save the trained draft here."),
    overwrite: bool = OVERWRITE,
    layers: str = typer.Option("", help="Target decoder layers to initialise from (default: the first and last; "
                               "the first for target-features)."),
    vocab_size: int = typer.Option(0, help="Restricted head size (0 = full vocabulary)."),
    steps: int = typer.Option(1000, help="Training steps."),
    stop_after: int | None = STOP_AFTER,
    batch_windows: int = BATCH_WINDOWS,
    lr: float = LR,
    warmup_steps: int = WARMUP_STEPS,
    kl_weight: float = KL_WEIGHT,
    ce_weight: float = CE_WEIGHT,
    seed: int = SEED,
    eval_every: int = typer.Option(50, help="Steps between held-out evaluations."),
    ckpt_every: int = CKPT_EVERY,
    kind: DraftKindName = KIND,
    reg_weight: float | None = REG_WEIGHT,
    feature_noise: float = FEATURE_NOISE,
    projection_lr_scale: float = PROJECTION_LR_SCALE,
) -> None:
    """Train a draft on a cache."""
    params = dict(locals())  # first: the parameters only
    from asr_spec.distill.commands import cmd_train

    _call(cmd_train, ctx, params)


@distill_app.command("eval")
def evaluate(  # long function: typer declares each of its 15 options as a parameter
    ctx: typer.Context,
    held_out_cache: Path = typer.Option(..., help="The held-out cache."),
    draft: Path | None = typer.Option(None, help="A draft saved by `train --out`."),
    untrained: list[str] | None = typer.Option(None, help="Also evaluate an untrained cut, e.g. 0,5 "
                                                  "(repeatable)."),
    batch_size: int = typer.Option(4, help="Rows of the step-time and speed measurements."),
    k: list[int] = typer.Option([4], help="Draft tokens per step of the speed measurements (one or more)."),
    repeats: int = typer.Option(2, help="Timed runs of each speed measurement."),
    also_full_head: bool = typer.Option(False, "--also-full-head", help="Also time a restricted draft with its "
                                        "full head."),
    no_speed: bool = typer.Option(False, "--no-speed", help="Agreement only."),
    sim_k: list[int] = typer.Option([3, 4, 5, 6, 8], help="K values for simulated tokens per target pass (exact "
                                    "for greedy verification of the draft in fp32; where bf16 products are native "
                                    "the engine runs a bf16 copy of it: --engine-k counts that)."),
    speed_windows: int = typer.Option(0, help="Time speed on the first N windows only (0 = all)."),
    head_sizes: list[int] | None = typer.Option(None, help="Also the draft with these restricted heads "
                                                   "(0 = full)."),
    train_cache: list[Path] | None = typer.Option(None, help="With --head-sizes: the caches whose token "
                                                     "counts pick the heads."),
    compare_draft: list[Path] | None = typer.Option(None, help="Other saved drafts, side by side on the same "
                                                       "windows."),
    engine_k: list[int] | None = typer.Option(None, help="K values whose tokens per target pass the engine "
                                                 "counts (exact for every kind) at --batch-size."),
) -> None:
    """Held-out agreement and speed-up vs greedy."""
    params = dict(locals())  # first: the parameters only
    from asr_spec.distill.commands import cmd_eval

    _call(cmd_eval, ctx, params)


@distill_app.command("head")
def head(
    ctx: typer.Context,
    draft: Path = typer.Option(..., help="A draft saved by `train --out`."),
    train_cache: list[Path] = typer.Option(..., help="Their token counts choose the head."),
    head_size: int = typer.Option(..., help="Tokens the head scores (0 = full vocabulary)."),
    out: Path = typer.Option(..., help="Where the draft is saved."),
    overwrite: bool = OVERWRITE,
) -> None:
    """Save a trained draft with another restricted head."""
    params = dict(locals())  # first: the parameters only
    from asr_spec.distill.commands import cmd_head

    _call(cmd_head, ctx, params)


@distill_app.command("run")
def run(  # long function: typer declares each of its 30 options as a parameter
    ctx: typer.Context,
    audio: Path = typer.Option(..., help="LibriSpeech-layout tree of training speech."),
    split: str = SPLIT,
    out: Path = typer.Option(..., help="Where the draft is saved."),
    overwrite: bool = OVERWRITE,
    work: Path | None = typer.Option(None, help="Pseudo-label cache and checkpoints (default: OUT.work; "
                                        "resumable)."),
    layers: str = typer.Option("2", help="Number of decoder layers (first..last), or explicit ids 0,5."),
    vocab_size: int = typer.Option(8192, help="Restricted head size (0 = full vocabulary)."),
    steps: int = typer.Option(600, help="Training steps."),
    window_s: float = WINDOW_S,
    gap_s: float = GAP_S,
    lr: float = LR,
    kl_weight: float = KL_WEIGHT,
    ce_weight: float = CE_WEIGHT,
    max_utterances: int = MAX_UTTERANCES,
    batch_size: int = LABEL_BATCH,
    max_new_tokens: int = MAX_NEW_TOKENS,
    batch_windows: int = BATCH_WINDOWS,
    warmup_steps: int = WARMUP_STEPS,
    seed: int = SEED,
    eval_every: int = typer.Option(0, help="Steps between points of the training loss in distill.json's history "
                                   "(0: none; run has no held-out cache to measure agreement on)."),
    ckpt_every: int = CKPT_EVERY,
    stop_after: int | None = STOP_AFTER,
    timestamps: bool = TIMESTAMPS,
    language: str = LANGUAGE,
    enc_dtype: EncDtype = ENC_DTYPE,
    hidden_dtype: EncDtype = HIDDEN_DTYPE,
    kind: DraftKindName = KIND,
    reg_weight: float | None = REG_WEIGHT,
    feature_noise: float = FEATURE_NOISE,
    projection_lr_scale: float = PROJECTION_LR_SCALE,
) -> None:
    """Cache + train + save: the whole distillation in one command."""
    params = dict(locals())  # first: the parameters only
    from asr_spec.distill.commands import cmd_run

    _call(cmd_run, ctx, params)


def distill_main(argv: list[str] | None = None, *, prog: str = "asr-spec distill") -> int:
    """`asr-spec distill ARGV` as a function: the exit code. argv None: sys.argv[1:]."""
    import sys

    try:
        distill_app(args=expand_variadic(sys.argv[1:] if argv is None else argv), prog_name=prog)
    except SystemExit as exit_:
        if isinstance(exit_.code, str):  # SystemExit("message") from a command: click does not print it
            typer.echo(exit_.code, err=True)
            return 1
        return int(exit_.code or 0)
    return 0
