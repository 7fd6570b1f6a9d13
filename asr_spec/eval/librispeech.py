"""LibriSpeech for evaluation: read utterances (local tree or the hub), build long-form files, log results.

Data path: `iter_local` / `iter_hub` -> (`take` for --limit) -> optionally `long_form` -> the caller transcribes
each `Utterance` and `ResultsLog.append`s one record -> `summarize` turns the log into corpus figures.

Results log: one JSON object per line, appended and fsync'ed as each utterance finishes, so a killed run resumes
by skipping `ResultsLog(path).done_ids()`. Fields `summarize` reads (others are kept and ignored):

    id                   str    utterance id ("1089-134686-0000"); unique per log
    ref, hyp             str    reference and hypothesis text (raw; normalised when scored)
    audio_s              float  seconds of audio
    wall_s               float  seconds of wall time spent on it
    error                str    present (non-empty) when the utterance failed: excluded from scores and timings
    identical_to_greedy  bool   speculative output == plain greedy output, token for token (optional)
    chunks, generated_tokens, target_passes, draft_passes, drafted_tokens, accepted_tokens, accepted_hist
                                the counts of `asr_spec.engine.ChunkStats` as `dataclasses.asdict` gives them
                                (optional; summed with `ChunkStats.total`)
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import warnings
from collections.abc import Collection, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf

from asr_spec.audio.loading import SAMPLE_RATE, audio_duration_s, load_audio
from asr_spec.checks import int_at_least
from asr_spec.engine.stats import ChunkStats
from asr_spec.errors import AsrSpecError, AudioError, InputError
from asr_spec.eval.metrics import Spelling, score

__all__ = [
    "HUB_DATASET",
    "HubUnavailableError",
    "ResultsLog",
    "Utterance",
    "iter_hub",
    "iter_local",
    "long_form",
    "summarize",
    "take",
]

HUB_DATASET = "openslr/librispeech_asr"  # the hub id that the bare name "librispeech_asr" now points to
_STATS_FIELDS = ChunkStats.count_names()
_SPECULATIVE_FIELDS = ("identical_to_greedy", "generated_tokens", "target_passes", "accepted_tokens", "drafted_tokens")
_UTT_ID = re.compile(r"^(\d+)-(\d+)-(\d+)$")  # speaker-chapter-utterance, as in 1089-134686-0000


class HubUnavailableError(AsrSpecError, ConnectionError):
    """The Hugging Face hub cannot be reached (offline, DNS, HTTP error); use a local tree instead."""


@dataclasses.dataclass(frozen=True)
class Utterance:
    """One LibriSpeech utterance (or, from `long_form`, one chapter). Equality and hashing ignore `audio`."""

    id: str  # "speaker-chapter-NNNN"; "speaker-chapter" for a long-form chapter
    speaker: str
    chapter: str
    audio: Path | np.ndarray = dataclasses.field(compare=False, repr=False)  # file, or float32 mono samples
    sampling_rate: int  # Hz of `audio` (of the file's samples when `audio` is a path)
    text: str  # reference transcript as the corpus gives it (LibriSpeech: upper case, no punctuation)
    duration_s: float
    parts: tuple[str, ...] = ()  # ids of the utterances a long-form chapter was built from, in order

    def load(self, sampling_rate: int = SAMPLE_RATE) -> np.ndarray:
        """float32 mono samples at `sampling_rate` Hz. shape = (n_samples,)"""
        if isinstance(self.audio, np.ndarray):
            return load_audio(self.audio, sampling_rate, input_sampling_rate=self.sampling_rate)
        return load_audio(self.audio, sampling_rate)


# ----------------------------------------------------------------------------------------------------------------
# Reading


def iter_local(root: str | os.PathLike, split: str = "test-clean") -> Iterator[Utterance]:
    """Utterances of a LibriSpeech tree in its original layout, in (speaker, chapter, utterance) numeric order.

    `root` is the folder holding `<split>/` (e.g. `LibriSpeech/`) or the split folder itself. Each chapter folder
    `<split>/<speaker>/<chapter>/` holds `<speaker>-<chapter>.trans.txt` (lines `ID TRANSCRIPT`) and `ID.flac`.
    Audio stays on disk (`Utterance.audio` is its path); durations come from the file headers.
    """
    base = _split_dir(Path(root), split)
    for speaker_dir in _numeric_dirs(base):
        for chapter_dir in _numeric_dirs(speaker_dir):
            trans = chapter_dir / f"{speaker_dir.name}-{chapter_dir.name}.trans.txt"
            if not trans.is_file():
                raise InputError(f"{trans}: transcript file missing")
            try:
                lines = trans.read_text(encoding="utf-8").splitlines()
            except UnicodeDecodeError as err:
                raise InputError(f"{trans}: not UTF-8 text ({err})") from err
            for line_no, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                utt_id, _, text = line.strip().partition(" ")
                match = _UTT_ID.match(utt_id)
                if match is None or match.group(1, 2) != (speaker_dir.name, chapter_dir.name):
                    raise InputError(f"{trans}:{line_no}: id {utt_id!r} does not belong to this chapter folder")
                audio = chapter_dir / f"{utt_id}.flac"
                try:
                    duration_s, rate = audio_duration_s(audio), _header_rate(audio)
                except (AudioError, RuntimeError):  # missing or unreadable: its record says why (as transcribing it)
                    duration_s, rate = 0.0, SAMPLE_RATE
                yield Utterance(utt_id, speaker_dir.name, chapter_dir.name, audio, rate, text.strip(), duration_s)


def iter_hub(
    config: str = "clean", split: str = "test", streaming: bool = True, *, dataset: str = HUB_DATASET
) -> Iterator[Utterance]:
    """Utterances of LibriSpeech `config` ("clean" | "other" | "all") / `split` ("test", "validation",
    "train.100", ...) from the Hugging Face hub, via `datasets.load_dataset`, in the dataset's order.

    Audio is decoded here (soundfile) rather than by `datasets` (which needs torchcodec); `Utterance.audio` is a
    float32 array at 16 kHz. Raises `HubUnavailableError` when the hub cannot be reached (at the start or while
    streaming); without a network, datasets retries for ~20 s first unless HF_HUB_OFFLINE=1 is set.
    """
    try:
        import datasets
    except ImportError as err:
        raise ImportError("iter_hub needs the 'datasets' package (pip install 'asr-spec[eval]')") from err
    what = f"{dataset} {config}/{split}"
    unreachable = _hub_errors()
    try:
        ds = datasets.load_dataset(dataset, config, split=split, streaming=streaming)
        ds = ds.cast_column("audio", datasets.Audio(decode=False))
        for row in ds:
            yield _from_hub_row(row, what)
    except unreachable as err:
        cause = (str(err).strip().splitlines() or [""])[0]
        raise HubUnavailableError(
            f"{what}: the Hugging Face hub is unreachable ({type(err).__name__}: {cause}); "
            "pass a local LibriSpeech tree instead (iter_local(root, split))"
        ) from err


def _from_hub_row(row: Mapping[str, Any], what: str) -> Utterance:
    missing = [k for k in ("id", "speaker_id", "chapter_id", "audio", "text") if k not in row]
    if missing:
        raise InputError(f"{what}: rows lack {', '.join(missing)} (is this a LibriSpeech dataset?)")
    audio = load_audio(row["audio"], SAMPLE_RATE)
    return Utterance(
        id=str(row["id"]),
        speaker=str(row["speaker_id"]),
        chapter=str(row["chapter_id"]),
        audio=audio,
        sampling_rate=SAMPLE_RATE,
        text=str(row["text"]),
        duration_s=len(audio) / SAMPLE_RATE,
    )


def _hub_errors() -> tuple[type[BaseException], ...]:
    """Exception types that mean "cannot reach the hub" (the builtin ConnectionError covers datasets' own and
    huggingface_hub's OfflineModeIsEnabled)."""
    errors: list[type[BaseException]] = [ConnectionError, TimeoutError]
    try:
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

        errors += [HfHubHTTPError, LocalEntryNotFoundError]
    except ImportError:  # pragma: no cover
        pass
    try:
        import httpx

        errors.append(httpx.TransportError)
    except ImportError:  # pragma: no cover
        pass
    return tuple(errors)


def take(utterances: Iterable[Utterance], limit: int | None) -> Iterator[Utterance]:
    """The first `limit` utterances (all when `limit` is None): the meaning of --limit."""
    if limit is None:
        return iter(utterances)
    int_at_least(limit, "limit", 0)
    return itertools.islice(utterances, limit)


def long_form(utterances: Iterable[Utterance], gap_s: float = 0.0) -> Iterator[Utterance]:
    """One long utterance per chapter: its utterances' audio end to end (with `gap_s` of silence between them) in
    utterance-number order, and their texts joined by spaces; the long-form test set distil-whisper built from
    LibriSpeech the same way.

    The input must give each chapter's utterances consecutively (iter_local and the hub do); a chapter that
    reappears after another one started raises InputError, since holding every chapter in memory is not an option
    for a whole split. Audio is loaded at 16 kHz; the result's `audio` is the float32 array.
    """
    if not np.isfinite(gap_s) or gap_s < 0:
        raise InputError(f"gap_s must be a non-negative number of seconds, got {gap_s!r}")
    finished: set[tuple[str, str]] = set()
    for key, group in itertools.groupby(utterances, key=lambda u: (u.speaker, u.chapter)):
        if key in finished:
            raise InputError(f"long_form: chapter {key[0]}-{key[1]} appears twice; group the input by chapter")
        finished.add(key)
        yield _join_chapter(sorted(group, key=_utterance_number), gap_s)


def _utterance_number(u: Utterance) -> int:
    match = _UTT_ID.match(u.id)
    if match is None:
        raise InputError(f"long_form: {u.id!r} is not a speaker-chapter-number id")
    return int(match.group(3))


def _join_chapter(parts: list[Utterance], gap_s: float) -> Utterance:
    gap = np.zeros(round(gap_s * SAMPLE_RATE), dtype=np.float32)
    pieces: list[np.ndarray] = []
    for part in parts:
        if pieces and len(gap):
            pieces.append(gap)
        pieces.append(part.load(SAMPLE_RATE))
    audio = np.concatenate(pieces)
    first = parts[0]
    return Utterance(
        id=f"{first.speaker}-{first.chapter}",
        speaker=first.speaker,
        chapter=first.chapter,
        audio=audio,
        sampling_rate=SAMPLE_RATE,
        text=" ".join(p.text for p in parts),
        duration_s=len(audio) / SAMPLE_RATE,
        parts=tuple(p.id for p in parts),
    )


def _split_dir(root: Path, split: str) -> Path:
    if (root / split).is_dir():
        return root / split
    if root.is_dir() and root.name == split:
        return root
    raise InputError(f"{root}: no LibriSpeech split {split!r} here (expected {root / split}/<speaker>/<chapter>/)")


def _numeric_dirs(folder: Path) -> list[Path]:
    return sorted((p for p in folder.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))


def _header_rate(path: Path) -> int:
    return int(sf.info(str(path)).samplerate)


# ----------------------------------------------------------------------------------------------------------------
# Results


class ResultsLog:
    """Append-only JSONL of per-utterance results that survives a crash at any point.

    A crash can leave at most a last line without its newline; reading ignores it (that utterance is simply redone)
    and the next `append` cuts it off first, so the file stays one valid record per line.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._tail_checked = False

    def records(self) -> list[dict[str, Any]]:
        """Every complete record, in file order."""
        return _read_records(self.path)

    def done_ids(self) -> set[str]:
        """Ids already logged (failed ones included: delete their lines to retry them)."""
        return {r["id"] for r in self.records()}

    def check_writable(self) -> None:
        """`InputError` naming the log when it cannot be appended to (checked before the models load: found at the
        first record, every utterance of a group had been decoded for nothing)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "ab"):
                pass
        except OSError as err:
            raise InputError(f"{self.path}: cannot write the results log ({err.strerror or err})") from err

    def append(self, record: Mapping[str, Any]) -> None:
        """Write `record` as one line, then flush and fsync it."""
        if not isinstance(record.get("id"), str) or not record["id"]:
            raise InputError(f"{self.path}: a result record needs a non-empty string 'id', got {record.get('id')!r}")
        try:
            line = json.dumps(dict(record), ensure_ascii=False, allow_nan=False) + "\n"
        except (TypeError, ValueError) as err:
            raise InputError(f"{self.path}: record {record['id']!r} is not JSON-serialisable ({err})") from err
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not self._tail_checked:
            _cut_partial_tail(self.path)
            self._tail_checked = True
        with open(self.path, "ab") as handle:
            handle.write(line.encode("utf-8"))
            handle.flush()
            os.fsync(handle.fileno())


