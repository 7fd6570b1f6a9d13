"""Read CTranslate2 ``model.bin`` files in plain numpy: the file format only (no model type).

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
converting never needs the file twice in RAM.

Built on this module: :mod:`asr_spec.models.ct2_whisper` maps a Whisper model.bin onto transformers'
``WhisperForConditionalGeneration`` tensors; :mod:`asr_spec.models.embedded` builds the transformers directory
(tokenizer, generation config, safetensors), the cache and the models shipped in registry packages.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from asr_spec.errors import AsrSpecError

__all__ = ["CT2Model", "CT2Variable", "ModelFormatError", "read_ct2"]

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


class _Cursor:
    """Reads the header fields of a mapped model.bin in order; every read past the end is a one-line error."""

    def __init__(self, path: Path, data: np.ndarray):
        self.path = path
        self.buf = memoryview(data)
        self.size_bytes = len(data)
        self.pos = 0  # bytes read so far

    def corrupt(self, cause: str) -> ModelFormatError:
        return ModelFormatError(f"{self.path}: corrupt CTranslate2 model.bin: {cause}; re-download (or re-join) it")

    def take(self, n_bytes: int, what: str) -> int:
        """Skip `n_bytes` (the field `what`); the offset where they start."""
        if self.pos + n_bytes > self.size_bytes:
            raise ModelFormatError(
                f"{self.path}: truncated CTranslate2 model.bin: {what} needs {n_bytes} bytes at byte {self.pos}, but "
                f"the file ends at {self.size_bytes}; re-download (or re-join) the model"
            )
        self.pos += n_bytes
        return self.pos - n_bytes

    def unpack(self, fmt: str, what: str) -> int:
        """One little-endian number of struct format `fmt`."""
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        """A u16 length (counting the trailing NUL), then that many bytes of UTF-8."""
        n_bytes = self.unpack("<H", f"the length of {what}")
        raw = bytes(self.buf[self.take(n_bytes, what) : self.pos])
        try:
            if raw[-1:] == b"\0":
                return raw[:-1].decode("utf-8")
        except UnicodeDecodeError:
            pass
        raise self.corrupt(f"{what} at byte {self.pos - n_bytes} is not a NUL-terminated UTF-8 string")


def _read_variable(cur: _Cursor, binary_version: int, index: int, stored: dict[str, CT2Variable]) -> CT2Variable:
    """The header of variable `index` (its data skipped, its offset kept)."""
    name = cur.string(f"the name of variable {index}")
    rank = cur.unpack("<B", f"the rank of {name}")
    if rank > _MAX_RANK:
        raise cur.corrupt(f"{name} has rank {rank}")
    if name in stored:
        raise cur.corrupt(f"{name} is stored twice")
    shape = tuple(cur.unpack("<I", f"the shape of {name}") for _ in range(rank))
    if binary_version >= 4:
        dtype_id = cur.unpack("<B", f"the dtype of {name}")
        n_bytes = cur.unpack("<I", f"the size of {name}")
    else:
        item_size = cur.unpack("<B", f"the item size of {name}")
        dtype_id = _LEGACY_ITEM_SIZE_TO_ID.get(item_size, -1)
        n_bytes = cur.unpack("<I", f"the size of {name}") * item_size
    if dtype_id not in CT2_DTYPES:
        raise cur.corrupt(f"{name} has unknown dtype id {dtype_id}")
    dtype, np_dtype = CT2_DTYPES[dtype_id]
    if n_bytes != math.prod(shape) * np_dtype.itemsize:
        raise cur.corrupt(f"{name} of shape {shape} and dtype {dtype} declares {n_bytes} bytes")
    return CT2Variable(name, shape, dtype, cur.take(n_bytes, f"the data of {name}"), n_bytes)


def _read_aliases(cur: _Cursor, variables: dict[str, CT2Variable]) -> dict[str, str]:
    """The alias table (binary_version >= 3): alias name -> stored variable name."""
    n_aliases = cur.unpack("<I", "the alias count")
    if n_aliases > _MAX_COUNT:
        raise cur.corrupt(f"{n_aliases} aliases")
    aliases: dict[str, str] = {}
    for index in range(n_aliases):
        alias = cur.string(f"the name of alias {index}")
        target = cur.string(f"the target of alias {alias}")
        if target not in variables:
            raise cur.corrupt(f"alias {alias} points to {target}, which is not stored")
        aliases[alias] = target
    return aliases


def read_ct2(path: str | Path) -> CT2Model:
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
    if path.stat().st_size == 0:
        raise ModelFormatError(f"{path}: empty file, not a CTranslate2 model.bin; re-download the model")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(path, data)
    binary_version = cur.unpack("<I", "the binary version")
    if not 1 <= binary_version <= MAX_BINARY_VERSION:
        raise ModelFormatError(
            f"{path}: not a CTranslate2 model.bin this reader knows (binary version {binary_version}, expected "
            f"1…{MAX_BINARY_VERSION}); the file is corrupt or comes from a newer CTranslate2"
        )
    spec_name, spec_revision = "", 1
    if binary_version >= 2:
        spec_name = cur.string("the spec name")
        spec_revision = cur.unpack("<I", "the spec revision")
    n_variables = cur.unpack("<I", "the variable count")
    if n_variables > _MAX_COUNT:
        raise cur.corrupt(f"{n_variables} variables")
    variables: dict[str, CT2Variable] = {}
    for index in range(n_variables):
        var = _read_variable(cur, binary_version, index, variables)
        variables[var.name] = var
    aliases = _read_aliases(cur, variables) if binary_version >= 3 else {}
    if cur.pos != cur.size_bytes:
        raise cur.corrupt(f"{cur.size_bytes - cur.pos} unexpected bytes after the last alias (at byte {cur.pos})")
    return CT2Model(path, data, binary_version, spec_name, spec_revision, variables, aliases)
