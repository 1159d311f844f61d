"""The model runner: the only engine module that builds MLX arrays and evaluates them.

A step is a list of forwards: one B=1 forward per prompt chunk, then one batched decode
forward over every running stream (rows of different lengths, one token each). The decode
forward is traced with `mx.compile` and replayed: building every layer's graph in Python
each step is what bounds a GPU's decode rate at small batches.

Steps are pipelined: each forward's graph is built while the previous one computes, then
the runner waits for that one and launches this one. It must wait before launching because
a forward writes the page storage in place only when no pending work still reads it (MLX
decides buffer donation when the work is launched); building ahead is what overlaps. The
last forward of a step stays in flight while the engine reads back the step before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from .cache.batched import BatchedKVCache
from .request import Request
from .sampling import RequestSampler
from .scheduler import PrefillChunk, StepPlan


@dataclass(slots=True)
class Launch:
    """The sampled tokens of one launched step (lazy until collected)."""

    step_id: int  # the cache's fence id of this step
    request_ids: list[str] = field(default_factory=list)  # one per sampled token, in order
    rows: dict[str, int] = field(default_factory=dict)  # request id -> its index in request_ids
    parts: list[mx.array] = field(default_factory=list)  # uint32 [n] each: the sampled tokens
    is_done: bool = False  # every forward of it has finished (the runner waited on it)

    def tokens(self) -> mx.array | None:
        """uint32 [len(request_ids)], lazy."""
        if not self.parts:
            return None
        return self.parts[0] if len(self.parts) == 1 else mx.concatenate(self.parts)

    def add(self, tokens: mx.array, requests: list[Request]) -> None:
        """Append one forward's sampled tokens [n] for its n requests."""
        self.parts.append(tokens)
        for request in requests:
            self.rows[request.request_id] = len(self.request_ids)
            self.request_ids.append(request.request_id)


class ModelRunner:
    """Runs scheduled steps of an mlx-lm model over a `BatchedKVCache`.

    Args:
        model (nn.Module): mlx-lm model whose attention goes through our seam.
        cache (BatchedKVCache): The paged cache; the runner writes its storage.
    """

    def __init__(self, model: nn.Module, cache: BatchedKVCache):
        self.model, self.cache = model, cache
        self._samplers: dict[str, RequestSampler] = {}
        self._last: Launch | None = None  # the latest launch, whose tokens feed the next decode
        # Traced once per shape (rows, pages read) and replayed: building the graph of every
        # layer in Python each step is what bounds a GPU's decode rate at small batches.
        self._decode_logits = mx.compile(self._decode_graph)

    def run(self, plan: StepPlan) -> Launch:
        """Build and launch every forward of a step; the last one is left in flight.

        Raises:
            CapacityExhausted: only if the plan asks for pages the scheduler did not reserve.
        """
        launch = Launch(step_id=self.cache.slots.launch_step())
        for chunk in plan.prefills:
            self._launch(*self._prefill(chunk), launch)
        if plan.decodes:
            self._launch([], *self._decode(plan.decodes), launch)
        self._last = launch
        return launch

    def collect(self, launch: Launch) -> dict[str, int]:
        """Wait for a launched step and read its tokens back; its pages may then be reused.

        Returns:
            dict[str, int]: token id sampled for each request of the step.
        """
        if not launch.is_done:
            mx.synchronize()
            launch.is_done = True
        tokens = launch.tokens()
        values = [] if tokens is None else tokens.tolist()
        self.cache.slots.complete_step(launch.step_id)
        return dict(zip(launch.request_ids, values))

    def drain(self) -> None:
        """With nothing in flight, pass the fence so released pages return to the free list."""
        step_id = self.cache.slots.launch_step()
        mx.synchronize()
        self.cache.slots.complete_step(step_id)

    def forget(self, request_id: str) -> None:
        """Drop a finished request's sampler."""
        self._samplers.pop(request_id, None)

    # -- forwards ----------------------------------------------------------------

    def _launch(
        self, prefetch: list[mx.array], sampled: mx.array | None, requests: list[Request], launch: Launch
    ) -> None:
        """Wait for whatever is in flight, then launch this forward (see the module docstring)."""
        mx.synchronize()
        if self._last is not None:
            self._last.is_done = True
        if prefetch:
            mx.eval(prefetch)
        outputs = [] if sampled is None else [sampled]
        mx.async_eval(*outputs, *self.cache.arrays)
        if sampled is not None:
            launch.add(sampled, requests)

    def _prefill(self, chunk: PrefillChunk):
        """Build one prompt chunk's forward (B=1); sample only when it completes the prompt."""
        request = chunk.request
        batch = self.cache.batch([request.slot], chunk.num_tokens)
        logits = self.model(mx.array(chunk.token_ids, dtype=mx.uint32)[None], cache=batch.layers)
        if not chunk.is_last:
            return batch.prefetch, None, []  # the logits are never evaluated, so never computed
        token = self._sampler(request)(logits[0, -1])
        return batch.prefetch, token.reshape(1).astype(mx.uint32), [request]

    def _decode(self, requests: tuple[Request, ...]):
        """Build the batched decode forward: one token per row, each row at its own position."""
        indices = self.cache.decode_indices([r.slot for r in requests])
        logits, arrays = self._decode_logits(self._input_tokens(requests), indices, self.cache.arrays)
        self.cache.replace_arrays(arrays)
        tokens = mx.argmax(logits, axis=-1).astype(mx.uint32)  # greedy rows, all at once
        drawn = [i for i, r in enumerate(requests) if r.params.temperature > 0]
        if drawn:
            samples = [self._sampler(requests[i])(logits[i]) for i in drawn]
            tokens[mx.array(drawn)] = mx.stack(samples).astype(mx.uint32)
        return tokens, list(requests)

    def _decode_graph(self, tokens: mx.array, indices: list[list[mx.array]], arrays: list[mx.array]):
        """The traced decode forward: logits [B, vocab] and the written storage arrays."""
        layers, storage = self.cache.decode_layers(arrays, indices)
        logits = self.model(tokens[:, None], cache=layers)[:, -1]
        return logits, storage.arrays

    def _input_tokens(self, requests: tuple[Request, ...]) -> mx.array:
        """uint32 [B]: each row's latest token, from the last launch while it is not read back yet."""
        last = self._last
        rows = [None if last is None else last.rows.get(r.request_id) for r in requests]
        if last is not None and rows == list(range(len(last.request_ids))):
            return last.tokens()  # the common case: the last step's rows, in the same order
        # Otherwise pick from the last launch's tokens followed by tokens already read back.
        sampled = 0 if last is None else len(last.request_ids)
        known, index = [], []
        for request, row in zip(requests, rows):
            if row is None:
                index.append(sampled + len(known))
                known.append(request.output_token_ids[-1])
            else:
                index.append(row)
        pool = [last.tokens()] if sampled else []
        if known:
            pool.append(mx.array(known, dtype=mx.uint32))
        return mx.take(mx.concatenate(pool), mx.array(index))

    def _sampler(self, request: Request) -> RequestSampler:
        if request.request_id not in self._samplers:
            self._samplers[request.request_id] = RequestSampler(request.params)
        return self._samplers[request.request_id]
