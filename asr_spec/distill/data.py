"""Training data for draft distillation: utterances packed into 30 s encoder windows, and the pseudo-label cache
(target encoder outputs, the target's greedy transcripts, its teacher-forced final decoder states) on disk,
memory-mapped so that epochs cost no encoder or target pass."""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from asr_spec.errors import InputError

CACHE_FORMAT = 1
# the target's config fields a cache records (meta.json "target"), with its name: what makes its labels its own
TARGET_FIELDS = ("d_model", "vocab_size", "encoder_layers", "decoder_layers", "num_mel_bins", "max_source_positions",
                 "max_target_positions")


# -- packing utterances into encoder windows (pure) -------------------------------------------------------------

def pack_windows(durations_s: Sequence[float], max_window_s: float = 29.0, gap_s: float = 0.4) -> list[list[int]]:
    """Group consecutive utterances into windows of at most `max_window_s` seconds (gaps of `gap_s` between them).

    Greedy, in order: each window takes utterances until the next would overflow. Returns lists of indices.
    max_window_s < 30 leaves trailing silence so the last word is never cut by the 30 s encoder window.
    """
    windows: list[list[int]] = []
    used_s = 0.0
    for i, d in enumerate(durations_s):
        if d > max_window_s:
            raise ValueError(f"utterance {i} lasts {d:.2f} s, longer than a {max_window_s} s window")
        if windows and used_s + gap_s + d <= max_window_s:
            windows[-1].append(i)
            used_s += gap_s + d
        else:
            windows.append([i])
            used_s = d
    return windows


def join_audio(parts: Sequence[np.ndarray], gap_s: float = 0.4, sample_rate: int = 16_000) -> np.ndarray:
    """Concatenate 1-D float32 sample arrays with `gap_s` seconds of digital silence between them."""
    gap = np.zeros(int(round(gap_s * sample_rate)), dtype=np.float32)
    out: list[np.ndarray] = []
    for i, p in enumerate(parts):
        if i:
            out.append(gap)
        out.append(np.asarray(p, dtype=np.float32))
    return np.concatenate(out)


# -- what a cache or a checkpoint was made from ----------------------------------------------------------------

def target_identity(target: nn.Module, name: str | None = None) -> dict[str, Any]:
    """What a cache (and a training checkpoint) records of the target that labelled it: the name it was loaded by
    (None: not known, e.g. a model built in memory), its <|endoftext|> id and its `TARGET_FIELDS`."""
    from asr_spec.engine.rules import WhisperTokens

    eot = WhisperTokens.from_generation_config(target.generation_config, target.config.max_target_positions).eot
    return {"name": name, "eot": eot, **{key: getattr(target.config, key) for key in TARGET_FIELDS}}


def comparable_identity(recorded: Mapping[str, Any] | None, identity: dict[str, Any]) -> dict[str, Any]:
    """`identity` as it is compared with a `recorded` one: without the name where either name is not known."""
    if recorded is None or recorded.get("name") is None or identity.get("name") is None:
        return {key: value for key, value in identity.items() if key != "name"}
    return identity


def first_difference(recorded: Mapping[str, Any], wanted: Mapping[str, Any]) -> str | None:
    """The first key of `wanted` whose value `recorded` does not hold (absent counts as None), as
    "key: recorded R, wanted W" (nested mappings compared key by key: "config.steps: ..."); None when all agree."""
    for key, value in wanted.items():
        have = recorded.get(key)
        if isinstance(value, Mapping) and isinstance(have, Mapping):
            inner = first_difference(have, value)
            if inner is not None:
                return f"{key}.{inner}"
        elif have != value:
            return f"{key}: recorded {have!r}, wanted {value!r}"
    return None


# -- the pseudo-label cache -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CacheBatch:
    """Training tensors of B windows, right-padded to T = the longest sequence - 1.

    encoded: (B, n_audio_ctx, d_model) float32 target encoder output
    input_ids: (B, T) long, the pseudo-label sequence (prompt + generated) without its last token (pad = eot)
    labels: (B, T) long, the next token where it is a generated token, -100 elsewhere (prompt, padding)
    teacher_hidden: (B, T, d_model) float32 target's final decoder state at each input position
    """

    encoded: torch.Tensor
    input_ids: torch.Tensor
    labels: torch.Tensor
    teacher_hidden: torch.Tensor


