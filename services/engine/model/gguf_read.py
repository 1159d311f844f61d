"""Reading a GGUF file: metadata as Python values and tensors dequantized to float32.

The header (metadata and tensor table) is parsed here. Tensors are then decoded by one of two
libraries, whichever is exact for the file:
- `mx.load` for llama files whose tensors are all F32, F16, Q4_0, Q4_1 or Q8_0 (the default
  model): quantized tensors arrive as MLX affine triples (packed uint32 `weight`, `scales`,
  `biases`, group size 32) and `mx.dequantize` decodes them exactly;
- the `gguf` library (llama.cpp's `gguf-py`, `gguf.quants.dequantize`) for every other file:
  other architectures, and types `mx.load` cannot read (Q5_0) or rounds to float16 (K-quants).

The header is not read with `gguf.GGUFReader`: it builds a numpy view per metadata array
element, 16 s for Gemma 3's 262,144-piece vocabulary on a 2-core machine against 0.5 s here.

Source: GGUF layout and value types, llama.cpp `docs/gguf.md` and `gguf-py/gguf/constants.py`.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from shared.errors import ModelNotFound

GROUP_SIZE = 32  # weights per GGML Q4_0/Q4_1/Q8_0 block
GGUF_INSTALL_HINT = "pip install 'gguf==0.19.0'"
_MAGIC = b"GGUF"
_MLX_ARCHITECTURES = ("llama",)
_MLX_EXACT_TYPES = frozenset({0, 1, 2, 3, 8})  # GGML F32, F16, Q4_0, Q4_1, Q8_0


@dataclass(frozen=True)
class GGUFContents:
    """What the importer needs from one GGUF file.

    Attributes:
        meta (dict[str, Any]): Metadata by key; scalars as int/float/bool/str, arrays as lists.
        tensor_names (tuple[str, ...]): Tensor names in file order (`blk.0.attn_q.weight`).
        load (Callable[[str], mx.array]): A tensor by name, dequantized to float32, shape
            `[ne1, ne0]` for matrices (rows, columns as GGML writes them) or `[ne0]`.
    """

    meta: dict[str, Any]
    tensor_names: tuple[str, ...]
    load: Callable[[str], mx.array]

    @property
    def architecture(self) -> str | None:
        """`general.architecture`, e.g. "llama" or "gemma3"."""
        return self.meta.get("general.architecture")


@dataclass(frozen=True)
class _Table:
    """Where a file's tensors are: {name: (dims ne0 first, GGML type id, offset)} and the data start (bytes)."""

    tensors: dict[str, tuple[tuple[int, ...], int, int]]
    data_start: int


def read_gguf(path: str | os.PathLike) -> GGUFContents:
    """Parses a GGUF file's header and picks the library that decodes its tensors exactly.

    Raises:
        ModelNotFound: The file is missing, not GGUF, malformed or unreadable, or needs the
            `gguf` package, which is not installed (the message says how to install it).
    """
    path = Path(path)
    if not path.is_file():
        raise ModelNotFound(f"GGUF file {path} does not exist")
    with path.open("rb") as f:
        if f.read(4) != _MAGIC:
            raise ModelNotFound(f"{path} is not a GGUF file (it does not start with the bytes 'GGUF')")
    raw = np.memmap(path, mode="r", dtype=np.uint8)
    try:
        meta, table = _Header(memoryview(raw)).parse()
    except (struct.error, UnicodeDecodeError, ValueError) as exc:
        raise ModelNotFound(f"cannot read GGUF file {path}: {exc}") from exc
    types = {kind for _, kind, _ in table.tensors.values()}
    if meta.get("general.architecture") in _MLX_ARCHITECTURES and types <= _MLX_EXACT_TYPES:
        return GGUFContents(meta, tuple(table.tensors), _mlx_loader(path))
    return GGUFContents(meta, tuple(table.tensors), _gguf_loader(raw, table, path.name))


