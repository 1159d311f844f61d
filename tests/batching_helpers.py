"""Models shared by the batching tests (the tiny llama of conftest has full attention only)."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import llama

from services.engine import attention


def make_tiny_mixed_llama(*, vocab: int = 128, sliding_window: int = 6):
    """A random llama whose layer 0 has full attention and layer 1 an architectural sliding window."""
    attention.install()
    args = llama.ModelArgs(
        model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=vocab, head_dim=32, tie_word_embeddings=True,
        max_position_embeddings=4096, layer_types=["full_attention", "sliding_attention"],
        sliding_window=sliding_window,
    )
    mx.random.seed(1)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model
