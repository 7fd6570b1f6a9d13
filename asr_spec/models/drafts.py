"""Drafts made from a target: a decoder-only draft cut from its layers, and the on-disk format of drafts trained by
`asr-spec distill` (only the draft's own layers are saved; embeddings, positions and head are the target's)."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from asr_spec.errors import InputError
from asr_spec.models.cpu import dtype_name

SHARED_PREFIXES = ("model.decoder.embed_tokens.", "model.decoder.embed_positions.", "proj_out.")  # from the target
VOCAB_FILE = "draft_vocab.json"
INFO_FILE = "distill.json"
DECODER_KIND = "decoder"  # distill.json "kind" of a decoder-only draft (models/feature_draft.py: the other kind)


def decoder_draft(target: nn.Module, layers: list[int] | None = None) -> Any:
    """A `WhisperForCausalLM` draft made of some of the target's decoder layers (all by default), sharing its
    encoder output — distil-whisper's initialisation when `layers` is the first and last."""
    from transformers import WhisperForCausalLM

    layers = list(range(target.config.decoder_layers)) if layers is None else list(layers)
    bad = [i for i in layers if not 0 <= i < target.config.decoder_layers]
    if bad or not layers:
        raise ValueError(f"decoder layers {layers} not in 0..{target.config.decoder_layers - 1}")
    config = copy.deepcopy(target.config)
    config.decoder_layers = len(layers)
    config.is_encoder_decoder = False
    draft = WhisperForCausalLM(config).to(target.dtype).to(target.device).eval()
    src = target.model.decoder
    dst = draft.model.decoder
    dst.embed_tokens.load_state_dict(src.embed_tokens.state_dict())
    dst.embed_positions.load_state_dict(src.embed_positions.state_dict())
    dst.layer_norm.load_state_dict(src.layer_norm.state_dict())
    for i, j in enumerate(layers):
        dst.layers[i].load_state_dict(src.layers[j].state_dict())
    draft.proj_out.weight = dst.embed_tokens.weight
    draft.generation_config = copy.deepcopy(target.generation_config)
    return draft


def tie_shared(draft: nn.Module, target: nn.Module) -> None:
    """Point the draft's token embeddings, output head and position table at the target's (no copy) and freeze."""
    src, dst = target.model.decoder, draft.model.decoder
    dst.embed_tokens.weight = src.embed_tokens.weight
    dst.embed_positions.weight = src.embed_positions.weight
    draft.proj_out.weight = src.embed_tokens.weight
    for p in (src.embed_tokens.weight, src.embed_positions.weight):
        p.requires_grad_(False)


