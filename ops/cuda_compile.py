"""Compile buttermilk's CUDA kernels without a GPU: every instantiation a test run launches, through NVRTC.

MLX's CUDA backend compiles a custom kernel (`mx.fast.cuda_kernel`) at its first launch, on the GPU host,
with NVRTC. Where no GPU is at hand, this module stands in for that backend: under `compile_only()` the
kernels believe CUDA is the default device, each launch records the translation unit MLX would build for it
(`kernel_source`: MLX's default header, the kernel's header, its signature from the inputs' dtypes and the
shape arguments the source names, the template constants, the body) and its block size, and returns zeros of
the output shapes, so the Python around the kernels runs on. `compile_sources` then compiles each distinct
unit with NVRTC as MLX calls it (`ops.nvrtc`: its options, `sm_90a` for the H200) and reports errors,
registers, spills, shared memory and whether the block's registers fit an SM, per kernel. Outputs are zeros,
so what a test asserts of values means nothing here: this checks that code compiles and how heavy it is,
not what it computes.

    python -m ops.cuda_compile --mlx-include /path/to/mlx-src -- tests/test_qkv_rope.py -k store

runs the given pytest arguments under `compile_only()` (the GPU tests then take their CUDA branches),
compiles what they launched and prints JSON (`--out` also writes it); exit status 1 if any unit failed or
needs more registers at its launch's block size than an SM has, 2 if the tests launched none.
`--mlx-include` is a folder holding `mlx/backend/cuda/device/utils.cuh`: a checkout of MLX's source at the
version in use (the CUDA wheel carries these headers inside its library, not as files). NVRTC:
`pip install nvidia-cuda-nvrtc` (or `--nvrtc`); CUDA's headers: a CUDA toolkit's include folder
(`--cuda-include`). Not a test.

Source: MLX's `mlx/backend/cuda/custom_kernel.cpp` (`build_kernel`, the unit mirrored) and
`mlx/backend/cuda/jit_module.cpp` (its NVRTC options).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx

from kernels import cuda_kv
from ops import nvrtc

# MLX's `default_header` of a CUDA custom kernel (0.32.4's: no `inf` macro since 0.32.0).
DEFAULT_HEADER = """
#include "mlx/backend/cuda/device/utils.cuh"

#include <cooperative_groups.h>

