"""The figures of benchmarks/bench.py and how they are reported: one `Result` per configuration and batch size, the
table (RTFx, speed-ups, WER, tokens per target pass, acceptance, "same as greedy") and the PNG of speed-up against
batch size. Pure reporting: nothing here runs a model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asr_spec.eval.metrics import score

CONFIGS = ("hf", "hf+asst", "greedy", "spec", "fw", "fw-ts", "default", "fp32", "fw-int8")
LABELS = {
    "hf": "(1) transformers pipeline",
    "hf+asst": "(2) transformers + assistant",
    "greedy": "(3) asr-spec greedy",
    "spec": "(4) asr-spec speculative",
    "fw": "(5) faster-whisper batched",
    "fw-ts": "(6) faster-whisper timestamps",
    "default": "(7) asr-spec preset default",
    "fp32": "(8) asr-spec default, float32",
    "fw-int8": "(9) faster-whisper int8",
}
BASELINES = ("hf", "greedy")  # the speed-up columns: vs (1) and vs (3) at the same batch size
LOSSLESS = ("spec", "default")  # the configurations whose tokens must equal greedy's


@dataclass(frozen=True)
class Result:
    config: str  # one of CONFIGS
    batch_size: int
    wall_s: float | None  # None when it could not run
    texts: list[str] | None
    error: str | None = None  # why it could not run (one line)
    tokens: list[Any] | None = None  # asr-spec only: each clip's per-chunk token ids
    tokens_per_target_pass: float | None = None  # asr-spec only
    acceptance_rate: float | None = None  # asr-spec speculative only
    # asr-spec on a CPU: the timed run's `StageTimes` as a dict (encoder_s, steps_s, steps)
    stages: dict[str, float] | None = None


def _row(result: Result, by: dict[tuple[str, int], Result], audio_s: float,
         refs: Sequence[str | None]) -> dict[str, Any]:
    """The figures of one result: RTFx, the speed-ups vs the baselines, WER (when every clip has a reference) and
    whether a lossless configuration gave greedy's tokens."""
    row: dict[str, Any] = {"batch_size": result.batch_size, "config": result.config, "wall_s": result.wall_s,
                           "error": result.error}
    if result.wall_s is not None:
        row["rtfx"] = audio_s / result.wall_s
        for base in BASELINES:
            other = by.get((base, result.batch_size))
            if other is not None and other.wall_s:
                row[f"speedup_vs_{base}"] = other.wall_s / result.wall_s
            else:
                row[f"speedup_vs_{base}"] = None
        if all(ref is not None for ref in refs):
            row["wer"] = score(list(refs), result.texts).wer
        else:
            row["wer"] = None
        row["tokens_per_target_pass"] = result.tokens_per_target_pass
        row["acceptance_rate"] = result.acceptance_rate
        row["stages"] = _stages(result, by.get(("greedy", result.batch_size)))
    greedy = by.get(("greedy", result.batch_size))
    if result.config in LOSSLESS and greedy is not None and greedy.texts is not None:
        # token for token, not only the text
        row["identical_to_greedy"] = result.texts == greedy.texts and result.tokens == greedy.tokens
    return row


def _stages(result: Result, greedy: Result | None) -> dict[str, float] | None:
    """An asr-spec result's stage times (encoder, decode steps, admissions, the rest of its wall time: audio,
    voice activity, log-mel features, scheduling, stitching), ms per step, and its steps' time against greedy's at
    the same batch size (measured in the same run, interleaved)."""
    if result.stages is None or result.wall_s is None:
        return None
    out = dict(result.stages)
    out.setdefault("admit_s", 0.0)
    out["rest_s"] = result.wall_s - out["encoder_s"] - out["steps_s"] - out["admit_s"]
    out["ms_per_step"] = 1000 * out["steps_s"] / out["steps"] if out["steps"] else None
    base = greedy.stages if greedy is not None else None
    out["steps_vs_greedy"] = base["steps_s"] / out["steps_s"] if base and out["steps_s"] else None
    out["bound_vs_greedy"] = (speculation_bound(greedy.wall_s, base["steps_s"], result.tokens_per_target_pass)
                              if base and greedy.wall_s and result.tokens_per_target_pass else None)
    return out


def speculation_bound(greedy_wall_s: float, greedy_steps_s: float, tokens_per_pass: float) -> float:
    """The most a draft giving `tokens_per_pass` tokens a target pass can speed a run up over greedy decoding
    (greedy's wall time and its decode steps' share of it, measured): were each speculative step as cheap as a
    greedy step (a free draft, a verify pass costing a 1-token step), the steps would take greedy's time over
    tokens_per_pass, and nothing else (encoder, admissions, the rest) would change. Free steps
    (tokens_per_pass -> inf) bound it by greedy_wall_s / (greedy_wall_s - greedy_steps_s)."""
    if not 0 <= greedy_steps_s < greedy_wall_s or tokens_per_pass < 1:
        raise ValueError(f"need 0 <= steps < wall and tokens a pass >= 1, got {greedy_steps_s}, {greedy_wall_s}, "
                         f"{tokens_per_pass}")
    return greedy_wall_s / (greedy_wall_s - greedy_steps_s + greedy_steps_s / tokens_per_pass)


