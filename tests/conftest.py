"""Shared fixtures: the real default model (loaded once) and a tiny random-initialized llama."""

from __future__ import annotations

import os

# MLX's CUDA backend runs float32 matmuls in TF32 unless told otherwise (read once, at the first matmul), so
# a batched forward (a GEMM) and one row (a GEMV) of the float32 test models would differ by ~1e-3; the
# batch-invariance tests compare them at 2e-4 (on the H200, 11 of tests/test_batched_cache.py failed so).
os.environ["MLX_ENABLE_TF32"] = "0"

import mlx.core as mx  # noqa: E402
import pytest  # noqa: E402

from services.engine import attention  # noqa: E402


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by mark
def pytest_collection_modifyitems(items):
    """Every test that takes the real default model carries the `model` mark, so `-m "not model"` skips it."""
    for item in items:
        if "default_model" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.model)


@pytest.fixture(scope="session")
def default_model():
    """SmolLM2-135M-Instruct from the shipped GGUF, float32 on CPU (converted once per data dir)."""
    from services.engine.model.loader import load_model

    return load_model("default")


def make_tiny_llama(*, seed: int = 0, n_layers: int = 2, head_dim: int = 64, vocab: int = 128):
    """A random-initialized llama (float32) small enough for exhaustive cache tests."""
    attention.install()
    from mlx_lm.models import llama

    args = llama.ModelArgs(
        model_type="llama", hidden_size=4 * head_dim, num_hidden_layers=n_layers, intermediate_size=8 * head_dim,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=vocab,
        head_dim=head_dim, tie_word_embeddings=True, max_position_embeddings=4096,
    )
    mx.random.seed(seed)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="session")
def tiny_llama():
    return make_tiny_llama()