"""

CUDA_TYPES = {mx.bool_: "bool", mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t",
              mx.uint64: "uint64_t", mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t",
              mx.int64: "int64_t", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.float32: "float",
              mx.float64: "double"}
# MLX's `get_type_string` (mlx/backend/common/compiled.cpp): a dtype template argument in a kernel's name.
TYPE_NAMES = {**CUDA_TYPES, mx.float16: "float16_t", mx.bfloat16: "bfloat16_t"}


@dataclass(frozen=True, slots=True)
class Unit:
    """One kernel instantiation as MLX would compile it.

    Attributes:
        name (str): MLX's kernel name (`custom_kernel_<name>` and the template arguments).
        source (str): The whole translation unit.
        threads (int): Threads of a block at its largest launch seen (0: not launched).
    """

    name: str
    source: str
    threads: int = 0


@dataclass
class Recorder:
    """The units launched under `compile_only()`, distinct by source."""

    units: dict[str, Unit] = field(default_factory=dict)

    def add(self, unit: Unit) -> None:
        key = hashlib.sha256(unit.source.encode()).hexdigest()
        seen = self.units.get(key)
        if seen is None or seen.threads < unit.threads:
            self.units[key] = unit


def kernel_source(name: str, header: str, source: str, input_names: list[str], inputs: list[mx.array],
                  output_names: list[str], output_dtypes: list[mx.Dtype], template: list[tuple]) -> Unit:
    """The translation unit MLX's CUDA backend builds for one launch of `mx.fast.cuda_kernel` (its
    `build_kernel`): an input's `_shape` / `_strides` / `_ndim` parameters where the source text holds them
    (and the input is not a scalar), template arguments as constants in the body.

    Raises:
        KeyError: an input or output dtype without a CUDA type here.
    """
    params = []
    for input_name, x in zip(input_names, inputs):
        params.append(f"    const {CUDA_TYPES[x.dtype]}* {input_name}")
        if x.ndim > 0:
            kinds = (("_shape", "Shape"), ("_strides", "Strides"), ("_ndim", "int"))
            params += [f"    const __grid_constant__ {kind} {input_name}{part}" for part, kind in kinds
                       if input_name + part in source]
    params += [f"    {CUDA_TYPES[dtype]}* {output_name}" for output_name, dtype in zip(output_names, output_dtypes)]
    constants, suffix = [], ""
    for arg_name, value in template:
        if isinstance(value, bool):
            constants.append(f"  constexpr bool {arg_name} = {'true' if value else 'false'};")
            suffix += "_t" if value else "_f"
        elif isinstance(value, int):
            constants.append(f"  constexpr int {arg_name} = {value};")
            suffix += f"_{value}"
        else:
            constants.append(f"  using {arg_name} = {CUDA_TYPES[value]};")
            suffix += f"_{TYPE_NAMES[value]}"
    kernel = f"custom_kernel_{name}{suffix}"  # as MLX names it: a negative int makes no identifier, nor compiles
    body = "\n".join(constants) + ("\n\n" if constants else "")
    text = (f"{DEFAULT_HEADER}{header}namespace mlx::core::cu {{\n\nnamespace cg = cooperative_groups;\n\n"
            f"__global__ void {kernel}(\n" + ",\n".join(params) + ") {\n" + body + source
            + "\n}\n\n} // namespace mlx::core::cu\n")
    return Unit(kernel, text)


def _fake_cuda_kernel(recorder: Recorder):
    def cuda_kernel(name, input_names, output_names, source, header="", ensure_row_contiguous=True,
                    shared_memory=0):
        def launch(*, inputs, output_shapes, output_dtypes, grid, threadgroup, template=None, init_value=None,
                   verbose=False, stream=None):
            if len(inputs) != len(input_names) or not len(output_shapes) == len(output_dtypes) == len(output_names):
                raise ValueError(f"{name}: {len(inputs)} inputs for {input_names}, {len(output_shapes)} output shapes "
                                 f"and {len(output_dtypes)} dtypes for {output_names}")
            if shared_memory:
                raise ValueError(f"{name}: dynamic shared memory is not modeled here")
            threads = math.prod(threadgroup)
            if threads > 1024:
                raise ValueError(f"{name}: a block of {threadgroup} threads is over CUDA's 1,024")
            unit = kernel_source(name, header, source, list(input_names), list(inputs), list(output_names),
                                 list(output_dtypes), list(template or []))
            recorder.add(Unit(unit.name, unit.source, threads))
            fill = 0 if init_value is None else init_value
            return [mx.full(tuple(shape), fill, dtype) for shape, dtype in zip(output_shapes, output_dtypes)]

        return launch

    return cuda_kernel


def _clear_kernel_caches() -> None:
    """Empty every `functools.cache` of the `kernels` modules (the built kernels, and constants)."""
    for name, module in list(sys.modules.items()):
        if name == "kernels" or name.startswith("kernels."):
            for value in list(vars(module).values()):
                if callable(getattr(value, "cache_clear", None)):
                    value.cache_clear()


@contextlib.contextmanager
def compile_only() -> Iterator[Recorder]:
    """Within: buttermilk's kernels take their CUDA branches on any device (`kernels.cuda_kv.is_available`
    says yes, compute capability 9), and every custom-kernel launch records its unit and returns zeros.
    The kernels' caches are emptied on entering and leaving, so no kernel built outside is launched inside,
    nor one built inside outside."""
    recorder = Recorder()
    saved = (mx.fast.cuda_kernel, cuda_kv.is_available, cuda_kv._compute_capability)
    _clear_kernel_caches()
    mx.fast.cuda_kernel = _fake_cuda_kernel(recorder)
    cuda_kv.is_available = lambda: True
    cuda_kv._compute_capability = lambda: 9
    try:
        yield recorder
    finally:
        mx.fast.cuda_kernel, cuda_kv.is_available, cuda_kv._compute_capability = saved
        _clear_kernel_caches()


def compile_sources(units: list[Unit], compiler: nvrtc.Nvrtc, jobs: int = os.cpu_count() or 1
                    ) -> list[nvrtc.Compiled]:
    """Each unit through `compiler` (NVRTC, as MLX calls it), `jobs` at a time, in the units' order."""

    def one(unit: Unit) -> nvrtc.Compiled:
        return compiler.compile(unit.name, unit.source, f"mlx::core::cu::{unit.name}", unit.threads)

    with ThreadPoolExecutor(jobs) as pool:  # ctypes lets go of the GIL during each compile
        return list(pool.map(one, units))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mlx-include", type=Path, required=True,
                        help="a folder holding mlx/backend/cuda/device/utils.cuh (an MLX source checkout)")
    parser.add_argument("--cuda-include", type=Path, default=Path("/usr/local/cuda/include"),
                        help="CUDA's headers (cuda_bf16.h; CCCL's in its cccl/ where that exists)")
    parser.add_argument("--nvrtc", help="libnvrtc.so (default: the nvidia-cuda-nvrtc wheel's, the system's, CUDA's)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path)
    parser.add_argument("pytest_args", nargs="+", help="after --: what pytest runs (files, -k ...)")
    args = parser.parse_args()
    if not (args.mlx_include / "mlx/backend/cuda/device/utils.cuh").is_file():
        parser.error(f"{args.mlx_include} holds no mlx/backend/cuda/device/utils.cuh")
    if not (args.cuda_include / "cuda_bf16.h").is_file():
        parser.error(f"{args.cuda_include} holds no cuda_bf16.h (--cuda-include)")
    try:
        library = nvrtc.find_library(args.nvrtc)
    except FileNotFoundError as exc:
        parser.error(str(exc))
    includes = [args.mlx_include, args.cuda_include] + [p for p in [args.cuda_include / "cccl"] if p.is_dir()]
    compiler = nvrtc.Nvrtc(library, includes)
    import pytest

    with compile_only() as recorder:
        status = pytest.main(["-q", "--tb=no", "-rN", "-p", "no:cacheprovider", *args.pytest_args])  # outcomes: zeros
    units = list(recorder.units.values())
    if status not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED) or not units:
        parser.error(f"pytest ran no kernel (exit {int(status)}, {len(units)} units): check the paths and -k")
    print(f"compiling {len(units)} units with {library}", file=sys.stderr)
    results = compile_sources(units, compiler, args.jobs)
    report = {"units": len(results), "failed": sum(not r.ok for r in results),
              "over_registers": sum(r.fits is False for r in results),
              "kernels": [asdict(r) for r in results]}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    sys.exit(1 if report["failed"] or report["over_registers"] else 0)


if __name__ == "__main__":
    main()
