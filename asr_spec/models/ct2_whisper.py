"""A Whisper CTranslate2 ``model.bin`` mapped onto transformers' ``WhisperForConditionalGeneration`` tensors.

Built on the file-format reader :mod:`asr_spec.models.ct2`; used by :func:`asr_spec.models.embedded.convert_ct2`.
:func:`whisper_dims` checks the spec and reads the sizes; :func:`whisper_state_dict` checks every variable is known
(none missing, none left unmapped, layer attributes as Whisper needs them) and maps each one, splitting CTranslate2's
fused projections (q|k|v of self-attention, k|v of cross-attention) into transformers' separate ones.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from asr_spec.models.ct2 import CT2Model, ModelFormatError

__all__ = ["WHISPER_SPEC_NAME", "WHISPER_SPEC_REVISION", "WhisperDims", "whisper_dims", "whisper_state_dict"]

WHISPER_SPEC_NAME = "WhisperSpec"
WHISPER_SPEC_REVISION = 3  # ctranslate2 4.x writes revision 3; a higher one may have variables we do not know
_GELU = 3  # ctranslate2.specs.common_spec.Activation.GELU

# Rank-0 layer attributes a Whisper model.bin holds: value they must have (None: any value, read elsewhere).
_WHISPER_SCALARS: dict[str, int | None] = {
    "encoder/num_heads": None,
    "decoder/num_heads": None,
    "decoder/pre_norm": 1,
    "decoder/activation": _GELU,
    "decoder/scale_embeddings": 0,
    "decoder/embeddings/multiply_by_sqrt_depth": 0,
    "decoder/alibi": 0,
    "decoder/alibi_use_positive_positions": 0,
    "decoder/scale_alibi": 0,
    "decoder/start_from_zero_embedding": 0,
    "decoder/alignment_layer": None,  # CTranslate2's own alignment defaults; ours come from config.json
    "decoder/alignment_heads": None,
}


@dataclass(frozen=True)
class _Split:
    """A CT2 tensor cut into equal blocks along dim 0, each stored under an HF name (None: a dropped key bias)."""

    ct2_name: str
    hf_names: tuple[str | None, ...]


@dataclass(frozen=True)
class WhisperDims:
    """Sizes read from the tensor shapes and scalar attributes of a CT2 Whisper model."""

    n_mels: int
    d_model: int
    n_encoder_layers: int
    n_decoder_layers: int
    n_encoder_heads: int
    n_decoder_heads: int
    encoder_ffn_dim: int
    decoder_ffn_dim: int
    n_audio_ctx: int  # encoder positions (frames after the stride-2 conv): 1500 for 30 s
    n_text_ctx: int  # decoder positions (tokens): 448
    vocab_size: int


def _linear(ct2: str, hf: str) -> list[_Split]:
    return [_Split(f"{ct2}/weight", (f"{hf}.weight",)), _Split(f"{ct2}/bias", (f"{hf}.bias",))]


def _layer_norm(ct2: str, hf: str) -> list[_Split]:
    return [_Split(f"{ct2}/gamma", (f"{hf}.weight",)), _Split(f"{ct2}/beta", (f"{hf}.bias",))]


def _self_attention(ct2: str, hf: str) -> list[_Split]:
    """CT2 fuses q, k, v into linear_0 (stacked on dim 0); linear_1 is the output projection."""
    return [
        _Split(f"{ct2}/linear_0/weight", (f"{hf}.q_proj.weight", f"{hf}.k_proj.weight", f"{hf}.v_proj.weight")),
        _Split(f"{ct2}/linear_0/bias", (f"{hf}.q_proj.bias", None, f"{hf}.v_proj.bias")),
        *_linear(f"{ct2}/linear_1", f"{hf}.out_proj"),
    ]


def _cross_attention(ct2: str, hf: str) -> list[_Split]:
    """CT2 cross-attention: linear_0 = q, linear_1 = k, v stacked on dim 0, linear_2 = output projection."""
    return [
        *_linear(f"{ct2}/linear_0", f"{hf}.q_proj"),
        _Split(f"{ct2}/linear_1/weight", (f"{hf}.k_proj.weight", f"{hf}.v_proj.weight")),
        _Split(f"{ct2}/linear_1/bias", (None, f"{hf}.v_proj.bias")),
        *_linear(f"{ct2}/linear_2", f"{hf}.out_proj"),
    ]


def _whisper_plan(n_encoder_layers: int, n_decoder_layers: int) -> list[_Split]:
    """Every CT2 tensor of a Whisper model (except the output head) and where it goes in transformers."""
    plan = [
        *_linear("encoder/conv1", "model.encoder.conv1"),
        *_linear("encoder/conv2", "model.encoder.conv2"),
        _Split("encoder/position_encodings/encodings", ("model.encoder.embed_positions.weight",)),
        *_layer_norm("encoder/layer_norm", "model.encoder.layer_norm"),
        _Split("decoder/embeddings/weight", ("model.decoder.embed_tokens.weight",)),
        _Split("decoder/position_encodings/encodings", ("model.decoder.embed_positions.weight",)),
        *_layer_norm("decoder/layer_norm", "model.decoder.layer_norm"),
    ]
    for i in range(n_encoder_layers):
        ct2, hf = f"encoder/layer_{i}", f"model.encoder.layers.{i}"
        plan += _self_attention(f"{ct2}/self_attention", f"{hf}.self_attn")
        plan += _layer_norm(f"{ct2}/self_attention/layer_norm", f"{hf}.self_attn_layer_norm")
        plan += _linear(f"{ct2}/ffn/linear_0", f"{hf}.fc1") + _linear(f"{ct2}/ffn/linear_1", f"{hf}.fc2")
        plan += _layer_norm(f"{ct2}/ffn/layer_norm", f"{hf}.final_layer_norm")
    for i in range(n_decoder_layers):
        ct2, hf = f"decoder/layer_{i}", f"model.decoder.layers.{i}"
        plan += _self_attention(f"{ct2}/self_attention", f"{hf}.self_attn")
        plan += _layer_norm(f"{ct2}/self_attention/layer_norm", f"{hf}.self_attn_layer_norm")
        plan += _cross_attention(f"{ct2}/attention", f"{hf}.encoder_attn")
        plan += _layer_norm(f"{ct2}/attention/layer_norm", f"{hf}.encoder_attn_layer_norm")
        plan += _linear(f"{ct2}/ffn/linear_0", f"{hf}.fc1") + _linear(f"{ct2}/ffn/linear_1", f"{hf}.fc2")
        plan += _layer_norm(f"{ct2}/ffn/layer_norm", f"{hf}.final_layer_norm")
    return plan


def _count_layers(ct2: CT2Model, stack: str) -> int:
    indices = {int(m.group(1)) for n in ct2.names() if (m := re.match(rf"{stack}/layer_(\d+)/", n))}
    if not indices:
        raise ModelFormatError(f"{ct2.path}: no {stack} layers; not a Whisper model or a corrupt file")
    return max(indices) + 1


def whisper_dims(ct2: CT2Model) -> WhisperDims:
    """Check the spec of a parsed model.bin is Whisper and read its sizes.

    Raises:
        ModelFormatError: another model type, a newer spec revision, or a missing core tensor.
    """
    if ct2.spec_name != WHISPER_SPEC_NAME:
        raise ModelFormatError(
            f"{ct2.path}: a CTranslate2 {ct2.spec_name or 'unnamed'} model, not Whisper ({WHISPER_SPEC_NAME}); "
            "point to a directory converted with `ct2-transformers-converter` from a Whisper checkpoint"
        )
    if ct2.spec_revision > WHISPER_SPEC_REVISION:
        raise ModelFormatError(
            f"{ct2.path}: WhisperSpec revision {ct2.spec_revision} is newer than this converter knows "
            f"({WHISPER_SPEC_REVISION}); upgrade asr-spec"
        )
    try:
        conv1 = ct2.resolve("encoder/conv1/weight").shape  # (d_model, n_mels, 3)
        return WhisperDims(
            n_mels=conv1[1],
            d_model=conv1[0],
            n_encoder_layers=_count_layers(ct2, "encoder"),
            n_decoder_layers=_count_layers(ct2, "decoder"),
            n_encoder_heads=int(ct2.scalar("encoder/num_heads")),
            n_decoder_heads=int(ct2.scalar("decoder/num_heads")),
            encoder_ffn_dim=ct2.resolve("encoder/layer_0/ffn/linear_0/weight").shape[0],
            decoder_ffn_dim=ct2.resolve("decoder/layer_0/ffn/linear_0/weight").shape[0],
            n_audio_ctx=ct2.resolve("encoder/position_encodings/encodings").shape[0],
            n_text_ctx=ct2.resolve("decoder/position_encodings/encodings").shape[0],
            vocab_size=ct2.resolve("decoder/embeddings/weight").shape[0],
        )
    except KeyError as err:
        raise ModelFormatError(f"{ct2.path}: Whisper model.bin lacks {err.args[0]}; the file is corrupt") from err


_HEAD = "decoder/projection/weight"
_HEAD_BIAS = "decoder/projection/bias"
_EMBEDDINGS = "decoder/embeddings/weight"


def _check_variables(ct2: CT2Model, plan: list[_Split]) -> None:
    """Every variable the plan (and the head) needs is there, every stored one is known, and the layer attributes
    have the values Whisper needs (ModelFormatError otherwise)."""
    expected = {split.ct2_name for split in plan} | {_HEAD}
    missing = sorted(expected - set(ct2.names()))
    if missing:
        raise ModelFormatError(f"{ct2.path}: Whisper model.bin lacks {len(missing)} variables: {', '.join(missing)}")
    for name, required in _WHISPER_SCALARS.items():
        if name in ct2 and required is not None and ct2.scalar(name) != required:
            raise ModelFormatError(
                f"{ct2.path}: {name} = {ct2.scalar(name)}, but Whisper needs {required}; not a Whisper model"
            )
    known = expected | set(_WHISPER_SCALARS) | {_HEAD_BIAS}
    unmapped = sorted(n for n in ct2.names() if n not in known and not (ct2.is_scale(n) and n[:-6] in known))
    if unmapped:
        raise ModelFormatError(
            f"{ct2.path}: {len(unmapped)} variables this converter does not know how to map: {', '.join(unmapped)}"
        )


def _map_split(ct2: CT2Model, split: _Split, dtype: torch.dtype, state: dict[str, torch.Tensor]) -> None:
    """One CT2 tensor cut into its blocks along dim 0, each stored in `state` under its transformers name."""
    value = ct2.float32(split.ct2_name)
    n_blocks = len(split.hf_names)
    if value.shape[0] % n_blocks:
        raise ModelFormatError(f"{ct2.path}: {split.ct2_name} {value.shape} cannot be split in {n_blocks}")
    for hf_name, block in zip(split.hf_names, np.split(value, n_blocks, axis=0), strict=True):
        if hf_name is None:
            # transformers' k_proj has no bias. CTranslate2 stores zeros there; a non-zero key bias would add the
            # same q·b to every score of a query, which softmax cancels, so dropping it is exact either way.
            if np.any(block):
                warnings.warn(f"{ct2.path}: dropping a non-zero key bias in {split.ct2_name} (exact)", stacklevel=4)
            continue
        state[hf_name] = torch.from_numpy(np.ascontiguousarray(block)).to(dtype)


def _output_head(ct2: CT2Model, dtype: torch.dtype, state: dict[str, torch.Tensor]) -> bool:
    """``proj_out.weight`` into `state`: the embeddings when the head is tied to them (an alias, or equal
    values), else its own tensor (with a warning). Whether it is tied."""
    if _HEAD_BIAS in ct2 and np.any(ct2.float32(_HEAD_BIAS)):
        raise ModelFormatError(f"{ct2.path}: the output head has a bias, which transformers' Whisper cannot hold")
    tied = ct2.aliases.get(_HEAD) == _EMBEDDINGS
    if not tied:
        head_value = torch.from_numpy(ct2.float32(_HEAD)).to(dtype)
        tied = torch.equal(head_value, state["model.decoder.embed_tokens.weight"])
        if not tied:
            warnings.warn(f"{ct2.path}: the output head is not tied to the embeddings; keeping both", stacklevel=5)
            state["proj_out.weight"] = head_value
    if tied:
        state["proj_out.weight"] = state["model.decoder.embed_tokens.weight"]
    return tied


def whisper_state_dict(ct2: CT2Model, dims: WhisperDims, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], bool]:
    """Map every CT2 variable onto a transformers ``WhisperForConditionalGeneration`` state dict.

    Returns:
        (state dict with ``proj_out.weight`` included, whether the output head is tied to the embeddings).

    Raises:
        ModelFormatError: a variable missing from the file, a variable left unmapped, or a bad scalar attribute.
    """
    plan = _whisper_plan(dims.n_encoder_layers, dims.n_decoder_layers)
    _check_variables(ct2, plan)
    state: dict[str, torch.Tensor] = {}
    for split in plan:
        _map_split(ct2, split, dtype, state)
    tied = _output_head(ct2, dtype, state)
    return state, tied
