"""The feature-conditioned (EAGLE-style) draft: a module, its initialisation from a target, its training forward, and
its on-disk format (the drafts/ format: the draft's own weights only, `"kind": "target-features"` in distill.json).

Input at position t: fc([the target's final state at t - 1 ; the target's embedding of token t]) + the target's
embedding of position t; then one or two Whisper decoder layers (self-attention causal, cross-attention to the
target's encoder output) and a final LayerNorm, whose output is the draft's guess of the target's final state at t.
The target's head scores it (optionally a restricted vocabulary: `draft_vocab_ids`). The engine runs it through
`asr_spec.engine.features.FeatureDecoder` (its `step_decoder`); `hidden` here is the same computation with
gradients, teacher-forced on the target's states (what `asr-spec distill` trains).

Initialisation: the layers are copies of target decoder layers (the first by default), the final LayerNorm the
target's, fc = [0 | I]: the draft starts as the target's one-layer cut (its input the token's embedding plus the
position's, as the target's own first layer sees), and training opens the state's channel. Measured on whisper-base
(8 LibriSpeech fixture utterances, timestamp mode, teacher-forced): that start agrees on 18.7 % of tokens; the last
layer with fc = [I | I] (the state plus the embedding) or [I | 0], or the first with [I | I], on 0.8 %.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from asr_spec.engine.features import FeatureDecoder
from asr_spec.models.cpu import dtype_name
from asr_spec.models.drafts import (
    INFO_FILE,
    SHARED_PREFIXES,
    draft_kind,
    new_draft_dir,
    read_draft_vocab,
    write_draft_extras,
)

KIND = "target-features"  # distill.json "kind" of this draft (a plain distilled draft: "decoder")


class FeatureDraftDecoder(nn.Module):
    """Shaped like a transformers `WhisperDecoder` for `engine.Decoder` (layers, layer_norm, embed_tokens,
    embed_positions, config), plus `fc`, the input projection (2 d_model -> d_model). The embeddings are the
    target's modules (shared, frozen)."""

    def __init__(self, config: Any, layers: nn.ModuleList, layer_norm: nn.LayerNorm, embed_tokens: nn.Embedding,
                 embed_positions: nn.Module):
        super().__init__()
        self.config = config
        self.layers = layers
        self.layer_norm = layer_norm
        self.embed_tokens = embed_tokens
        self.embed_positions = embed_positions
        d = config.d_model
        self.fc = nn.Linear(2 * d, d)


class _Inner(nn.Module):
    """`draft.model.decoder`, where the engine looks for a draft's decoder."""

    def __init__(self, decoder: FeatureDraftDecoder):
        super().__init__()
        self.decoder = decoder


class FeatureDraft(nn.Module):
    """A feature-conditioned draft for one target. `check_pair` knows it by `reads_target_features`; the engine
    runs it through `step_decoder` (engine/features.py)."""

    reads_target_features = True
    step_decoder = FeatureDecoder

    def __init__(self, config: Any, decoder: FeatureDraftDecoder, proj_out: nn.Module, generation_config: Any):
        super().__init__()
        self.config = config
        self.model = _Inner(decoder)
        self.proj_out = proj_out
        self.generation_config = generation_config
        self.draft_vocab_ids: torch.Tensor | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.model.decoder.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.decoder.fc.weight.device

    def hidden(self, input_ids: torch.Tensor, features: torch.Tensor, encoded: torch.Tensor) -> torch.Tensor:
        """Teacher-forced forward, with gradients.

        input_ids: (B, T) long tokens at positions 0..T-1; features: (B, T, d) the target's final state at each
        position - 1 (zero at position 0: `shift_features`); encoded: (B, n_audio_ctx, d) target encoder output.
        returns: (B, T, d) the draft's guesses of the target's final states at positions 0..T-1.
        """
        dec = self.model.decoder
        t = input_ids.shape[1]
        x = dec.fc(torch.cat([features.to(self.dtype), dec.embed_tokens(input_ids)], -1))
        x = x + dec.embed_positions.weight[:t]
        causal = torch.full((t, t), float("-inf"), device=x.device, dtype=x.dtype).triu(1)[None, None]
        enc = encoded.to(self.dtype)
        for layer in dec.layers:
            x = layer(x, attention_mask=causal, encoder_hidden_states=enc, use_cache=False)
            x = x[0] if isinstance(x, tuple) else x
        return dec.layer_norm(x)


