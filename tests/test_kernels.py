"""Tests of the stateless KV-cache kernels against independent float64 NumPy references.

Source of the expected numbers: CACHES.md "AURA encode / decode" and "Bytes per token";
Max (1960) for the Lloyd-Max tables.
"""

from __future__ import annotations

import hashlib
import math

import mlx.core as mx
import numpy as np
import pytest

from kernels import reference as ref
from kernels.affine import (
    AFFINE_BITS,
    AffineCodes,
    affine_dequantize,
    affine_quantize,
    bits_per_element,
    default_group_size,
)
from kernels.aura import (
    GAINS,
    AuraCodes,
    aura_bits_per_element,
    aura_codebook,
    aura_decode,
    aura_decode_rotated,
    aura_encode,
    gain_cells,
    pack_bits,
    parse_aura_scheme,
    unpack_bits,
)
from kernels.lloyd_max import MAX_BITS, lloyd_max_codebook, lloyd_max_mse, lloyd_max_thresholds
from kernels.rotation import RandomizedHadamard, hadamard_matrix, hadamard_signs, supports_head_dim

UNIT_ROUNDOFF = {mx.float16: 2.0**-11, mx.bfloat16: 2.0**-8, mx.float32: 2.0**-24}


def to_np(a: mx.array) -> np.ndarray:
    """float64 (or integer) NumPy copy of an MLX array."""
    if a.dtype in (mx.float16, mx.bfloat16, mx.float32):
        return np.array(a.astype(mx.float32), dtype=np.float64)
    return np.array(a)


