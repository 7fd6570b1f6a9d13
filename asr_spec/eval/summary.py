"""The summary of an evaluation log: corpus figures, the speculative figures, the speed-up; JSON and a table."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Collection
from pathlib import Path
from typing import Any

from asr_spec.eval.librispeech import ResultsLog, summarize

__all__ = ["eval_summary", "format_summary", "summary_path", "write_summary"]


def eval_summary(path: str | os.PathLike, ids: Collection[str] | None = None,
                 **summarize_kwargs: Any) -> dict[str, Any]:
    """`librispeech.summarize` of the log (which sums the statistics with `ChunkStats.total`), plus:

    target_passes_per_token        target passes / generated tokens (1 for greedy; lower is better)
    mean_accepted_per_target_pass  accepted draft tokens / target passes
    identical_fraction             n_identical_to_greedy / n_greedy_checked (with compare_greedy; must be 1)
    greedy_wall_s, speedup         Σ greedy_wall_s / Σ wall_s over the records that have both
    greedy_rtfx                    Σ audio_s / Σ greedy_wall_s over the same records

    ids: the records of those ids only (None: all).
    """
    path = Path(path)
    summary = summarize(path, ids=ids, **summarize_kwargs)
    if summary.get("target_passes"):
        summary["target_passes_per_token"] = summary["target_passes"] / summary["generated_tokens"] \
            if summary["generated_tokens"] else math.nan
        summary["mean_accepted_per_target_pass"] = summary["accepted_tokens"] / summary["target_passes"]
    if summary.get("n_greedy_checked"):
        summary["identical_fraction"] = summary["n_identical_to_greedy"] / summary["n_greedy_checked"]
    scored = [r for r in ResultsLog(path).records() if not r.get("error") and (ids is None or r["id"] in ids)]
    scored = list({r["id"]: r for r in scored}.values())  # a repeated id keeps its last record, as in summarize
    timed = [r for r in scored if "greedy_wall_s" in r]
    if timed:
        greedy_wall_s = sum(r["greedy_wall_s"] for r in timed)
        spec_wall_s = sum(r["wall_s"] for r in timed)
        summary["greedy_wall_s"] = greedy_wall_s
        summary["greedy_rtfx"] = sum(r["audio_s"] for r in timed) / greedy_wall_s if greedy_wall_s > 0 else math.nan
        summary["speedup"] = greedy_wall_s / spec_wall_s if spec_wall_s > 0 else math.nan
    return summary


def _jsonable(value: Any) -> Any:
    """Non-finite floats become None (strict JSON has no NaN/inf)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def summary_path(log_path: str | os.PathLike) -> Path:
    """runs/x.jsonl -> runs/x.summary.json"""
    path = Path(log_path)
    return path.with_name(f"{path.stem}.summary.json")


def write_summary(summary: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write `summary` as JSON atomically (temporary file, then rename); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(_jsonable(summary), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def _pct(x: Any) -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{100 * x:.2f} %"


def _num(x: Any, fmt: str = ".2f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def format_summary(summary: dict[str, Any], title: str = "") -> str:
    """The summary as an aligned two-column table (figures that the log cannot give are left out)."""
    rows = [
        ("utterances", f"{summary['n_scored']} scored, {summary['n_failed']} failed"),
        ("WER", _pct(summary["wer"])),
        ("CER", _pct(summary["cer"])),
        ("audio", f"{summary['audio_s']:.1f} s in {summary['wall_s']:.1f} s"),
        ("RTFx", _num(summary["rtfx"], ".1f")),
    ]
    if "tokens_per_target_pass" in summary:
        rows.append(("tokens per target pass", _num(summary["tokens_per_target_pass"])))
        rows.append(("target passes per token", _num(summary.get("target_passes_per_token"), ".3f")))
    if summary.get("drafted_tokens"):
        rows.append(("acceptance rate", _pct(summary.get("acceptance_rate"))))
        rows.append(("accepted tokens / target pass", _num(summary.get("mean_accepted_per_target_pass"))))
        if summary.get("accepted_hist"):
            rows.append(("accepted per step (histogram)", " ".join(map(str, summary["accepted_hist"]))))
    if "n_greedy_checked" in summary:
        rows.append(("identical to greedy", f"{_pct(summary['identical_fraction'])} "
                                             f"({summary['n_identical_to_greedy']}/{summary['n_greedy_checked']})"))
    if "speedup" in summary:
        rows.append(("greedy RTFx", _num(summary["greedy_rtfx"], ".1f")))
        rows.append(("speed-up vs greedy", f"{_num(summary['speedup'])}x"))
    if "hardware" in summary:
        from asr_spec.models.cpu import precision_words

        rows.append(("precision", precision_words(summary["hardware"])))
    width = max(len(name) for name, _ in rows)
    lines = [title] if title else []
    lines += [f"{name:<{width}}  {value}" for name, value in rows]
    return "\n".join(lines)
