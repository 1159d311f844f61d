"""`KVCache`: one layer's K/V storage in any codec, growing in steps, optionally windowed."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from shared.errors import ContextOverflow

from .codecs import Fields, KVCodec
from .protocol import AttendingCache
from .quantized import Packed, affine_attention, attends_packed
from .window import Window


def _slice(fields: Fields, stop: int) -> Fields:
    return tuple(f[:, :, :stop] for f in fields)


def _token_bytes(fields: Fields) -> int:
    """Bytes one token occupies across fields, all batch rows included."""
    return sum(f.nbytes // f.shape[2] for f in fields)


class KVCache(AttendingCache):
    """One attention layer's cache, speaking mlx-lm's cache protocol.

    Storage is one array per codec field, `[B, n_kv_heads, capacity, *]`, grown in
    `step`-token increments as tokens arrive and never past `max_tokens` (the context
    cap) or, under a window, past `window.max_size`: memory is never preallocated to
    the advertised context. `offset` counts every token seen; it drives RoPE and keeps
    growing across window evictions, while the live length stays `<= window.max_size`.

    Args:
        key_codec (KVCodec): Codec for keys.
        value_codec (KVCodec): Codec for values.
        max_tokens (int): Context cap for this sequence, in tokens (`--max-context`).
        window (Window | None): Sliding window with sinks, or `None` for full attention.

    Raises:
        ContextOverflow: from `update_and_fetch` when a full-attention cache would pass
            `max_tokens`.
    """

    step = 256

    def __init__(self, key_codec: KVCodec, value_codec: KVCodec, *, max_tokens: int, window: Window | None = None):
        self.key_codec = key_codec
        self.value_codec = value_codec
        self.max_tokens = max_tokens
        self.window = window
        self.offset = 0
        self._keys: Fields | None = None
        self._values: Fields | None = None

    # -- sizes -----------------------------------------------------------------

    @property
    def num_live(self) -> int:
        """Tokens whose K/V are held (tokens)."""
        return self.offset if self.window is None else min(self.offset, self.window.max_size)

    @property
    def capacity(self) -> int:
        """Token slots allocated per batch row (tokens)."""
        return 0 if self._keys is None else self._keys[0].shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes held for live tokens, K and V, every field (scales and biases) included."""
        if self._keys is None:
            return 0
        return self.num_live * (_token_bytes(self._keys) + _token_bytes(self._values))

    @property
    def capacity_nbytes(self) -> int:
        """Bytes allocated, live or not."""
        if self._keys is None:
            return 0
        return sum(f.nbytes for f in self._keys + self._values)

    def size(self) -> int:
        return self.num_live

    def empty(self) -> bool:
        return self._keys is None

    # -- the protocol ------------------------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Store L new tokens and return what attention reads.

        Args:
            keys (mx.array): [B, n_kv_heads, L, head_dim], RoPE already applied at
                positions `offset .. offset+L-1`.
            values (mx.array): [B, n_kv_heads, L, head_dim].

        Returns:
            tuple: keys and values [B, n_kv_heads, T, head_dim] in the codecs' attention
            domain, ordered as `make_mask(L)` assumes; for a phase that attends on packed
            codes (`quantized.attends_packed`), `Packed` handles of the stored fields instead.

        Raises:
            ContextOverflow: the sequence would pass `max_tokens` (full attention only).
        """
        num_new, start = keys.shape[2], self.offset
        k_new, v_new = self.key_codec.encode(keys), self.value_codec.encode(values)
        if self.window is None and start + num_new > self.max_tokens:
            raise ContextOverflow(start + num_new, self.max_tokens, what="sequence")
        if self.window is None or start + num_new <= self.window.max_size:
            self._write(k_new, v_new, None, start)
            self.offset += num_new
            return self._fetch(self.num_live, num_new)
        if num_new == 1:  # the slot it evicts is exactly the one that fell out of the window
            self._write(k_new, v_new, self.window.slot(np.array([start])), start)
            self.offset += 1
            return self._fetch(self.window.max_size, 1)
        # A chunk that wraps: attend over old live slots plus the whole chunk, then keep the ring.
        new_k, new_v = self.key_codec.decode(k_new), self.value_codec.decode(v_new)
        if self.num_live:
            old_k, old_v = self._fetch(self.num_live, num_new)
            new_k, new_v = mx.concatenate([old_k, new_k], axis=2), mx.concatenate([old_v, new_v], axis=2)
        self._write_ring(k_new, v_new, start)
        self.offset += num_new
        return new_k, new_v

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """Mask for N queries at positions `offset .. offset+N-1`, matching `update_and_fetch`.

        Returns `None` (one query, every key visible), `"causal"`, or a boolean [N, T] array.
        """
        start = self.offset
        window = self.window or (Window(window_size) if window_size else None)
        if window is None or start + N <= window.max_size:
            if window_size is not None and self.window is None and start + N > window_size:
                return mx.array(window.visible(np.arange(start, start + N), np.arange(start + N)))
            if N == 1:
                return None
            if return_array:
                return mx.array(np.tril(np.ones((N, start + N), bool), k=start))
            return "causal"
        if N == 1:
            return None
        keys = np.concatenate([window.stored_positions(start), np.arange(start, start + N)])
        return mx.array(window.visible(np.arange(start, start + N), keys))

    def attend(self, queries, keys, values, *, scale: float, mask, sinks=None) -> mx.array:
        """Scaled dot-product attention over what `update_and_fetch` returned.

        Decoded K/V go through `mx.fast` SDPA; `Packed` affine fields through
        `affine_attention` (or are decoded first when the model has learned sinks).

        Args:
            queries (mx.array): [B, n_heads, L, head_dim] with RoPE applied.
            keys, values: [B, n_kv_heads, T, head_dim] in the codecs' domain, or `Packed`.
            scale (float): Score scale, usually head_dim**-0.5.
            mask: `None`, `"causal"` or a boolean/additive array broadcastable to [B, n_heads, L, T].

        Returns:
            mx.array: [B, n_heads, L, head_dim] in the model's domain.
        """
        if isinstance(keys, Packed):
            if sinks is None:
                return affine_attention(queries, keys.fields, values.fields, key_codec=self.key_codec,
                                        value_codec=self.value_codec, scale=scale, mask=mask)
            keys, values = self.key_codec.decode(keys.fields), self.value_codec.decode(values.fields)
        q = self.key_codec.rotate_query(queries)
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask, sinks=sinks)
        return self.value_codec.unrotate_output(out)

    def is_trimmable(self) -> bool:
        return self.window is None or self.offset <= self.window.max_size

    def trim(self, n: int) -> int:
        """Forget the last `n` tokens (tokens actually trimmed is returned)."""
        n = min(self.offset, n) if self.is_trimmable() else 0
        self.offset -= n
        return n

    # -- state (save/load) ------------------------------------------------------

    @property
    def state(self) -> tuple[mx.array, ...]:
        if self._keys is None:
            return ()
        if self.window is None or self.offset <= self.window.max_size:
            return _slice(self._keys, self.num_live) + _slice(self._values, self.num_live)
        return self._keys + self._values

    @state.setter
    def state(self, arrays) -> None:
        arrays = tuple(arrays)
        half = len(arrays) // 2
        self._keys, self._values = (arrays[:half], arrays[half:]) if arrays else (None, None)

    @property
    def meta_state(self) -> dict[str, str]:
        meta = {"offset": str(self.offset), "max_tokens": str(self.max_tokens)}
        if self.window is not None:
            meta |= {"window_max_size": str(self.window.max_size), "window_keep": str(self.window.keep)}
        meta |= {f"key_{k}": v for k, v in self.key_codec.meta().items()}
        return meta | {f"value_{k}": v for k, v in self.value_codec.meta().items()}

    # -- storage ----------------------------------------------------------------

    def _fetch(self, stop: int, num_queries: int) -> tuple:
        """The first `stop` slots as attention will read them for `num_queries` queries."""
        keys, values = _slice(self._keys, stop), _slice(self._values, stop)
        if attends_packed(self.key_codec, self.value_codec, num_queries):
            return Packed(keys), Packed(values)
        return self.key_codec.decode(keys), self.value_codec.decode(values)

    def _limit(self) -> int:
        return self.max_tokens if self.window is None else self.window.max_size

    def _reserve(self, needed: int, like_k: Fields, like_v: Fields) -> None:
        """Grow storage to hold `needed` token slots (rounded up to `step`, capped)."""
        if needed <= self.capacity:
            return
        new_cap = min(self._limit(), self.step * math.ceil(needed / self.step))
        live = self.num_live

        def grow(old: Fields | None, like: Fields) -> Fields:
            fresh = tuple(
                mx.zeros((*f.shape[:2], new_cap - (live if old else 0), *f.shape[3:]), f.dtype) for f in like
            )
            if old is None:
                return fresh
            return tuple(mx.concatenate([o[:, :, :live], z], axis=2) for o, z in zip(old, fresh))

        self._keys, self._values = grow(self._keys, like_k), grow(self._values, like_v)

    def _write(self, k_new: Fields, v_new: Fields, slots: np.ndarray | None, start: int) -> None:
        num_new = k_new[0].shape[2]
        if slots is None:
            self._reserve(start + num_new, k_new, v_new)
            for store, new in ((self._keys, k_new), (self._values, v_new)):
                for f, x in zip(store, new):
                    f[:, :, start : start + num_new] = x
            return
        idx = mx.array(slots)
        for store, new in ((self._keys, k_new), (self._values, v_new)):
            for f, x in zip(store, new):
                f[:, :, idx] = x

    def _write_ring(self, k_new: Fields, v_new: Fields, start: int) -> None:
        """Write a wrapping chunk: per slot, only the newest position that maps to it survives."""
        num_new = k_new[0].shape[2]
        self._reserve(self.window.max_size, k_new, v_new)
        slots = self.window.slot(np.arange(start, start + num_new))
        last_for_slot = {int(s): i for i, s in enumerate(slots)}  # later positions overwrite
        dest = np.fromiter(last_for_slot.keys(), np.int64)
        src = mx.array(np.fromiter(last_for_slot.values(), np.int64))
        self._write(tuple(x[:, :, src] for x in k_new), tuple(x[:, :, src] for x in v_new), dest, start)
