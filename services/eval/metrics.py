"""Teacher-forced and free-running quality of a cache scheme against the raw cache.

Teacher-forced: the same tokens go through the model in chunks, so every chunk after the
first attends to history the scheme has already stored (compressed). Per position the
scheme's next-token distribution `q` is compared with the raw cache's `p`: mean
`KL(p || q) = sum_v p_v (log p_v - log q_v)` in nats, top-1 agreement (`argmax q == argmax p`)
and the perplexity `exp(mean -log q[target])`. Log-probabilities come from the model in its
dtype (log-softmax in MLX); every sum and mean is accumulated in float64.

Free-running: greedy decoding from a prompt, token by token through the decode path;
the score is how many tokens match the raw cache's greedy continuation before the first
difference.

Source: CACHES.md "What measurements on the default model say".
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from services.engine.generate import prefill


def logprob_chunks(model: nn.Module, caches: list, token_ids: list[int], *, chunk: int) -> Iterator[np.ndarray]:
    """Run `token_ids` through the model in chunks and yield each chunk's log-probabilities.

    Args:
        model (nn.Module): mlx-lm model.
        caches (list): Fresh per-layer caches; filled in place.
        token_ids (list[int]): Input tokens.
        chunk (int): Tokens per forward.

    Yields:
        np.ndarray: float32 [n, vocab] log-softmax of the next-token logits at each of the
        chunk's `n` positions (owned by the caller).
    """
    tokens = mx.array(token_ids, dtype=mx.uint32)[None]
    for start in range(0, len(token_ids), chunk):
        logits = model(tokens[:, start : start + chunk], cache=caches)[0].astype(mx.float32)
        yield np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


@dataclass(frozen=True, slots=True)
class Quality:
    """Teacher-forced quality of one scheme against the raw cache."""

    num_positions: int  # next-token predictions scored
    perplexity: float  # exp(mean NLL of the targets under the scheme)
    mean_kl: float  # mean KL(raw || scheme) per position, nats
    top1_agreement: float  # fraction of positions whose argmax equals the raw cache's


@dataclass(slots=True)
class QualityAccumulator:
    """Float64 running sums behind `Quality`; feed it chunk by chunk with `add`."""

    nll_sum: float = 0.0
    kl_sum: float = 0.0
    agreements: int = 0
    count: int = 0

    def add(self, logprobs: np.ndarray, reference: np.ndarray, targets: np.ndarray) -> None:
        """Score one chunk.

        Args:
            logprobs (np.ndarray): [n, vocab] log-probabilities under the scheme.
            reference (np.ndarray): [n, vocab] log-probabilities under the raw cache.
            targets (np.ndarray): [n] int, the actual next tokens.
        """
        self.nll_sum -= float(np.sum(logprobs[np.arange(len(targets)), targets], dtype=np.float64))
        self.kl_sum += float(np.sum(kl_divergence(reference, logprobs)))
        self.agreements += int(np.sum(logprobs.argmax(-1) == reference.argmax(-1)))
        self.count += len(targets)

    def result(self) -> Quality:
        """The accumulated `Quality` (means over every position added)."""
        return Quality(self.count, float(np.exp(self.nll_sum / self.count)), self.kl_sum / self.count,
                       self.agreements / self.count)


def kl_divergence(reference: np.ndarray, logprobs: np.ndarray) -> np.ndarray:
    """`KL(p || q)` per row from log-probabilities, in float64 nats.

    Args:
        reference (np.ndarray): [n, vocab] `log p`.
        logprobs (np.ndarray): [n, vocab] `log q`.

    Returns:
        np.ndarray: float64 [n], each `sum_v p_v (log p_v - log q_v)`.
    """
    log_p = reference.astype(np.float64)
    return np.sum(np.exp(log_p) * (log_p - logprobs.astype(np.float64)), axis=-1)


def greedy_tokens(
    model: nn.Module, caches: list, prompt_ids: list[int], *, max_new: int, chunk: int, follow: list[int] | None = None
) -> list[int]:
    """Greedy continuation of a prompt, one decode step per token.

    Args:
        model (nn.Module): mlx-lm model.
        caches (list): Fresh per-layer caches; filled in place.
        prompt_ids (list[int]): Prompt tokens (prefilled in chunks of `chunk`).
        max_new (int): Most tokens to generate.
        chunk (int): Prefill chunk (tokens).
        follow (list[int] | None): A reference continuation: stop after the first token
            that differs from it (that token is included).

    Returns:
        list[int]: The generated tokens (EOS is not special here).
    """
    logits = prefill(model, caches, prompt_ids, chunk=chunk)
    out: list[int] = []
    while len(out) < max_new:
        token = int(mx.argmax(logits).item())
        out.append(token)
        if follow is not None and token != follow[len(out) - 1]:
            break
        logits = model(mx.array([[token]], dtype=mx.uint32), cache=caches)[0, -1]
    return out


def matching_prefix(reference: list[int], tokens: list[int]) -> int:
    """Tokens generated before the first difference from `reference` (tokens)."""
    for i, (a, b) in enumerate(zip(reference, tokens)):
        if a != b:
            return i
    return min(len(reference), len(tokens))


@dataclass(frozen=True, slots=True)
class KLReference:
    """A chunk of the raw cache's distributions, prepared so each `KL(p || q)` is one dot product.

    `KL(p || q) = sum_v p_v log p_v - sum_v p_v log q_v`: the first sum is computed once, so
    scoring a scheme costs a row-wise float64 dot product instead of an `exp` over the vocabulary
    (about 40x less time on the default model's 49,152 tokens).
    """

    probs: np.ndarray  # float32 [n, vocab], p = exp(log p)
    neg_entropy: np.ndarray  # float64 [n], sum_v p_v log p_v with the same float32 p (nats)

    @classmethod
    def from_logprobs(cls, reference: np.ndarray) -> "KLReference":
        """Prepare from the raw cache's float32 [n, vocab] log-probabilities."""
        probs = np.exp(reference)
        return cls(probs, np.einsum("ij,ij->i", probs, reference, dtype=np.float64))

    def kl(self, logprobs: np.ndarray) -> np.ndarray:
        """`KL(p || q)` per row, float64 nats, from the scheme's [n, vocab] `log q`."""
        return self.neg_entropy - np.einsum("ij,ij->i", self.probs, logprobs, dtype=np.float64)
