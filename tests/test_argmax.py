"""Greedy sampling's argmax (`kernels.argmax.argmax_rows`) equals numpy's: the CUDA kernel where it runs (an
H100/H200 host), `mx.argmax` on a CPU-only machine."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kernels.argmax import argmax_rows

DTYPES = [mx.float32, mx.float16, mx.bfloat16]


def _check(logits: mx.array) -> None:
    got = argmax_rows(logits)
    assert got.dtype == mx.uint32 and got.shape == (logits.shape[0],)
    want = np.argmax(np.array(logits.astype(mx.float32), np.float64), axis=-1)  # first max; a NaN wins
    np.testing.assert_array_equal(np.array(got), want)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("batch, vocab", [(1, 1), (1, 7), (3, 1000), (17, 8195), (1, 128256), (2, 151936)])
def test_argmax_rows_matches_numpy(dtype, batch, vocab):
    rng = np.random.default_rng(batch * vocab)
    _check(mx.array(rng.standard_normal((batch, vocab)) * 8, dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float16", "bfloat16"])
def test_argmax_rows_takes_the_first_of_ties_and_nans(dtype):
    rng = np.random.default_rng(7)
    vocab = 32771  # odd: rows after the first start unaligned for 16-byte loads
    x = rng.integers(-3, 4, (6, vocab)).astype(np.float64)  # seven levels: the maximum repeats in every row
    x[1, [5, 900, 20000]] = np.nan  # the first NaN wins over the maximum
    x[2, :] = -np.inf  # all -inf: index 0
    x[3, -1] = 9.0  # the maximum is the last element (a tail shorter than one load)
    x[4, [31000, 17]] = [np.inf, np.inf]  # +inf twice: the first
    x[5, :] = 0.0  # all equal: index 0
    _check(mx.array(x, dtype))


def test_argmax_rows_reads_a_row_view_at_any_offset():
    x = mx.array(np.random.default_rng(3).standard_normal((5, 4099)), mx.bfloat16)
    _check(x[1:4])  # rows start 4099 elements in: not 16-byte aligned
    _check(mx.array(np.random.default_rng(4).standard_normal((3, 4096)), mx.float16)[:, 8:])  # a strided view


def test_argmax_rows_rejects_other_ranks_and_empty_rows():
    for bad in (mx.zeros((4,)), mx.zeros((2, 0)), mx.zeros((1, 2, 3))):
        with pytest.raises(ValueError, match=r"\[B, V\]"):
            argmax_rows(bad)