class PseudoLabelCache:
    """A cache directory, memory-mapped: meta.json, encoded.npy (N, ctx, d), tokens.npy (N, L) int32 (padded with
    -1), lengths.npy (N,), hidden.npy (N, L - 1, d) the target's final states, float16 or float32 (read as
    float32)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        meta_path = self.path / "meta.json"
        if not meta_path.is_file():
            raise ValueError(f"{self.path}: not a pseudo-label cache (no meta.json; make one with "
                             "`asr-spec distill cache`)")
        self.meta = json.loads(meta_path.read_text())
        if self.meta.get("format") != CACHE_FORMAT:
            raise ValueError(f"{self.path}: cache format {self.meta.get('format')} != {CACHE_FORMAT}; rebuild it")
        self.encoded = np.load(self.path / "encoded.npy", mmap_mode="r")
        self.tokens = np.load(self.path / "tokens.npy", mmap_mode="r")
        self.lengths = np.load(self.path / "lengths.npy")
        self.hidden = np.load(self.path / "hidden.npy", mmap_mode="r")
        self.prompt_len: int = int(self.meta["prompt_len"])
        self.eot: int = int(self.meta["eot"])

    def __len__(self) -> int:
        return len(self.lengths)

    def check_target(self, target: nn.Module, name: str | None = None) -> None:
        """InputError (one line naming the field, the target the cache was made with and `name`) unless the cache
        was labelled by `target`: the same width, encoder length and <|endoftext|>, and where meta.json records
        the target (caches since it does), the same `target_identity` (the name compared when both are known)."""
        identity = target_identity(target, name)
        wanted = {"d_model": identity["d_model"], "n_audio_ctx": identity["max_source_positions"],
                  "eot": identity["eot"]}
        recorded = self.meta.get("target")
        if recorded is not None:
            wanted["target"] = comparable_identity(recorded, identity)
        diff = first_difference(self.meta, wanted)
        if diff is not None:
            made = (recorded or {}).get("name") or "a target it does not name"
            raise InputError(f"{self.path}: a cache made for another target ({diff}): made with {made}, asked for "
                             f"{name or 'a target of no name'}; label one with this target (distill cache --model ...)")

    def fingerprint(self) -> str:
        """A short digest of meta.json: what a training checkpoint records of the data it was trained on (a cache
        labelled again, of other audio or by another target has another)."""
        return hashlib.sha256((self.path / "meta.json").read_bytes()).hexdigest()[:16]

    def sequence(self, i: int) -> list[int]:
        """Prompt + generated tokens of window i."""
        return self.tokens[i, : self.lengths[i]].tolist()

    def token_counts(self, vocab_size: int) -> np.ndarray:
        """(vocab_size,) how often each token occurs among the generated pseudo-labels."""
        counts = np.zeros(vocab_size, dtype=np.int64)
        for i in range(len(self)):
            np.add.at(counts, self.tokens[i, self.prompt_len: self.lengths[i]], 1)
        return counts

    @property
    def timestamps(self) -> bool:
        """Whether the pseudo-labels were decoded in Whisper's timestamp mode (caches before it: no)."""
        return bool(self.meta.get("timestamps", False))

    def batch(self, indices: Sequence[int]) -> CacheBatch:
        return make_batch([(self, i) for i in indices])


class CacheUnion:
    """Several pseudo-label caches trained on as one (e.g. the same windows labelled with and without timestamps):
    window i of the union is window i - offset of the cache it falls in. Same eot required."""

    def __init__(self, caches: Sequence[PseudoLabelCache]):
        if not caches:
            raise ValueError("CacheUnion: no caches")
        if len({c.eot for c in caches}) != 1:
            raise ValueError("CacheUnion: the caches disagree on <|endoftext|>; they were made for other targets")
        self.caches = list(caches)
        self.eot: int = caches[0].eot
        self.starts = np.cumsum([0] + [len(c) for c in caches])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def check_target(self, target: nn.Module, name: str | None = None) -> None:
        for cache in self.caches:
            cache.check_target(target, name)

    def fingerprint(self) -> str:
        return ",".join(cache.fingerprint() for cache in self.caches)

    def _locate(self, i: int) -> tuple[PseudoLabelCache, int]:
        c = int(np.searchsorted(self.starts, i, side="right")) - 1
        return self.caches[c], i - int(self.starts[c])

    def token_counts(self, vocab_size: int) -> np.ndarray:
        return sum(c.token_counts(vocab_size) for c in self.caches)

    def batch(self, indices: Sequence[int]) -> CacheBatch:
        return make_batch([self._locate(i) for i in indices])


