"""Save and load per-layer caches: one safetensors file, arrays plus a JSON description.

Format (`FORMAT`, version `VERSION`). Tensor `layers.{i}.{j}` is the j-th array of layer i's
`state` (for `KVCache`: its pools' rows [B, n_kv_heads, T, width], T the live slots, or the
whole ring once a window has wrapped; `kernels.kv_format` describes a row; for
`RecurrentStateCache`: its state arrays [B, ...]). A `CacheGroup` at index i stores its
members as `layers.{i}.{m}.{j}`.
The safetensors header metadata holds three strings: `format`, `version`, and `caches`, a
JSON list with one entry per layer, `{"class", "meta_state", "num_arrays", "present"}`
(`present` marks which `state` entries were not `None`; a group's entry is
`{"class": "CacheGroup", "members": [entry, ...]}`), plus `metadata`, the caller's
JSON-serialisable dict. `meta_state` carries everything the cache and its codecs are rebuilt
from: offset, context cap, window, key and value widths, whether the layer is latent (MLA),
and each part's `meta()` under `key_`/`value_` prefixes,
AURA rotation seeds included, so codes written by one process decode the same in another.

Source: safetensors format (https://github.com/huggingface/safetensors); MLX
`mx.save_safetensors` / `mx.load`.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

from .kv import KVCache
from .recurrent import CacheGroup, RecurrentStateCache
from .schemes import part_from_meta
from .window import Window

FORMAT = "buttermilk.kv_caches"
VERSION = "2"  # 2: pool rows (kernels.kv_format) instead of per-codec fields
_PREFIXES = ("key_", "value_")


def save_caches(path: str | Path, caches: list, metadata: dict | None = None) -> Path:
    """Write every layer's cache state to one safetensors file (evaluates the state).

    Args:
        path (str | Path): Target file; `.safetensors` is appended when missing.
        caches (list): Per-layer `KVCache` / `RecurrentStateCache` / `CacheGroup` objects (not mutated).
        metadata (dict | None): Caller data stored beside (must be JSON-serialisable).

    Returns:
        Path: The file written.

    Raises:
        ValueError: a cache of a class this format does not describe.
    """
    path = Path(path)
    path = path if path.suffix == ".safetensors" else path.with_name(path.name + ".safetensors")
    arrays = {}
    entries = [_describe(cache, f"layers.{layer}", arrays) for layer, cache in enumerate(caches)]
    header = {"format": FORMAT, "version": VERSION, "caches": json.dumps(entries),
              "metadata": json.dumps(metadata or {})}
    mx.save_safetensors(str(path), arrays, metadata=header)
    return path


def load_caches(path: str | Path) -> tuple[list, dict]:
    """Rebuild the caches `save_caches` wrote, formats and rotations included.

    Args:
        path (str | Path): A file written by `save_caches`.

    Returns:
        tuple[list, dict]: The per-layer caches (fresh objects owning the loaded arrays,
        ready to continue the sequence) and the caller metadata.

    Raises:
        ValueError: the file is not in this format or version, or describes an unknown
            cache class or part format.
    """
    arrays, header = mx.load(str(path), return_metadata=True)
    if header.get("format") != FORMAT or header.get("version") != VERSION:
        raise ValueError(f"{path}: not a {FORMAT} v{VERSION} file (header {header.get('format')!r} "
                         f"v{header.get('version')!r})")
    caches = [_rebuild(entry, f"layers.{layer}", arrays) for layer, entry in enumerate(json.loads(header["caches"]))]
    return caches, json.loads(header["metadata"])


def _describe(cache, name: str, arrays: dict) -> dict:
    """The header entry of one cache; its arrays go into `arrays` under `name`."""
    if isinstance(cache, CacheGroup):
        return {"class": "CacheGroup", "members": [_describe(c, f"{name}.{m}", arrays) for m, c in enumerate(cache.caches)]}
    if not isinstance(cache, (KVCache, RecurrentStateCache)):
        raise ValueError(f"{name}: cannot save a {type(cache).__name__}")
    state = list(cache.state)
    arrays |= {f"{name}.{j}": a for j, a in enumerate(state) if a is not None}
    entry = {"class": type(cache).__name__, "meta_state": cache.meta_state, "num_arrays": len(state),
             "present": [a is not None for a in state]}
    if getattr(cache, "key_mean", None) is not None:  # centered keys: later keys must be centered alike
        arrays[f"{name}.key_mean"] = cache.key_mean
        entry["key_mean"] = True
    return entry


def _rebuild(entry: dict, name: str, arrays: dict):
    kind = entry["class"]
    if kind == "CacheGroup":
        return CacheGroup(*(_rebuild(e, f"{name}.{m}", arrays) for m, e in enumerate(entry["members"])))
    state = [arrays[f"{name}.{j}"] if present else None for j, present in enumerate(entry["present"])]
    meta = entry["meta_state"]
    if kind == "KVCache":
        cache = _rebuild_kv(meta, state)
        cache.key_mean = arrays[f"{name}.key_mean"] if entry.get("key_mean") else None
        return cache
    if kind == "RecurrentStateCache":
        cache = RecurrentStateCache(int(meta["num_arrays"]))
        cache.state, cache.offset = state, int(meta["offset"])
        return cache
    raise ValueError(f"unknown cache class {kind!r}")


def _rebuild_kv(meta: dict[str, str], state: list) -> KVCache:
    key, value = (part_from_meta(_strip(meta, prefix)) for prefix in _PREFIXES)
    window = None
    if "window_max_size" in meta:
        window = Window(int(meta["window_max_size"]), int(meta["window_keep"]))
    cache = KVCache(key, value, max_tokens=int(meta["max_tokens"]), window=window)
    cache.state, cache.offset = state, int(meta["offset"])
    if "key_dim" in meta:
        cache.restore_format(int(meta["key_dim"]), int(meta["value_dim"]), latent=meta.get("latent") == "1")
    elif "head_dim" in meta:  # written before keys and values could differ in width
        cache.restore_format(int(meta["head_dim"]), int(meta["head_dim"]))
    return cache


def _strip(meta: dict[str, str], prefix: str) -> dict[str, str]:
    return {k.removeprefix(prefix): v for k, v in meta.items() if k.startswith(prefix)}
