"""`ops.cuda_compile`: the translation unit MLX builds for a custom kernel, recorded without a GPU, and compiled.

The unit's layout is checked against text written out by hand from MLX's `build_kernel`
(`mlx/backend/cuda/custom_kernel.cpp`); the compile itself needs `nvcc` and MLX's CUDA device headers
(`BUTTERMILK_MLX_INCLUDE`: a folder holding `mlx/backend/cuda/device/utils.cuh`), so it skips without them.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from kernels import cuda_kv, norm_gemv
from kernels.fused_norm import float_bits
from ops import cuda_compile

MLX_INCLUDE = Path(os.environ.get("BUTTERMILK_MLX_INCLUDE", "/nonexistent"))
CAN_COMPILE = shutil.which("nvcc") is not None and (MLX_INCLUDE / "mlx/backend/cuda/device/utils.cuh").is_file()


def test_unit_is_laid_out_as_mlx_builds_it():
    """Inputs as const pointers of their CUDA types, `_shape` / `_strides` / `_ndim` only where the source names
    them and the input has dimensions, outputs, template arguments as constants (bools as true/false), then
    the body, in MLX's namespace; the kernel's name carries the template values."""
    source = "o[0] = static_cast<float>(a[a_shape[0] + a_ndim]) + n[0] * N;  // n_shape: a scalar has none"
    unit = cuda_compile.kernel_source(
        "toy", "#define HELPER 1\n", source, ["a", "n"], [mx.zeros((2, 3), mx.bfloat16), mx.array(3, mx.int32)],
        ["o"], [mx.float32], [("T", mx.float16), ("N", 4), ("F", False)])
    assert unit.name == "custom_kernel_toy_float16_4_f"
    assert unit.source == (
        cuda_compile.DEFAULT_HEADER + "#define HELPER 1\n"
        "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
        "__global__ void custom_kernel_toy_float16_4_f(\n"
        "    const __nv_bfloat16* a,\n"
        "    const __grid_constant__ Shape a_shape,\n"
        "    const __grid_constant__ int a_ndim,\n"
        "    const int32_t* n,\n"
        "    float* o) {\n"
        "  using T = __half;\n  constexpr int N = 4;\n  constexpr bool F = false;\n\n"
        + source + "\n}\n\n} // namespace mlx::core::cu\n")


def test_compile_only_records_a_kernel_and_leaves_the_cpu_path_as_it_was():
    """Inside, `norm_gemv` takes its CUDA branch on the CPU: one unit with its template constants, zeros out.
    Outside, the real path again: MLX ops, equal to a float64 RMSNorm and projection."""
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
    assert unit.name == f"custom_kernel_bm_norm_gemv_bfloat16_256_32_{float_bits(1e-5)}_f_f_2" and unit.threads == 32
    for line in ("using T = __nv_bfloat16;", "constexpr int H = 256;", "constexpr bool ADD = false;",
                 "const __nv_bfloat16* w,", "const __grid_constant__ Shape w_shape,", "__nv_bfloat16* out,"):
        assert line in unit.source
    assert not cuda_kv.is_available() or mx.default_device() != mx.cpu
    _, out = norm_gemv.norm_gemv(*args)
    y = x / np.sqrt(np.mean(x**2) + 1e-5) * nw
    np.testing.assert_allclose(np.array(out), y @ w.T, rtol=1e-4, atol=1e-4)


def test_block_registers_round_each_warp_to_256():
    """An SM's 65,536 registers go to warps in 256s: by hand, 96 a thread x 16 warps = 49,152; 255 x 8 warps
    rounds 8,160 to 8,192 a warp, exactly the file; 33 a thread x 2 warps: 1,056 -> 1,280 a warp."""
    assert cuda_compile.block_registers(96, 512) == 49152
    assert cuda_compile.block_registers(255, 256) == 65536 == cuda_compile.SM_REGISTERS
    assert cuda_compile.block_registers(255, 257) > cuda_compile.SM_REGISTERS
    assert cuda_compile.block_registers(33, 33) == 2560


def test_a_launch_over_cudas_block_limit_is_refused():
    with cuda_compile.compile_only():
        kernel = mx.fast.cuda_kernel(name="big", input_names=["a"], output_names=["o"], source="")
        with pytest.raises(ValueError, match="1,024"):
            kernel(inputs=[mx.zeros(4)], output_shapes=[(4,)], output_dtypes=[mx.float32], grid=(2048, 1, 1),
                   threadgroup=(2048, 1, 1))


@pytest.mark.skipif(not CAN_COMPILE, reason="needs nvcc and BUTTERMILK_MLX_INCLUDE (MLX's CUDA device headers)")
def test_nvcc_compiles_a_real_kernel_and_reports_a_broken_one():
    with cuda_compile.compile_only() as recorder:
        norm_gemv.norm_gemv(mx.zeros((1, 512), mx.float16), None, mx.ones(512, mx.float16), 1e-6,
                            mx.zeros((128, 512), mx.float16))
    (unit,) = recorder.units.values()
    broken = cuda_compile.Unit("broken", unit.source.replace("\n}\n\n} // namespace", "\nundeclared = 1;\n}\n\n} //"))
    good, bad = cuda_compile.compile_sources([unit, broken], MLX_INCLUDE, jobs=2)
    assert good.ok and good.registers > 0 and good.spill_bytes == 0 and good.shared_bytes >= 512 * 2 and good.fits
    assert not bad.ok and '"undeclared" is undefined' in bad.error
