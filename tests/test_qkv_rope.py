"""`split_qkv_rope` equals float64 RMSNorm + RoPE and the model's own modules (the CUDA kernel where it runs,
on the H200; the MLX-ops fallback on a CPU-only machine); `split_qkv_rope_store` writes its k and v (coded by
the cache's CUDA encoder in a compressed layer) into the pool rows asked, in place."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.rope_utils import Llama3RoPE, YarnRoPE

from kernels import cuda_kv
from kernels.qkv_rope import RopeSpec, split_qkv_rope, split_qkv_rope_store, stores
from services.engine.cache.schemes import layer_format

ULP = {mx.float32: 2.0**-23, mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7}
LLAMA3 = {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _inv_freq(spec: RopeSpec) -> np.ndarray:
    """float64 [dims / 2]: base^(-2i / dims), or 1 / freqs."""
    if spec.freqs is not None:
        return 1.0 / np.array(spec.freqs, np.float64)
    return spec.base ** (-np.arange(spec.dims // 2, dtype=np.float64) / (spec.dims // 2))


def _reference(x: np.ndarray, pos: np.ndarray, spec: RopeSpec, weight: np.ndarray | None, eps: float) -> np.ndarray:
    """float64 RMSNorm (optional) then RoPE of x [B, heads, D] at positions pos [B]."""
    if weight is not None:
        x = x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * weight
    out, half = x.copy(), spec.dims // 2
    theta = spec.scale * pos[:, None, None] * _inv_freq(spec)[None, None, :]  # [B, 1, dims / 2]
    i1 = np.arange(half) * 2 if spec.traditional else np.arange(half)
    i2 = i1 + 1 if spec.traditional else i1 + half
    a, b = x[..., i1], x[..., i2]
    out[..., i1] = a * np.cos(theta) - b * np.sin(theta)
    out[..., i2] = a * np.sin(theta) + b * np.cos(theta)
    return out


def _f64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32), np.float64)


ROPES = {
    "default": lambda d: nn.RoPE(d, base=10000.0),
    "qwen3": lambda d: nn.RoPE(d, base=1_000_000.0),
    "traditional": lambda d: nn.RoPE(d, traditional=True, base=10000.0),
    "partial_linear": lambda d: nn.RoPE(d // 2, base=10000.0, scale=0.25),
    "llama3": lambda d: Llama3RoPE(d, base=500000.0, scaling_config=LLAMA3),
}


@pytest.mark.parametrize("rope", ROPES)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16], ids=["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("head_dim, heads, kv, norm", [(64, 8, 2, False), (128, 4, 4, True), (48, 6, 3, True)])
def test_split_qkv_rope_matches_float64_and_the_model_modules(rope, dtype, head_dim, heads, kv, norm):
    module = ROPES[rope](head_dim)
    spec = RopeSpec.of(module)
    rng = np.random.default_rng(head_dim + heads)
    pos = np.array([0, 7, 4095, 32769], np.int64)
    batch = pos.size
    qkv = mx.array(rng.standard_normal((batch, (heads + 2 * kv) * head_dim)) * 2, dtype)
    q_norm = k_norm = None
    if norm:
        q_norm, k_norm = nn.RMSNorm(head_dim, eps=1e-6), nn.RMSNorm(head_dim, eps=1e-5)
        q_norm.weight = mx.array(rng.uniform(0.5, 1.5, head_dim), dtype)
        k_norm.weight = mx.array(rng.uniform(0.5, 1.5, head_dim), dtype)
    q, k, v = split_qkv_rope(qkv, n_heads=heads, n_kv_heads=kv, head_dim=head_dim, rope=spec,
                             offset=mx.array(pos, mx.int32), q_norm=q_norm, k_norm=k_norm)
    assert q.shape == (batch, heads, 1, head_dim) and k.shape == v.shape == (batch, kv, 1, head_dim)
    assert q.dtype == k.dtype == v.dtype == dtype

    x = _f64(qkv).reshape(batch, heads + 2 * kv, head_dim)
    xq, xk, xv = x[:, :heads], x[:, heads: heads + kv], x[:, heads + kv:]
    np.testing.assert_array_equal(_f64(v)[:, :, 0], xv)  # values pass through untouched
    # Rounding of the normalized value and of the output (2 ulp), and float32 angles: an ulp of inv_freq
    # times the position.
    tol = 3 * ULP[dtype] + float(pos.max()) * 2.0**-23 * 2
    for got, xs, n in ((q, xq, q_norm), (k, xk, k_norm)):
        want = _reference(xs, pos.astype(np.float64), spec, None if n is None else _f64(n.weight), n.eps if n else 0)
        scale = np.abs(want).max(-1, keepdims=True)
        np.testing.assert_allclose(_f64(got)[:, :, 0] / scale, want / scale, atol=tol, rtol=0)

    # The model's own path: reshape, slice, nn.RMSNorm, the RoPE module (exact on the fallback; the kernel
    # rounds as MLX does, its norm may sum squares in another order: within 2 ulp).
    for b in range(batch):
        xs = qkv[b: b + 1].reshape(1, heads + 2 * kv, 1, head_dim)
        mq, mk = xs[:, :heads], xs[:, heads: heads + kv]
        if norm:
            mq, mk = q_norm(mq), k_norm(mk)
        mq, mk = module(mq, offset=int(pos[b])), module(mk, offset=int(pos[b]))
        for got, want in ((q[b: b + 1], mq), (k[b: b + 1], mk)):
            w = _f64(want)
            np.testing.assert_allclose(_f64(got), w, atol=2 * ULP[dtype] * np.abs(w).max(), rtol=0)


def test_an_int_offset_is_every_row_s_position():
    spec = RopeSpec.of(nn.RoPE(64))
    qkv = mx.array(np.random.default_rng(0).standard_normal((3, 12 * 64)), mx.float32)
    by_int = split_qkv_rope(qkv, n_heads=4, n_kv_heads=4, head_dim=64, rope=spec, offset=77)
    by_rows = split_qkv_rope(qkv, n_heads=4, n_kv_heads=4, head_dim=64, rope=spec, offset=mx.full((3,), 77, mx.int32))
    for a, b in zip(by_int, by_rows):
        np.testing.assert_array_equal(np.array(a), np.array(b))


def test_rope_spec_reads_supported_modules_and_refuses_others():
    spec = RopeSpec.of(nn.RoPE(32, traditional=True, base=500.0, scale=0.5))
    assert (spec.dims, spec.traditional, spec.base, spec.scale, spec.freqs) == (32, True, 500.0, 0.5, None)
    llama3 = RopeSpec.of(Llama3RoPE(64, base=500000.0, scaling_config=LLAMA3))
    assert llama3.base is None and llama3.freqs.shape == (32,) and llama3.freqs.dtype == mx.float32
    # Llama 3's long wavelengths are stretched by `factor`, short ones kept: the first dim's frequency is base^0 = 1.
    assert math.isclose(float(llama3.freqs[0]), 1.0) and math.isclose(float(llama3.freqs[-1]),
                                                                      32.0 * 500000.0 ** (62 / 64), rel_tol=1e-6)
    assert RopeSpec.of(YarnRoPE(64)) is None
    assert RopeSpec.of(None) is None


def test_split_qkv_rope_rejects_bad_shapes_norms_and_offsets():
    spec = RopeSpec.of(nn.RoPE(64))
    qkv = mx.zeros((2, 8 * 64))
    with pytest.raises(ValueError, match=r"qkv must be \[B"):
        split_qkv_rope(mx.zeros((2, 100)), n_heads=4, n_kv_heads=2, head_dim=64, rope=spec, offset=0)
    with pytest.raises(ValueError, match=r"qkv must be \[B"):
        split_qkv_rope(mx.zeros((2, 1, 8 * 64)), n_heads=4, n_kv_heads=2, head_dim=64, rope=spec, offset=0)
    with pytest.raises(ValueError, match="together"):
        split_qkv_rope(qkv, n_heads=4, n_kv_heads=2, head_dim=64, rope=spec, offset=0, q_norm=nn.RMSNorm(64))
    half = nn.RMSNorm(64)
    half.weight = half.weight.astype(mx.float16)
    with pytest.raises(ValueError, match="dtype"):
        split_qkv_rope(qkv, n_heads=4, n_kv_heads=2, head_dim=64, rope=spec, offset=0, q_norm=half, k_norm=half)
    with pytest.raises(ValueError, match="offset"):
        split_qkv_rope(qkv, n_heads=4, n_kv_heads=2, head_dim=64, rope=spec, offset=mx.zeros((3,), mx.int32))


def test_a_scalar_array_offset_is_every_row_s_position():
    spec = RopeSpec.of(nn.RoPE(64))
    qkv = mx.array(np.random.default_rng(1).standard_normal((2, 8 * 64)), mx.float32)
    for a, b in zip(split_qkv_rope(qkv, n_heads=4, n_kv_heads=2, head_dim=64, rope=spec, offset=mx.array(9)),
                    split_qkv_rope(qkv, n_heads=4, n_kv_heads=2, head_dim=64, rope=spec, offset=9)):
        np.testing.assert_array_equal(np.array(a), np.array(b))


ON_CUDA = cuda_kv.is_available()
STORED = [  # scheme, head_dim, rope, q/k norm, keys centered
    ("raw", 64, "llama3", False, False),
    ("raw", 128, "qwen3", True, False),
    ("affine4", 64, "llama3", False, False),
    ("affine8", 128, "qwen3", True, True),
    ("aura4v4", 64, "default", False, True),
    ("aura8v4", 64, "llama3", False, False),
    ("aura4v2", 128, "partial_linear", True, False),
    ("aura8v8", 256, "traditional", False, True),
]


@pytest.mark.skipif(not ON_CUDA, reason="the in-place q/k/v kernel needs MLX's CUDA backend; run on the H200")
@pytest.mark.parametrize("scheme, head_dim, rope, norm, centered", STORED)
def test_store_writes_split_k_v_into_the_rows_asked_in_place(scheme, head_dim, rope, norm, centered):
    """One launch gives the q of `split_qkv_rope`, and its k and v (raw) or the rows `encode_rows` codes from
    them land in the pool rows asked, bit for bit, in the pool arrays given; every other row keeps its bits."""
    spec = RopeSpec.of(ROPES[rope](head_dim))
    heads, kv, batch, num_rows = 8, 2, 3, 40
    rng = np.random.default_rng(head_dim)
    pos = mx.array([3, 900, 33000], mx.int32)
    qkv = mx.array(rng.standard_normal((batch, (heads + 2 * kv) * head_dim)) * 2, mx.bfloat16)
    q_norm = k_norm = None
    if norm:
        q_norm, k_norm = nn.RMSNorm(head_dim, eps=1e-6), nn.RMSNorm(head_dim, eps=1e-6)
        q_norm.weight = mx.array(rng.uniform(0.5, 1.5, head_dim), mx.bfloat16)
        k_norm.weight = mx.array(rng.uniform(0.5, 1.5, head_dim), mx.bfloat16)
    fmt = layer_format(scheme, layer=0, dtype=mx.bfloat16, head_dim=head_dim)
    mean = mx.array(rng.standard_normal((kv, 1, head_dim)), mx.float32) if centered else None
    shape = dict(n_heads=heads, n_kv_heads=kv, head_dim=head_dim, rope=spec, offset=pos, q_norm=q_norm, k_norm=k_norm)
    assert stores(fmt, head_dim, spec, mx.bfloat16)
    widths = [(head_dim, mx.bfloat16)] * 2 if fmt.is_raw else [(fmt.row_words, mx.uint32)]
    old = [rng.integers(0, 2**15, (num_rows, w)).astype(np.uint16 if d == mx.bfloat16 else np.uint32) for w, d in widths]
    pools = tuple(mx.array(o).view(d) if d == mx.bfloat16 else mx.array(o) for o, (_, d) in zip(old, widths))
    mx.eval(pools)
    rows = np.array([7, 31, 0, 12, 39, 20], np.int32)  # row b * kv + h
    q = split_qkv_rope_store(qkv, fmt, mean, pools, mx.array(rows), **shape)
    want_q, k, v = split_qkv_rope(qkv, **shape)
    want = [k, v] if fmt.is_raw else [cuda_kv.encode_rows(fmt, k, v, mean)]
    mx.eval(q)
    np.testing.assert_array_equal(np.array(q.astype(mx.float32)), np.array(want_q.astype(mx.float32)))
    for pool, before, new in zip(pools, old, want):
        got = np.array(pool.view(mx.uint16) if pool.dtype == mx.bfloat16 else pool)
        new = np.array(new.view(mx.uint16) if new.dtype == mx.bfloat16 else new).reshape(len(rows), -1)
        np.testing.assert_array_equal(got[rows], new)
        kept = np.setdiff1d(np.arange(num_rows), rows)
        np.testing.assert_array_equal(got[kept], before[kept])


def test_store_refuses_pools_and_rows_of_other_shapes():  # checked before the backend: runs anywhere
    spec = RopeSpec.of(nn.RoPE(64))
    qkv = mx.zeros((2, 8 * 64), mx.bfloat16)
    shape = dict(n_heads=4, n_kv_heads=2, head_dim=64, rope=spec, offset=0)
    raw = layer_format("raw", layer=0, dtype=mx.bfloat16, head_dim=64)
    pools, rows = (mx.zeros((8, 64), mx.bfloat16),) * 2, mx.arange(4, dtype=mx.int32)
    with pytest.raises(ValueError, match="pools must be"):
        split_qkv_rope_store(qkv, raw, None, pools[:1], rows, **shape)
    with pytest.raises(ValueError, match="pools must be"):
        split_qkv_rope_store(qkv, raw, None, (pools[0], mx.zeros((8, 32), mx.bfloat16)), rows, **shape)
    with pytest.raises(ValueError, match="rows must be"):
        split_qkv_rope_store(qkv, raw, None, pools, rows[:3], **shape)
    with pytest.raises(ValueError, match="rows must be"):
        split_qkv_rope_store(qkv, raw, None, pools, rows.astype(mx.int64), **shape)
    with pytest.raises(ValueError, match="no key mean"):
        split_qkv_rope_store(qkv, raw, mx.zeros((2, 1, 64)), pools, rows, **shape)


def test_store_serves_cuda_raw_pools_of_the_activations_dtype_and_compressed_head_dim_64_up():
    spec = RopeSpec.of(nn.RoPE(64))
    aura = layer_format("aura4v4", layer=0, dtype=mx.bfloat16, head_dim=64)
    raw = layer_format("raw", layer=0, dtype=mx.bfloat16, head_dim=64)
    assert stores(aura, 64, spec, mx.bfloat16) == stores(raw, 64, spec, mx.bfloat16) == ON_CUDA
    assert not stores(raw, 64, spec, mx.float16)  # the kernel writes the activations' type
    assert not stores(layer_format("aura4v4", layer=0, dtype=mx.bfloat16, head_dim=32), 32, RopeSpec.of(nn.RoPE(32)),
                      mx.bfloat16)
    if not ON_CUDA:
        with pytest.raises(ValueError, match="in-place q/k/v kernel serves CUDA"):
            split_qkv_rope_store(mx.zeros((1, 8 * 64)), aura, None, (mx.zeros((4, aura.row_words), mx.uint32),),
                                 mx.arange(2, dtype=mx.int32), n_heads=4, n_kv_heads=2, head_dim=64, rope=spec, offset=0)
