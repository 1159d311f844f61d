"""The one-row GEMM routing (`shared/blas_gemv.c`) and how `shared.blas` builds and preloads it.

A preloaded library only takes effect in a process started with it, so each numeric check runs a
child Python with `LD_PRELOAD` set and compares against float64 NumPy computed here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from shared import blas

pytestmark = pytest.mark.skipif(sys.platform != "linux" or not (shutil.which("cc") or shutil.which("gcc")),
                                reason="the GEMV shim is built by a C compiler on Linux; none here")


@pytest.fixture(scope="module")
def shim(tmp_path_factory) -> str:
    data = tmp_path_factory.mktemp("data")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BUTTERMILK_DATA_DIR", str(data))
        mp.delenv("BUTTERMILK_BLAS_GEMV", raising=False)
        path = blas.gemv_shim_path()
    assert path is not None and path.startswith(str(data))
    return path


def run_child(code: str, preload: list[str]) -> dict:
    env = dict(os.environ, LD_PRELOAD=":".join(preload))
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# Direct cblas_sgemm calls through the global symbol (the shim's when preloaded), every layout it routes:
# (m, n, k, trans_a, trans_b, lda pad, ldb pad, ldc pad, alpha, beta). Outputs start as NaN.
CASES = [
    (1, 37, 19, False, True, 0, 0, 0, 1.0, 0.0),  # x @ W.T: a decode step's projection
    (1, 37, 19, False, False, 0, 3, 0, 1.0, 0.0),  # x @ W, W [k, n] with padded rows
    (1, 37, 19, True, True, 2, 1, 0, 0.5, 0.0),  # a [k, 1] with lda 3
    (1, 37, 19, False, True, 0, 0, 0, 2.0, 0.75),  # c = 2 a @ b + 0.75 c
    (23, 1, 19, False, False, 4, 2, 4, 1.0, 0.0),  # one output column, c rows ldc apart
    (23, 1, 19, True, True, 1, 0, 2, 1.0, -1.5),
    (1, 1, 19, False, False, 0, 0, 0, 1.0, 0.0),  # a dot product
    (3, 5, 7, False, True, 0, 0, 0, 1.0, 0.0),  # a GEMM proper, passed through
]

DIRECT = """
    import ctypes, json, numpy as np
    cases, blas_lib = {cases!r}, {blas_lib!r}
    P = ctypes.POINTER(ctypes.c_float)
    ptr = lambda x: x.ctypes.data_as(P)
    sgemm = ctypes.CDLL(None).cblas_sgemm
    gemv = ctypes.CDLL(blas_lib).cblas_sgemv
    rng = np.random.default_rng(0)
    results = []
    for m, n, k, ta, tb, pa, pb, pc, alpha, beta in cases:
        a = rng.standard_normal((k, m + pa) if ta else (m, k + pa), dtype=np.float32)
        b = rng.standard_normal((n, k + pb) if tb else (k, n + pb), dtype=np.float32)
        c0 = rng.standard_normal((m, n + pc), dtype=np.float32)
        c = c0.copy()
        if beta == 0.0:
            c[:] = np.nan
        sgemm(101, 112 if ta else 111, 112 if tb else 111, m, n, k, ctypes.c_float(alpha), ptr(a), a.shape[1],
              ptr(b), b.shape[1], ctypes.c_float(beta), ptr(c), c.shape[1])
        via_gemv = None
        if m == 1 and n > 1 and not ta and tb and beta == 0.0:  # the routed call, made by hand
            y = np.zeros(n, np.float32)
            gemv(101, 111, n, k, ctypes.c_float(alpha), ptr(b), b.shape[1], ptr(a), 1, ctypes.c_float(0.0), ptr(y), 1)
            via_gemv = y.tolist()
        results.append(dict(a=a.tolist(), b=b.tolist(), c0=c0.tolist(), c=c.tolist(), via_gemv=via_gemv))
    print(json.dumps(results))
"""


def reference(case, a, b, c0) -> np.ndarray:
    m, n, k, ta, tb, _, _, _, alpha, beta = case
    a, b, c0 = (np.asarray(x, np.float64) for x in (a, b, c0))
    op_a = a[:k, :m].T if ta else a[:m, :k]
    op_b = b[:n, :k].T if tb else b[:k, :n]
    return alpha * op_a @ op_b + beta * c0[:, :n]


@pytest.mark.parametrize("behind", ["bundled", "openblas"])
def test_routed_sgemm_equals_float64_and_is_gemv(shim, behind):
    """Every routed layout (one row, one column, transposed, padded, alpha and beta) equals float64 NumPy
    within float32 rounding, a NaN left in the output is overwritten when beta is 0, and a one-row
    sgemm is the BLAS's sgemv bit for bit (so the call was routed)."""
    if behind == "openblas":
        lib = blas.openblas_path()
        if lib is None:
            pytest.skip("Debian's OpenBLAS (libopenblas0-pthread) is not installed")
        preload = [shim, lib]
    else:
        import glob

        import mlx

        libs = glob.glob(os.path.join(os.path.dirname(mlx.__path__[0]), "mlx_cpu.libs", "libblas-*.so*"))
        if not libs:
            pytest.skip("this MLX wheel bundles no reference BLAS (not the Linux CPU wheel)")
        lib, preload = libs[0], [shim, libs[0]]
    results = run_child(DIRECT.format(cases=CASES, blas_lib=lib), preload)
    for case, got in zip(CASES, results):
        want = reference(case, got["a"], got["b"], got["c0"])
        m, n = case[0], case[1]
        out = np.asarray(got["c"], np.float64)[:, :n]
        assert np.all(np.isfinite(out)), case
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(), err_msg=str(case))
        if got["via_gemv"] is not None:
            assert np.array_equal(np.asarray(got["c"], np.float32)[0, :n], np.asarray(got["via_gemv"], np.float32))


