"""Plain-dict descriptions of model geometry and per-layer caches (for `inspect` and `stats`)."""

from __future__ import annotations

import mlx.core as mx

from .kv import KVCache
from .recurrent import CacheGroup, RecurrentStateCache, leaf_caches


def geometry(loaded) -> dict:
    """n_layers, n_heads, n_kv_heads, head_dim, hidden size, vocab and dtype of a loaded model."""
    cfg = loaded.config.get("text_config", loaded.config)
    n_heads = cfg.get("num_attention_heads")
    hidden = cfg.get("hidden_size")
    return {
        "model_type": cfg.get("model_type"),
        "n_layers": cfg.get("num_hidden_layers"),
        "n_heads": n_heads,
        "n_kv_heads": cfg.get("num_key_value_heads", n_heads),
        "head_dim": cfg.get("head_dim") or (hidden // n_heads if hidden and n_heads else None),
        "hidden_size": hidden,
        "vocab_size": cfg.get("vocab_size"),
        "dtype": str(loaded.dtype).removeprefix("mlx.core."),
        "advertised_context": loaded.advertised_context,
    }


def state_bytes_per_slot(model) -> int:
    """Recurrent state bytes one sequence holds across a hybrid model's layers (0 for others)."""
    from mlx_lm.models.cache import ArraysCache, CacheList

    from .state_pool import probe_state_specs

    template = model.make_cache() if hasattr(model, "make_cache") else []
    leaves = [m for c in template for m in (c.caches if isinstance(c, CacheList) else [c])]
    if not any(isinstance(c, ArraysCache) for c in leaves):
        return 0
    return sum(spec.nbytes for spec in probe_state_specs(model))


def layer_report(layer: int, cache, model_dtype: mx.Dtype) -> dict:
    """One layer's cache: kind, scheme, window, live tokens, pool shapes and bytes.

    For a `KVCache` holding tokens it adds `bytes_per_token` (bytes per live token, K and V,
    metadata and batch rows included: `nbytes / live_tokens`), `bits_per_element` (the same per K or
    V element, metadata included) and `ratio_to_raw` (against a raw cache in `model_dtype`).

    Args:
        layer (int): Layer index.
        cache: The layer's cache (not mutated).
        model_dtype (mx.Dtype): The model dtype, which a raw cache stores.

    Returns:
        dict: One row; `nbytes` counts live tokens only, `capacity_nbytes` what is allocated.
    """
    row = {"layer": layer, "kind": type(cache).__name__, "nbytes": cache.nbytes}
    if isinstance(cache, RecurrentStateCache):  # fixed-size state, never quantized
        arrays = [a for a in cache.state if a is not None]
        return row | {"pools": [{"shape": list(a.shape), "dtype": str(a.dtype).removeprefix("mlx.core.")}
                                for a in arrays]}
    if not isinstance(cache, KVCache):
        return row
    pools = [] if cache.empty() else list(cache.state)
    row |= {
        "scheme": None if cache.fmt is None else cache.fmt.name,
        "window": None if cache.window is None else [cache.window.max_size, cache.window.keep],
        "live_tokens": cache.num_live,
        "offset": cache.offset,
        "capacity_tokens": cache.capacity,
        "capacity_nbytes": cache.capacity_nbytes,
        "pools": [{"shape": list(p.shape), "dtype": str(p.dtype).removeprefix("mlx.core.")} for p in pools],
    }
    if cache.num_live and pools:
        batch, n_kv_heads = pools[0].shape[:2]
        elements_per_token = batch * n_kv_heads * (cache.fmt.key_dim + cache.fmt.value_dim)  # K and V
        per_token = cache.nbytes / cache.num_live
        row |= {
            "bytes_per_token": round(per_token, 2),
            "bits_per_element": round(8 * per_token / elements_per_token, 4),
            "ratio_to_raw": round(per_token / (elements_per_token * model_dtype.size), 4),
        }
    return row


def layer_reports(caches: list, model_dtype: mx.Dtype) -> list[dict]:
    """`layer_report` of every cache of a model's cache list; a `CacheGroup` gives one row per member."""
    return [layer_report(i, member, model_dtype) for i, cache in enumerate(caches)
            for member in (leaf_caches([cache]) if isinstance(cache, CacheGroup) else [cache])]


def bits_per_element(caches: list) -> float:
    """Stored bits per cached K or V element over every `KVCache` layer, metadata included.

    Args:
        caches (list): Per-layer caches holding tokens (groups are flattened; other cache kinds are skipped).

    Returns:
        float: `8 * sum(nbytes) / sum(B * n_kv_heads * (key_dim + value_dim) * live_tokens)`.

    Raises:
        ValueError: no `KVCache` layer holds a token.
    """
    held = [c for c in leaf_caches(caches) if isinstance(c, KVCache) and c.num_live]
    if not held:
        raise ValueError("no KV cache layer holds a token")
    elements = sum(c.nbytes // c.fmt.bytes_per_row * (c.fmt.key_dim + c.fmt.value_dim) for c in held)
    return 8.0 * sum(c.nbytes for c in held) / elements
