"""Read CTranslate2 ``model.bin`` files in plain numpy; map a Whisper one onto transformers' tensors.

The format (written by ``ctranslate2.specs.model_spec.ModelSpec._serialize``, read by the C++ ``models/model.cc``)
is little-endian and unaligned::

    u32  binary_version                      (1 … 6; Whisper models are 5 or 6)
    str  spec_name, u32 spec_revision        (binary_version >= 2)
    u32  n_variables, then n_variables times:
        str name
        u8  rank, u32 dims[rank]
        binary_version >= 4:  u8 dtype_id, u32 n_bytes      (dtype ids below)
        binary_version <  4:  u8 item_size, u32 n_items     (float32/int16/int8 by size)
        u8  data[n_bytes]
    u32  n_aliases, then n_aliases times: str alias, str target   (binary_version >= 3)

where ``str`` is a u16 length that counts a trailing NUL, then that many bytes. Quantised weights come with a
``<name>_scale`` variable: int8 weights are scaled per output row (``w = q / scale[:, None]``), int16 weights by one
global scalar (``w = q / scale``). Scalar variables (rank 0) hold layer attributes such as ``num_heads``.

The file is memory-mapped: parsing reads only the headers, and a tensor's bytes are touched when it is converted, so
converting never needs the file twice in RAM. :func:`whisper_state_dict` maps a Whisper model.bin onto transformers'
``WhisperForConditionalGeneration`` tensors.

Building the transformers directory (tokenizer, generation config, safetensors), the cache and the models shipped in
registry packages are in :mod:`asr_spec.models.embedded`, which builds on this module.
"""

from __future__ import annotations

import math
import re
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asr_spec.errors import AsrSpecError

__all__ = ["CT2Model", "CT2Variable", "ModelFormatError", "WhisperDims", "read_ct2", "whisper_dims", "whisper_state_dict"]

# dtype id (include/ctranslate2/types.h `DataType` order) → (CTranslate2 name, numpy storage dtype). bfloat16 has
# no numpy dtype: its bits are kept as uint16 and widened in `CT2Model.float32`.
CT2_DTYPES: dict[int, tuple[str, np.dtype]] = {
    0: ("float32", np.dtype("<f4")), 1: ("int8", np.dtype("i1")), 2: ("int16", np.dtype("<i2")),
    3: ("int32", np.dtype("<i4")), 4: ("float16", np.dtype("<f2")), 5: ("bfloat16", np.dtype("<u2")),
}  # fmt: skip
_NP_DTYPES = dict(CT2_DTYPES.values())
_LEGACY_ITEM_SIZE_TO_ID = {4: 0, 2: 2, 1: 1}  # binary_version < 4 stored an item size, not a dtype id
MAX_BINARY_VERSION = 6
_MAX_RANK = 8  # CTranslate2 tensors have rank <= 4: a larger rank means a corrupt header
_MAX_COUNT = 1_000_000  # variables or aliases; more means a corrupt header


class ModelFormatError(AsrSpecError, ValueError):
    """A model directory or file that cannot be read or converted; the message names the file, cause and fix."""


