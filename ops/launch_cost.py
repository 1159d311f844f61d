"""Host time of one custom-kernel launch by how its source reaches MLX: inline text of a size, or an `#include` line.

MLX hashes a custom kernel's whole source at every launch (`CustomKernel::eval_gpu`); `kernels.cuda_kv.custom_kernel`
hands it `#include` lines instead (`kernels.cuda_kv.source_file`). This launches one trivial kernel (one thread
copies a float) `--launches` times, each evaluated with `mx.async_eval` (MLX builds and launches it, nothing waits),
for sources of each `--sizes` bytes inline (the same code and a comment of that length) and as an include line, in
alternating rounds; reports the median host µs per launch of each. Each call here also has MLX build the
kernel's source string (a replayed `mx.compile` trace, as the engine's decode step, does not), so an inline
source pays its length twice. Needs MLX's CUDA backend.

    python -m ops.launch_cost --sizes 2000,16000 --launches 4000 --rounds 5

Prints JSON; `--out` also writes it. Not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx

from kernels import cuda_kv

_BODY = "if (threadIdx.x == 0) out[0] = x[0];\n"


def host_us_per_launch(kernel, x: mx.array, launches: int) -> float:
    """Host µs per launch of `kernel` on `x`, each launch evaluated alone and not waited for."""
    mx.synchronize()
    start = time.perf_counter()
    for _ in range(launches):
        (y,) = kernel(inputs=[x], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(1,)],
                      output_dtypes=[mx.float32])
        mx.async_eval(y)
    seconds = time.perf_counter() - start
    mx.synchronize()
    return seconds / launches * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2000,16000", type=lambda s: [int(x) for x in s.split(",")],
                        help="inline source sizes (bytes)")
    parser.add_argument("--launches", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not cuda_kv.is_available():
        parser.error("needs MLX's CUDA backend")
    kernels = {}
    for size in args.sizes:
        text = _BODY + "// " + "x" * max(size - len(_BODY) - 4, 0) + "\n"
        kernels[f"inline_{size}"] = mx.fast.cuda_kernel(name=f"bm_cost_{size}", input_names=["x"],
                                                        output_names=["out"], source=text)
        kernels[f"include_{size}"] = mx.fast.cuda_kernel(name=f"bm_cost_inc_{size}", input_names=["x"],
                                                         output_names=["out"], source=cuda_kv.source_file(text))
    x = mx.ones((1,), mx.float32)
    for kernel in kernels.values():  # compile, warm the allocator
        host_us_per_launch(kernel, x, 100)
    runs = {name: [] for name in kernels}
    for _ in range(args.rounds):
        for name, kernel in kernels.items():
            runs[name].append(host_us_per_launch(kernel, x, args.launches))
    result = {"launches": args.launches, "rounds": args.rounds,
              "host_us_per_launch_median": {k: round(statistics.median(v), 3) for k, v in runs.items()},
              "runs": {k: [round(u, 3) for u in v] for k, v in runs.items()}}
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