def shift_features(states: torch.Tensor) -> torch.Tensor:
    """(B, T, d) the target's states at positions 0..T-1 -> (B, T, d) the draft's inputs: the state at each
    position - 1, zero at position 0."""
    return torch.cat([torch.zeros_like(states[:, :1]), states[:, :-1]], 1)


def init_feature_draft(target: nn.Module, layers: Sequence[int] | None = None) -> FeatureDraft:
    """A feature-conditioned draft of copies of target decoder `layers` (default: the first), the target's final
    LayerNorm, fc = [0 | I]; embeddings, positions and head the target's own tensors (frozen)."""
    n = target.config.decoder_layers
    layers = [0] if layers is None else list(layers)
    bad = [i for i in layers if not 0 <= i < n]
    if bad or not layers:
        raise ValueError(f"decoder layers {layers} not in 0..{n - 1}")
    src = target.model.decoder
    config = copy.deepcopy(target.config)
    config.decoder_layers = len(layers)
    decoder = FeatureDraftDecoder(config, nn.ModuleList(copy.deepcopy(src.layers[j]) for j in layers),
                                  copy.deepcopy(src.layer_norm), src.embed_tokens, src.embed_positions)
    d = config.d_model
    with torch.no_grad():
        eye = torch.eye(d, dtype=decoder.fc.weight.dtype)
        decoder.fc.weight.copy_(torch.cat([torch.zeros_like(eye), eye], 1))
        decoder.fc.bias.zero_()
    draft = FeatureDraft(config, decoder, target.proj_out, copy.deepcopy(target.generation_config))
    for p in (src.embed_tokens.weight, src.embed_positions.weight):
        p.requires_grad_(False)
    return draft.to(target.device, target.dtype).eval()


def own_state(draft: FeatureDraft) -> dict[str, torch.Tensor]:
    """The draft's own (trained, saved) tensors by name: everything but the target's shared ones."""
    return {k: v for k, v in draft.state_dict().items() if not k.startswith(SHARED_PREFIXES)}


def save_feature_draft(draft: FeatureDraft, out_dir: str | os.PathLike, *, dtype: torch.dtype = torch.float16,
                       info: dict | None = None, overwrite: bool = False) -> Path:
    """Save the draft's own weights (model.safetensors, in `dtype`), its config, `draft_vocab.json` when its head is
    restricted and `distill.json` (how it was made, with "kind": "target-features"), as the folder `out_dir`
    (`new_draft_dir`: InputError when it holds files, unless `overwrite`)."""
    from safetensors.torch import save_file

    config = copy.deepcopy(draft.config)
    config.dtype = dtype_name(dtype)
    with new_draft_dir(out_dir, overwrite) as out:
        save_file({k: v.detach().to(dtype).contiguous() for k, v in own_state(draft).items()},
                  str(out / "model.safetensors"))
        config.save_pretrained(out)
        draft.generation_config.save_pretrained(out)
        write_draft_extras(draft, out, {**(info or {}), "kind": KIND})
    return Path(out_dir)


def is_feature_draft(path: str | os.PathLike) -> bool:
    """Whether the draft directory at `path` holds a feature-conditioned draft (its distill.json says so)."""
    return (Path(path) / INFO_FILE).is_file() and draft_kind(path) == KIND


def load_feature_draft(path: str | os.PathLike, target: nn.Module) -> FeatureDraft:
    """Load a draft saved by `save_feature_draft` for `target`, in the target's dtype and device."""
    from safetensors.torch import load_file
    from transformers import WhisperConfig

    where = Path(path)
    weights = where / "model.safetensors"
    if not weights.is_file():
        raise ValueError(f"{where}: no model.safetensors (not a draft saved by save_feature_draft)")
    config = WhisperConfig.from_pretrained(where)
    for key in ("d_model", "vocab_size", "max_target_positions"):
        if getattr(config, key) != getattr(target.config, key):
            raise ValueError(f"{where}: draft {key} {getattr(config, key)} != target's {getattr(target.config, key)}")
    draft = init_feature_draft(target, [0] * config.decoder_layers)  # the shapes; every own tensor is loaded
    state = load_file(str(weights))
    missing, extra = sorted(set(own_state(draft)) - set(state)), sorted(set(state) - set(own_state(draft)))
    if missing or extra:
        raise ValueError(f"{where}: weights missing for {missing[:4]}, unexpected {extra[:4]}")
    draft.load_state_dict({k: v.to(target.dtype) for k, v in state.items()}, strict=False)
    read_draft_vocab(draft, where, target)
    return draft.eval()