def _read_records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    data = path.read_bytes()
    lines = data.split(b"\n")
    if lines[-1]:  # no newline at the end: a write the crash interrupted
        _check_partial_record(path, lines[-1])
        warnings.warn(f"{path}: ignoring an incomplete last line ({len(lines[-1])} bytes)", stacklevel=3)
    records = []
    for line_no, raw in enumerate(lines[:-1], 1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise InputError(f"{path}:{line_no}: not a JSON record ({err})") from err
        if not isinstance(record, dict) or not isinstance(record.get("id"), str):
            raise InputError(f"{path}:{line_no}: a record must be a JSON object with a string 'id'")
        records.append(record)
    return records


def _check_partial_record(path: Path, line: bytes) -> None:
    """`InputError` unless `line`, a last line without its newline, can be the head of a record a crash cut (one
    `append` writes a whole JSON object): a text file given as the log was read as crash residue and cut away."""
    if line.strip() and not line.lstrip().startswith(b"{"):  # a blank last line (a hand edit) is nothing
        raise InputError(f"{path}: not a results log (its last line, {line[:40]!r}, is no JSON record): give "
                         "another --output")


def _cut_partial_tail(path: Path) -> None:
    if not path.exists() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if data.endswith(b"\n"):
        return
    keep = data.rfind(b"\n") + 1  # 0 when the file is one partial line
    _check_partial_record(path, data[keep:])
    with open(path, "r+b") as handle:
        handle.truncate(keep)
        handle.flush()
        os.fsync(handle.fileno())


def _last_records(path: str | os.PathLike, ids: Collection[str] | None) -> dict[str, dict[str, Any]]:
    """The log's last record of each id (of `ids` only, unless None), by id; repeated ids warned about."""
    records = _read_records(Path(path))
    if ids is not None:
        records = [r for r in records if r["id"] in ids]
    by_id = {record["id"]: record for record in records}
    if len(by_id) < len(records):
        warnings.warn(f"{path}: {len(records) - len(by_id)} repeated ids; the last record of each is used",
                      stacklevel=3)
    return by_id


def _warn_empty_references(path: str | os.PathLike, scored: list[dict[str, Any]]) -> None:
    """Records with an empty reference are scored as they are (their transcript's words are insertions), but
    said, naming them: one such record made 11 of a run's 13 insertions."""
    empty = [r["id"] for r in scored if not str(r["ref"]).strip()]
    if empty:
        shown = ", ".join(empty[:3]) + (f" and {len(empty) - 3} more" if len(empty) > 3 else "")
        warnings.warn(f"{path}: {len(empty)} scored records have an empty reference ({shown}): every word of their "
                      "transcripts counts as an insertion", stacklevel=3)


def summarize(path: str | os.PathLike, *, spelling: Spelling = None,
              ids: Collection[str] | None = None) -> dict[str, Any]:
    """Corpus figures from a results log alone.

    Always: n_records, n_failed, n_scored, wer, cer, n_words, substitutions, deletions, insertions, audio_s, wall_s,
    rtfx (= sum audio_s / sum wall_s over scored records; nan when no wall time). When scored records carry them:
    n_greedy_checked, n_identical_to_greedy, all_identical_to_greedy; and every field of `ChunkStats` (chunks,
    generated_tokens, target_passes, draft_passes, drafted_tokens, accepted_tokens, accepted_hist, acceptance_rate,
    tokens_per_target_pass), summed by `ChunkStats.total` over the records that carry statistics. A field present
    in only some records is warned about. A repeated id keeps its
    last record (with a warning). wer/cer are inf when there are insertions but no reference words. `ids`: the
    records of those ids only (a run's `limit`: the log may hold more), None: every record.
    """
    by_id = _last_records(path, ids)
    failed = [r for r in by_id.values() if r.get("error")]
    scored = [r for r in by_id.values() if not r.get("error")]
    for r in scored:
        missing = [k for k in ("ref", "hyp", "audio_s", "wall_s") if k not in r]
        if missing:
            raise InputError(f"{path}: record {r['id']!r} lacks {', '.join(missing)}")
    _warn_empty_references(path, scored)
    s = score([r["ref"] for r in scored], [r["hyp"] for r in scored], spelling=spelling)
    audio_s = float(sum(r["audio_s"] for r in scored))
    wall_s = float(sum(r["wall_s"] for r in scored))
    summary: dict[str, Any] = {
        "n_records": len(by_id),
        "n_failed": len(failed),
        "n_scored": len(scored),
        "wer": s.wer if scored else float("nan"),  # nothing scored is no WER of 0 % (n/a)
        "cer": s.cer if scored else float("nan"),
        "n_words": s.n_words,
        "substitutions": s.substitutions,
        "deletions": s.deletions,
        "insertions": s.insertions,
        "audio_s": audio_s,
        "wall_s": wall_s,
        "rtfx": audio_s / wall_s if wall_s > 0 else float("nan"),
    }
    for field in _SPECULATIVE_FIELDS:
        n_with = sum(field in r for r in scored)
        if 0 < n_with < len(scored):
            warnings.warn(
                f"{path}: {field!r} is in only {n_with} of {len(scored)} scored records; figures that use "
                "it cover those records only",
                stacklevel=2,
            )
    checked = [r["identical_to_greedy"] for r in scored if "identical_to_greedy" in r]
    if checked:
        summary["n_greedy_checked"] = len(checked)
        summary["n_identical_to_greedy"] = sum(bool(x) for x in checked)
        summary["all_identical_to_greedy"] = all(checked)
    with_stats = [r for r in scored if any(name in r for name in _STATS_FIELDS)]
    if with_stats:  # the engine's statistics type sums them: the same figures as a Transcription's stats
        summary.update(dataclasses.asdict(ChunkStats.total(ChunkStats.from_dict(r) for r in with_stats)))
    return summary
