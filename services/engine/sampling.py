"""Per-request sampling: temperature, top-k, top-p, and a seed that belongs to the request.

Each request owns a PRNG key split once per generated token, so its draws do not depend
on what else shares the batch. Logit filters are mlx-lm's (`apply_top_k`, `apply_top_p`).

Every accepted value is sampled correctly in float32: a temperature below `MIN_TEMPERATURE`
is greedy (as vLLM's `_SAMPLING_EPS`; 1/T would overflow float32 near 1e-39), log-probs are
divided by T after their maximum is subtracted, top_p is raised to `MIN_TOP_P` (any top_p
at or below the top token's probability, which is at least 1/vocab, keeps that token alone),
and a top_k at or above the vocabulary size keeps every token.
"""

from __future__ import annotations

import random

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_k, apply_top_p

from shared.protocol import SamplingParams

MIN_TEMPERATURE = 1e-5  # below: greedy
MIN_TOP_P = 1e-10  # below 1/vocab for any vocabulary under 2**33 tokens; float32 keeps it non-zero


class RequestSampler:
    """Draws one request's tokens with its own PRNG stream."""

    def __init__(self, params: SamplingParams):
        self.params = params
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        self._key = mx.random.key(seed)

    def __call__(self, logits: mx.array) -> mx.array:
        """Sample from logits [V] (float) and return a scalar uint32 token id (lazy)."""
        p = self.params
        if p.temperature < MIN_TEMPERATURE:
            return mx.argmax(logits, axis=-1)
        self._key, draw = mx.random.split(self._key)
        logprobs = (logits - mx.logsumexp(logits, keepdims=True))[None]
        if p.top_k is not None and p.top_k < logprobs.shape[-1]:
            logprobs = apply_top_k(logprobs, p.top_k)
        if p.top_p < 1:
            logprobs = apply_top_p(logprobs, max(p.top_p, MIN_TOP_P))
        # Shifted so the best token is at 0: dividing by a small T cannot overflow to -inf everywhere.
        shifted = logprobs - mx.max(logprobs, axis=-1, keepdims=True)
        return mx.random.categorical(shifted / p.temperature, key=draw)[0]