def kv_like(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Gaussian data with per-vector offsets and a few outlier channels, like real K/V."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * 2.0 + rng.standard_normal((*shape[:-1], 1)) * 3.0
    x[..., :3] *= 8.0
    return x


# --------------------------------------------------------------------------- Lloyd-Max

KNOWN_HALF_CODEBOOKS = {
    1: [0.7979],
    2: [0.4528, 1.5104],
    3: [0.2451, 0.7560, 1.3439, 2.1519],
    4: [0.1284, 0.3880, 0.6568, 0.9423, 1.2562, 1.6180, 2.0690, 2.7326],
}


@pytest.mark.parametrize("bits", sorted(KNOWN_HALF_CODEBOOKS))
def test_lloyd_max_centroids_match_max_table(bits):
    codebook = lloyd_max_codebook(bits)
    np.testing.assert_allclose(codebook[2 ** (bits - 1) :], KNOWN_HALF_CODEBOOKS[bits], atol=5e-5)


@pytest.mark.parametrize("bits, mse", [(1, 0.3634), (2, 0.1175), (3, 0.03455)])
def test_lloyd_max_mse_matches_max_table(bits, mse):
    assert f"{lloyd_max_mse(bits):.4g}" == f"{mse:.4g}"


def test_lloyd_max_4bit_mse_is_0_009501_not_the_printed_0_009497():
    # Max (1960) prints 0.009497 for 16 levels, but the distortion of that very codebook
    # (even of its 4-decimal printed centroids) integrates to 0.0095010.
    assert f"{lloyd_max_mse(4):.4g}" == "0.009501"
    printed = np.array(KNOWN_HALF_CODEBOOKS[4])
    printed_mse = ref.lloyd_max_mse_quadrature(np.concatenate([-printed[::-1], printed]))
    assert abs(printed_mse - 0.009501) < 1e-6
    assert abs(lloyd_max_mse(4) / 0.009497 - 1) < 5e-4


@pytest.mark.parametrize("bits", range(1, 11))
def test_lloyd_max_codebook_is_a_converged_lloyd_fixed_point(bits):
    codebook = lloyd_max_codebook(bits)
    assert codebook.dtype == np.float64 and codebook.shape == (2**bits,)
    assert np.all(np.diff(codebook) > 0)
    np.testing.assert_array_equal(codebook, -codebook[::-1])
    np.testing.assert_allclose(ref.lloyd_step_ref(codebook), codebook, rtol=0, atol=2e-12)
    np.testing.assert_allclose(lloyd_max_thresholds(bits), 0.5 * (codebook[1:] + codebook[:-1]))


@pytest.mark.parametrize("bits", range(1, 11))
def test_lloyd_max_mse_matches_quadrature(bits):
    assert lloyd_max_mse(bits) == pytest.approx(
        ref.lloyd_max_mse_quadrature(lloyd_max_codebook(bits)), rel=1e-9
    )


def test_lloyd_max_mse_within_known_factor_of_distortion_rate_bound():
    # CACHES.md "Physical limits": Lloyd-Max is 1.45-2.43x above 2**(-2b) for 1..4 bits.
    ratios = [lloyd_max_mse(b) * 4**b for b in range(1, 5)]
    assert ratios[0] == pytest.approx(1.45, abs=0.01)
    assert ratios[-1] == pytest.approx(2.43, abs=0.01)
    assert all(1 < r < math.pi * math.sqrt(3) / 2 for r in ratios)  # Panter-Dite limit 2.72


def test_lloyd_max_codebook_is_cached_and_read_only():
    assert lloyd_max_codebook(3) is lloyd_max_codebook(3)
    with pytest.raises(ValueError):
        lloyd_max_codebook(3)[0] = 0.0


@pytest.mark.parametrize("bits", [0, 11, 2.0, "4"])
def test_lloyd_max_rejects_bad_bits(bits):
    with pytest.raises(ValueError, match="bits"):
        lloyd_max_codebook(bits)
    with pytest.raises(ValueError, match="bits"):
        lloyd_max_mse(bits)


# --------------------------------------------------------------------------- rotation


def rotation_signs(rotation: RandomizedHadamard) -> np.ndarray:
    """The rotation's +-1 signs as float64."""
    return to_np(rotation.signs)


def rotation_as_matrix(rotation: RandomizedHadamard) -> np.ndarray:
    """The matrix `R` with `forward(x) = R x`, read off the basis vectors (float64)."""
    return to_np(rotation.forward(mx.eye(rotation.head_dim))).T


NON_POWER_OF_TWO = [80, 96, 192]  # phi-2, phi-3, DeepSeek-V2 keys: 20 * 4, 12 * 8, 12 * 16


@pytest.mark.parametrize("head_dim", [64, 128, *NON_POWER_OF_TWO, 112])
def test_rotation_is_orthogonal_and_equals_hadamard_reference(head_dim):
    rotation = RandomizedHadamard(head_dim, seed=3)
    matrix = rotation_as_matrix(rotation)
    np.testing.assert_allclose(matrix.T @ matrix, np.eye(head_dim), atol=1e-5)
    expected = ref.rotation_matrix_ref(hadamard_signs(head_dim, 3))
    np.testing.assert_allclose(matrix, expected, atol=1e-6)
    inverse = to_np(rotation.inverse(mx.eye(head_dim))).T
    np.testing.assert_allclose(inverse, expected.T, atol=1e-6)


@pytest.mark.parametrize("head_dim", [64, 128, *NON_POWER_OF_TWO])
def test_rotation_round_trip_and_norm(head_dim):
    rotation = RandomizedHadamard(head_dim, seed=11)
    x_np = kv_like((2, 3, 17, head_dim))
    x = mx.array(x_np.astype(np.float32))
    y = rotation.forward(x)
    np.testing.assert_allclose(
        to_np(y), x_np @ ref.rotation_matrix_ref(rotation_signs(rotation)).T, rtol=1e-5, atol=1e-4
    )
    np.testing.assert_allclose(
        np.linalg.norm(to_np(y), axis=-1), np.linalg.norm(x_np, axis=-1), rtol=1e-5
    )
    np.testing.assert_allclose(to_np(rotation.inverse(y)), x_np, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_rotation_keeps_dtype(dtype):
    rotation = RandomizedHadamard(64, seed=0)
    x = mx.ones((1, 1, 2, 64), dtype=dtype)
    assert rotation.forward(x).dtype == dtype
    assert rotation.inverse(x).dtype == dtype


def test_rotation_signs_are_seeded_and_stable():
    # Part of the stored format: a change here invalidates every stored AURA cache.
    np.testing.assert_array_equal(
        hadamard_signs(16, 0), [-1, -1, -1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1]
    )
    np.testing.assert_array_equal(
        to_np(RandomizedHadamard(64, 5).signs), to_np(RandomizedHadamard(64, 5).signs)
    )
    assert not np.array_equal(hadamard_signs(64, 5), hadamard_signs(64, 6))
    assert set(np.unique(hadamard_signs(128, 1))) == {-1.0, 1.0}


@pytest.mark.parametrize("head_dim, seed", [(72, 0), (120, 0), (0, 0), (16384, 0), (1280, 0), (64, -1), (64, 1.5)])
def test_rotation_rejects_bad_arguments(head_dim, seed):
    """72 = 9 * 8 and 120 = 15 * 8 have no Hadamard matrix here (mx.hadamard_transform returns
    garbage for them rather than raising); 1280 = 20 * 64 would be a 6.5 MB dense matrix."""
    with pytest.raises(ValueError):
        RandomizedHadamard(head_dim, seed)


def test_hadamard_matrices_of_every_supported_order_are_hadamard():
    orders = [d for d in range(1, 1025) if supports_head_dim(d) and d & (d - 1)]
    assert orders[:8] == [12, 20, 24, 28, 40, 48, 56, 80] and 96 in orders and 192 in orders
    for d in orders:
        h = hadamard_matrix(d)
        assert set(np.unique(h)) == {-1.0, 1.0}, d
        np.testing.assert_array_equal(h @ h.T, d * np.eye(d), err_msg=str(d))


def test_hadamard_matrices_are_pinned():
    """Part of the stored format: the rows of H_12, H_20, H_28 (a change invalidates stored AURA caches)."""
    digest = {m: hashlib.sha256(np.packbits(hadamard_matrix(m) > 0).tobytes()).hexdigest()[:16] for m in (12, 20, 28)}
    assert digest == {12: "1c475cc60159bdd7", 20: "aa2bc16404d65699", 28: "3922f1bda34d8791"}
    np.testing.assert_array_equal(hadamard_matrix(80), np.kron(hadamard_matrix(20), hadamard_matrix(4)))


def test_rotation_rejects_wrong_last_axis():
    with pytest.raises(ValueError, match="last axis"):
        RandomizedHadamard(64, 0).forward(mx.zeros((1, 128)))


# --------------------------------------------------------------------------- affine


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
@pytest.mark.parametrize("group_size", [32, 64])
@pytest.mark.parametrize("bits", AFFINE_BITS)
def test_affine_round_trip_is_nearest_grid_point(bits, group_size, dtype):
    """Error <= step/2 inside the group's grid, plus clipping and scale rounding.

    mx.quantize snaps zero onto the grid (scale = edge / round(edge / step)), so the grid
    may end short of the group's far edge by up to one step: those elements are clipped.
    The scale and bias are computed in float32 and then rounded to `dtype`, which moves
    grid point q by up to u * (q*|scale| + |bias|).
    """
    x = mx.array(kv_like((2, 2, 16, 128)).astype(np.float32)).astype(dtype)
    codes = affine_quantize(x, bits=bits, group_size=group_size)
    x_hat = to_np(affine_dequantize(codes, bits=bits, group_size=group_size, dtype=mx.float32))

    groups = to_np(x).reshape(2, 2, 16, -1, group_size)
    scale, bias = to_np(codes.scales)[..., None], to_np(codes.biases)[..., None]
    step, top = np.abs(scale), 2**bits - 1
    low, high = np.minimum(bias, bias + top * scale), np.maximum(bias, bias + top * scale)
    clipped = np.maximum(low - groups, 0) + np.maximum(groups - high, 0)
    rounding = UNIT_ROUNDOFF[dtype] * (top * step + np.abs(bias)) + 1e-6 * step
    error = np.abs(x_hat.reshape(groups.shape) - groups)
    assert np.all(error <= step / 2 + clipped + rounding)
    assert np.all(clipped <= step + rounding)


@pytest.mark.parametrize("bits", AFFINE_BITS)
def test_affine_mse_close_to_float64_min_max_reference(bits):
    """Zero snapping costs little MSE on Gaussian groups (measured 0.99-1.05x min/max).

    With outlier channels it can even help (0.73x at 2 bits), so only the cost is bounded.
    """
    group_size = default_group_size(bits)
    rng = np.random.default_rng(bits)
    x_np = rng.standard_normal((1, 2, 256, 64)) * 3 + rng.standard_normal((1, 2, 256, 1)) * 5
    x_np = x_np.astype(np.float32).astype(np.float64)
    codes = affine_quantize(mx.array(x_np.astype(np.float32)), bits=bits, group_size=group_size)
    x_hat = to_np(affine_dequantize(codes, bits=bits, group_size=group_size, dtype=mx.float32))
    ref_mse = np.mean((ref.affine_round_trip_ref(x_np, bits, group_size) - x_np) ** 2)
    assert np.mean((x_hat - x_np) ** 2) < 1.1 * ref_mse


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
@pytest.mark.parametrize("bits", AFFINE_BITS)
def test_affine_layout_matches_mlx_and_reference_unpacking(bits, dtype):
    group_size = default_group_size(bits)
    x = mx.array(kv_like((1, 2, 8, 128), seed=2).astype(np.float32)).astype(dtype)
    codes = affine_quantize(x, bits=bits, group_size=group_size)
    assert isinstance(codes, AffineCodes)
    assert codes.packed.dtype == mx.uint32 and codes.packed.shape == (1, 2, 8, 128 * bits // 32)
    assert codes.scales.dtype == dtype and codes.scales.shape == (1, 2, 8, 128 // group_size)
    assert codes.biases.dtype == dtype and codes.biases.shape == codes.scales.shape

    ours = affine_dequantize(codes, bits=bits, group_size=group_size, dtype=dtype)
    theirs = mx.dequantize(*codes, group_size=group_size, bits=bits)
    assert ours.dtype == dtype
    assert mx.array_equal(ours, theirs.astype(dtype)).item()
    expected = ref.affine_dequantize_ref(
        np.array(codes.packed), to_np(codes.scales), to_np(codes.biases), bits, group_size
    )
    step = np.repeat(np.abs(to_np(codes.scales)), group_size, axis=-1)
    np.testing.assert_allclose(
        to_np(ours), expected, rtol=0, atol=np.max(UNIT_ROUNDOFF[dtype] * (np.abs(expected) + step))
    )
    np.testing.assert_array_equal(
        np.array(unpack_bits(codes.packed, bits)), ref.unpack_bits_ref(np.array(codes.packed), bits)
    )


def test_affine_default_group_sizes():
    assert default_group_size(8) == 64
    assert default_group_size(4) == 32
    x = mx.zeros((1, 1, 1, 64), dtype=mx.float16)
    assert affine_quantize(x, bits=8).scales.shape[-1] == 1
    assert affine_quantize(x, bits=4).scales.shape[-1] == 2


@pytest.mark.parametrize(
    "bits, group_size, head_dim, match",
    [(7, 64, 64, "bits"), (1, 64, 64, "bits"), (4, 48, 96, "group_size"), (4, 16, 80, "group_size")],
)
def test_affine_rejects_bad_arguments(bits, group_size, head_dim, match):
    with pytest.raises(ValueError, match=match):
        affine_quantize(mx.zeros((1, 1, 2, head_dim)), bits=bits, group_size=group_size)


@pytest.mark.parametrize("bits", AFFINE_BITS)
def test_affine_tail_group_equals_mlx_on_that_group(bits):
    """head_dim 96 at group 64: a full group then a tail of 32, which MLX can quantize on its own."""
    x = mx.array(kv_like((2, 3, 8, 96), seed=bits).astype(np.float32))
    codes = affine_quantize(x, bits=bits, group_size=64)
    head = mx.quantize(x[..., :64], group_size=64, bits=bits)
    tail = mx.quantize(x[..., 64:], group_size=32, bits=bits)
    for ours, theirs in zip(codes, (mx.concatenate([a, b], axis=-1) for a, b in zip(head, tail))):
        assert mx.array_equal(ours, theirs).item()


@pytest.mark.parametrize("bits", AFFINE_BITS)
@pytest.mark.parametrize("head_dim, group_size", [(80, 64), (80, 32), (40, 64), (192, 128)])
def test_affine_tail_group_is_nearest_grid_point_of_its_own_range(bits, head_dim, group_size):
    """A tail group (80 at 64 or 32: 16 elements; 40 at 64: all of it) gets the scale and bias of
    its own min and max; dequantization agrees with the float64 reference; padding bits are zero."""
    x_np = kv_like((2, 2, 16, head_dim), seed=head_dim + bits).astype(np.float32)
    codes = affine_quantize(mx.array(x_np), bits=bits, group_size=group_size)
    groups = math.ceil(head_dim / group_size)
    assert codes.packed.shape[-1] == math.ceil(head_dim * bits / 32) and codes.scales.shape[-1] == groups
    x_hat = to_np(affine_dequantize(codes, bits=bits, group_size=group_size, dtype=mx.float32, head_dim=head_dim))
    expected = ref.affine_dequantize_ref(np.array(codes.packed), to_np(codes.scales), to_np(codes.biases), bits,
                                         group_size, head_dim)
    np.testing.assert_allclose(x_hat, expected, rtol=0, atol=4 * UNIT_ROUNDOFF[mx.float32] * np.abs(x_np).max())
    member = np.arange(head_dim) // group_size
    for g in range(groups):
        part = x_np[..., member == g].astype(np.float64)
        scale, bias = to_np(codes.scales)[..., g : g + 1], to_np(codes.biases)[..., g : g + 1]
        step, top = np.abs(scale), 2**bits - 1
        low, high = np.minimum(bias, bias + top * scale), np.maximum(bias, bias + top * scale)
        clipped = np.maximum(low - part, 0) + np.maximum(part - high, 0)
        error = np.abs(x_hat[..., member == g] - part)
        assert np.all(error <= step / 2 + clipped + 1e-5 * step), g
        assert np.all(clipped <= step * (1 + 1e-5)), g
        # The group's own edges are on its grid (MLX keeps the larger-magnitude edge as the bias).
        edge = np.where(np.abs(part.min(-1)) > np.abs(part.max(-1)), part.min(-1), part.max(-1))
        np.testing.assert_allclose(bias[..., 0], edge, rtol=1e-6, atol=1e-6)
    used = head_dim * bits % 32
    if used:
        assert np.all(np.array(codes.packed)[..., -1] >> used == 0)


@pytest.mark.parametrize("bits, group_size, expected", [(8, 64, 8.5), (4, 32, 5.0)])
def test_affine_bits_per_element_equals_stored_bytes(bits, group_size, expected):
    assert bits_per_element(bits, group_size) == expected
    x = mx.zeros((2, 3, 5, 64), dtype=mx.float16)
    codes = affine_quantize(x, bits=bits, group_size=group_size)
    assert sum(a.nbytes for a in codes) * 8 / x.size == expected
    x32 = x.astype(mx.float32)
    codes32 = affine_quantize(x32, bits=bits, group_size=group_size)
    assert sum(a.nbytes for a in codes32) * 8 / x.size == bits_per_element(bits, group_size, 32)


# --------------------------------------------------------------------------- packing


@pytest.mark.parametrize("bits", range(1, 11))
def test_pack_round_trip_and_reference_layout(bits):
    rng = np.random.default_rng(bits)
    values = rng.integers(0, 2**bits, size=(2, 3, 7, 64)).astype(np.uint32)
    values[..., :2] = [0, 2**bits - 1]
    packed = pack_bits(mx.array(values), bits)
    assert packed.dtype == mx.uint32 and packed.shape == (2, 3, 7, 64 * bits // 32)
    np.testing.assert_array_equal(np.array(packed), ref.pack_bits_ref(values, bits))
    unpacked = unpack_bits(packed, bits)
    assert unpacked.dtype == mx.uint32
    np.testing.assert_array_equal(np.array(unpacked), values)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_pack_layout_is_mx_quantize_layout(bits):
    rng = np.random.default_rng(bits)
    q = rng.integers(0, 2**bits, size=(4, 64))
    q[:, :2] = [0, 2**bits - 1]  # mx.quantize then maps q to (2**bits - 1 - q), exactly
    packed, scales, _ = mx.quantize(mx.array(q.astype(np.float32)), group_size=64, bits=bits)
    assert to_np(scales).ravel().tolist() == [-1.0] * 4
    np.testing.assert_array_equal(np.array(unpack_bits(packed, bits)), 2**bits - 1 - q)


@pytest.mark.parametrize("bits, count", [(3, 80), (5, 80), (7, 96), (3, 16), (6, 72)])
def test_pack_partial_words_pad_with_zero_bits(bits, count):
    rng = np.random.default_rng(count + bits)
    values = rng.integers(0, 2**bits, size=(3, count)).astype(np.uint32)
    packed = pack_bits(mx.array(values), bits)
    assert packed.shape == (3, math.ceil(count * bits / 32))
    np.testing.assert_array_equal(np.array(packed), ref.pack_bits_ref(values, bits))
    np.testing.assert_array_equal(np.array(unpack_bits(packed, bits, count)), values)
    assert np.all(np.array(packed)[:, -1] >> (count * bits % 32 or 32) == 0)


@pytest.mark.parametrize("bits", range(1, 11))
@pytest.mark.parametrize("lead, count", [((2, 3, 5), 64), ((7,), 60), ((0, 4), 64)])
def test_aura_lookup_equals_codebook_of_reference_packed_indices(bits, lead, count):
    """`aura_lookup` (byte tables, GatherAxis) gives `codebook[index]` for codes packed by the NumPy reference."""
    from kernels.kv_format import aura_lookup

    rng = np.random.default_rng(bits * 100 + count)
    values = rng.integers(0, 2**bits, size=(*lead, count)).astype(np.uint32)
    packed = mx.array(ref.pack_bits_ref(values, bits)) if values.size else mx.zeros((*lead, -(-count * bits // 32)), mx.uint32)
    out = aura_lookup(packed, bits, count)
    assert out.dtype == mx.float32 and out.shape == (*lead, count)
    np.testing.assert_array_equal(np.array(out), np.array(lloyd_max_codebook(bits), np.float32)[values])


@pytest.mark.parametrize("bits", range(1, 11))
def test_encoder_cell_search_counts_edges_below_like_numpy_searchsorted(bits):
    """The encoder's branchless search gives NumPy's `searchsorted(edges, u, "left")`, edges themselves included."""
    from kernels.aura import _cells_of

    edges = np.array(gain_cells(bits)[0])
    rng = np.random.default_rng(bits)
    u = np.concatenate([rng.standard_normal(4000) * 2, edges, np.nextafter(edges, np.inf), [-1e30, 1e30, 0.0]])
    u = np.concatenate([u, np.zeros(-len(u) % 8)]).astype(np.float32).reshape(-1, 8)
    got = np.array(_cells_of(bits, mx.array(u)))
    np.testing.assert_array_equal(got, np.searchsorted(edges, u, side="left"))


# --------------------------------------------------------------------------- AURA


def aura_reference_mse(x_np, rotation, bits, gains=GAINS):
    index, scale, _ = ref.aura_encode_ref(x_np, rotation_signs(rotation), lloyd_max_codebook(bits), gains)
    decoded = ref.aura_decode_ref(index, scale, rotation_signs(rotation), lloyd_max_codebook(bits))
    return np.mean((decoded - x_np) ** 2)


@pytest.mark.parametrize("head_dim", [64, 128, *NON_POWER_OF_TWO])
@pytest.mark.parametrize("bits", range(1, 11))
def test_aura_matches_float64_reference(bits, head_dim):
    rotation = RandomizedHadamard(head_dim, seed=bits)
    x_np = kv_like((1, 2, 64, head_dim), seed=bits).astype(np.float32).astype(np.float64)
    codes = aura_encode(mx.array(x_np.astype(np.float32)), bits=bits, rotation=rotation)
    assert isinstance(codes, AuraCodes)
    assert codes.packed.shape == (1, 2, 64, math.ceil(head_dim * bits / 32))  # d=80 at 3 bits: 7.5 -> 8 words
    assert codes.packed.dtype == mx.uint32
    assert codes.scales.shape == (1, 2, 64, 1) and codes.scales.dtype == mx.float16

    codebook = lloyd_max_codebook(bits)
    index_ref, scale_ref, u = ref.aura_encode_ref(x_np, rotation_signs(rotation), codebook, GAINS)
    index = np.array(unpack_bits(codes.packed, bits, head_dim)).astype(np.int64)
    np.testing.assert_array_equal(np.array(codes.packed), ref.pack_bits_ref(index, bits))  # padding bits zero
    differ = index != index_ref
    # float32 vs float64 may differ where two gains code a vector almost equally well (whole
    # vectors then differ, but the kernel's codes are as close in angle), and else only at
    # coordinates within rounding of a threshold.
    signs = rotation_signs(rotation)
    direction = x_np @ ref.rotation_matrix_ref(signs).T

    def cosine(idx):
        c = codebook[idx]
        return np.sum(c * direction, -1) / np.linalg.norm(c, axis=-1) / np.linalg.norm(direction, axis=-1)

    np.testing.assert_array_less(cosine(index_ref) - 1e-6, cosine(index))
    # On average as close as the float64 search; at 9-10 bits float32 sums cannot tell the gains
    # apart on many vectors (their cosines differ by ~1e-7), which costs a few percent.
    assert np.mean(1 - cosine(index)) <= np.mean(1 - cosine(index_ref)) * (1.02 if bits <= 8 else 1.15)
    if bits <= 7:  # wider codes: gains tie within float32 rounding on many vectors
        assert differ.any(axis=-1).mean() < {5: 0.03, 6: 0.03, 7: 0.08}.get(bits, 0.02)
    few = differ.sum(axis=-1, keepdims=True) <= 2  # same gain, a coordinate at a threshold
    gap = np.min(np.abs(u[..., None] - lloyd_max_thresholds(bits)), axis=-1)
    assert np.all(gap[differ & few] < 1e-4)
    assert np.all(np.abs(index - index_ref)[few[..., 0]] <= 1)

    vectors_same = ~differ.any(axis=-1)
    scale = to_np(codes.scales)
    np.testing.assert_allclose(scale[vectors_same], scale_ref[vectors_same], rtol=2.0**-11 + 1e-6)
    decoded = to_np(aura_decode(codes, bits=bits, rotation=rotation, dtype=mx.float32))
    expected = ref.aura_decode_ref(index, scale, rotation_signs(rotation), codebook)
    np.testing.assert_allclose(decoded, expected, rtol=1e-5, atol=1e-5 * np.max(np.abs(expected)))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_aura_reconstruction_has_the_input_norm(bits, head_dim):
    rotation = RandomizedHadamard(head_dim, seed=0)
    x = mx.array(kv_like((2, 2, 32, head_dim), seed=bits).astype(np.float32))
    codes = aura_encode(x, bits=bits, rotation=rotation)
    norm = np.linalg.norm(to_np(x), axis=-1)
    rotated = to_np(aura_decode_rotated(codes, bits=bits, dtype=mx.float32))
    decoded = to_np(aura_decode(codes, bits=bits, rotation=rotation, dtype=mx.float32))
    # Exact up to the float16 rounding of the stored scale (relative 2**-11) and float32 math.
    np.testing.assert_allclose(np.linalg.norm(rotated, axis=-1), norm, rtol=2.0**-11 + 1e-5)
    np.testing.assert_allclose(np.linalg.norm(decoded, axis=-1), norm, rtol=2.0**-11 + 1e-5)
    # And exactly scale * ||c[idx]|| in float32.
    centroids = to_np(aura_codebook(bits))[np.array(unpack_bits(codes.packed, bits))]
    stored = to_np(codes.scales)[..., 0] * np.linalg.norm(centroids, axis=-1)
    np.testing.assert_allclose(np.linalg.norm(rotated, axis=-1), stored, rtol=1e-6)


def gaussian_vectors(count: int, head_dim: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, 1, count, head_dim))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_aura_mse_on_gaussian_vectors(bits, head_dim):
    """Per-coordinate MSE of AURA on N(0, I) vectors vs the Lloyd-Max distortion D.

    Expected deviation from D (float64 Monte Carlo, 1e5 vectors, +-0.1%), bits 1/2/3/4:
      gain search (the encoder)   d=64: +9.5  -2.6  -14.2  -25.6%   d=128: +10.4  +0.1  -7.4  -17.0%
      nearest centroids (g = 1)   d=64: +9.5  -0.9   -5.0   -6.5%   d=128: +10.4  +1.0  -2.0   -3.3%
      plain ||x||/sqrt(d), g = 1  d=64: -1.4  -2.6   -3.2   -3.5%   d=128:  -0.7  -1.3  -1.7   -1.9%
    The rotated, normalised coordinate follows sqrt(d) * (Beta((d-1)/2, (d-1)/2) on [-1, 1]),
    lighter-tailed than N(0, 1), so the plain scale lands below D (quadrature of that law
    gives the same figures). Norm correction uses `||u|| = sqrt(d)` exactly (a shape-gain
    code), which helps at 3-4 bits, but it inflates `c` by about `1/sqrt(1 - D)`, which costs
    at 1 bit: its d -> inf limit is `2 (1 - sqrt(1 - D))` = 0.4042 at 1 bit (+11% over D).
    The gain search changes nothing at 1 bit (the codes are the signs) and gains most where a
    vector's 64 coordinates leave the outer centroids empty.
    """
    rotation = RandomizedHadamard(head_dim, seed=0)
    x = mx.array(gaussian_vectors(4096, head_dim, seed=head_dim + bits).astype(np.float32))
    codes = aura_encode(x, bits=bits, rotation=rotation)
    x_hat = to_np(aura_decode(codes, bits=bits, rotation=rotation, dtype=mx.float32))
    x_np = to_np(x)
    measured = np.mean((x_hat - x_np) ** 2)
    distortion = lloyd_max_mse(bits)

    # The kernel agrees with the float64 reference on the same vectors.
    assert measured == pytest.approx(aura_reference_mse(x_np, rotation, bits), rel=1e-4)

    # Plain scale ||x|| / sqrt(d) on the g = 1 indices: within 5% of Lloyd-Max.
    signs, codebook = rotation_signs(rotation), lloyd_max_codebook(bits)
    index, _, _ = ref.aura_encode_ref(x_np, signs, codebook)
    norm = np.linalg.norm(x_np, axis=-1, keepdims=True)
    plain = ref.aura_decode_ref(index, norm / math.sqrt(head_dim), signs, codebook)
    assert np.mean((plain - x_np) ** 2) == pytest.approx(distortion, rel=0.05)

    # The search never does worse than g = 1, and lands where the Monte Carlo figures say
    # (4096 vectors: within 0.6 points of them).
    nearest = aura_reference_mse(x_np, rotation, bits, gains=(1.0,))
    expected = {(64, 1): 1.0, (64, 2): 0.983, (64, 3): 0.903, (64, 4): 0.796,
                (128, 1): 1.0, (128, 2): 0.991, (128, 3): 0.945, (128, 4): 0.858}[head_dim, bits]
    assert measured <= nearest * (1 + 1e-5)
    assert measured / nearest == pytest.approx(expected, abs=0.006)
    searched = {(64, 1): 0.095, (64, 2): -0.026, (64, 3): -0.142, (64, 4): -0.256,
                (128, 1): 0.104, (128, 2): 0.001, (128, 3): -0.074, (128, 4): -0.170}[head_dim, bits]
    assert measured / distortion - 1 == pytest.approx(searched, abs=0.015)


@pytest.mark.parametrize("bits", [8, 10])
def test_aura_gain_search_works_at_wide_codes(bits):
    """At 8-10 bits the gains' cosines differ by ~1e-7, near float32 rounding: the search must still
    cut the error of nearest-centroid coding (float64 reference, one gain) by a fifth or so. Measured
    (d = 64, 256 N(0, I) vectors, three seeds): 0.75-0.76 at 8 bits, 0.77-0.83 at 10."""
    rotation = RandomizedHadamard(64, seed=0)
    x_np = gaussian_vectors(256, 64, seed=bits).astype(np.float32).astype(np.float64)
    codes = aura_encode(mx.array(x_np.astype(np.float32)), bits=bits, rotation=rotation)
    decoded = to_np(aura_decode(codes, bits=bits, rotation=rotation, dtype=mx.float32))
    nearest = aura_reference_mse(x_np, rotation, bits, gains=(1.0,))
    assert np.mean((decoded - x_np) ** 2) / nearest < 0.88


@pytest.mark.parametrize("bits", range(1, 11))
def test_gain_cells_give_every_gains_nearest_centroid(bits):
    """Inside each cell, each gain's table code is count(thresholds < u / g), computed directly."""
    edges, centroids, index = (np.array(a) for a in gain_cells(bits))
    assert np.all(np.diff(edges) > 0)
    assert centroids.shape == (edges.size + 1, len(GAINS)) and index.shape == ((edges.size + 1) * len(GAINS),)
    thresholds = np.array(lloyd_max_thresholds(bits), dtype=np.float64)
    points = np.concatenate([[edges[0] - 1.0], (edges[:-1].astype(np.float64) + edges[1:]) / 2, [edges[-1] + 1.0]])
    want = np.stack([np.sum(thresholds[None, :] < points[:, None] / g, axis=1) for g in GAINS], axis=1)
    np.testing.assert_array_equal(index.reshape(-1, len(GAINS)), want)
    np.testing.assert_allclose(centroids, np.array(lloyd_max_codebook(bits))[want], rtol=1e-6)


@pytest.mark.parametrize("bits", range(1, MAX_BITS + 1))
def test_search_table_probes_find_each_gains_cell_code(bits):
    """The CUDA encoder's search (`encode_part`: `bits` branchless probes of `float32(t * g) < u` down the
    breadth-first thresholds of `search_table`) gives each gain the code `gain_cells` assigns to u's cell, and
    the table's centroid there is that cell's. Checked here in NumPy float32 on random and on edge points."""
    from kernels.cuda_kv import search_table

    table, n = search_table(bits), 1 << bits
    assert table.dtype == np.float32 and table.shape == (2 * n + len(GAINS),) and table[0] == np.inf
    assert np.all(np.isfinite(table[1:n]))
    edges, centroids, index = (np.array(a) for a in gain_cells(bits))
    u = np.concatenate([np.random.default_rng(bits).standard_normal(20_000).astype(np.float32) * 1.5, edges,
                        np.nextafter(edges, np.float32(np.inf)), np.nextafter(edges, np.float32(-np.inf))])
    cell = np.searchsorted(edges, u, side="left")  # count of edges < u
    for g in range(len(GAINS)):
        gain = table[2 * n + g]
        assert gain == np.float32(GAINS[g])
        node = np.ones(u.shape, np.int64)
        for _ in range(bits):
            node = 2 * node + (table[node] * gain < u)
        pos = node - n
        np.testing.assert_array_equal(pos, index.reshape(-1, len(GAINS))[cell, g])
        np.testing.assert_array_equal(table[n + pos], centroids[cell, g])


@pytest.mark.parametrize("bits", range(1, MAX_BITS + 1))
def test_search_table_holds_each_threshold_once_in_breadth_first_order(bits):
    """Slots 1 .. 2^bits - 1 are the Lloyd-Max thresholds, each once, and an in-order walk of the tree
    (left child 2i, right 2i + 1) reads them sorted: the layout the probes above rely on."""
    from kernels.cuda_kv import search_table

    n = 1 << bits
    tree = search_table(bits)[:n]

    def in_order(i):
        return [] if i >= n else in_order(2 * i) + [tree[i]] + in_order(2 * i + 1)

    np.testing.assert_array_equal(in_order(1), np.array(lloyd_max_thresholds(bits), np.float32))


def test_aura_zero_vector_decodes_to_zero():
    rotation = RandomizedHadamard(64, seed=0)
    codes = aura_encode(mx.zeros((1, 1, 2, 64), dtype=mx.float16), bits=4, rotation=rotation)
    assert to_np(codes.scales).ravel().tolist() == [0.0, 0.0]
    decoded = aura_decode(codes, bits=4, rotation=rotation, dtype=mx.float16)
    assert decoded.dtype == mx.float16
    assert np.all(to_np(decoded) == 0)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_aura_accepts_model_dtypes_and_decodes_to_requested_dtype(dtype):
    rotation = RandomizedHadamard(64, seed=0)
    x = mx.array(kv_like((1, 2, 4, 64)).astype(np.float32)).astype(dtype)
    codes = aura_encode(x, bits=4, rotation=rotation)
    reference = aura_encode(x.astype(mx.float32), bits=4, rotation=rotation)
    assert mx.array_equal(codes.packed, reference.packed).item()
    for out in (mx.float16, mx.bfloat16, mx.float32):
        assert aura_decode(codes, bits=4, rotation=rotation, dtype=out).dtype == out
        assert aura_decode_rotated(codes, bits=4, dtype=out).dtype == out


def test_aura_token_slots_are_independent():
    rotation = RandomizedHadamard(64, seed=0)
    x = mx.array(kv_like((1, 2, 8, 64)).astype(np.float32))
    whole = aura_encode(x, bits=3, rotation=rotation)
    slot = aura_encode(x[:, :, 5:6], bits=3, rotation=rotation)
    assert mx.array_equal(whole.packed[:, :, 5:6], slot.packed).item()
    assert mx.array_equal(whole.scales[:, :, 5:6], slot.scales).item()


@pytest.mark.parametrize(
    "bits, head_dim, rotation_dim", [(0, 64, 64), (11, 64, 64), (4, 80, 64), (4, 64, 128)]
)
def test_aura_encode_rejects_bad_arguments(bits, head_dim, rotation_dim):
    with pytest.raises(ValueError):
        aura_encode(
            mx.zeros((1, 1, 1, head_dim)), bits=bits, rotation=RandomizedHadamard(rotation_dim, 0)
        )


@pytest.mark.parametrize(
    "key_bits, value_bits, head_dim, expected",
    [(4, 4, 64, 4.25), (4, 2, 64, 3.25), (4, 2, 128, 3.125), (8, 8, 128, 8.125)],
)
def test_aura_bits_per_element_equals_stored_bytes(key_bits, value_bits, head_dim, expected):
    assert aura_bits_per_element(key_bits, value_bits, head_dim) == expected
    rotation = RandomizedHadamard(head_dim, seed=0)
    x = mx.array(kv_like((2, 3, 5, head_dim)).astype(np.float16))
    keys = aura_encode(x, bits=key_bits, rotation=rotation)
    values = aura_encode(x, bits=value_bits, rotation=rotation)
    stored_bits = sum(a.nbytes for a in (*keys, *values)) * 8
    assert stored_bits / (2 * x.size) == expected


def test_aura_vs_fp16_compression_ratios_from_caches_md():
    assert 16 / aura_bits_per_element(4, 2, 64) == pytest.approx(4.92, abs=0.005)
    assert 16 / aura_bits_per_element(4, 2, 128) == pytest.approx(5.12, abs=0.005)


@pytest.mark.parametrize(
    "name, expected",
    [("aura5v3", (5, 3)), ("aura4v2", (4, 2)), ("aura2v2", (2, 2)), ("aura8v8", (8, 8))],
)
def test_parse_aura_scheme(name, expected):
    assert parse_aura_scheme(name) == expected


@pytest.mark.parametrize(
    "name", ["aura1v4", "aura4v11", "aura11v2", "aura4v1", "aura04v4", "aura4", "AURA4v2", "aura4v2x", "affine4", "", None]
)
def test_parse_aura_scheme_rejects(name):
    with pytest.raises(ValueError, match="aura"):
        parse_aura_scheme(name)


def test_zero_tokens_round_trip_to_empty_arrays():
    x = mx.zeros((1, 2, 0, 64), dtype=mx.float16)
    rotation = RandomizedHadamard(64, seed=0)
    codes = aura_encode(x, bits=3, rotation=rotation)
    assert codes.packed.shape == (1, 2, 0, 6) and codes.scales.shape == (1, 2, 0, 1)
    assert aura_decode(codes, bits=3, rotation=rotation, dtype=mx.float16).shape == x.shape
    affine = affine_quantize(x, bits=4)
    assert affine.packed.shape == (1, 2, 0, 8) and affine.scales.shape == (1, 2, 0, 2)
    assert affine_dequantize(affine, bits=4, dtype=mx.float16).shape == x.shape
