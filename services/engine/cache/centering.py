"""Key centering: each compressed attention layer stores `k - mu` for its mean key `mu` (SageAttention's "smooth K").

Every query's scores over one sequence move by the same constant, `q . mu`, so softmax, and with it
attention, is unchanged exactly. The stored vectors lose their shared component, and with it most of
their energy: on the default model, held-out post-RoPE keys keep 0.33–0.58 of it per layer. Every
codec's error scales with that energy (AURA quantizes the unit direction and stores the norm), so
centering lowers the KL of the compressed schemes: aura4v4 0.053 -> 0.033 on 1,024 held-out Lee
tokens, −10 to −38% for the others whose error is not all in their values (`ops/centering_gain.py`).

Keys only. Values could be centered too (the weights sum to one, so adding `mu_v` back to the output
is exact), and their energy falls to 0.75–0.97, but measured KL rose (aura4v4 with centered keys
0.031 -> 0.042 on 256 tokens): the tokens attention weighs most, the attention sinks, carry small
values that centering makes large. Layers with learned attention sinks (the sink logit does not move with the
scores) and latent (MLA) layers, whose model reads the slots back, keep their keys as they are: the
factory (`make_layer_caches`) reads both off the layer's probed geometry.

Source: Zhang et al., "SageAttention: Accurate 8-bit attention for plug-and-play inference
acceleration" (ICLR 2025), section 4.2 ("smooth K").
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

CALIBRATION_TOKENS = 512  # tokens of text whose keys give the means


@dataclass(frozen=True, eq=False)
class KeyMeans:
    """Per attention layer (the model's `KVCache` leaves, in order), its mean key.

    Attributes:
        means (tuple[mx.array, ...]): float32 [n_kv_heads, 1, key_dim] each, row-contiguous.
    """

    means: tuple[mx.array, ...]

    @classmethod
    def measure(cls, model: nn.Module, token_ids: list[int], *, chunk: int = 256) -> KeyMeans:
        """Run `token_ids` through the model over raw caches and average each layer's post-RoPE keys.

        Args:
            model (nn.Module): mlx-lm model.
            token_ids (list[int]): Calibration text (`CALIBRATION_TOKENS` serve; the Lee corpus by default).
            chunk (int): Tokens per forward.

        Raises:
            ValueError: no tokens.
        """
        from .factory import CacheOptions, make_layer_caches
        from .kv import KVCache
        from .recurrent import leaf_caches

        if not token_ids:
            raise ValueError("key means need at least one calibration token")
        caches = make_layer_caches(model, CacheOptions(scheme="raw", max_context=len(token_ids)))
        layers = [c for c in leaf_caches(caches) if isinstance(c, KVCache)]
        sums: list[mx.array | None] = [None] * len(layers)
        for i, cache in enumerate(layers):
            cache.update_and_fetch = _summing(cache.update_and_fetch, sums, i)
        tokens = mx.array(token_ids, dtype=mx.uint32)[None]
        for start in range(0, len(token_ids), chunk):
            mx.eval(model(tokens[:, start : start + chunk], cache=caches), sums)
        return cls(tuple(total / len(token_ids) for total in sums))


def _summing(update, sums: list, i: int):
    def update_and_fetch(keys, values):
        total = keys[0].astype(mx.float32).sum(axis=1, keepdims=True)  # [H, 1, D]
        sums[i] = total if sums[i] is None else sums[i] + total
        return update(keys, values)
    return update_and_fetch


def center(keys: mx.array, mean: mx.array | None) -> mx.array:
    """`keys` [B, H, L, D] minus `mean` [H, 1, D] (float32), in `keys`' dtype; `keys` when `mean` is None."""
    return keys if mean is None else (keys.astype(mx.float32) - mean).astype(keys.dtype)
