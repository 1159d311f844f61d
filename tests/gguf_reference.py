"""An independent float64 reading of GGUF files for the importer tests.

It parses the file itself (GGUF v2/v3: header, metadata, tensor table, aligned data) and
decodes GGML blocks in float64 from their C definitions, so it shares no code with the
importer (`mx.load`, the `gguf` library, `mx.dequantize`).

Sources: llama.cpp `docs/gguf.md` (file layout); ggml `ggml-common.h` (`block_q8_0`,
`block_q5_0`, `block_q4_K`, `block_q6_K`) and `ggml-quants.c` (`dequantize_row_*`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

F32, Q5_0, Q8_0, Q4_K, Q6_K = 0, 6, 8, 12, 14  # ggml_type ids
BLOCKS = {Q8_0: (32, 34), Q5_0: (32, 22), Q4_K: (256, 144), Q6_K: (256, 210)}  # type: (weights, bytes)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]  # GGML order: ne0 (columns) first
    ggml_type: int
    data: np.ndarray  # uint8 bytes of the whole tensor


class Reader:
    """Parses a GGUF file's metadata and tensor table (the whole file is read into memory)."""

    def __init__(self, path: str | Path):
        self.raw = Path(path).read_bytes()
        self.pos = 0
        assert self._bytes(4) == b"GGUF"
        version, num_tensors, num_kv = self._unpack("<IQQ")
        assert version in (2, 3)
        self.meta = {self._string(): self._value(self._unpack("<I")[0]) for _ in range(num_kv)}
        table = [(self._string(), self._dims(), *self._unpack("<IQ")) for _ in range(num_tensors)]
        alignment = self.meta.get("general.alignment", 32)
        start = -(-self.pos // alignment) * alignment
        self.tensors = {}
        for name, shape, ggml_type, offset in table:
            count = int(np.prod(shape))
            nbytes = count * 4 if ggml_type == F32 else count // BLOCKS[ggml_type][0] * BLOCKS[ggml_type][1]
            data = np.frombuffer(self.raw, np.uint8, count=nbytes, offset=start + offset)
            self.tensors[name] = Tensor(name, shape, ggml_type, data)

    def _bytes(self, n: int) -> bytes:
        self.pos += n
        return self.raw[self.pos - n : self.pos]

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self.raw, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        return self._bytes(self._unpack("<Q")[0]).decode("utf-8")

    def _dims(self) -> tuple[int, ...]:
        (n,) = self._unpack("<I")
        return self._unpack(f"<{n}Q")

    def _value(self, kind: int):
        if kind == 8:
            return self._string()
        if kind == 9:
            item_kind, count = self._unpack("<IQ")
            if item_kind in _SCALARS:
                return list(self._unpack(f"<{count}{_SCALARS[item_kind]}"))
            return [self._value(item_kind) for _ in range(count)]
        return self._unpack(f"<{_SCALARS[kind]}")[0]


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian fp16 from [..., 2] bytes, as float64 [..., 1]."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float64)


def dequant_q8_0(blocks: np.ndarray) -> np.ndarray:
    """[n, 34] -> [n, 32]: fp16 d, int8 q[32]; x = d*q."""
    return _f16(blocks[:, 0:2]) * np.ascontiguousarray(blocks[:, 2:]).view(np.int8)


def dequant_q5_0(blocks: np.ndarray) -> np.ndarray:
    """[n, 22] -> [n, 32]: fp16 d, 32 high bits qh, 16 bytes of nibbles; x = d*((nibble | high<<4) - 16).

    Weight j < 16 is the low nibble of qs[j], weight j + 16 its high nibble; bit j of qh is weight j's high bit.
    """
    qh = np.ascontiguousarray(blocks[:, 2:6]).view("<u4").astype(np.int64)
    qs = blocks[:, 6:22].astype(np.int64)
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
    high = (qh >> np.arange(32)) & 1
    return _f16(blocks[:, 0:2]) * (low + 16 * high - 16)


def _k4_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml `get_scale_min_k4` for j = 0..7 over [n, 12] bytes: 6-bit scales and mins [n, 8]."""
    s = s.astype(np.int64)
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)], axis=1)
    mn = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
    return sc, mn


def dequant_q4_k(blocks: np.ndarray) -> np.ndarray:
    """[n, 144] -> [n, 256]: fp16 d, fp16 dmin, 12 bytes of scales/mins, 128 bytes of nibbles.

    Sub-block i (32 weights) is x = d*sc[i]*q - dmin*m[i]; each 64 weights take 32 bytes,
    low nibbles first, then high nibbles.
    """
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, mn = _k4_scales(blocks[:, 4:16])
    qs = blocks[:, 16:144].astype(np.int64).reshape(-1, 4, 32)
    q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)
    return (d[:, :, None] * sc[:, :, None] * q - dmin[:, :, None] * mn[:, :, None]).reshape(-1, 256)


def dequant_q6_k(blocks: np.ndarray) -> np.ndarray:
    """[n, 210] -> [n, 256]: 128 bytes low nibbles ql, 64 bytes 2-bit highs qh, 16 int8 scales, fp16 d.

    Each half of 128 weights uses 64 ql and 32 qh bytes; for l < 32 its weights l, l+32,
    l+64, l+96 are (ql[l]&15, ql[l+32]&15, ql[l]>>4, ql[l+32]>>4) | (qh[l] bits 0-1, 2-3,
    4-5, 6-7) << 4, minus 32, times d*scale[16-weight group].
    """
    ql = blocks[:, 0:128].astype(np.int64).reshape(-1, 2, 64)
    qh = blocks[:, 128:192].astype(np.int64).reshape(-1, 2, 32)
    scales = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float64)
    d = _f16(blocks[:, 208:210])
    lows = [ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4]
    q = np.stack([lo | (((qh >> (2 * k)) & 3) << 4) for k, lo in enumerate(lows)], axis=2) - 32
    return (d * scales).repeat(16, axis=1) * q.reshape(-1, 256)


DECODERS = {Q8_0: dequant_q8_0, Q5_0: dequant_q5_0, Q4_K: dequant_q4_k, Q6_K: dequant_q6_k}


def rows(tensor: Tensor, row_ids: np.ndarray | None = None) -> np.ndarray:
    """Rows of a tensor in float64: [len(row_ids) or ne1, ne0] (a 1-D tensor gives [1, ne0])."""
    cols = tensor.shape[0]
    if tensor.ggml_type == F32:
        data = np.ascontiguousarray(tensor.data).view("<f4").astype(np.float64).reshape(-1, cols)
        return data if row_ids is None else data[row_ids]
    per_block, nbytes = BLOCKS[tensor.ggml_type]
    raw = tensor.data.reshape(-1, cols // per_block * nbytes)
    raw = raw if row_ids is None else raw[row_ids]
    return DECODERS[tensor.ggml_type](np.ascontiguousarray(raw).reshape(-1, nbytes)).reshape(len(raw), cols)
