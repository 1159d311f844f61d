"""Per-layer KV caches: codecs (raw, affine, AURA), windows, recurrent state, and their factory."""

from .factory import CacheOptions, make_layer_caches, model_dtype
from .kv import KVCache
from .recurrent import RecurrentStateCache
from .window import Window

__all__ = ["CacheOptions", "KVCache", "RecurrentStateCache", "Window", "make_layer_caches", "model_dtype"]
