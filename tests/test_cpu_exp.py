"""`kernels.cpu_exp`: e^x for x <= 0 against float64 NumPy, compiled (as the decode step runs it) and not."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kernels.cpu_exp import POLY_MIN_ELEMENTS, exp_nonpositive, softmax_exp

ULP = 2.0**-24  # float32 relative rounding


@pytest.mark.parametrize("compiled", [False, True])
def test_matches_float64_exp(compiled):
    x = np.concatenate([np.linspace(-87.0, 0.0, 200_001, dtype=np.float32),
                        -np.logspace(-30, 1.9, 5_001, dtype=np.float32)])
    fn = mx.compile(exp_nonpositive) if compiled else exp_nonpositive
    got = np.array(fn(mx.array(x))).astype(np.float64)
    want = np.exp(x.astype(np.float64))
    # x * log2(e) is rounded to float32 first: |x| * 2^-24 of relative error; 4 ulp more for the
    # polynomial (2.2e-9) and its float32 evaluation.
    bound = (4 + 1.5 * np.abs(x)) * ULP
    normal = want >= 2.0**-126
    rel = np.abs(got[normal] - want[normal]) / want[normal]
    assert np.all(rel <= bound[normal]), float((rel / bound[normal]).max())
    assert np.all(got[~normal] <= 2.0**-126)


def test_masked_scores_give_exact_zero_and_zero_gives_one():
    x = mx.array([-np.inf, -1e30, -200.0, 0.0, -0.0], dtype=mx.float32)
    assert np.array(exp_nonpositive(x)).tolist() == [0.0, 0.0, 0.0, 1.0, 1.0]


def test_nan_stays_nan():
    assert np.isnan(np.array(exp_nonpositive(mx.array([np.nan], dtype=mx.float32)))).all()


@pytest.mark.parametrize("size", [POLY_MIN_ELEMENTS - 1, POLY_MIN_ELEMENTS])
def test_softmax_exp_matches_float64_either_side_of_its_switch(size):
    x = -np.linspace(0.0, 30.0, size, dtype=np.float32)
    got = np.array(softmax_exp(mx.array(x))).astype(np.float64)
    want = np.exp(x.astype(np.float64))
    assert np.all(np.abs(got - want) <= (4 + 1.5 * np.abs(x)) * ULP * want)
