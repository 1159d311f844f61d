"""Layers whose attention runs on operands the model derives from the cache (MLA).

DeepSeek-V3 / Kimi attention (mlx-lm's `deepseek_v3`, `kimi_k25`, ...) caches one *latent*
per token (`kv_lora_rank` wide, after its RMSNorm) and the RoPE part of the key
(`qk_rope_head_dim` wide) as the cache's "keys" and "values" of a single kv head; the model
then scores the RoPE part itself, passes the result as an additive mask, and multiplies the
latent out per head (prompt chunks) or folds the per-head projections into the queries
(decode). Nothing the cache holds is attended directly, so such a layer cannot be attended
in place: `latent_operands` decodes every slot the forward sees (history, then the chunk's
own tokens) to the model's domain, zeros where a row has no token, and `latent_mask` gives
the visibility the model applies (per row: its length, causality, the window rule).

Source: DeepSeek-V2 (arXiv 2405.04434) section 2.1 (multi-head latent attention); mlx-lm 0.32
`models/deepseek_v3.py`.
"""

from __future__ import annotations

import mlx.core as mx

from kernels.paged_attention import History, PoolRef, WindowRule, history_masks, new_visible


def latent_operands(ref: PoolRef, history: History | None, new_rows: tuple[mx.array, ...] | None,
                    dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    """The rows' stored K and V in the model's domain: history slots, then the chunk's own.

    Args:
        ref (PoolRef): The layer's pools.
        history (History | None): Stored slots (decode: every live slot, the new token included).
        new_rows (tuple[mx.array, ...] | None): The chunk's encoded rows per pool [B, H, L, width]
            (prompt chunks), or None.
        dtype (mx.Dtype): Dtype of the result (the model's).

    Returns:
        tuple[mx.array, mx.array]: K [B, H, T, Dk] and V [B, H, T, Dv], T = `history.num_slots` + L;
        zeros at history slots past a row's length (whatever storage holds there).
    """
    keys, values = [], []
    if history is not None:
        for first, rows in history.chunks(ref):
            k, v = ref.fmt.decode_plain(rows)
            valid = history_masks(history, first, rows[0].shape[2], None)[0].swapaxes(-1, -2)  # [B, 1, C, 1]
            keys.append(mx.where(valid, k, 0).astype(dtype)), values.append(mx.where(valid, v, 0).astype(dtype))
    if new_rows is not None:
        k, v = ref.fmt.decode_plain(new_rows)
        keys.append(k.astype(dtype)), values.append(v.astype(dtype))
    return mx.concatenate(keys, axis=2), mx.concatenate(values, axis=2)


def latent_mask(history: History | None, num_history_slots: int, query_positions: mx.array | None,
                window: WindowRule | None) -> mx.array:
    """Visibility [B, 1, L, T] of `latent_operands`' slots to the forward's queries.

    Args:
        history (History | None): As given to `latent_operands`.
        num_history_slots (int): `history.num_slots(page_size)` (0 without history).
        query_positions (mx.array | None): int32 [B, L] of a prompt chunk; None for a decode
            step, whose history already holds its token (every live slot is visible).
        window (WindowRule | None): The layer's window.
    """
    parts = []
    if history is not None:
        rule = None
        if query_positions is not None and window is not None:
            rule = (query_positions[:, None, :, None], window)
        parts.append(history_masks(history, 0, num_history_slots, rule)[1])
    if query_positions is not None:
        length = query_positions.shape[1]
        parts = [mx.broadcast_to(p, (p.shape[0], 1, length, p.shape[-1])) for p in parts]
        parts.append(new_visible(query_positions, window))
    return mx.concatenate(parts, axis=-1)
