"""Fused sibling projections compute what the separate Linear layers computed."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from services.engine.model.fuse import FusedLinear, FusedView, fuse_projections
from services.engine.model.loader import load_model


def _count(model: nn.Module) -> int:
    return sum(v.size for _, v in nn.utils.tree_flatten(model.parameters()))


@pytest.mark.model
def test_fused_default_model_gives_the_same_logits_with_the_same_parameters():
    loaded = load_model("default")
    model, layers = loaded.model, len(loaded.model.layers)
    ids = mx.array([[1, 504, 3102, 314, 2681, 28, 9, 77]])
    want, size = np.array(model(ids)), _count(model)
    assert fuse_projections(model) == 2 * layers  # q/k/v and gate/up in every layer
    assert fuse_projections(model) == 0  # already fused: nothing left to fuse
    assert _count(model) == size  # the fused weights replace the separate ones, listed once
    np.testing.assert_allclose(np.array(model(ids)), want, rtol=1e-4, atol=1e-4)


def test_each_view_is_its_own_slice_whatever_the_call_order():
    rng = np.random.default_rng(0)
    linears = [nn.Linear(8, n, bias=True) for n in (3, 5, 2)]
    fused = FusedLinear(linears)
    views = [FusedView(fused, i) for i in range(3)]
    x, y = (mx.array(rng.standard_normal((4, 8)).astype(np.float32)) for _ in range(2))
    for i, inp in ((2, x), (0, x), (1, y), (1, x), (0, y), (2, y)):  # shared and distinct inputs, any order
        want = np.array(inp, np.float64) @ np.array(linears[i].weight, np.float64).T + np.array(linears[i].bias)
        np.testing.assert_allclose(np.array(views[i](inp)), want, rtol=1e-5, atol=1e-5)
