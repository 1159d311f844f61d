"""What each attention layer of a model stores and how it attends, read off one traced forward.

Configs spell geometry many ways (`head_dim`, `qk_nope_head_dim + qk_rope_head_dim` and
`v_head_dim`, `kv_lora_rank`...), and the number of kv heads a config names is not always
what the cache holds (an MLA layer caches one latent "head"). So the shapes are taken from
the model itself: one token goes through it with probe caches (never evaluated: MLX builds
the graph only), each recording what `update_and_fetch` stores and whether attention then
runs on exactly what the cache returned. A layer whose attention runs on something derived
from the cache (MLA multiplies its latent out per head) is *latent*: our caches hand it the
decoded slots instead of attending in place (`kernels.latent_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import cache as mlx_cache

from .protocol import AttendingCache


@dataclass(frozen=True, slots=True)
class LayerGeometry:
    """One attention layer's cached K/V shapes.

    Attributes:
        n_kv_heads (int): Heads stored per token (1 for an MLA latent).
        key_dim (int): Elements per stored key vector (MLA: `kv_lora_rank`).
        value_dim (int): Elements per stored value vector (MLA: `qk_rope_head_dim`).
        latent (bool): Attention runs on operands the model derives from the cache (MLA), so the
            cache returns its decoded slots instead of attending in place.
        sinks (bool): The layer passes learned attention-sink logits to attention (gpt-oss).
    """

    n_kv_heads: int
    key_dim: int
    value_dim: int
    latent: bool = False
    sinks: bool = False


class _Probe(AttendingCache):
    """Stores nothing; records the shapes of what the layer caches and what it attends."""

    offset = 0

    def __init__(self):
        self.shapes: tuple | None = None
        self.returned: tuple = ()
        self.direct: bool | None = None  # attention ran on exactly what update_and_fetch returned
        self.sinks = False

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.shapes = (keys.shape[1], keys.shape[-1], values.shape[-1])
        self.returned = (keys, values)
        return keys, values

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        return None  # one token

    def attend(self, queries, keys, values, *, scale: float, mask, sinks=None) -> mx.array:
        self.direct = keys is self.returned[0] and values is self.returned[1]
        self.sinks = sinks is not None
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)

    def geometry(self) -> LayerGeometry | None:
        if self.shapes is None:
            return None
        return LayerGeometry(*self.shapes, latent=not self.direct, sinks=self.sinks)


def probe_geometry(model: nn.Module, template: list) -> list:
    """Per layer of `template` (the model's `make_cache()`), its geometry; None for non-attention layers.

    A `CacheList` layer (several mixers, e.g. falcon_h1) gets a list, one entry per member.

    Args:
        model (nn.Module): An mlx-lm model (not mutated; nothing is evaluated).
        template (list): Fresh mlx-lm caches, one per layer; K/V kinds are replaced by probes,
            others (recurrent state) are used as they are.

    Returns:
        list[LayerGeometry | None | list]: as described.

    Raises:
        ValueError: the model's forward fails on one token with these caches.
    """
    from services.engine import attention

    attention.install()  # probes see the attention calls only through our dispatcher
    caches = [_with_probes(c) for c in template]
    geometries = [_read(c) for c in caches]
    if not any(_has_probe(c) for c in caches):
        return geometries
    try:
        model(mx.zeros((1, 1), dtype=mx.uint32), cache=caches)
    except (TypeError, IndexError, AttributeError) as exc:
        raise ValueError(f"cannot trace one token through the model to read its cache geometry: {exc}") from exc
    return [_read(c) for c in caches]


def _with_probes(cache):
    if isinstance(cache, (mlx_cache.KVCache, mlx_cache.RotatingKVCache)):
        return _Probe()
    if isinstance(cache, mlx_cache.CacheList):
        return mlx_cache.CacheList(*(_with_probes(c) for c in cache.caches))
    return cache


def _has_probe(cache) -> bool:
    if isinstance(cache, mlx_cache.CacheList):
        return any(_has_probe(c) for c in cache.caches)
    return isinstance(cache, _Probe)


def _read(cache):
    if isinstance(cache, mlx_cache.CacheList):
        return [_read(c) for c in cache.caches]
    return cache.geometry() if isinstance(cache, _Probe) else None
