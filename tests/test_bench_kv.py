"""ops/bench_kv.py's "weights" figure (the model's parameter bytes) and its median of interleaved rounds'
ratios, hand-derived."""

import mlx.core as mx
import pytest

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


def test_median_round_ratio_takes_each_rounds_ratio_then_the_median():
    from ops.bench_kv import median_round_ratio

    # Round ratios 1.1, 0.5 (a stalled round), 1.2: the median is 1.1, where the aggregate 560 / 600 is 0.93.
    assert median_round_ratio([220.0, 100.0, 240.0], [200.0, 200.0, 200.0]) == pytest.approx(1.1)
    assert median_round_ratio([300.0, 330.0], [300.0, 300.0]) == pytest.approx(1.05)  # even count: the mean of two
    with pytest.raises(ValueError):
        median_round_ratio([1.0], [1.0, 2.0])
