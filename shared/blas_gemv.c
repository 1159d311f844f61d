/* cblas_sgemm with one output row (or column) answered by cblas_sgemv.
 *
 * MLX's CPU backend runs every float32 matmul through cblas_sgemm, also a decode step's
 * [1, in] @ [in, out] projections, where OpenBLAS's sgemm (0.3.21 of Debian 12; 0.3.34 alike)
 * runs its packing GEMM path: on 2 cores all of SmolLM2-135M's projections took 36.8 ms a token
 * through sgemm and 21.5 ms through sgemv (shared/blas.py, README "CPU speed"). Preloaded ahead of the
 * BLAS, this library takes cblas_sgemm's symbol, sends m == 1 or n == 1 row-major calls to the
 * next library's cblas_sgemv and everything else to its cblas_sgemm, unchanged.
 *
 * A GEMM of one row computes each output as a dot product of length k, as sgemv does, so only
 * the order of the k-term sums may differ (float32 rounding). With beta == 0, sgemv sets the
 * output without reading it (the reference BLAS's rule, OpenBLAS's too), as MLX's uninitialized
 * output buffers need.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float,
                         float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int, float, float *, int);

static sgemm_fn next_sgemm;
static sgemv_fn next_sgemv;

/* The next library's functions, looked up at the first call (a race only stores the same values). */
static sgemm_fn resolve(void) {
  sgemm_fn gemm = __atomic_load_n(&next_sgemm, __ATOMIC_ACQUIRE);
  if (gemm) return gemm;
  __atomic_store_n(&next_sgemv, (sgemv_fn)dlsym(RTLD_NEXT, "cblas_sgemv"), __ATOMIC_RELEASE);
  gemm = (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm");
  if (!gemm) abort(); /* preloaded without any BLAS behind it */
  __atomic_store_n(&next_sgemm, gemm, __ATOMIC_RELEASE);
  return gemm;
}

/* c = alpha * op(a) @ op(b) + beta * c, op(a) [m, k], op(b) [k, n], c [m, n] (row-major). */
void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha, const float *a, int lda,
                 const float *b, int ldb, float beta, float *c, int ldc) {
  sgemm_fn gemm = resolve();
  sgemv_fn gemv = __atomic_load_n(&next_sgemv, __ATOMIC_ACQUIRE);
  if (order != ROW_MAJOR || !gemv || m < 1 || n < 1 || k < 1 || (m > 1 && n > 1)) {
    gemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  if (m == 1) { /* c[n] = op(b)^T @ a[k]: a's k values lie 1 apart, or lda apart when a is [k, 1] */
    int inc_a = trans_a == TRANS ? lda : 1;
    if (trans_b == TRANS) /* b is [n, k] */
      gemv(ROW_MAJOR, NO_TRANS, n, k, alpha, b, ldb, a, inc_a, beta, c, 1);
    else /* b is [k, n] */
      gemv(ROW_MAJOR, TRANS, k, n, alpha, b, ldb, a, inc_a, beta, c, 1);
    return;
  }
  /* n == 1: c[m] (ldc apart) = op(a) @ b[k]; b's k values lie ldb apart, or 1 apart when b is [1, k] */
  int inc_b = trans_b == TRANS ? 1 : ldb;
  if (trans_a == TRANS) /* a is [k, m] */
    gemv(ROW_MAJOR, TRANS, k, m, alpha, a, lda, b, inc_b, beta, c, ldc);
  else /* a is [m, k] */
    gemv(ROW_MAJOR, NO_TRANS, m, k, alpha, a, lda, b, inc_b, beta, c, ldc);
}
