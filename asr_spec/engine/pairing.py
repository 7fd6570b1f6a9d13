"""How a draft serves a target: the pair check the engine runs before decoding (same tokenizer, usable encoder
states), and whether the draft can share the target's encoder output."""

from __future__ import annotations

import enum
import logging
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

# Encoders are "the same" up to fp16 rounding: distil-whisper stores the teacher's encoder in fp16 (distil-large-v2)
# while the hub holds large-v2 in fp32; fp16 keeps 11 significant bits, a relative rounding error <= 2^-11 ~ 4.9e-4
# (absolute <= 2^-25 below fp16's normal range). Sharing the target's encoder output with the draft is lossless
# whatever the tolerance (the draft only proposes): the tolerance decides only whether the proposals change.
ENCODER_RTOL, ENCODER_ATOL = 1e-3, 1e-7

class DraftKind(enum.Enum):
    NONE = "none"
    SHARED_ENCODER = "shared-encoder"  # decoder-only draft reading the target's encoder output (distil-whisper)
    OWN_ENCODER = "own-encoder"  # full Whisper with its own encoder, run once on the same features
    # reads the target's final states and encoder output (EAGLE-style: engine/features.py)
    TARGET_FEATURES = "target-features"


def _setting(model: nn.Module, name: str) -> Any:
    """A token setting from the model's generation config, else from its config (None when neither has it)."""
    value = getattr(getattr(model, "generation_config", None), name, None)
    return value if value is not None else getattr(model.config, name, None)


def _special_ids(model: nn.Module) -> dict[str, Any]:
    gen, cfg = getattr(model, "generation_config", None), model.config
    eos = _setting(model, "eos_token_id")
    return {
        "vocab_size": cfg.vocab_size,
        "decoder_start_token_id": _setting(model, "decoder_start_token_id"),
        "eos_token_id": eos[0] if isinstance(eos, (list, tuple)) else eos,
        "no_timestamps_token_id": getattr(gen, "no_timestamps_token_id", None),
        "lang_to_id": getattr(gen, "lang_to_id", None),
    }


def check_pair(target: nn.Module, draft: nn.Module | None) -> DraftKind:
    """Say how `draft` serves `target`, or raise ValueError naming the incompatibility."""
    from transformers import WhisperForCausalLM, WhisperForConditionalGeneration

    if not isinstance(target, WhisperForConditionalGeneration):
        raise ValueError(f"target must be a WhisperForConditionalGeneration, got {type(target).__name__}")
    if draft is None:
        return DraftKind.NONE
    t_ids, d_ids = _special_ids(target), _special_ids(draft)
    for key, value in t_ids.items():
        if d_ids[key] is not None and value is not None and d_ids[key] != value:
            raise ValueError(f"draft and target disagree on {key} ({d_ids[key]} vs {value}): different tokenizers")
    enc_width = target.config.d_model
    if getattr(draft, "reads_target_features", False):  # asr_spec.models.feature_draft.FeatureDraft
        if draft.config.d_model != enc_width:
            raise ValueError(f"feature-conditioned draft of width {draft.config.d_model} for a target of width "
                             f"{enc_width}: it reads the target's own states")
        return DraftKind.TARGET_FEATURES
    if isinstance(draft, WhisperForCausalLM):
        width = draft.model.decoder.layers[0].encoder_attn.k_proj.in_features
        if width != enc_width:
            raise ValueError(
                f"draft decoder reads encoder states of width {width} but the target's encoder gives {enc_width}: "
                "use a draft with its own encoder (a full Whisper model)"
            )
        return DraftKind.SHARED_ENCODER
    if isinstance(draft, WhisperForConditionalGeneration):
        if draft.config.num_mel_bins != target.config.num_mel_bins:
            raise ValueError(
                f"draft expects {draft.config.num_mel_bins} mel bins, the target {target.config.num_mel_bins}"
            )
        if draft.config.max_source_positions != target.config.max_source_positions:
            raise ValueError("draft and target encoders cover different audio lengths")
        if getattr(draft, "own_encoder", False):  # a preset said share_encoder = false
            return DraftKind.OWN_ENCODER
        shared = same_encoder(target, draft)
        log.info("draft encoder %s the target's (rtol %g): %s", "equals" if shared else "differs from",
                 ENCODER_RTOL, "run once, shared" if shared else "the draft runs its own")
        return DraftKind.SHARED_ENCODER if shared else DraftKind.OWN_ENCODER
    raise ValueError(f"draft must be WhisperForCausalLM or WhisperForConditionalGeneration, got {type(draft).__name__}")


def same_encoder(a: nn.Module, b: nn.Module, rtol: float = ENCODER_RTOL, atol: float = ENCODER_ATOL) -> bool:
    """True when two Whisper models have the same encoder weights up to fp16 rounding (distil-whisper keeps the
    teacher's, stored in fp16), compared in fp32 whatever dtypes they were loaded in."""
    sa, sb = a.model.encoder.state_dict(), b.model.encoder.state_dict()
    if sa.keys() != sb.keys():
        return False
    return all(sa[k].shape == sb[k].shape and torch.allclose(sa[k].float(), sb[k].to(sa[k].device).float(),
                                                             rtol=rtol, atol=atol) for k in sa)
