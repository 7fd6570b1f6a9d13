"""Record, or compare, everything asr-spec outputs for the committed fixtures: a refactoring's safety net.

    python -m scripts.record_outputs record OUT.json      # on the old commit
    python -m scripts.record_outputs compare OLD.json     # on the new one: exit 1 on any difference

For every committed audio fixture (tests/fixtures/**.flac) and each configuration below, it keeps the transcript,
segments (times, text, word times), language, statistics, per-chunk reports and token ids: everything a
`Transcription` holds except wall-clock times. Floats are stored as `repr` strings, so "identical" means
byte-identical. Only the public API is used (`Transcriber.from_preset`, `transcribe`), so the same script runs on
both sides of a restructuring.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"

# name -> (from_preset overrides, batch size). The default preset greedy at batch 8 and drafted runs of few rows,
# stride chunking, word timestamps, and the shipped draft at batch 1 and 4 (every row drafted).
CONFIGS: dict[str, tuple[dict[str, Any], int]] = {
    "default-b8": ({}, 8),
    "default-b4": ({}, 4),
    "stride-b8": ({"chunking": "stride"}, 8),
    "words-b8": ({"word_timestamps": True}, 8),
    "distilled-b1": ({"_preset": "base-distilled"}, 1),
    "distilled-b4-words": ({"_preset": "base-distilled", "word_timestamps": True}, 4),
}


def _plain(value: Any) -> Any:
    """JSON-ready copy of a result: dataclasses as dicts, tuples as lists, floats as their repr."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float):
        return repr(value)
    return value


def _fixtures() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in FIXTURES.rglob("*.flac"))


def record() -> dict[str, Any]:
    from asr_spec.transcribe import Transcriber

    torch.set_num_threads(2)
    files = _fixtures()
    out: dict[str, Any] = {}
    for name, (overrides, batch) in CONFIGS.items():
        values = dict(overrides)
        preset = values.pop("_preset", "base")
        transcriber = Transcriber.from_preset(preset, device="cpu", **values)
        results = transcriber.transcribe([str(ROOT / f) for f in files], batch_size=batch, progress=False)
        per_file = {}
        for path, t in zip(files, results):
            item = _plain(t)
            item.pop("wall_s")
            item["source"] = path
            per_file[path] = item
        out[name] = per_file
        print(f"{name}: {len(files)} files, {sum(len(t.text.split()) for t in results)} words", file=sys.stderr)
    return out


def _restricted(new: Any, old: Any) -> Any:
    """`new` with, at every depth, only the dict keys `old` has there: a field added since the recording (e.g.
    segments' token ids) is not a difference in what was recorded."""
    if isinstance(new, dict) and isinstance(old, dict):
        return {k: _restricted(v, old[k]) for k, v in new.items() if k in old}
    if isinstance(new, list) and isinstance(old, list) and len(new) == len(old):
        return [_restricted(n, o) for n, o in zip(new, old)]
    return new


def differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """One line per (configuration, fixture) whose recorded outputs differ, naming the fields."""
    new = _restricted(new, old)
    lines = []
    for config in sorted(set(old) | set(new)):
        a, b = old.get(config, {}), new.get(config, {})
        for path in sorted(set(a) | set(b)):
            if a.get(path) != b.get(path):
                ka, kb = a.get(path, {}), b.get(path, {})
                keys = sorted(k for k in set(ka) | set(kb) if ka.get(k) != kb.get(k))
                lines.append(f"{config} {path}: differs in {', '.join(keys)}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("record", "compare"))
    parser.add_argument("path", type=Path, help="record: where to write; compare: the old recording")
    args = parser.parse_args()
    new = record()
    if args.mode == "record":
        args.path.write_text(json.dumps(new, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        return 0
    old = json.loads(args.path.read_text(encoding="utf-8"))
    lines = differences(old, json.loads(json.dumps(new)))
    n = sum(len(files) for files in old.values())
    for line in lines:
        print(line)
    print(f"{n - len(lines)} of {n} (configuration, fixture) outputs byte-identical; {len(lines)} differ")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
