"""`make_layer_caches`: translate `model.make_cache()` into our cache classes."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import cache as mlx_cache

from .centering import KeyMeans
from .geometry import probe_geometry
from .kv import KVCache
from .recurrent import CacheGroup, RecurrentStateCache, leaf_caches
from .schemes import layer_parts, parse_layer_overrides
from .window import Window


@dataclass(frozen=True, slots=True)
class CacheOptions:
    """Request-independent cache settings of one model instance.

    Attributes:
        scheme (str): A scheme spec (`services.engine.cache.schemes`), e.g. `aura4v4+1=aura8v8`.
        max_context (int): Context cap per sequence (tokens).
        window (Window | None): User sliding window with sinks, composed with architectural ones.
        raw_layers (frozenset[int]): Layers kept raw whatever the scheme.
        key_means (KeyMeans | None): Center the keys of compressed layers on these means (`centering`);
            None: keys are stored as they come.
    """

    scheme: str = "raw"
    max_context: int = 8192
    window: Window | None = None
    raw_layers: frozenset[int] = field(default_factory=frozenset)
    key_means: KeyMeans | None = None


def model_dtype(model: nn.Module) -> mx.Dtype:
    """The floating dtype of the model's weights (activations and raw K/V use it)."""
    for _, p in nn.utils.tree_flatten(model.parameters()):
        if mx.issubdtype(p.dtype, mx.floating):
            return p.dtype
    return mx.float32


def make_layer_caches(model: nn.Module, options: CacheOptions) -> list:
    """Build one cache per entry of the model's cache list, keeping each layer's architectural kind.

    Full-attention layers get a `KVCache` in the chosen scheme; architectural sliding
    layers (`RotatingKVCache` in mlx-lm) get a windowed `KVCache` whose window composes
    with the user's (the smaller wins); recurrent layers (`ArraysCache`) get a
    `RecurrentStateCache` (never quantized); a `CacheList` (several mixers in one layer)
    gets a `CacheGroup` of its members. Scheme overrides and seeds use the entry's index. Each
    `KVCache` knows its layer's geometry (`geometry.probe_geometry`: key and value widths, kv
    heads, latent or attended in place).

    Raises:
        ValueError: an unknown scheme, a scheme that cannot store a layer's widths (the message
            names the layer), or a cache kind we do not translate.
    """
    template = _template(model)
    geometries = probe_geometry(model, _template(model))
    dtype = model_dtype(model)
    caches = [_translate(proto, geometry, layer, options, dtype) for layer, (proto, geometry)
              in enumerate(zip(template, geometries))]
    if options.key_means is not None:
        layers = [c for c in leaf_caches(caches) if isinstance(c, KVCache)]
        means = options.key_means.means
        if len(layers) != len(means):
            raise ValueError(f"key means for {len(means)} attention layers, the model has {len(layers)}")
        for cache, mean in zip(layers, means):
            geometry = cache.geometry
            cache.key_mean = None if cache.fmt.is_raw or geometry.latent or geometry.sinks else mean
    return caches


def _translate(proto, geometry, layer: int, options: CacheOptions, dtype: mx.Dtype):
    if isinstance(proto, mlx_cache.CacheList):
        return CacheGroup(*(_translate(m, g, layer, options, dtype) for m, g in zip(proto.caches, geometry)))
    if isinstance(proto, mlx_cache.ArraysCache):
        return RecurrentStateCache(len(proto.cache))
    if isinstance(proto, mlx_cache.RotatingKVCache):
        window = Window(proto.max_size, proto.keep).compose(options.window)
    elif isinstance(proto, mlx_cache.KVCache):
        window = options.window
    else:
        raise ValueError(f"layer {layer}: cache kind {type(proto).__name__} is not supported")
    scheme = "raw" if layer in options.raw_layers else options.scheme
    key, value = layer_parts(scheme, layer=layer, dtype=dtype)
    try:
        return KVCache(key, value, max_tokens=options.max_context, window=window, geometry=geometry)
    except ValueError as exc:
        base, overrides = parse_layer_overrides(scheme)
        raise ValueError(f"layer {layer} ({overrides.get(layer, base)}): {exc}") from exc


def _template(model: nn.Module) -> list:
    """Fresh mlx-lm caches, one per layer (the model's `make_cache()`, else plain KV caches)."""
    return model.make_cache() if hasattr(model, "make_cache") else [mlx_cache.KVCache() for _ in model.layers]
