"""The seam between mlx-lm's attention layers and our caches.

mlx-lm attention calls `scaled_dot_product_attention(q, k, v, cache=..., scale=..., mask=...)`
from `mlx_lm.models.base`, bound into each model module at import. We install one
dispatcher in its place: caches of ours compute attention themselves (rotated or
compressed domains); anything else falls through to mlx-lm's function unchanged.
This is the only patch buttermilk makes to mlx-lm.
"""

from __future__ import annotations

import sys

import mlx_lm.models.base as _base

from .cache.protocol import AttendingCache

_ORIGINAL = _base.scaled_dot_product_attention


def scaled_dot_product_attention(queries, keys, values, cache, scale: float, mask, sinks=None):
    """Dispatch attention to the cache when it is one of ours, else to mlx-lm.

    Args:
        queries (mx.array): [B, n_heads, L, head_dim].
        keys, values: whatever `cache.update_and_fetch` returned ([B, n_kv_heads, T, head_dim]).
        cache: the layer's cache, or `None`.
        scale (float): score scale.
        mask: `None`, `"causal"` or an array.
    """
    if isinstance(cache, AttendingCache):
        return cache.attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
    return _ORIGINAL(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def install() -> None:
    """Bind the dispatcher into `mlx_lm.models.base` and every model module already imported."""
    _base.scaled_dot_product_attention = scaled_dot_product_attention
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm.models.") and getattr(module, "scaled_dot_product_attention", None) is _ORIGINAL:
            module.scaled_dot_product_attention = scaled_dot_product_attention
