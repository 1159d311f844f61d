"""Count the primitives of one engine decode step (the graph the host launches per token).

MLX spends host time on every primitive it evaluates, and on the CUDA backend most of it on
those that launch a kernel; a decode step near the GPU's pace needs few of them. This builds
an engine, lets it reach decode, and exports the graph of one decode step (`mx.export_to_dot`,
taken when the runner launches it), then counts primitives by kind. View-only primitives
(reshape, transpose, slice, broadcast, …) are counted apart: they launch no kernel.

    python -m ops.step_ops                              # CPU, the default model
    python -m ops.step_ops --random-model llama-1b      # GPU, Llama-3.2-1B shape, bf16
    python -m ops.step_ops --step 1 --dot step.dot      # a window's second step; its graph as dot

Prints JSON (not a test).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import tempfile
from pathlib import Path

import mlx.core as mx

VIEWS = {"Reshape", "Transpose", "Slice", "ExpandDims", "Squeeze", "Broadcast", "Flatten", "Unflatten",
         "AsStrided", "Split", "View", "StopGradient", "Depends"}


def count_graph(outputs: list[mx.array], dot: str | None = None) -> dict:
    """Primitives of the graph behind `outputs` (unevaluated), by kind; `dot`: also keep the graph there."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(dot or Path(tmp) / "step.dot")
        mx.export_to_dot(str(path), *outputs)
        labels = re.findall(r'\[label\s*=\s*"?([A-Za-z][^",\]]*)', path.read_text())
    kinds = collections.Counter(label.split()[0] for label in labels)
    views = sum(n for kind, n in kinds.items() if kind in VIEWS)
    return {"primitives": sum(kinds.values()), "kernels": sum(kinds.values()) - views, "views": views,
            "by_kind": dict(kinds.most_common())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--random-model", help="a model of ops.bench_kv.RANDOM_MODELS (random weights)")
    parser.add_argument("--kv-cache", default="raw")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--step", type=int, default=0,
                        help="which step of the window (0: the first, which also copies the tail pages in)")
    parser.add_argument("--dot", help="also write that step's graph here (mx.export_to_dot)")
    args = parser.parse_args()
    from services.engine.cache import CacheOptions
    from services.engine.core import EngineCore
    from services.engine.request import Request
    from shared.protocol import SamplingParams
    from services.engine import runner as runner_module

    loaded = _load(args.random_model)
    core = EngineCore(loaded, CacheOptions(scheme=args.kv_cache, max_context=1024), capacity_tokens=1024 * args.batch,
                      max_slots=args.batch, step_token_budget=max(64, args.batch))
    for i in range(args.batch):
        core.add_request(Request(str(i), [1, 2, 3, 4], SamplingParams(max_tokens=200)))
    for _ in range(3):
        core.step()
    seen, calls = [], [0]
    real = runner_module.mx

    class Spy:  # the runner's `mx`, recording the `--step`-th step's graph of the window before it launches
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def async_eval(*arrays):
            if not seen and launching[0]:
                if calls[0] == args.step:
                    seen.append(count_graph([a for a in arrays if isinstance(a, mx.array)], args.dot))
                calls[0] += 1
            return real.async_eval(*arrays)

    launching = [False]
    window = core.runner._window

    def spied_window(*args):
        launching[0] = True
        return window(*args)

    core.runner._window = spied_window

    runner_module.mx = Spy()
    try:
        core.step()
    finally:
        runner_module.mx = real
    if not seen:
        raise SystemExit(f"the window launched {calls[0]} steps; --step {args.step} is past them")
    print(json.dumps({"device": str(mx.default_device()), "kv_cache": args.kv_cache, "batch": args.batch,
                      "step": args.step,
                      "layers": len(core.cache.layers), **seen[0]}, indent=1))


def _load(random_model: str | None):
    from types import SimpleNamespace

    from services.engine.model.loader import LoadedModel, load_model

    if random_model is None:
        return load_model("default")
    from ops.bench_kv import RANDOM_MODELS, random_model as build

    return LoadedModel(model=build(random_model), tokenizer=SimpleNamespace(eos_token_ids=set()),
                       path=Path(random_model), config=RANDOM_MODELS[random_model][1])


if __name__ == "__main__":
    main()
