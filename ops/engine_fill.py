"""An engine whose slots already hold long contexts of random K/V (for decode benchmarks).

A real 32K-token prefill takes long and does not change what a decode step costs (that
depends on the lengths and the storage format, not on the values), so the benchmarks write
random K/V of the model's shape straight into each slot's pages through the layer's own
encoder, and register the slot as a session whose next turn is one token: the engine then
decodes from a context of the chosen length.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from services.engine.cache import CacheOptions, pool_rows
from services.engine.core import EngineCore
from services.engine.model.loader import LoadedModel
from services.engine.request import Request
from shared.protocol import SamplingParams
from services.engine.scheduler import Session

FILL_CHUNK = 1024  # tokens encoded at once per layer (bounds the fill's temporary memory)


def filled_engine(loaded: LoadedModel, scheme: str, contexts: list[int], *, max_tokens: int, page_size: int = 16,
                  decode_window: int | None = None, capacity_tokens: int | None = None) -> tuple[EngineCore, list[Request]]:
    """An engine with one slot per context, filled, and one request per slot continuing it.

    Args:
        contexts (list[int]): Tokens already held by each slot.
        max_tokens (int): Tokens each request generates.
        capacity_tokens (int | None): KV capacity; default: exactly what the requests need.

    Returns:
        tuple[EngineCore, list[Request]]: the engine and the requests to add (not added yet).
    """
    need = sum(c + max_tokens + 2 * page_size for c in contexts)
    core = EngineCore(loaded, CacheOptions(scheme=scheme, max_context=max(contexts) + max_tokens + 1),
                      capacity_tokens=capacity_tokens or need, max_slots=len(contexts),
                      step_token_budget=len(contexts) + 512, page_size=page_size, decode_window=decode_window)
    requests = []
    for i, context in enumerate(contexts):
        view = core.cache.acquire()
        fill_slot(core, view, context, seed=i)
        core.scheduler.sessions[f"s{i}"] = Session(slot=view, token_ids=[1] * context)
        requests.append(Request(f"r{i}", [2], SamplingParams(max_tokens=max_tokens), session_id=f"s{i}"))
    return core, requests


def fill_slot(core: EngineCore, view, num_tokens: int, *, seed: int) -> None:
    """Write `num_tokens` tokens of N(0, 1) K/V into a slot's pages, every layer, through its encoder."""
    cache = core.cache
    starts, tables = cache.slots.begin_forward([view], num_tokens)
    table = np.array(tables[0], np.int64)[None]
    key = mx.random.key(seed)
    dtype = core.loaded.dtype
    for first in range(0, num_tokens, FILL_CHUNK):
        slots = np.arange(first, min(first + FILL_CHUNK, num_tokens))[None]
        rows = mx.array(pool_rows.flat_rows(table, slots, n_kv_heads=cache.n_kv_heads, num_pages=cache.num_pages,
                                            page_size=cache.page_size).reshape(-1).astype(np.int32))
        for layer, spec in enumerate(cache.layers):
            key, k_key, v_key = mx.random.split(key, 3)
            shape = (1, cache.n_kv_heads, slots.shape[1])
            new = pool_rows.encode(spec.fmt, mx.random.normal((*shape, spec.fmt.key_dim), key=k_key).astype(dtype),
                                   mx.random.normal((*shape, spec.fmt.value_dim), key=v_key).astype(dtype))
            cache.storage.pools[layer] = pool_rows.write(cache.storage.pools[layer], rows, new)
        mx.eval(cache.arrays)
