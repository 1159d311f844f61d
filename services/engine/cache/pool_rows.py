"""Row addressing and writes of a layer's page pools, shared by `KVCache` and `BatchedKVCache`.

A pool is `[n_kv_heads * num_pages * page_size, width]`, head-major: kv head h of the token in
slot s of page p is row `(h * num_pages + p) * page_size + s`. Head-major keeps each head of a
single sequence with consecutive pages contiguous (a plain view for mlx-lm's raw SDPA path),
and a forward's new tokens land with one scatter per pool.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from kernels.cuda_kv import encode_rows
from kernels.kv_format import LayerFormat
from kernels.paged_attention import uses_cuda

from .centering import center


def flat_rows(page_table: np.ndarray, slots: np.ndarray, *, n_kv_heads: int, num_pages: int,
              page_size: int) -> np.ndarray:
    """Pool rows [B, n_kv_heads, N] of logical slots [B, N] under page tables [B, P] (int64)."""
    pages = np.take_along_axis(page_table, slots // page_size, axis=1)
    heads = np.arange(n_kv_heads)[None, :, None]
    return (heads * num_pages + pages[:, None, :]) * page_size + (slots % page_size)[:, None, :]


def encode(fmt: LayerFormat, keys: mx.array, values: mx.array, key_mean: mx.array | None = None) -> tuple[mx.array, ...]:
    """Pool rows [B, H, L, width] of new K/V [B, H, L, D]: the CUDA encoder where it runs, else MLX ops.

    `key_mean` (float32 [H, 1, D], or None): keys are stored centered on it (`centering`).
    """
    if not fmt.is_raw and uses_cuda(fmt):
        return (encode_rows(fmt, keys, values, key_mean),)
    return fmt.encode(center(keys, key_mean), values)


def write(pools: tuple[mx.array, ...], rows: mx.array, new: tuple[mx.array, ...],
          source: mx.array | None = None) -> tuple[mx.array, ...]:
    """Scatter new rows into pools; returns the written pools (MLX arrays are values).

    Args:
        pools: Pools `[R, width]`.
        rows (mx.array): int32 [n], destination rows.
        new: Per pool `[B, H, L, width]`, flattened in (b, h, l) order.
        source (mx.array | None): int32 [n], which flattened new rows go to `rows` (None: all, in order).
    """
    out = []
    for pool, x in zip(pools, new):
        x = x.reshape(-1, pool.shape[-1])
        if source is not None:
            x = mx.take(x, source, axis=0)
        pool[rows] = x
        out.append(pool)
    return tuple(out)


def move(sources: tuple[mx.array, ...], source_rows: mx.array, targets: tuple[mx.array, ...],
         target_rows: mx.array) -> tuple[mx.array, ...]:
    """Per pool, `target` with rows `target_rows` replaced by `source[source_rows]` (int32 [m] each)."""
    out = []
    for source, target in zip(sources, targets):
        target[target_rows] = mx.take(source, source_rows, axis=0)
        out.append(target)
    return tuple(out)


def allocate(fmt: LayerFormat, num_rows: int) -> tuple[mx.array, ...]:
    """Zeroed pools of `num_rows` rows in the layer's format."""
    return tuple(mx.zeros((num_rows, width), dtype) for width, dtype in fmt.pool_specs())
