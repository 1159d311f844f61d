"""Use Debian's OpenBLAS in place of the reference BLAS that MLX's Linux CPU wheel bundles.

MLX's CPU backend runs float32 matmuls through BLAS; the wheel ships netlib's reference
BLAS. Preloading OpenBLAS (`apt-get install libopenblas0-pthread`) makes the dynamic
linker resolve `cblas_sgemm` and friends to it: measured here on 2 cores, a 576x576x512
float32 matmul went from 5.8 to 143 GFLOP/s. Ahead of it goes `blas_gemv.c`, compiled
once into the data folder with the system's C compiler: it answers GEMMs of one row, a
decode step's projections, with OpenBLAS's GEMV (SmolLM2's projections 36.8 → 21.5 ms a
token). Libraries must be preloaded before the process starts, so the CLI re-executes
itself once with `LD_PRELOAD` set; child processes inherit it. `BUTTERMILK_OPENBLAS=0`
opts out of both, `BUTTERMILK_BLAS_GEMV=0` out of the GEMV routing alone.

    python -m shared.blas    # prints the LD_PRELOAD value (what `make test` runs under)
"""

from __future__ import annotations

import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from shared.paths import data_dir, private_folder

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
)
GEMV_SOURCE = Path(__file__).with_name("blas_gemv.c")
COMPILE_TIMEOUT_S = 60.0


def openblas_path() -> str | None:
    """Path of an installed OpenBLAS shared library, or `None`."""
    return next((p for p in CANDIDATES if Path(p).exists()), None)


def gemv_shim_path() -> str | None:
    """Path of the compiled `blas_gemv.c`, built on first use, or `None` where it cannot be.

    The library lives in `data_dir()/blas/`, named by the source's hash and the machine, and is
    compiled with `$CC` (else `cc`, `gcc`), written to a temporary name and renamed into place, so
    processes racing to build it each see a whole file. Every process preloads it, so the folder
    must be this user's alone (`shared.paths.private_folder`). `None` when opted out
    (`BUTTERMILK_BLAS_GEMV=0`), off Linux, or when no compiler, build or private folder serves.
    """
    if sys.platform != "linux" or os.environ.get("BUTTERMILK_BLAS_GEMV") == "0":
        return None
    digest = hashlib.sha256(GEMV_SOURCE.read_bytes()).hexdigest()[:16]
    try:
        folder = data_dir() / "blas"
    except RuntimeError:  # no home folder
        return None
    if not private_folder(folder):  # every process preloads what lies here: only this user may write it
        return None
    target = folder / f"libbuttermilk_gemv-{digest}-{platform.machine()}.so"
    if target.exists():
        return str(target)
    cc = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc")]
    if cc[0] is None:
        return None
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    try:
        subprocess.run([*cc, "-O2", "-shared", "-fPIC", "-o", str(partial), str(GEMV_SOURCE), "-ldl"],
                       check=True, capture_output=True, timeout=COMPILE_TIMEOUT_S)
        os.replace(partial, target)
    except (OSError, subprocess.SubprocessError):
        partial.unlink(missing_ok=True)
        return None
    return str(target)


def preloads() -> list[str]:
    """The libraries to preload, in order: the GEMV shim (when it builds) and OpenBLAS; none without
    OpenBLAS (the bundled reference BLAS gains nothing from the shim) or when opted out."""
    if sys.platform != "linux" or os.environ.get("BUTTERMILK_OPENBLAS") == "0":
        return []
    lib = openblas_path()
    if lib is None:
        return []
    shim = gemv_shim_path()
    return [shim, lib] if shim else [lib]


def active_blas() -> str:
    """What this process's float32 matmuls run on: `"openblas+gemv"` (both preloaded), `"openblas"`, or
    `"bundled"` (MLX's reference BLAS)."""
    preloaded = os.environ.get("LD_PRELOAD", "")
    lib = openblas_path()
    if not lib or lib not in preloaded:
        return "bundled"
    return "openblas+gemv" if "libbuttermilk_gemv-" in preloaded else "openblas"


def reexec_with_blas(module: str) -> None:
    """Re-execute `python -m module argv...` with `preloads()` preloaded, when useful.

    Returns without doing anything off Linux, when opted out, when OpenBLAS is not installed,
    or when every library is already preloaded. Must run before `mlx` is imported.
    """
    if "mlx.core" in sys.modules:
        return  # too late for this process
    preload = os.environ.get("LD_PRELOAD", "")
    missing = [lib for lib in preloads() if lib not in preload]
    if not missing:
        return
    env = dict(os.environ, LD_PRELOAD=":".join([*missing, preload] if preload else missing))
    os.execve(sys.executable, [sys.executable, "-m", module, *sys.argv[1:]], env)


if __name__ == "__main__":
    print(":".join(preloads()))
