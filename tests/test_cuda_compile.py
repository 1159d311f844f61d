"""`ops.cuda_compile` and `ops.nvrtc`: the translation unit MLX builds for a custom kernel, recorded without a GPU,
and compiled by NVRTC as MLX calls it.

The unit's layout is checked against text written out by hand from MLX's `build_kernel`
(`mlx/backend/cuda/custom_kernel.cpp`) and the register rule against CUDA's occupancy rules; compiling needs
NVRTC (`pip install nvidia-cuda-nvrtc`), CUDA's headers and MLX's CUDA device headers
(`BUTTERMILK_MLX_INCLUDE`: a folder holding `mlx/backend/cuda/device/utils.cuh`), so it skips without them.
"""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from kernels import cuda_kv, norm_gemv
from kernels.fused_norm import float_bits
from ops import cuda_compile, nvrtc

MLX_INCLUDE = Path(os.environ.get("BUTTERMILK_MLX_INCLUDE", "/nonexistent"))
CUDA_INCLUDE = Path(os.environ.get("BUTTERMILK_CUDA_INCLUDE", "/usr/local/cuda/include"))


def _compiler() -> nvrtc.Nvrtc | None:
    headers = (MLX_INCLUDE / "mlx/backend/cuda/device/utils.cuh", CUDA_INCLUDE / "cuda_bf16.h")
    if not all(h.is_file() for h in headers):
        return None
    try:
        library = nvrtc.find_library(os.environ.get("BUTTERMILK_NVRTC"))
    except FileNotFoundError:
        return None
    return nvrtc.Nvrtc(library, [MLX_INCLUDE, CUDA_INCLUDE, CUDA_INCLUDE / "cccl"])


COMPILER = _compiler()


def test_unit_is_laid_out_as_mlx_builds_it():
    """Inputs as const pointers of their CUDA types, `_shape` / `_strides` / `_ndim` only where the source names
    them and the input has dimensions, outputs, template arguments as constants (bools as true/false), then
    the body, in MLX's namespace; the kernel's name carries the template values as MLX prints them."""
    source = "o[0] = static_cast<float>(a[a_shape[0] + a_ndim + a_strides[1]]) + n[0] * N;  // n_shape: none (scalar)"
    unit = cuda_compile.kernel_source(
        "toy", "#define HELPER 1\n", source, ["a", "n"], [mx.zeros((2, 3), mx.bfloat16), mx.array(3, mx.int32)],
        ["o"], [mx.float32], [("T", mx.float16), ("U", mx.bfloat16), ("N", 4), ("F", False), ("G", True)])
    assert unit.name == "custom_kernel_toy_float16_t_bfloat16_t_4_f_t"
    assert unit.source == (
        cuda_compile.DEFAULT_HEADER + "#define HELPER 1\n"
        "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
        "__global__ void custom_kernel_toy_float16_t_bfloat16_t_4_f_t(\n"
        "    const __nv_bfloat16* a,\n"
        "    const __grid_constant__ Shape a_shape,\n"
        "    const __grid_constant__ Strides a_strides,\n"
        "    const __grid_constant__ int a_ndim,\n"
        "    const int32_t* n,\n"
        "    float* o) {\n"
        "  using T = __half;\n  using U = __nv_bfloat16;\n  constexpr int N = 4;\n  constexpr bool F = false;\n"
        "  constexpr bool G = true;\n\n"
        + source + "\n}\n\n} // namespace mlx::core::cu\n")


def test_compile_only_records_a_kernel_and_leaves_the_cpu_path_as_it_was():
    """Inside, `norm_gemv` takes its CUDA branch on the CPU: one unit with its template constants and block size,
    zeros out. Outside, the real path again: MLX ops, equal to a float64 RMSNorm and projection."""
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((1, 256)), rng.standard_normal((64, 256)) / 16
    nw = 1 + rng.standard_normal(256) / 8
    args = (mx.array(x, mx.float32), None, mx.array(nw, mx.float32), 1e-5, mx.array(w, mx.float32))
    with cuda_compile.compile_only() as recorder:
        assert cuda_kv.is_available()
        bf16 = [a.astype(mx.bfloat16) if isinstance(a, mx.array) else a for a in args]
        h, out = norm_gemv.norm_gemv(*bf16)
        assert out.shape == (1, 64) and not np.any(np.array(out.astype(mx.float32)))
    (unit,) = recorder.units.values()
    assert unit.name == f"custom_kernel_bm_norm_gemv_bfloat16_t_256_32_{float_bits(1e-5)}_f_f_2_{norm_gemv.CHUNK_WORDS}" and unit.threads == 32
    for line in ("using T = __nv_bfloat16;", "constexpr int H = 256;", "constexpr bool ADD = false;",
                 "const __nv_bfloat16* w,", "const __grid_constant__ Shape w_shape,", "__nv_bfloat16* out,"):
        assert line in unit.source
    assert not cuda_kv.is_available() or mx.default_device() != mx.cpu
    _, out = norm_gemv.norm_gemv(*args)
    y = x / np.sqrt(np.mean(x**2) + 1e-5) * nw
    np.testing.assert_allclose(np.array(out), y @ w.T, rtol=1e-4, atol=1e-4)


def test_compile_only_puts_back_what_it_replaced_also_after_an_error():
    saved = (mx.fast.cuda_kernel, cuda_kv.is_available, cuda_kv._compute_capability)
    with cuda_compile.compile_only():
        assert cuda_kv._compute_capability() == 9 and mx.fast.cuda_kernel is not saved[0]
    assert (mx.fast.cuda_kernel, cuda_kv.is_available, cuda_kv._compute_capability) == saved
    with pytest.raises(KeyError), cuda_compile.compile_only():
        raise KeyError("inside")
    assert (mx.fast.cuda_kernel, cuda_kv.is_available, cuda_kv._compute_capability) == saved


