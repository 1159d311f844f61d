"""A decode window's tail-page moves for every layer in one launch, in place.

Before a decode window the pages its steps will write are copied from the main pools into the
tail pools, and after it back (`services.engine.cache.decode_window`). Through MLX ops that is a
gather and a scatter per pool per layer: 4 primitives a layer each way at llama-1b raw, 128 a
window, each costing host time (issue 10) and a small kernel of GPU time. `move_rows` copies the
same rows of every pool pair in one kernel: block row y takes pair y, its threads stride over
the moved rows' 4-byte words.

In place, as `kernels.qkv_rope.split_qkv_rope_store`: MLX passes the targets as read-only inputs
and still considers them unchanged, so it orders nothing after the write. Sound only as
`services.engine.cache.batched` uses it: the returned array is evaluated on its own
(`mx.async_eval`), and MLX commits each evaluation's kernels as one CUDA graph on the default
stream, so the copy runs after everything evaluated before it and before everything evaluated
after it (within one graph MLX would link a reader only to the last *writer* of its inputs, and
another stream or thread would not be ordered at all); no array evaluated together with it reads
the targets; a host read of a target waits for the stream itself (`mx.synchronize`), as MLX
sees nothing pending on the array; targets are row-contiguous buffers that no other array
shares (the tail and main pools are); rows lie inside their pools (the window's plan).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import mlx.core as mx

from kernels import cuda_kv

_THREADS = 256
MAX_PAIRS = 200  # pool pairs a launch takes: 16 bytes of kernel parameters each, under CUDA's 4 KB before 12.1

_BODY = r"""
  // Pair p = blockIdx.y: rows dst[r] of target p take rows src[r] of source p, word by word.
  const uint32_t* from;
  uint32_t* to;
  int W;
  switch (blockIdx.y) {
{cases}
    default: return;
  }
  const int m = src_shape[0];
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < m * W; i += gridDim.x * blockDim.x) {
    const int r = i / W, w = i - r * W;
    to[(size_t)dst[r] * W + w] = from[(size_t)src[r] * W + w];
  }
"""
_CASE = ("    case {p}: from = reinterpret_cast<const uint32_t*>(s{p}); "
         "to = const_cast<uint32_t*>(reinterpret_cast<const uint32_t*>(t{p})); W = {words}; break;")


def serves(sources: Sequence[mx.array], targets: Sequence[mx.array]) -> bool:
    """Whether `move_rows` runs here for these pools: MLX's CUDA backend is the default device, 1 to
    `MAX_PAIRS` pairs, each two 2-D pools of one dtype and row width, a whole number of 4-byte words."""
    return cuda_kv.is_available() and 0 < len(sources) == len(targets) <= MAX_PAIRS and all(
        s.ndim == t.ndim == 2 and s.dtype == t.dtype and s.shape[1] == t.shape[1]
        and (s.shape[1] * s.dtype.size) % 4 == 0 for s, t in zip(sources, targets))


def move_rows(sources: Sequence[mx.array], targets: Sequence[mx.array], source_rows: mx.array,
              target_rows: mx.array) -> mx.array:
    """Copy rows `source_rows` of each source pool into rows `target_rows` of its target pool, in place.

    Args:
        sources, targets: Pairs of pools `[R, width]` (R may differ within a pair; dtype and width may differ
            between pairs), row-contiguous; targets written in place (module docstring).
        source_rows, target_rows (mx.array): int32 [m] each, m >= 1, inside every source / target pool (not
            checked: the kernel would write out of bounds); target rows distinct.

    Returns:
        mx.array: int32 [1], unwritten: evaluate it (alone) to run the copy.

    Raises:
        ValueError: a pair `serves` refuses, or row indices of another dtype or shape.
    """
    m = source_rows.size
    if not (source_rows.dtype == target_rows.dtype == mx.int32 and source_rows.shape == target_rows.shape == (m,)
            and m > 0):
        raise ValueError(f"rows must be int32 [m], m >= 1, alike; got {source_rows.dtype} {source_rows.shape}, "
                         f"{target_rows.dtype} {target_rows.shape}")
    if not serves(sources, targets):
        raise ValueError("move_rows needs MLX's CUDA backend and pairs of 2-D pools of one dtype and width "
                         "(whole 4-byte words); got "
                         f"{[(s.dtype, s.shape, t.dtype, t.shape) for s, t in zip(sources, targets)]}")
    words = tuple(s.shape[1] * s.dtype.size // 4 for s in sources)
    blocks = min(-(-m * max(words) // _THREADS), 1024)
    (done,) = _kernel(words)(inputs=[*sources, *targets, source_rows, target_rows],
                             grid=(blocks * _THREADS, len(words), 1), threadgroup=(_THREADS, 1, 1),
                             output_shapes=[(1,)], output_dtypes=[mx.int32])
    return done


@functools.cache
def _kernel(words: tuple[int, ...]):
    """The kernel for pairs of these row widths (4-byte words), pair p's pools named s{p} and t{p}."""
    cases = "\n".join(_CASE.format(p=p, words=w) for p, w in enumerate(words))
    n = len(words)
    return cuda_kv.custom_kernel(
        f"bm_pool_move_{n}", _BODY.replace("{cases}", cases),
        input_names=[*[f"s{p}" for p in range(n)], *[f"t{p}" for p in range(n)], "src", "dst"],
        output_names=["done"], ensure_row_contiguous=False)