def _mlx_loader(path: Path) -> Callable[[str], mx.array]:
    """Tensors through `mx.load`; quantized triples dequantized exactly in float32."""
    try:
        tensors = mx.load(str(path), format="gguf")
    except (RuntimeError, ValueError) as exc:
        raise ModelNotFound(f"cannot read GGUF file {path}: {exc}") from exc

    def load(name: str) -> mx.array:
        w, base = tensors[name], name.removesuffix(".weight")
        if f"{base}.scales" not in tensors:
            return w.astype(mx.float32)
        # Widened to float32 first so x = scale*q + bias is exact; bits from the packed width.
        scales = tensors[f"{base}.scales"].astype(mx.float32)
        biases = tensors[f"{base}.biases"].astype(mx.float32)
        bits = w.shape[-1] // scales.shape[-1]
        return mx.dequantize(w, scales, biases, group_size=GROUP_SIZE, bits=bits)

    return load


def _gguf_loader(raw: np.ndarray, table: _Table, file_name: str) -> Callable[[str], mx.array]:
    """Tensors decoded by `gguf.quants.dequantize` from the memory-mapped file.

    Raises:
        ModelNotFound: `gguf` is not installed, or a tensor has a type it does not know.
    """
    try:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import dequantize
    except ImportError as exc:
        raise ModelNotFound(f"reading {file_name} needs the `gguf` package; run `{GGUF_INSTALL_HINT}`") from exc

    def load(name: str) -> mx.array:
        dims, kind, offset = table.tensors[name]
        try:
            qtype = GGMLQuantizationType(kind)
            per_block, block_bytes = GGML_QUANT_SIZES[qtype]
            row_bytes, num_rows = dims[0] // per_block * block_bytes, int(np.prod(dims[1:], dtype=np.int64))
            start = table.data_start + offset
            values = dequantize(raw[start : start + num_rows * row_bytes].reshape(num_rows, row_bytes), qtype)
        except (ValueError, KeyError, NotImplementedError) as exc:
            raise ModelNotFound(f"{file_name}: cannot dequantize tensor {name} (GGML type {kind}): {exc}") from exc
        return mx.array(values.astype(np.float32, copy=False).reshape(tuple(reversed(dims))))

    return load


class _Header:
    """A GGUF v2/v3 header: magic, version, counts, metadata key-values, then the tensor table."""

    _SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
    _STRING, _ARRAY = 8, 9

    def __init__(self, buffer: memoryview):
        self.buffer, self.pos = buffer, 0

    def parse(self) -> tuple[dict[str, Any], _Table]:
        """(metadata, tensor table).

        Raises:
            ValueError: An unsupported version or value type.
            struct.error: The file ends inside the header.
        """
        magic, version, num_tensors, num_kv = self._unpack("<4sIQQ")
        if magic != _MAGIC or version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version}")
        meta = {self._string(): self._value(self._unpack("<I")[0]) for _ in range(num_kv)}
        tensors = {}
        for _ in range(num_tensors):
            name, (num_dims,) = self._string(), self._unpack("<I")
            dims = self._unpack(f"<{num_dims}Q")
            tensors[name] = (dims, *self._unpack("<IQ"))
        alignment = meta.get("general.alignment", 32)  # the data section starts aligned
        return meta, _Table(tensors, -(-self.pos // alignment) * alignment)

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self.buffer, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (size,) = self._unpack("<Q")
        self.pos += size
        return bytes(self.buffer[self.pos - size : self.pos]).decode("utf-8")

    def _value(self, kind: int) -> Any:
        if kind == self._STRING:
            return self._string()
        if kind == self._ARRAY:
            item_kind, count = self._unpack("<IQ")
            if item_kind in self._SCALARS:
                return list(self._unpack(f"<{count}{self._SCALARS[item_kind]}"))
            return [self._value(item_kind) for _ in range(count)]
        if kind not in self._SCALARS:
            raise ValueError(f"unknown GGUF value type {kind}")
        return self._unpack(f"<{self._SCALARS[kind]}")[0]
