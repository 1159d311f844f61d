"""Single-sequence generation in process: chunked prefill, pipelined decode, streaming text."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from shared.detok import IncrementalDetokenizer
from shared.errors import BadRequest
from shared.protocol import FinishReason, SamplingParams
from shared.text_stream import TextStream

from .request import cap_max_tokens
from .sampling import RequestSampler


@dataclass(slots=True)
class GenerationStats:
    """Counters of one generation (tokens, seconds, bytes)."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0  # prompt submitted → first token sampled
    decode_s: float = 0.0  # first token → last token
    kv_bytes: int = 0  # bytes the caches hold at the end
    finish_reason: FinishReason | None = None  # STOP (EOS or stop string) or LENGTH; None until the end
    token_ids: list[int] = field(default_factory=list)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        steps = self.generated_tokens - 1
        return steps / self.decode_s if steps > 0 and self.decode_s else 0.0


def prefill(model: nn.Module, caches: list, token_ids: list[int], *, chunk: int) -> mx.array:
    """Run the prompt through the model in chunks of `chunk` tokens.

    Args:
        model (nn.Module): mlx-lm model.
        caches (list): Per-layer caches; filled in place.
        token_ids (list[int]): Prompt tokens (at least one).
        chunk (int): Tokens per forward (bounds activation memory).

    Returns:
        mx.array: Logits of the last prompt token, [vocab] (lazy).
    """
    tokens = mx.array(token_ids, dtype=mx.uint32)[None]
    # All but the last token only fill the caches: evaluating just their state skips the LM head.
    for start in range(0, len(token_ids) - 1, chunk):
        model(tokens[:, start : min(start + chunk, len(token_ids) - 1)], cache=caches)
        mx.eval([c.state for c in caches])
    return model(tokens[:, -1:], cache=caches)[0, -1]


def generate(
    model: nn.Module,
    tokenizer,
    token_ids: list[int],
    caches: list,
    params: SamplingParams,
    *,
    max_context: int,
    stop: tuple[str, ...] = (),
    prefill_chunk: int = 512,
    stats: GenerationStats | None = None,
) -> Iterator[str]:
    """Generate from a prompt, yielding UTF-8-safe text deltas.

    Decode is pipelined as in mlx-lm's `generate_step`: step n+1 is launched with
    `mx.async_eval` before token n is read back. Generation ends on an EOS token, a stop
    string (also across token boundaries; the stop text is not emitted), or after
    `params.max_tokens` tokens capped to the context. Text comes from the gateway's own
    `TextStream` (`shared/text_stream.py`), so both show the same completion.

    Args:
        token_ids (list[int]): Prompt tokens.
        caches (list): Fresh per-layer caches (from `make_layer_caches`).
        max_context (int): Context cap (tokens).
        stop (tuple[str, ...]): Strings that end generation (not included in the output).
        stats (GenerationStats | None): Filled in as generation goes.

    Raises:
        BadRequest: an empty prompt or an empty stop string.
        ContextOverflow: the prompt does not fit `max_context`.
    """
    if any(not s for s in stop):
        raise BadRequest("stop strings must be non-empty")
    stats = stats if stats is not None else GenerationStats()
    max_tokens = cap_max_tokens(len(token_ids), params.max_tokens, max_context)
    sampler = RequestSampler(params)
    text = TextStream(IncrementalDetokenizer(tokenizer, token_ids), stop, frozenset(tokenizer.eos_token_ids))
    stats.prompt_tokens = len(token_ids)
    t0 = time.perf_counter()
    y = sampler(prefill(model, caches, token_ids, chunk=prefill_chunk))
    mx.async_eval(y)
    for n in range(1, max_tokens + 1):
        if n < max_tokens:
            next_y = sampler(model(y.reshape(1, 1), cache=caches)[0, -1])
            mx.async_eval(next_y)
        token = y.item()
        if n == 1:
            t1 = time.perf_counter()
            stats.prefill_s = t1 - t0
        stats.token_ids.append(token)
        stats.generated_tokens = n
        delta = text.feed([token])
        if delta.text:
            yield delta.text
        if text.closed:
            stats.finish_reason = FinishReason.STOP
            break
        if n < max_tokens:
            y = next_y
    else:
        stats.finish_reason = FinishReason.LENGTH
    stats.decode_s = time.perf_counter() - t1
    tail = text.finish()
    if tail:
        yield tail
    stats.kv_bytes = sum(c.nbytes for c in caches)