def make_batch(rows: Sequence[tuple[PseudoLabelCache, int]]) -> CacheBatch:
    """The training tensors of (cache, window) rows, each labelled after its own cache's prompt."""
    t = int(max(c.lengths[i] for c, i in rows)) - 1
    b = len(rows)
    eot = rows[0][0].eot
    input_ids = torch.full((b, t), eot, dtype=torch.long)
    labels = torch.full((b, t), -100, dtype=torch.long)
    hidden = torch.zeros(b, t, rows[0][0].hidden.shape[-1])
    for r, (c, i) in enumerate(rows):
        n = int(c.lengths[i])
        seq = torch.from_numpy(np.asarray(c.tokens[i, :n], dtype=np.int64))
        input_ids[r, : n - 1] = seq[:-1]
        labels[r, c.prompt_len - 1: n - 1] = seq[c.prompt_len:]
        hidden[r, : n - 1] = torch.from_numpy(np.array(c.hidden[i, : n - 1], dtype=np.float32))
    enc = torch.from_numpy(np.stack([np.array(c.encoded[i], dtype=np.float32) for c, i in rows]))
    return CacheBatch(enc, input_ids, labels, hidden)


def _fresh_cache_dir(out_dir: str | Path) -> Path:
    """The folder a cache is built in, made if need be, without a meta.json: that is written last and marks a whole
    cache, so a rebuild cut short leaves none beside its new, partly written arrays."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").unlink(missing_ok=True)
    return out


@torch.inference_mode()
def build_cache(
    target: nn.Module, batches: Iterable[tuple[list[str], torch.Tensor]], n_windows: int, out_dir: str | os.PathLike,
    *, language: str | None = "en", max_new_tokens: int = 256, batch_size: int = 4, enc_dtype: str = "float16",
    timestamps: bool = False, pre_encoded: bool = False, progress: bool = True, hidden_dtype: str = "float16",
    source: Mapping[str, Any] | None = None, target_name: str | None = None,
) -> PseudoLabelCache:
    """Encode and greedily transcribe up to `n_windows` windows with `target`, and store what training needs.

    batches: (ids, features (b, n_mels, n_frames)) pairs, at most `n_windows` rows in all (fewer where the caller
        left windows out, e.g. of unreadable audio); ids name each window's contents.
        pre_encoded: the pairs hold encoder outputs (b, n_audio_ctx, d_model) instead (relabelling a cache).
    enc_dtype: storage of the encoder outputs ("float16" halves the disk; the teacher states are computed from the
        unrounded encoder output).
    hidden_dtype: storage of the target's teacher-forced final states at every input position (the teacher logits
        of both draft kinds, and a feature-conditioned draft's inputs and regression targets): "float16" halves the
        disk and memory (a relative rounding of 2^-11), "float32" as computed.
    timestamps: decode in Whisper's timestamp mode, as transcription does by default: a draft that is to run there
        must learn where the target puts its timestamp tokens.
    source, target_name: recorded in meta.json ("source"; "target": `target_identity`), so that a cache is reused
        only for the audio and the target it was made from (`distill run`, `PseudoLabelCache.check_target`).
    """
    from asr_spec.engine import DecodeOptions, Engine

    out = _fresh_cache_dir(out_dir)
    engine = Engine(target, None, DecodeOptions(language=language, max_new_tokens=max_new_tokens,
                                                timestamps=timestamps))
    d, max_len = target.config.d_model, target.config.max_target_positions
    enc_mm = np.lib.format.open_memmap(out / "encoded.npy", "w+", np.dtype(enc_dtype),
                                       (n_windows, target.config.max_source_positions, d))
    tokens = np.full((n_windows, max_len), -1, dtype=np.int32)
    lengths = np.zeros(n_windows, dtype=np.int32)
    hidden = np.zeros((n_windows, max_len - 1, d), dtype=np.dtype(hidden_dtype))
    ids: list[list[str]] = []
    prompt_len = None
    for batch_ids, enc, results in _labelled(engine, target, batches, n_windows, batch_size, pre_encoded, progress):
        for r, res in enumerate(results):
            row = len(ids)
            seq = list(res.prompt) + list(res.tokens)
            prompt_len = len(res.prompt)
            ids_t = torch.tensor([seq[:-1]], device=enc.device)
            h = target.model.decoder(input_ids=ids_t, encoder_hidden_states=enc[r: r + 1],
                                     use_cache=False).last_hidden_state
            enc_mm[row] = enc[r].float().cpu().numpy().astype(enc_dtype)
            tokens[row, : len(seq)] = seq
            lengths[row] = len(seq)
            hidden[row, : len(seq) - 1] = h[0].float().cpu().numpy().astype(hidden_dtype)
            ids.append(list(batch_ids[r]) if isinstance(batch_ids[r], (list, tuple)) else [str(batch_ids[r])])
    enc_mm.flush()
    del enc_mm
    n = len(ids)
    if n == 0:
        raise InputError(f"{out}: no windows to label (no audio, or none of it readable)")
    if n < n_windows:
        keep_first_rows(out / "encoded.npy", n)
    meta = dict(format=CACHE_FORMAT, n=n, prompt_len=prompt_len, eot=engine.tokens.eot,
                n_audio_ctx=target.config.max_source_positions, d_model=d, language=language,
                max_new_tokens=max_new_tokens, enc_dtype=enc_dtype, hidden_dtype=hidden_dtype, timestamps=timestamps,
                generated_tokens=int((lengths[:n] - prompt_len).sum()), source=dict(source or {}),
                target=target_identity(target, target_name), ids=ids)
    return _write_cache(out, tokens[:n], lengths[:n], hidden[:n], meta)


def _labelled(engine: Any, target: nn.Module, batches: Iterable[tuple[list[str], torch.Tensor]], n_windows: int,
              batch_size: int, pre_encoded: bool, progress: bool) -> Iterator[tuple[list[str], torch.Tensor, list]]:
    """(ids, encoder outputs (b, n_audio_ctx, d_model), the engine's greedy results) of each batch, with a progress
    bar; ValueError when more than `n_windows` rows come."""
    from tqdm import tqdm

    n_rows = 0
    with tqdm(total=n_windows, desc="pseudo-labels", unit="win", disable=not progress) as bar:
        for batch_ids, feats in batches:
            n_rows += len(feats)
            if n_rows > n_windows:
                raise ValueError(f"build_cache: more than the {n_windows} windows n_windows said came")
            enc = feats.to(target.dtype) if pre_encoded else engine.encode(feats, batch_size)
            results = engine.decode(None, enc, batch_size)
            yield batch_ids, enc, results
            bar.update(len(results))


def keep_first_rows(path: Path, n_rows: int) -> None:
    """Cut the C-order .npy array at `path` to its first `n_rows` rows, in place: a header for the new shape over
    the old one (numpy leaves room in every header for the first axis to change), then the file truncated."""
    fmt = np.lib.format
    with open(path, "r+b") as f:
        version = fmt.read_magic(f)
        read, write = ((fmt.read_array_header_1_0, fmt.write_array_header_1_0) if version == (1, 0)
                       else (fmt.read_array_header_2_0, fmt.write_array_header_2_0))
        shape, fortran_order, dtype = read(f)
        data_offset = f.tell()
        if fortran_order or not 0 <= n_rows <= shape[0]:
            raise ValueError(f"{path}: cannot keep {n_rows} of its {shape} rows (C order only)")
        header = io.BytesIO()
        write(header, {"shape": (n_rows, *shape[1:]), "fortran_order": False, "descr": fmt.dtype_to_descr(dtype)})
        if header.tell() != data_offset:
            raise ValueError(f"{path}: the header of {n_rows} rows does not fit where the old one was")
        f.seek(0)
        f.write(header.getvalue())
        f.truncate(data_offset + n_rows * int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize)


def _write_cache(out: Path, tokens: np.ndarray, lengths: np.ndarray, hidden: np.ndarray,
                 meta: dict[str, Any]) -> PseudoLabelCache:
    """Store the label arrays, cut to the longest sequence, and meta.json last (its presence marks a whole cache)."""
    longest = int(lengths.max())
    np.save(out / "tokens.npy", tokens[:, :longest])
    np.save(out / "lengths.npy", lengths)
    np.save(out / "hidden.npy", hidden[:, : longest - 1])
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return PseudoLabelCache(out)


def iter_batches(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    """Consecutive slices of `size` items (the last may be shorter)."""
    for i in range(0, len(items), size):
        yield items[i: i + size]
