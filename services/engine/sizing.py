"""KV pool sizing: bytes per token from the scheme registry, capacity for a memory budget, concurrency.

Bytes per token come from the scheme registry itself: each layer's `LayerFormat`
(`schemes.layer_format`, what the caches allocate their page pools with) gives its bytes per
(token, kv head) row, so a new scheme or a changed row layout is sized correctly without
touching this module. The engine sizes its pool with these functions (`--kv-memory-gib`,
`--kv-memory-fraction`), and `buttermilk pool-size` prints the same figures before anything
starts.

Capacity follows the paged `BatchedKVCache`: storage is whole pages of `page_size` tokens, and
a request of L tokens takes `ceil(min(L, window) / page_size)` pages. "Maximum concurrency for
L tokens per request" is `capacity_tokens / (pages per request x page_size)`, the figure vLLM
logs at start.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import mlx.core as mx

from .cache.schemes import layer_format

GIB = 2**30


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """What a model's KV cache looks like per token.

    Attributes:
        n_layers (int): attention layers, each holding K and V.
        n_kv_heads (int): KV heads per layer.
        head_dim (int): dimensions per head.
        dtype (mx.Dtype): the model dtype, which raw K/V storage uses.
    """

    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: mx.Dtype

    @classmethod
    def from_config(cls, config: dict, dtype: mx.Dtype) -> KVGeometry:
        """Read the geometry off a model's `config.json` (the `text_config` of a multimodal one).

        Raises:
            ValueError: the config lacks the layer or head counts.
        """
        cfg = config.get("text_config", config)
        n_heads, hidden = cfg.get("num_attention_heads"), cfg.get("hidden_size")
        head_dim = cfg.get("head_dim") or (hidden // n_heads if hidden and n_heads else None)
        n_layers = cfg.get("num_hidden_layers")
        if not (n_layers and n_heads and head_dim):
            raise ValueError("the model config lacks num_hidden_layers, num_attention_heads or head_dim")
        return cls(int(n_layers), int(cfg.get("num_key_value_heads") or n_heads), int(head_dim), dtype)


def layer_bytes_per_token(scheme: str, geometry: KVGeometry, *, raw_layers: frozenset[int] = frozenset()) -> list[int]:
    """Bytes one token's K and V take in each layer, every codec field (scales, biases) included.

    Args:
        scheme (str): a `--kv-cache` value, layer overrides included (`aura4v4+1=aura8v8`).
        geometry (KVGeometry): the model's KV shape.
        raw_layers (frozenset[int]): layers kept raw whatever the scheme (`--kv-raw-layers`).

    Returns:
        list[int]: one entry per layer, bytes.

    Raises:
        ValueError: an unknown scheme, or one that cannot store vectors of `head_dim`.
    """
    return [
        layer_format("raw" if layer in raw_layers else scheme, layer=layer, dtype=geometry.dtype,
                     head_dim=geometry.head_dim).bytes_per_row * geometry.n_kv_heads
        for layer in range(geometry.n_layers)
    ]  # fmt: skip


def bytes_per_token(scheme: str, geometry: KVGeometry, *, raw_layers: frozenset[int] = frozenset()) -> int:
    """Bytes one token's K and V take across all layers (see `layer_bytes_per_token`)."""
    return sum(layer_bytes_per_token(scheme, geometry, raw_layers=raw_layers))


def capacity_tokens(memory_bytes: int, per_token_bytes: int, *, page_size: int, state_bytes: int = 0) -> int:
    """Tokens a KV pool of `memory_bytes` holds, in whole pages.

    Args:
        state_bytes (int): Recurrent state of a hybrid model, all slots (bytes): it comes off
            the budget first. Default: 0.

    Raises:
        ValueError: the budget holds less than one page after the state.
    """
    if state_bytes >= memory_bytes:
        raise ValueError(f"the recurrent state ({state_bytes} bytes for all slots) leaves no room in {int(memory_bytes)} bytes")
    num_pages = int(memory_bytes - state_bytes) // (per_token_bytes * page_size)
    if num_pages < 1:
        raise ValueError(f"a KV pool of {int(memory_bytes)} bytes holds no page of {page_size} tokens "
                         f"at {per_token_bytes} bytes per token")  # fmt: skip
    return num_pages * page_size


def tokens_per_request(num_tokens: int, *, page_size: int, window: int | None = None) -> int:
    """Tokens a request of `num_tokens` (prompt + output) holds: whole pages, capped by a window."""
    live = num_tokens if window is None else min(num_tokens, window)
    return math.ceil(live / page_size) * page_size


def max_concurrency(capacity: int, num_tokens: int, *, page_size: int, window: int | None = None) -> float:
    """How many requests of `num_tokens` tokens the pool holds at once (vLLM's start-up figure)."""
    return capacity / tokens_per_request(num_tokens, page_size=page_size, window=window)


def concurrency_line(num_tokens: int, concurrency: float) -> str:
    """The operator-facing line, worded as vLLM words it."""
    return f"Maximum concurrency for {num_tokens:,} tokens per request: {concurrency:.2f}x"


def device_memory_bytes(device: mx.Device | None = None) -> int:
    """Memory of `device` (default: MLX's default device), bytes: GPU memory, or RAM on the CPU.

    Raises:
        ValueError: the backend does not report the device's memory.
    """
    device = device or mx.default_device()
    if device.type == mx.cpu:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    info = mx.device_info(device)
    size = info.get("memory_size") or info.get("total_memory")
    if not size:
        raise ValueError(f"{device} does not report its memory; give the KV pool in GiB instead")
    return int(size)


def budget_bytes(*, memory_gib: float | None = None, memory_fraction: float | None = None,
                 device_memory: int | None = None) -> int:  # fmt: skip
    """A KV pool budget in bytes from exactly one of a size in GiB or a fraction of device memory.

    Args:
        memory_gib (float | None): the pool's size, GiB (2**30 bytes).
        memory_fraction (float | None): the pool's share of the device's memory, in (0, 1].
        device_memory (int | None): device memory, bytes (default: `device_memory_bytes()`).

    Raises:
        ValueError: neither or both given, or a value out of range.
    """
    if (memory_gib is None) == (memory_fraction is None):
        raise ValueError("give exactly one of a KV memory size (GiB) or a fraction of device memory")
    if memory_gib is not None:
        if not 0 < memory_gib < math.inf:
            raise ValueError(f"KV memory must be > 0 GiB, got {memory_gib}")
        return int(memory_gib * GIB)
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"KV memory fraction must be in (0, 1], got {memory_fraction}")
    total = device_memory if device_memory is not None else device_memory_bytes()
    return int(total * memory_fraction)
