"""NVRTC, the compiler MLX's CUDA backend runs at a custom kernel's first launch, called here as MLX calls it.

MLX compiles each kernel's source with `nvrtcCompileProgram` and the options of its
`mlx/backend/cuda/jit_module.cpp`: `--device-as-default-execution-space` (a function without `__device__`
is a device function) and `--gpu-architecture=sm_<cc>a` for a GPU of compute capability 9 or more (`sm_90a`
on the H200), with include paths to MLX's headers and CUDA's. This module does the same through `ctypes`
on any machine (NVRTC needs no GPU), adds `--ptxas-options=-v`, and reads registers, spills and shared
memory from the compiler's log. The library comes from the `nvidia-cuda-nvrtc` wheel
(`pip install nvidia-cuda-nvrtc`), the system's, or a CUDA toolkit's.

Source: NVIDIA, "NVRTC" (CUDA 13 documentation); MLX's `jit_module.cpp` (the options).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

MLX_OPTIONS = ("--device-as-default-execution-space",)  # jit_module.cpp's, beside the architecture and includes
SM_REGISTERS = 65536  # 32-bit registers of an SM (the H200's; every GPU since compute capability 5.0)
SUB_PARTITIONS = 4  # an SM's warp schedulers, each with a quarter of the registers


@dataclass(frozen=True, slots=True)
class Compiled:
    """What NVRTC said of one kernel: ok, and per ptxas's report registers (a thread's), spill bytes (stores +
    loads) and static shared memory (bytes); `threads` of its block at launch and `fits`: the block gets its
    registers from one SM (`fits`), else its launch fails ("too many resources requested");
    `error`: the compiler's log where it failed."""

    name: str
    ok: bool
    threads: int = 0
    registers: int | None = None
    spill_bytes: int | None = None
    shared_bytes: int | None = None
    fits: bool | None = None
    error: str = ""


def find_library(path: str | os.PathLike | None = None) -> Path:
    """libnvrtc: `path`, else the `nvidia-cuda-nvrtc` wheel's on `sys.path`, else the system's, else a CUDA
    toolkit's under /usr/local/cuda.

    Raises:
        FileNotFoundError: none of these exists.
    """
    if path is not None:
        if not Path(path).is_file():
            raise FileNotFoundError(f"no NVRTC library at {path}")
        return Path(path)
    wheels = ("nvidia/cu*/lib/libnvrtc.so.*", "nvidia/cuda_nvrtc/lib/libnvrtc.so.*")  # CUDA 13's layout, 12's
    found = [f for entry in sys.path for pattern in wheels for f in sorted(glob.glob(os.path.join(entry, pattern)))
             if "builtins" not in f and ".alt." not in f]
    system = ctypes.util.find_library("nvrtc")
    found += [system] if system else []
    found += sorted(glob.glob("/usr/local/cuda/lib64/libnvrtc.so*"))
    if not found:
        raise FileNotFoundError("NVRTC not found: pip install nvidia-cuda-nvrtc, or pass its libnvrtc.so")
    return Path(found[0])


class Nvrtc:
    """NVRTC through `ctypes`: `compile` one source as MLX's backend does.

    Args:
        library (Path): libnvrtc (`find_library`).
        include_paths (list[Path]): `--include-path`s: MLX's headers (a folder holding
            `mlx/backend/cuda/device/utils.cuh`), CUDA's (`cuda_bf16.h`, ...) and CCCL's (`cuda/std/...`).
        arch (str): The target, `sm_90a` for the H200.

    Raises:
        OSError: the library cannot be loaded.
    """

    def __init__(self, library: Path, include_paths: list[Path], arch: str = "sm_90a"):
        for builtins in sorted(Path(library).parent.glob("libnvrtc-builtins.so.*")):  # NVRTC opens it by name
            if ".alt." not in builtins.name:
                ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
        self._lib = lib = ctypes.CDLL(str(library))
        ptr, size = ctypes.c_void_p, ctypes.c_size_t
        for name, args in (("nvrtcCreateProgram", [ctypes.POINTER(ptr), ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int,
                                                   ptr, ptr]),
                           ("nvrtcAddNameExpression", [ptr, ctypes.c_char_p]),
                           ("nvrtcCompileProgram", [ptr, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]),
                           ("nvrtcGetProgramLogSize", [ptr, ctypes.POINTER(size)]),
                           ("nvrtcGetProgramLog", [ptr, ctypes.c_char_p]),
                           ("nvrtcDestroyProgram", [ctypes.POINTER(ptr)])):
            getattr(lib, name).argtypes, getattr(lib, name).restype = args, ctypes.c_int
        self._options = [*MLX_OPTIONS, f"--gpu-architecture={arch}", *[f"--include-path={p}" for p in include_paths],
                         "--ptxas-options=-v"]

    def compile(self, name: str, source: str, kernel: str, threads: int = 0) -> Compiled:
        """Compile `source` (a translation unit) for the kernel `kernel` (its qualified name), as MLX does;
        `threads`: its block size at launch (0: unknown, `fits` None)."""
        lib, prog = self._lib, ctypes.c_void_p()
        if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None):
            raise RuntimeError("nvrtcCreateProgram failed")
        try:
            lib.nvrtcAddNameExpression(prog, kernel.encode())
            options = (ctypes.c_char_p * len(self._options))(*[o.encode() for o in self._options])
            status = lib.nvrtcCompileProgram(prog, len(self._options), options)
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            text = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, text)
            log = text.value.decode(errors="replace")
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))
        if status:
            return Compiled(name, False, threads, error=log.strip()[-4000:])
        used = re.search(r"Used (\d+) registers", log)
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
        smem = re.search(r"(\d+) bytes smem", log)
        registers = int(used.group(1)) if used else None
        fit = None if registers is None or not threads else fits(registers, threads)
        return Compiled(name, True, threads, registers, sum(map(int, spill.groups())) if spill else None,
                        int(smem.group(1)) if smem else 0, fit)


def fits(registers: int, threads: int) -> bool:
    """Whether a block of `threads` threads of `registers` registers each can launch on one SM."""
    return block_registers(registers, threads) <= SM_REGISTERS


def block_registers(registers: int, threads: int) -> int:
    """Registers a block of `threads` takes of an SM's file: a warp's 32 x `registers` rounded up to 256, and
    its warps spread over the SM's 4 schedulers, each holding a quarter of the file (so a block is charged
    whole rounds of 4 warps). Source: CUDA's `cuda_occupancy.h` (`cudaOccMaxBlocksPerSMRegsLimit`)."""
    warps = -(-threads // 32)
    return -(-warps // SUB_PARTITIONS) * SUB_PARTITIONS * -(-registers * 32 // 256) * 256