def test_kernels_built_inside_are_not_launched_outside_nor_the_reverse():
    """The kernels' caches are emptied on the way in and out: a second recording sees its own launches."""
    x, nw, w = mx.zeros((1, 256), mx.float16), mx.ones(256, mx.float16), mx.zeros((32, 256), mx.float16)
    for _ in range(2):
        with cuda_compile.compile_only() as recorder:
            norm_gemv.norm_gemv(x, None, nw, 1e-6, w)
        assert len(recorder.units) == 1


def test_a_launch_records_its_whole_block_and_bad_launches_are_refused():
    with cuda_compile.compile_only() as recorder:
        kernel = mx.fast.cuda_kernel(name="blk", input_names=["a"], output_names=["o"], source="o[0] = a[0];")
        kernel(inputs=[mx.zeros(4)], output_shapes=[(4,)], output_dtypes=[mx.float32], grid=(64, 2, 1),
               threadgroup=(32, 2, 1))
        with pytest.raises(ValueError, match="1,024"):
            kernel(inputs=[mx.zeros(4)], output_shapes=[(4,)], output_dtypes=[mx.float32], grid=(2048, 1, 1),
                   threadgroup=(2048, 1, 1))
        with pytest.raises(ValueError, match="dtypes"):
            kernel(inputs=[mx.zeros(4)], output_shapes=[(4,)], output_dtypes=[], grid=(32, 1, 1),
                   threadgroup=(32, 1, 1))
        shared = mx.fast.cuda_kernel(name="sh", input_names=["a"], output_names=["o"], source="", shared_memory=1024)
        with pytest.raises(ValueError, match="shared memory"):
            shared(inputs=[mx.zeros(4)], output_shapes=[(4,)], output_dtypes=[mx.float32], grid=(32, 1, 1),
                   threadgroup=(32, 1, 1))
    (unit,) = recorder.units.values()
    assert unit.threads == 64


def test_block_registers_follow_cudas_occupancy_rules():
    """By hand from `cuda_occupancy.h`: a warp's 32 x registers rounded up to 256, warps rounded up to the SM's 4
    schedulers. 96 x 16 warps = 49,152; 255 x 8 warps: 8,160 -> 8,192 a warp, exactly the file; 257 threads
    are 9 warps, charged as 12; 200 x 10 warps: 6,400 x 12 = 76,800, over the file though 10 warps' 64,000
    are not; 33 x 2 warps: 1,280 x 4."""
    assert nvrtc.block_registers(96, 512) == 49152
    assert nvrtc.block_registers(255, 256) == 65536 == nvrtc.SM_REGISTERS and nvrtc.fits(255, 256)
    assert nvrtc.block_registers(255, 257) == 12 * 8192 and not nvrtc.fits(255, 257)
    assert nvrtc.block_registers(200, 320) == 76800 and not nvrtc.fits(200, 320)
    assert nvrtc.block_registers(33, 33) == 5120


def test_find_library_takes_a_path_given_and_refuses_a_missing_one(tmp_path):
    fake = tmp_path / "libnvrtc.so.13"
    fake.write_bytes(b"")
    assert nvrtc.find_library(fake) == fake
    with pytest.raises(FileNotFoundError, match="no NVRTC library"):
        nvrtc.find_library(tmp_path / "absent.so")


@pytest.mark.skipif(COMPILER is None, reason="compiles as MLX does, so needs MLX's CUDA device headers, which ship only "
                    "inside the mlx-cuda library (a CPU machine has them from an MLX source checkout: "
                    "BUTTERMILK_MLX_INCLUDE), NVRTC (pip install nvidia-cuda-nvrtc) and CUDA's headers")
def test_nvrtc_compiles_a_real_kernel_and_fails_where_mlx_would():
    """A recorded `norm_gemv` compiles, with its registers and shared memory; what MLX's NVRTC call refuses is
    refused: a statement naming nothing, a bare `inf` (MLX's header has had no such macro since 0.32.0), and a
    negative template argument, which MLX prints into the kernel's name."""
    with cuda_compile.compile_only() as recorder:
        norm_gemv.norm_gemv(mx.zeros((1, 512), mx.float16), None, mx.ones(512, mx.float16), 1e-6,
                            mx.zeros((128, 512), mx.float16))
        toy = mx.fast.cuda_kernel(name="neg", input_names=["a"], output_names=["o"], source="o[0] = a[0] * N;")
        toy(inputs=[mx.zeros(4)], output_shapes=[(4,)], output_dtypes=[mx.float32], grid=(32, 1, 1),
            threadgroup=(32, 1, 1), template=[("N", -3)])
    unit, negative = recorder.units.values()
    assert negative.name == "custom_kernel_neg_-3"
    end = "\n}\n\n} // namespace"

    def broken(name: str, statement: str) -> cuda_compile.Unit:
        return cuda_compile.Unit(name, unit.source.replace(end, f"\n{statement}{end}"), 64)

    no_name, bare_inf = broken("no_name", "undeclared = 1;"), broken("bare_inf", "float z = inf;")
    good, *bad = cuda_compile.compile_sources([unit, no_name, bare_inf, negative], COMPILER, jobs=2)
    assert good.ok and good.threads == 64 and good.registers > 0 and good.spill_bytes == 0 and good.fits
    assert good.shared_bytes >= 512 * 2  # the normalized row, fp16
    assert [b.ok for b in bad] == [False, False, False]
    assert '"undeclared" is undefined' in bad[0].error and '"inf" is undefined' in bad[1].error