@dataclass(frozen=True)
class CT2Variable:
    """One stored tensor: where its bytes are in the file and how to read them.

    Attributes:
        name: scoped name, e.g. ``"decoder/layer_0/self_attention/linear_0/weight"``.
        shape: dims as stored (a weight is ``(out_features, in_features)``); ``()`` for a scalar.
        dtype: CTranslate2 dtype name: float32 | float16 | bfloat16 | int8 | int16 | int32.
        offset_bytes: offset of the first data byte from the start of the file.
        n_bytes: data size in bytes.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset_bytes: int
    n_bytes: int


@dataclass
class CT2Model:
    """A parsed, memory-mapped CTranslate2 ``model.bin``.

    Attributes:
        path: the file.
        data: the whole file as a read-only uint8 memmap.
        binary_version: format version (1 … 6).
        spec_name: e.g. ``"WhisperSpec"`` (``""`` for binary_version 1).
        spec_revision: revision of that spec (Whisper: 3).
        variables: name → :class:`CT2Variable`, in file order.
        aliases: alias name → stored variable name (e.g. a tied output head → the embeddings).
    """

    path: Path
    data: np.ndarray
    binary_version: int
    spec_name: str
    spec_revision: int
    variables: dict[str, CT2Variable]
    aliases: dict[str, str]

    def names(self) -> list[str]:
        """Every readable name: stored variables, then aliases."""
        return [*self.variables, *self.aliases]

    def __contains__(self, name: object) -> bool:
        return name in self.variables or name in self.aliases

    def resolve(self, name: str) -> CT2Variable:
        """The stored variable behind ``name`` (following an alias); `KeyError` if absent."""
        return self.variables[self.aliases.get(name, name)]

    def raw(self, name: str) -> np.ndarray:
        """The stored tensor as a read-only view into the mapped file (no copy); bfloat16 shows as uint16 bits."""
        var = self.resolve(name)
        flat = self.data[var.offset_bytes : var.offset_bytes + var.n_bytes]
        return flat.view(_NP_DTYPES[var.dtype]).reshape(var.shape)

    def scalar(self, name: str) -> int | float:
        """A rank-0 attribute (e.g. ``encoder/num_heads``) as a Python number."""
        var = self.resolve(name)
        if var.shape != ():
            raise ModelFormatError(f"{self.path}: {name} should be a scalar but has shape {var.shape}")
        return self.float32(name).item() if var.dtype == "bfloat16" else self.raw(name).item()

    def float32(self, name: str) -> np.ndarray:
        """The tensor as a new float32 array (same shape), dequantised with ``<name>_scale`` if int8/int16.

        int8: ``q / scale[:, None, ...]`` (one scale per output row, dim 0); int16: ``q / scale`` (one global
        scale). Integer scalars are cast; an integer tensor without a scale is an error.
        """
        var = self.resolve(name)
        value = self.raw(name)
        if var.dtype == "bfloat16":
            return (value.astype(np.uint32) << 16).view(np.float32)  # bfloat16 = the top half of a float32
        if var.dtype in ("float32", "float16") or var.shape == ():
            return value.astype(np.float32)  # always a copy: the mapping is read-only
        scale_name = f"{var.name}_scale"  # an alias shares its target's scale
        if scale_name not in self:
            raise ModelFormatError(f"{self.path}: {name} is {var.dtype} but {scale_name} is missing; corrupt file")
        scale = self.float32(scale_name)
        expected = (var.shape[0],) if var.dtype == "int8" else ()
        if scale.shape != expected:
            raise ModelFormatError(f"{self.path}: {scale_name} has shape {scale.shape}, expected {expected}")
        return value.astype(np.float32) / scale.reshape(expected + (1,) * (len(var.shape) - len(expected)))

    def is_scale(self, name: str) -> bool:
        """Whether ``name`` is the dequantisation scale of another stored tensor."""
        return name.endswith("_scale") and name[: -len("_scale")] in self


def read_ct2(path: str | Path) -> CT2Model:  # long function: one pass over the file in its layout order
    """Parse the headers of a CTranslate2 ``model.bin`` and memory-map its data.

    Args:
        path: the ``model.bin`` file, or the model directory holding it.

    Returns:
        The parsed model; tensors are read lazily with :meth:`CT2Model.float32` / :meth:`CT2Model.raw`.

    Raises:
        ModelFormatError: missing, empty, truncated or corrupt file, or an unknown binary version / dtype.
    """
    path = Path(path)
    path = path / "model.bin" if path.is_dir() else path
    if not path.is_file():
        raise ModelFormatError(f"{path}: no such file; a CTranslate2 model directory must hold model.bin")
    size_bytes = path.stat().st_size
    if size_bytes == 0:
        raise ModelFormatError(f"{path}: empty file, not a CTranslate2 model.bin; re-download the model")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    buf, pos = memoryview(data), 0

    def corrupt(cause: str) -> ModelFormatError:
        return ModelFormatError(f"{path}: corrupt CTranslate2 model.bin: {cause}; re-download (or re-join) it")

    def take(n_bytes: int, what: str) -> int:
        nonlocal pos
        if pos + n_bytes > size_bytes:
            raise ModelFormatError(
                f"{path}: truncated CTranslate2 model.bin: {what} needs {n_bytes} bytes at byte {pos}, but the file "
                f"ends at {size_bytes}; re-download (or re-join) the model"
            )
        pos += n_bytes
        return pos - n_bytes

    def unpack(fmt: str, what: str) -> int:
        return struct.unpack_from(fmt, buf, take(struct.calcsize(fmt), what))[0]

    def string(what: str) -> str:
        n_bytes = unpack("<H", f"the length of {what}")
        raw = bytes(buf[take(n_bytes, what) : pos])
        try:
            if raw[-1:] == b"\0":
                return raw[:-1].decode("utf-8")
        except UnicodeDecodeError:
            pass
        raise corrupt(f"{what} at byte {pos - n_bytes} is not a NUL-terminated UTF-8 string")

    binary_version = unpack("<I", "the binary version")
    if not 1 <= binary_version <= MAX_BINARY_VERSION:
        raise ModelFormatError(
            f"{path}: not a CTranslate2 model.bin this reader knows (binary version {binary_version}, expected "
            f"1…{MAX_BINARY_VERSION}); the file is corrupt or comes from a newer CTranslate2"
        )
    spec_name, spec_revision = "", 1
    if binary_version >= 2:
        spec_name = string("the spec name")
        spec_revision = unpack("<I", "the spec revision")

    n_variables = unpack("<I", "the variable count")
    if n_variables > _MAX_COUNT:
        raise corrupt(f"{n_variables} variables")
    variables: dict[str, CT2Variable] = {}
    for index in range(n_variables):
        name = string(f"the name of variable {index}")
        rank = unpack("<B", f"the rank of {name}")
        if rank > _MAX_RANK or name in variables:
            raise corrupt(f"{name} has rank {rank}" if rank > _MAX_RANK else f"{name} is stored twice")
        shape = tuple(unpack("<I", f"the shape of {name}") for _ in range(rank))
        if binary_version >= 4:
            dtype_id, n_bytes = unpack("<B", f"the dtype of {name}"), unpack("<I", f"the size of {name}")
        else:
            item_size = unpack("<B", f"the item size of {name}")
            dtype_id = _LEGACY_ITEM_SIZE_TO_ID.get(item_size, -1)
            n_bytes = unpack("<I", f"the size of {name}") * item_size
        if dtype_id not in CT2_DTYPES:
            raise corrupt(f"{name} has unknown dtype id {dtype_id}")
        dtype, np_dtype = CT2_DTYPES[dtype_id]
        if n_bytes != math.prod(shape) * np_dtype.itemsize:
            raise corrupt(f"{name} of shape {shape} and dtype {dtype} declares {n_bytes} bytes")
        variables[name] = CT2Variable(name, shape, dtype, take(n_bytes, f"the data of {name}"), n_bytes)

    aliases: dict[str, str] = {}
    if binary_version >= 3:
        n_aliases = unpack("<I", "the alias count")
        if n_aliases > _MAX_COUNT:
            raise corrupt(f"{n_aliases} aliases")
        for index in range(n_aliases):
            alias = string(f"the name of alias {index}")
            target = string(f"the target of alias {alias}")
            if target not in variables:
                raise corrupt(f"alias {alias} points to {target}, which is not stored")
            aliases[alias] = target
    if pos != size_bytes:
        raise corrupt(f"{size_bytes - pos} unexpected bytes after the last alias (at byte {pos})")
    return CT2Model(path, data, binary_version, spec_name, spec_revision, variables, aliases)


# ------------------------------------------------------------------------------------ Whisper → transformers

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


def whisper_state_dict(ct2: CT2Model, dims: WhisperDims, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], bool]:
    """Map every CT2 variable onto a transformers ``WhisperForConditionalGeneration`` state dict.

    Returns:
        (state dict with ``proj_out.weight`` included, whether the output head is tied to the embeddings).

    Raises:
        ModelFormatError: a variable missing from the file, a variable left unmapped, or a bad scalar attribute.
    """
    plan = _whisper_plan(dims.n_encoder_layers, dims.n_decoder_layers)
    expected = {split.ct2_name for split in plan} | {"decoder/projection/weight"}
    missing = sorted(expected - set(ct2.names()))
    if missing:
        raise ModelFormatError(f"{ct2.path}: Whisper model.bin lacks {len(missing)} variables: {', '.join(missing)}")
    for name, required in _WHISPER_SCALARS.items():
        if name in ct2 and required is not None and ct2.scalar(name) != required:
            raise ModelFormatError(
                f"{ct2.path}: {name} = {ct2.scalar(name)}, but Whisper needs {required}; not a Whisper model"
            )
    known = expected | set(_WHISPER_SCALARS) | {"decoder/projection/bias"}
    unmapped = sorted(n for n in ct2.names() if n not in known and not (ct2.is_scale(n) and n[:-6] in known))
    if unmapped:
        raise ModelFormatError(
            f"{ct2.path}: {len(unmapped)} variables this converter does not know how to map: {', '.join(unmapped)}"
        )

    state: dict[str, torch.Tensor] = {}
    for split in plan:
        value = ct2.float32(split.ct2_name)
        n_blocks = len(split.hf_names)
        if value.shape[0] % n_blocks:
            raise ModelFormatError(f"{ct2.path}: {split.ct2_name} {value.shape} cannot be split in {n_blocks}")
        for hf_name, block in zip(split.hf_names, np.split(value, n_blocks, axis=0), strict=True):
            if hf_name is None:
                # transformers' k_proj has no bias. CTranslate2 stores zeros there; a non-zero key bias would add the
                # same q·b to every score of a query, which softmax cancels, so dropping it is exact either way.
                if np.any(block):
                    warnings.warn(f"{ct2.path}: dropping a non-zero key bias in {split.ct2_name} (exact)", stacklevel=2)
                continue
            state[hf_name] = torch.from_numpy(np.ascontiguousarray(block)).to(dtype)

    if "decoder/projection/bias" in ct2 and np.any(ct2.float32("decoder/projection/bias")):
        raise ModelFormatError(f"{ct2.path}: the output head has a bias, which transformers' Whisper cannot hold")
    head = "decoder/projection/weight"
    tied = ct2.aliases.get(head) == "decoder/embeddings/weight"
    if not tied:
        head_value = torch.from_numpy(ct2.float32(head)).to(dtype)
        tied = torch.equal(head_value, state["model.decoder.embed_tokens.weight"])
        if not tied:
            warnings.warn(f"{ct2.path}: the output head is not tied to the embeddings; keeping both", stacklevel=3)
            state["proj_out.weight"] = head_value
    if tied:
        state["proj_out.weight"] = state["model.decoder.embed_tokens.weight"]
    return state, tied

