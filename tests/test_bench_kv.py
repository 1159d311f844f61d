"""ops/bench_kv.py's "weights" figure: the model's parameter bytes (hand-derived)."""

import mlx.core as mx

from ops.bench_kv import parameter_bytes
from tests.conftest import make_tiny_llama


def test_weights_are_the_parameter_bytes_counted_by_hand():
    # Tiny llama (float32, tied embeddings): embedding 128 x 256; per layer q, o 256 x 256, k, v 256 x 128,
    # gate, up 256 x 512, down 512 x 256 and two norms of 256; one final norm of 256.
    per_layer = 2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 512 + 2 * 256
    params = 128 * 256 + 2 * per_layer + 256
    model = make_tiny_llama()
    assert parameter_bytes(model) == 4 * params == 4_854_784
    model.set_dtype(mx.bfloat16)
    assert parameter_bytes(model) == 2 * params
