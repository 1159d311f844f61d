"""Use Debian's OpenBLAS in place of the reference BLAS that MLX's Linux CPU wheel bundles.

MLX's CPU backend runs float32 matmuls through BLAS; the wheel ships netlib's reference
BLAS. Preloading OpenBLAS (`apt-get install libopenblas0-pthread`) makes the dynamic
linker resolve `sgemm_` and friends to it: measured here on 2 cores, a 576x576x512
float32 matmul went from 5.8 to 143 GFLOP/s. The library must be preloaded before the
process starts, so the CLI re-executes itself once with `LD_PRELOAD` set; child
processes inherit it. Set `BUTTERMILK_OPENBLAS=0` to opt out.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
)


def openblas_path() -> str | None:
    """Path of an installed OpenBLAS shared library, or `None`."""
    return next((p for p in CANDIDATES if Path(p).exists()), None)


def active_blas() -> str:
    """`"openblas"` when this process was started with OpenBLAS preloaded, else `"bundled"`."""
    lib = openblas_path()
    return "openblas" if lib and lib in os.environ.get("LD_PRELOAD", "") else "bundled"


def reexec_with_openblas(module: str) -> None:
    """Re-execute `python -m module argv...` with OpenBLAS preloaded, when useful.

    Returns without doing anything off Linux, when opted out, when OpenBLAS is not
    installed, or when it is already preloaded. Must run before `mlx` is imported.
    """
    lib = openblas_path()
    preload = os.environ.get("LD_PRELOAD", "")
    if sys.platform != "linux" or os.environ.get("BUTTERMILK_OPENBLAS") == "0" or lib is None or lib in preload:
        return
    if "mlx.core" in sys.modules:
        return  # too late for this process; children still get it via the environment
    env = dict(os.environ, LD_PRELOAD=f"{lib}:{preload}" if preload else lib)
    os.execve(sys.executable, [sys.executable, "-m", module, *sys.argv[1:]], env)
