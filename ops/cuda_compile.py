"""Compile buttermilk's CUDA kernels without a GPU: every instantiation a test run launches, through `nvcc`.

MLX's CUDA backend compiles a custom kernel (`mx.fast.cuda_kernel`) at its first launch, on the GPU host
(NVRTC). Where no GPU is at hand, this module stands in for that backend: under `compile_only()` the kernels
believe CUDA is the default device, each launch records the translation unit MLX would build for it
(`kernel_source`: MLX's default header, the kernel's header, its signature from the inputs' dtypes and the
shape arguments the source names, the template constants, the body) and returns zeros of the output shapes,
so the Python around the kernels runs on. `compile_sources` then compiles each distinct unit with `nvcc`
for the H200 (`sm_90a`, as MLX targets it) and reports errors, registers, spills and shared memory per
kernel (ptxas's report). Outputs are zeros, so what a test asserts of values means nothing here: this
checks that code compiles and how heavy it is, not what it computes.

    python -m ops.cuda_compile --mlx-include /path/to/mlx-src -- tests/test_qkv_rope.py -k store

runs the given pytest arguments under `compile_only()` (the GPU tests then take their CUDA branches),
compiles what they launched and prints JSON (`--out` also writes it); exit status 1 if any unit failed or
needs more registers at its launch's block size than an SM has.
`--mlx-include` is a folder holding `mlx/backend/cuda/device/utils.cuh` (an MLX source checkout: the CUDA
wheel carries these headers inside its library, not as files). Needs the CUDA toolkit's `nvcc` (12.8 or
newer for sm_90a's features the tensor-core kernel uses). Not a test.

Source: MLX's `mlx/backend/cuda/custom_kernel.cpp` (`build_kernel`, the unit mirrored) and
`mlx/backend/cuda/jit_module.cpp` (its NVRTC options).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx

from kernels import cuda_kv

# MLX's `default_header` of a CUDA custom kernel.
DEFAULT_HEADER = """
#include "mlx/backend/cuda/device/utils.cuh"

#include <cooperative_groups.h>

#define inf cuda::std::numeric_limits<float>::infinity()

"""

CUDA_TYPES = {mx.bool_: "bool", mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t",
              mx.uint64: "uint64_t", mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t",
              mx.int64: "int64_t", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.float32: "float",
              mx.float64: "double"}


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
            suffix += "_" + str(value).rsplit(".", 1)[-1]
    kernel = f"custom_kernel_{name}{suffix.replace('-', '_')}"
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
            if len(inputs) != len(input_names) or len(output_shapes) != len(output_names):
                raise ValueError(f"{name}: {len(inputs)} inputs for {input_names}, {len(output_shapes)} outputs "
                                 f"for {output_names}")
            if any(t > 1024 for t in threadgroup) or threadgroup[0] * threadgroup[1] * threadgroup[2] > 1024:
                raise ValueError(f"{name}: a block of {threadgroup} threads is over CUDA's 1,024")
            unit = kernel_source(name, header, source, list(input_names), list(inputs), list(output_names),
                                 list(output_dtypes), list(template or []))
            recorder.add(Unit(unit.name, unit.source, threadgroup[0] * threadgroup[1] * threadgroup[2]))
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


@dataclass(frozen=True, slots=True)
class Compiled:
    """What `nvcc` said of one unit: ok, and per ptxas's report registers (a thread's), spill bytes (stores +
    loads) and static shared memory (bytes); `fits`: a block of the unit's threads gets its registers from one
    SM's 65,536 (a warp's allocated in 256s), else its launch fails ("too many resources requested"); `error`
    the compiler's output where it failed."""

    name: str
    ok: bool
    registers: int | None = None
    spill_bytes: int | None = None
    shared_bytes: int | None = None
    fits: bool | None = None
    error: str = ""


_PTXAS = re.compile(r"Used (\d+) registers")
SM_REGISTERS = 65536  # 32-bit registers of an SM (H200, every GPU since compute capability 5.0)
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def compile_unit(unit: Unit, mlx_include: Path, nvcc: str = "nvcc", arch: str = "sm_90a") -> Compiled:
    """Compile one unit to a cubin with `nvcc` (relocatable device code off, C++17, as MLX's NVRTC call
    targets `arch`).

    Raises:
        FileNotFoundError: `nvcc` is not found.
    """
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"{unit.name}.cu"
        path.write_text(unit.source)
        run = subprocess.run([nvcc, "-std=c++17", f"-arch={arch}", "--cubin", "-Xptxas", "-v",
                              f"-I{mlx_include}", "-o", str(Path(folder) / "unit.cubin"), str(path)],
                             capture_output=True, text=True)
    log = run.stdout + run.stderr
    if run.returncode:
        return Compiled(unit.name, False, error=log.strip()[-4000:])
    used, spill, smem = _PTXAS.search(log), _SPILL.search(log), re.search(r"(\d+) bytes smem", log)
    registers = int(used.group(1)) if used else None
    fits = None if registers is None or not unit.threads else block_registers(registers, unit.threads) <= SM_REGISTERS
    return Compiled(unit.name, True, registers, sum(map(int, spill.groups())) if spill else None,
                    int(smem.group(1)) if smem else 0, fits)


def block_registers(registers: int, threads: int) -> int:
    """Registers a block of `threads` takes of an SM's file: each warp's 32 x `registers`, rounded up to 256."""
    return -(-threads // 32) * -(-registers * 32 // 256) * 256


def compile_sources(units: list[Unit], mlx_include: Path, jobs: int = os.cpu_count() or 1) -> list[Compiled]:
    """`compile_unit` of each unit, `jobs` at a time, in the units' order."""
    with ThreadPoolExecutor(jobs) as pool:
        return list(pool.map(lambda u: compile_unit(u, mlx_include), units))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mlx-include", type=Path, required=True,
                        help="a folder holding mlx/backend/cuda/device/utils.cuh (an MLX source checkout)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path)
    parser.add_argument("pytest_args", nargs="+", help="after --: what pytest runs (files, -k ...)")
    args = parser.parse_args()
    if not (args.mlx_include / "mlx/backend/cuda/device/utils.cuh").is_file():
        parser.error(f"{args.mlx_include} holds no mlx/backend/cuda/device/utils.cuh")
    if shutil.which("nvcc") is None:
        parser.error("nvcc is not on the PATH (the CUDA toolkit)")
    import pytest

    with compile_only() as recorder:
        pytest.main(["-q", "--tb=no", "-rN", "-p", "no:cacheprovider", *args.pytest_args])  # outcomes: zeros
    units = list(recorder.units.values())
    print(f"compiling {len(units)} units", file=sys.stderr)
    results = compile_sources(units, args.mlx_include, args.jobs)
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