MLX_MATMULS = """
    import json, numpy as np, mlx.core as mx
    rng = np.random.default_rng(1)
    f = lambda *s: rng.standard_normal(s, dtype=np.float32)
    x, w, wt, col = f(1, 48), f(40, 48), f(48, 40), f(48, 1)
    q, k, c = f(2, 3, 1, 16), f(2, 3, 33, 16), f(1, 40)
    cases = {
        "x @ w.T": (x @ w.T, mx.array(x) @ mx.array(w).T),
        "x @ wt": (x @ wt, mx.array(x) @ mx.array(wt)),
        "w @ col": (w @ col, mx.array(w) @ mx.array(col)),
        "wt.T @ col": (wt.T @ col, mx.array(wt).T @ mx.array(col)),
        "heads q @ k^T": (q @ k.transpose(0, 1, 3, 2), mx.array(q) @ mx.array(k).transpose(0, 1, 3, 2)),
        "addmm": (0.5 * c + 2.0 * (x @ w.T), mx.addmm(mx.array(c), mx.array(x), mx.array(w).T, alpha=2.0, beta=0.5)),
    }
    print(json.dumps({name: float(np.abs(np.array(got) - want.astype(np.float64)).max() / np.abs(want).max())
                      for name, (want, got) in cases.items()}))
"""


def test_mlx_matmuls_through_the_shim(shim):
    """MLX's CPU matmuls of one row or column (projections, per-head attention scores, addmm) keep their values
    when preloaded with the shim (and OpenBLAS where installed): the strides MLX passes map to the right GEMV.
    NumPy's float32 matmul is the reference, compared at float32 rounding."""
    preload = [shim] + ([blas.openblas_path()] if blas.openblas_path() else [])
    errors = run_child(MLX_MATMULS, preload)
    assert errors and all(err < 1e-5 for err in errors.values()), errors


def test_built_once_per_source_then_reused(tmp_path, monkeypatch):
    """The library is compiled once into the data folder (named by the source's hash) and found there
    afterwards without a compiler; no compiler and nothing built gives None, as does opting out."""
    monkeypatch.setenv("BUTTERMILK_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("BUTTERMILK_BLAS_GEMV", raising=False)
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert blas.gemv_shim_path() is None  # the compiler fails: nothing built, nothing half-written
    assert not any((tmp_path / "blas").glob("*"))
    monkeypatch.delenv("CC")
    built = blas.gemv_shim_path()
    assert built is not None and os.path.dirname(built) == str(tmp_path / "blas")
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert blas.gemv_shim_path() == built  # found, not rebuilt
    monkeypatch.setenv("BUTTERMILK_BLAS_GEMV", "0")
    assert blas.gemv_shim_path() is None


def test_preloads_put_the_shim_first(tmp_path, monkeypatch):
    """With OpenBLAS installed the shim goes ahead of it (the dynamic linker takes the first definition);
    `BUTTERMILK_OPENBLAS=0` preloads nothing; without OpenBLAS nothing is preloaded."""
    monkeypatch.setenv("BUTTERMILK_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("BUTTERMILK_BLAS_GEMV", raising=False)
    monkeypatch.delenv("BUTTERMILK_OPENBLAS", raising=False)
    monkeypatch.setattr(blas, "openblas_path", lambda: "/opt/libopenblas.so.0")
    libs = blas.preloads()
    assert len(libs) == 2 and libs[0] == blas.gemv_shim_path() and libs[1] == "/opt/libopenblas.so.0"
    monkeypatch.setenv("LD_PRELOAD", ":".join(libs))
    assert blas.active_blas() == "openblas+gemv"
    monkeypatch.setenv("LD_PRELOAD", libs[1])
    assert blas.active_blas() == "openblas"
    monkeypatch.setenv("LD_PRELOAD", "")
    assert blas.active_blas() == "bundled"
    monkeypatch.setenv("BUTTERMILK_OPENBLAS", "0")
    assert blas.preloads() == []
    monkeypatch.delenv("BUTTERMILK_OPENBLAS")
    monkeypatch.setattr(blas, "openblas_path", lambda: None)
    assert blas.preloads() == []


def test_a_folder_others_may_write_holds_no_library(tmp_path, monkeypatch):
    """Every process preloads the library, so a `blas` folder writable by others is refused: nothing is built or
    used there (the rule of `shared.paths.private_folder`, as for kernel sources)."""
    monkeypatch.setenv("BUTTERMILK_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("BUTTERMILK_BLAS_GEMV", raising=False)
    (tmp_path / "blas").mkdir(mode=0o700)
    os.chmod(tmp_path / "blas", 0o777)
    assert blas.gemv_shim_path() is None
    assert not any((tmp_path / "blas").iterdir())
