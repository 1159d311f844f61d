"""Plain-dict descriptions of model geometry and per-layer caches (for `inspect` and `stats`)."""

from __future__ import annotations

import mlx.core as mx

from .kv import KVCache


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


def layer_report(layer: int, cache, model_dtype: mx.Dtype) -> dict:
    """One layer's cache: kind, scheme, window, live tokens, field shapes, bytes (and per token)."""
    row = {"layer": layer, "kind": type(cache).__name__, "nbytes": cache.nbytes}
    if not isinstance(cache, KVCache):
        return row
    fields = [] if cache.empty() else [*cache._keys, *cache._values]
    row |= {
        "scheme": cache.key_codec.name if cache.key_codec.name == cache.value_codec.name else f"{cache.key_codec.name}/{cache.value_codec.name}",
        "window": None if cache.window is None else [cache.window.max_size, cache.window.keep],
        "live_tokens": cache.num_live,
        "offset": cache.offset,
        "capacity_tokens": cache.capacity,
        "capacity_nbytes": cache.capacity_nbytes,
        "fields": [{"shape": list(f.shape), "dtype": str(f.dtype).removeprefix("mlx.core.")} for f in fields],
    }
    if cache.num_live and fields:
        per_token = cache.nbytes / cache.num_live
        k = cache._keys[0]
        raw_per_token = 2 * k.shape[0] * k.shape[1] * _head_dim(cache) * model_dtype.size
        row |= {"bytes_per_token": round(per_token, 2), "ratio_to_raw": round(per_token / raw_per_token, 4)}
    return row


def _head_dim(cache: KVCache) -> int:
    return int(cache.key_codec.decode(tuple(f[:, :, :1] for f in cache._keys)).shape[-1])