def _stage_line(row: dict[str, Any]) -> str | None:
    stages = row.get("stages")
    if not stages:
        return None
    return (f"{row['batch_size']:>3}  {LABELS[row['config']]:<30} {row['wall_s']:7.2f} {stages['encoder_s']:9.2f} "
            f"{stages['steps_s']:8.2f} {stages['steps']:6d} {_fmt(stages['ms_per_step'], '8.1f')} "
            f"{stages['admit_s']:7.2f} {stages['rest_s']:7.2f}  {_fmt(stages['steps_vs_greedy'], '15.2f')}"
            f"  {_fmt(stages['bound_vs_greedy'], '13.2f')}")


def stage_table(rows: list[dict[str, Any]]) -> str:
    """The asr-spec rows' stage times (CPU runs; empty where none has them): encoder, decode steps, admissions,
    the rest; greedy's steps over this row's, and the bound its tokens a target pass put on its speed-up over
    greedy (`speculation_bound`: each step as cheap as a greedy step)."""
    lines = [line for line in map(_stage_line, rows) if line is not None]
    if not lines:
        return ""
    head = (f"{'N':>3}  {'configuration':<30} {'wall s':>7} {'encoder s':>9} {'steps s':>8} {'steps':>6} "
            f"{'ms/step':>8} {'admit s':>7} {'rest s':>7}  steps: (3)/this  bound vs (3)")
    return "\n".join([head, "-" * len(head), *lines])


def _fmt(x: Any, spec: str) -> str:
    """`x` formatted, or "-" when it is missing or not finite."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return format(x, spec)


def _line(row: dict[str, Any]) -> str:
    label = LABELS[row["config"]]
    if row["wall_s"] is None:
        return f"{row['batch_size']:>3}  {label:<30} {row['error']}"
    same = {True: "yes", False: "NO", None: ""}[row.get("identical_to_greedy")]
    wer = "-" if row["wer"] is None else f"{100 * row['wer']:.2f}%"
    accept = "-" if row["acceptance_rate"] is None else f"{100 * row['acceptance_rate']:.1f}%"
    return (f"{row['batch_size']:>3}  {label:<30} {row['wall_s']:7.2f} {row['rtfx']:7.2f} "
            f"{_fmt(row['speedup_vs_hf'], '7.2f')} {_fmt(row['speedup_vs_greedy'], '7.2f')} {wer:>7}  "
            f"{_fmt(row['tokens_per_target_pass'], '8.2f')} {accept:>7}  {same}")


def table(results: list[Result], audio_s: float, refs: Sequence[str | None]) -> tuple[str, list[dict[str, Any]]]:
    """The printed table and its rows (the JSON figures), one per result. audio_s: seconds of audio of one pass
    over the clips; refs: each clip's reference transcript (None: unknown, no WER)."""
    by = {(r.config, r.batch_size): r for r in results}
    rows = [_row(r, by, audio_s, refs) for r in results]
    head = (f"{'N':>3}  {'configuration':<30} {'wall s':>7} {'RTFx':>7} {'vs (1)':>7} {'vs (3)':>7} {'WER':>7}  "
            f"{'tok/pass':>8} {'accept':>7}  same as (3)")
    lines = [head, "-" * len(head)]
    lines += [_line(row) for row in rows]
    return "\n".join(lines), rows


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Throughput relative to the transformers pipeline at the smallest batch size, against batch size, one line
    per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    smallest = min(r["batch_size"] for r in rows)
    base = next((r for r in rows if r["config"] == "hf" and r["batch_size"] == smallest and r.get("rtfx")), None)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for config in CONFIGS:
        if base is None:
            break
        points = [(r["batch_size"], r["rtfx"] / base["rtfx"]) for r in rows if r["config"] == config and r.get("rtfx")]
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", label=LABELS[config])
    ax.set_xscale("log", base=2)
    sizes = sorted({r["batch_size"] for r in rows})
    ax.set_xticks(sizes, labels=[str(x) for x in sizes])
    ax.set_xlabel("batch size N")
    base_n = base["batch_size"] if base else "?"
    ax.set_ylabel(f"speed-up vs transformers pipeline at N={base_n}")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    if ax.lines:  # nothing to plot without a transformers row to compare with
        ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
