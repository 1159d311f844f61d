"""Temporary GPU probe (deleted after use): build vs launch vs wait of one decode step, ours vs mlx-lm."""
import sys, time
import mlx.core as mx, numpy as np
from mlx_lm.models.cache import BatchKVCache
from ops.bench_batching import random_model
from services.engine.cache import CacheOptions
from services.engine.cache.batched import BatchedKVCache

lm = random_model("llama-1b", "bfloat16"); m = lm.model
def stats(xs): xs = sorted(xs[3:]); return round(xs[len(xs)//2] * 1e3, 3)
for B in (1, 32):
    cache = BatchedKVCache.for_model(m, CacheOptions(max_context=4096), n_kv_heads=8, head_dim=64, capacity_tokens=B*256, page_size=16, max_slots=B)
    views = [cache.acquire() for _ in range(B)]
    for i, v in enumerate(views): cache.batch([v], 60 + i % 8)
    mx.eval(cache.arrays)
    x = mx.zeros((B, 1), mx.uint32)
    theirs = [BatchKVCache([0]*B) for _ in m.layers]
    m(mx.zeros((B, 64), mx.int32), cache=theirs); mx.eval([c.state for c in theirs])
    for name in ("ours", "theirs", "ours", "theirs"):
        build, launch, wait = [], [], []
        for _ in range(25):
            t0 = time.perf_counter()
            if name == "ours":
                b = cache.batch(views, 1)
                y = mx.argmax(m(x, cache=b.layers)[:, -1], -1)
                arrs = cache.arrays
            else:
                y = mx.argmax(m(x, cache=theirs)[:, -1], -1)
                arrs = [c.keys for c in theirs] + [c.values for c in theirs]
            t1 = time.perf_counter()
            mx.async_eval(y, *arrs)
            t2 = time.perf_counter()
            mx.synchronize()
            t3 = time.perf_counter()
            build.append(t1 - t0); launch.append(t2 - t1); wait.append(t3 - t2)
        print(B, name, "build", stats(build), "launch", stats(launch), "wait", stats(wait), flush=True)
    # pipelined mlx-lm style for theirs: build+launch next before waiting
    prev = None; ts = []
    for _ in range(25):
        t0 = time.perf_counter()
        y = mx.argmax(m(x, cache=theirs)[:, -1], -1)
        mx.async_eval(y)
        if prev is not None: prev.item() if B == 1 else prev.tolist()
        prev = y; ts.append(time.perf_counter() - t0)
    print(B, "theirs pipelined step", stats(ts), flush=True)
