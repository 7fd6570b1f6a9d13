"""Resolve and load a target/draft pair: hub id, local directory, CTranslate2 directory, "embedded:<name>", or a
draft made by `asr-spec distill`. Safetensors only, never remote code."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from asr_spec.audio.features import check_extractor
from asr_spec.engine import int8
from asr_spec.engine.pairing import DraftKind, check_pair
from asr_spec.errors import AsrSpecError, InputError, ModelLoadError
from asr_spec.models.cpu import INT8, torch_dtype

# decided in models.cpu; callers import them here too
from asr_spec.models.cpu import resolve_dtype as resolve_dtype
from asr_spec.models.cpu import resolve_precision as resolve_precision
from asr_spec.models.drafts import (
    DECODER_KIND,
    INFO_FILE,
    decoder_draft,
    draft_kind,
    load_trained_draft,
    training_caches,
)
from asr_spec.models.feature_draft import KIND as FEATURE_KIND
from asr_spec.models.feature_draft import load_feature_draft

log = logging.getLogger(__name__)


# -- loading ----------------------------------------------------------------------------------------------------

def resolve_device(device: str | torch.device | None) -> torch.device:
    """"auto" / None: CUDA where available, else the CPU; else the device named (cpu, cuda, cuda:N), checked here:
    a name torch does not know, another kind of device, or a CUDA device this machine lacks is a one-line error."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise InputError(f"device {device!r}: not a device name (cpu, cuda, cuda:N or auto)") from err
    if dev.type not in ("cpu", "cuda"):
        raise InputError(f"device {device!r}: asr-spec runs on cpu or cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"device {device!r}: CUDA is not available on this machine")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise InputError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


def model_dir(name: str | os.PathLike) -> str:
    """A transformers model directory or hub id for `name`: CTranslate2 directories (model.bin) and the embedded
    names ("embedded:whisper-base") are converted once to a cached safetensors directory."""
    from asr_spec.models import embedded

    text = str(name)
    if not text.strip():  # "" is no folder (Path("") is the current one)
        raise ModelLoadError("an empty model name: give a folder, a hub id or embedded:whisper-base")
    if text.startswith("embedded:"):
        return str(embedded.embedded_model_dir(text.split(":", 1)[1]))
    path = Path(text).expanduser()
    if _is_ct2_dir(path):
        return str(embedded.ensure_converted(path))
    if path.exists() and not path.is_dir():
        raise ModelLoadError(f"{name}: not a model directory")
    if path.is_dir() or text.startswith((".", "/", "~")):
        if not path.exists():
            raise ModelLoadError(f"{name}: no such folder")
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{name}: no config.json or model.bin there: not a Whisper model directory")
        model_type = (_config_of(path) or {}).get("model_type")
        if model_type not in (None, "whisper"):  # a BERT folder failed in the config's own checks, naming heads
            raise ModelLoadError(f"{name}: config.json says model_type {model_type!r}, not a Whisper model")
        return str(path)
    return text  # a hub id


def _is_ct2_dir(path: Path) -> bool:
    """A CTranslate2 model directory: model.bin and a config.json that is not a transformers config."""
    if not (path.is_dir() and (path / "model.bin").is_file()):
        return False
    config = _config_of(path)
    return config is None or "model_type" not in config


def _config_of(folder: Path) -> dict | None:
    """A folder's config.json as read (None: absent, unreadable or not a JSON object: the loader says why)."""
    import json

    try:
        data = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _load_errors() -> tuple[type[BaseException], ...]:
    """What a broken model directory makes the loaders raise: I/O, JSON and config validation errors, and
    safetensors' own `SafetensorError` (a truncated or corrupt weights file), which derives from Exception only."""
    errors: list[type[BaseException]] = [OSError, ValueError, KeyError, TypeError, RuntimeError, EOFError,
                                         AttributeError, IndexError]  # the last two: a side file of the wrong shape
    with contextlib.suppress(ImportError):
        from safetensors import SafetensorError

        errors.append(SafetensorError)
    with contextlib.suppress(ImportError):
        from huggingface_hub.errors import StrictDataclassError

        errors.append(StrictDataclassError)
    return tuple(errors)


@contextlib.contextmanager
def _loading(name: str | os.PathLike, what: str) -> Iterator[None]:
    """Turn any failure to load `what` from `name` into one `ModelLoadError` line naming the path and the cause."""
    try:
        yield
    except AsrSpecError:
        raise
    except _load_errors() as err:
        cause = " ".join(str(err).split()) or type(err).__name__
        cause = cause if len(cause) <= 300 else cause[:297] + "..."
        raise ModelLoadError(f"{name}: cannot load the {what} ({type(err).__name__}: {cause})") from err


@contextlib.contextmanager
def _no_progress_bar() -> Iterator[None]:
    """transformers' "Loading weights" bar off while a model loads (from a local folder in a second or two: a bar
    per model on an API caller's stderr, which the CLI turns off for its whole run, `logs.configure_logging`),
    then as the caller had it."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def load_model(name: str | os.PathLike, device: torch.device, dtype: torch.dtype | str, *,
               decoder_only: bool = False) -> Any:
    """Load a Whisper model (safetensors only, never remote code). decoder_only loads a `WhisperForCausalLM`.
    dtype: a torch dtype, or a precision from `resolve_precision` ("int8": fp32 weights, the encoder marked for
    int8 products, `engine.int8.request`). Any failure (truncated or corrupt weights, bad config.json) raises
    `ModelLoadError` naming `name`."""
    from transformers import WhisperForCausalLM, WhisperForConditionalGeneration

    precision = dtype if isinstance(dtype, str) else None
    dtype = torch_dtype(precision) if precision is not None else dtype

    cls = WhisperForCausalLM if decoder_only else WhisperForConditionalGeneration
    with _loading(name, "model"):  # a CTranslate2 directory is converted here: its failures are loading failures
        where = model_dir(name)
        with _no_progress_bar():
            model, info = cls.from_pretrained(where, dtype=dtype, use_safetensors=True, trust_remote_code=False,
                                              output_loading_info=True)
    missing = sorted(info.get("missing_keys") or ())
    if missing:  # transformers would start them from random values (and only log it): garbage, silently
        raise ModelLoadError(f"{name}: its weights lack {len(missing)} of the {cls.__name__}'s tensors "
                             f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): not a whole "
                             f"{'decoder' if decoder_only else 'Whisper model'} checkpoint")
    unused = sorted(k for k in info.get("unexpected_keys") or () if not (decoder_only and ".encoder." in f".{k}"))
    if unused:  # tensors the config has no place for (more layers than it says): dropped, the model is another one
        raise ModelLoadError(f"{name}: its weights hold {len(unused)} tensors its config.json has no place for "
                             f"({', '.join(unused[:3])}{', ...' if len(unused) > 3 else ''}): the config and the "
                             "weights are of different models")
    if not decoder_only:
        missing_ids = [key for key in _GENERATION_IDS.values() if getattr(model.generation_config, key, None) is None]
        if missing_ids:
            raise ModelLoadError(f"{name}: no Whisper generation config (generation_config.json missing, or without "
                                 f"{', '.join(missing_ids)}): copy the one of the model it was trained from")
    if precision == INT8 and not decoder_only:
        int8.request(model.model.encoder)
    return model.to(device).eval()


# the special tokens a tokenizer and a generation config must agree on: token -> generation config field
_GENERATION_IDS = {"<|endoftext|>": "eos_token_id", "<|startoftranscript|>": "decoder_start_token_id",
                   "<|notimestamps|>": "no_timestamps_token_id"}


MIN_VOCAB = 1000  # a Whisper tokenizer has ~50k tokens; transformers builds a 1-token one when the files are missing


def load_processor(name: str | os.PathLike, target: Any = None) -> Any:
    """The tokenizer and feature extractor of a model; `ModelLoadError` when missing or unreadable, or (given the
    `target` loaded from the same place) when its special tokens are not the target's (another model's tokenizer:
    a transcript of random words, exit 0, before)."""
    from transformers import WhisperProcessor

    with _loading(name, "tokenizer/feature extractor"):
        where = model_dir(name)
        processor = WhisperProcessor.from_pretrained(where)
    if len(processor.tokenizer) < MIN_VOCAB:
        raise ModelLoadError(f"{name}: no tokenizer there (tokenizer.json or vocab.json + merges.txt missing: "
                             f"the tokenizer loaded has {len(processor.tokenizer)} tokens)")
    try:
        check_extractor(processor.feature_extractor)
    except InputError as err:
        raise ModelLoadError(f"{name}: its feature extractor's settings: {err}") from err
    if target is not None:
        _check_tokenizer(name, processor.tokenizer, target)
        n_mels, wanted = processor.feature_extractor.feature_size, target.config.num_mel_bins
        if n_mels != wanted:
            raise ModelLoadError(f"{name}: its feature extractor makes {n_mels} mel bins, its model expects {wanted}")
    return processor


def _check_tokenizer(name: str | os.PathLike, tokenizer: Any, target: Any) -> None:
    """ModelLoadError naming `name` when the tokenizer's special tokens or size are not the target's."""
    gen = target.generation_config
    for token, key in _GENERATION_IDS.items():
        wanted = getattr(gen, key, None)
        wanted = wanted[0] if isinstance(wanted, (list, tuple)) else wanted
        found = tokenizer.convert_tokens_to_ids(token)
        if wanted is not None and found != wanted:
            raise ModelLoadError(f"{name}: its tokenizer gives {token} the id {found}, its generation config "
                                 f"{wanted}: the tokenizer is another model's")
    if len(tokenizer) > target.config.vocab_size:
        raise ModelLoadError(f"{name}: its tokenizer has {len(tokenizer)} tokens, the model {target.config.vocab_size}"
                             ": the tokenizer is another model's")


def load_distilled(path: str | os.PathLike, target: nn.Module) -> Any:
    """A draft saved by `asr-spec distill`, of the kind its distill.json names: decoder-only
    (`drafts.load_trained_draft`) or feature-conditioned (`feature_draft.load_feature_draft`). Any failure (a
    truncated weights file, a distill.json of another shape, layers that do not fit) raises `ModelLoadError`."""
    with _loading(path, "draft"):
        kind = draft_kind(path)
        if kind not in (FEATURE_KIND, DECODER_KIND):
            raise ModelLoadError(f"{path}: unknown draft kind {kind!r} in {INFO_FILE} ({DECODER_KIND} or "
                                 f"{FEATURE_KIND})")
        draft = (load_feature_draft if kind == FEATURE_KIND else load_trained_draft)(path, target)
        other = other_target(path, target)
        if other is not None:
            log.warning("%s: distilled for another target (%s): its proposals are verified all the same (the "
                        "transcript is this target's), but expect few of them accepted", path, other)
        return draft


def other_target(path: str | os.PathLike, target: nn.Module) -> str | None:
    """How the target a distilled draft was trained for (its distill.json: the config fields its training cache
    recorded of the target that labelled it) differs from `target`, as "decoder_layers 6, this one 4"; None when
    they agree or nothing is recorded. Names are not compared (one model has many)."""
    caches = training_caches(path)
    recorded = caches[0].get("target") if caches and isinstance(caches[0], dict) else None
    for key, value in recorded.items() if isinstance(recorded, dict) else ():
        have = getattr(target.config, key, None) if key not in ("name", "eot") else value
        if have != value:
            return f"{key} {value}, this one {have}"
    return None


def load_draft(name: str | os.PathLike, target: nn.Module, device: torch.device, dtype: torch.dtype,
               share_encoder: bool | None = None) -> Any:
    """Load a draft for `target`: a draft made by `asr-spec distill` (shares the target's embeddings); a
    decoder-only checkpoint as `WhisperForCausalLM`; a full checkpoint whose encoder equals the target's up to
    fp16 rounding (distil-whisper) has its encoder dropped after the check.

    share_encoder: None = decide by comparing the encoders; True = drop the draft's encoder (it reads the
    target's encoder output: always lossless, only the proposals change); False = keep and run its own."""
    from transformers import AutoConfig

    with _loading(name, "draft"):
        where = model_dir(name)
    if (Path(where) / INFO_FILE).is_file():  # made by `asr-spec distill`: its own layers, the target's rest
        with _loading(name, "draft"):
            return load_distilled(where, target).to(device, dtype).eval()
    with _loading(name, "draft's config"):
        config = AutoConfig.from_pretrained(where)
    archs = getattr(config, "architectures", None) or []
    if "WhisperForCausalLM" in archs:
        return load_model(where, device, dtype, decoder_only=True)
    full = load_model(where, device, dtype)
    if share_encoder is False:
        full.own_encoder = True  # read by check_pair
        log.info("draft %s runs its own encoder (share_encoder = false)", name)
        return full
    try:
        kind = check_pair(target, full)
    except ValueError as err:  # "draft and target disagree on vocab_size": which draft
        raise ModelLoadError(f"{name}: {err}") from err
    if share_encoder or kind is DraftKind.SHARED_ENCODER:
        log.info("draft %s reads the target's encoder output (%s): its own encoder is dropped", name,
                 "share_encoder = true" if share_encoder else "same weights up to fp16 rounding")
        return decoder_draft(full)
    return full