def check_out_dir(out_dir: str | os.PathLike, overwrite: bool) -> None:
    """InputError when a draft cannot be saved as `out_dir`: a file there, or a folder that holds anything while
    `overwrite` is off (a folder holding a whole model was replaced before)."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise InputError(f"{out}: not a folder (a draft is saved as a folder)")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise InputError(f"{out}: already holds files; choose another folder, or pass --overwrite to replace it")


@contextlib.contextmanager
def new_draft_dir(out_dir: str | os.PathLike, overwrite: bool) -> Iterator[Path]:
    """A temporary folder beside `out_dir` to write a draft into, published as `out_dir` when the block ends
    without error (`embedded.publish_dir`: one rename, so a half-written draft is never seen; a folder already
    there is replaced only with `overwrite`: `check_out_dir`), and removed either way."""
    from asr_spec.models.embedded import publish_dir

    out = Path(out_dir)
    check_out_dir(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")  # mkdtemp's would be 0700
    tmp.mkdir()
    try:
        yield tmp
        publish_dir(tmp, out, overwrite=overwrite)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def save_trained_draft(draft: nn.Module, out_dir: str | os.PathLike, *, dtype: torch.dtype = torch.float16,
                       info: dict | None = None, overwrite: bool = False) -> Path:
    """Save the draft's own weights (decoder layers + final LayerNorm, in `dtype`) with save_pretrained
    (safetensors), `draft_vocab.json` when its head is restricted, and `distill.json` (how it was made), as the
    folder `out_dir` (`new_draft_dir`: InputError when it holds files, unless `overwrite`)."""
    state = {k: v.detach().to(dtype).contiguous() for k, v in draft.state_dict().items()
             if not k.startswith(SHARED_PREFIXES)}
    to_save = copy.copy(draft)  # shallow: same modules; only the config's dtype note changes
    to_save.config = copy.deepcopy(draft.config)
    to_save.config.dtype = dtype_name(dtype)
    with new_draft_dir(out_dir, overwrite) as out:
        to_save.save_pretrained(out, state_dict=state)
        write_draft_extras(draft, out, {"kind": DECODER_KIND, **(info or {})})
    return Path(out_dir)


def write_draft_extras(draft: nn.Module, out: Path, info: dict) -> None:
    """A saved draft's files beside its weights, whatever its kind: `draft_vocab.json` when its head is restricted,
    `distill.json` (`info`, with the prefixes of the tensors that are the target's)."""
    vocab_ids = getattr(draft, "draft_vocab_ids", None)
    if vocab_ids is not None:
        (out / VOCAB_FILE).write_text(json.dumps(sorted(int(t) for t in vocab_ids)) + "\n")
    meta = {"shared_from_target": list(SHARED_PREFIXES), **info}
    (out / INFO_FILE).write_text(json.dumps(meta, indent=1) + "\n")


def draft_kind(path: str | os.PathLike) -> str:
    """The kind a draft directory saved by `asr-spec distill` holds ("decoder" when its distill.json predates
    kinds, as drafts/whisper-base-2l's does)."""
    return json.loads((Path(path) / INFO_FILE).read_text()).get("kind", DECODER_KIND)


def trained_language(path: str | os.PathLike) -> str | None:
    """The language a distilled draft's pseudo-labels were all in (its INFO_FILE's training caches), None when they
    were in several, not recorded, or `path` is no distilled draft (a hub draft: a name, not a folder)."""
    from asr_spec.engine.options import language_code

    try:
        languages = {language_code(str(meta.get("language"))) for meta in training_caches(path)}
    except (ValueError, AttributeError):  # language_code's ValueError: not one Whisper knows; a meta not a mapping
        return None
    return languages.pop() if len(languages) == 1 else None


def training_caches(path: str | os.PathLike) -> list:
    """What a distilled draft's INFO_FILE records of the pseudo-label caches it was trained on ("train_meta": each
    cache's meta.json but its ids); [] when it records none or `path` holds no readable INFO_FILE (a hub draft)."""
    try:
        caches = json.loads((Path(path) / INFO_FILE).read_text()).get("train_meta") or []
    except (OSError, ValueError, AttributeError):
        return []
    return caches if isinstance(caches, list) else []


def load_trained_draft(path: str | os.PathLike, target: nn.Module) -> Any:
    """Load a draft saved by `save_trained_draft` for `target`: its layers from `path`, the embeddings, position
    table and head tied to the target's, in the target's dtype and device; `draft_vocab_ids` set when restricted."""
    from safetensors.torch import load_file
    from transformers import WhisperConfig, WhisperForCausalLM

    where = Path(path)
    weights = where / "model.safetensors"
    if not weights.is_file():
        raise ValueError(f"{where}: no model.safetensors (not a draft saved by save_trained_draft)")
    if (where / INFO_FILE).is_file() and draft_kind(where) != DECODER_KIND:
        raise ValueError(f"{where}: a {draft_kind(where)} draft, not a decoder-only one (load it with "
                         "asr_spec.models.loading.load_distilled)")
    config = WhisperConfig.from_pretrained(where)
    for key in ("d_model", "vocab_size", "max_target_positions"):
        if getattr(config, key) != getattr(target.config, key):
            raise ValueError(f"{where}: draft {key} {getattr(config, key)} != target's {getattr(target.config, key)}")
    config.dtype = target.dtype
    with torch.device("meta"):
        draft = WhisperForCausalLM(config)
    state = load_file(str(weights))
    missing = [k for k in draft.state_dict() if k not in state and not k.startswith(SHARED_PREFIXES)]
    if missing:
        raise ValueError(f"{where}: weights missing for {missing[:4]}")
    draft.load_state_dict({k: v.to(target.dtype) for k, v in state.items()}, strict=False, assign=True)
    tie_shared(draft, target)
    draft = draft.to(target.device).eval()
    draft.generation_config = copy.deepcopy(target.generation_config)
    read_draft_vocab(draft, where, target)
    return draft


def read_draft_vocab(draft: nn.Module, where: Path, target: nn.Module) -> None:
    """Set `draft.draft_vocab_ids` from `where`'s VOCAB_FILE when there is one: a non-empty list of distinct token
    ids of the target's vocabulary (ValueError naming the file otherwise: an id past it was an IndexError
    traceback, an empty list a reshape error, a negative id an engine error mid-run)."""
    path = where / VOCAB_FILE
    if not path.is_file():
        return
    try:
        ids = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not a JSON list of token ids ({err})") from err
    size = target.config.vocab_size
    if not isinstance(ids, list) or not ids or any(type(i) is not int or not 0 <= i < size for i in ids):
        raise ValueError(f"{path}: must be a non-empty JSON list of token ids in [0, {size})")
    if len(set(ids)) < len(ids):
        raise ValueError(f"{path}: token ids repeat")
    draft.draft_vocab_ids = torch.tensor(ids, dtype=torch.long, device=target.device)
