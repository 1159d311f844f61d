"""The model runner: the only engine module that builds MLX arrays and evaluates them.

A step is a list of forwards: one B=1 forward per prompt chunk, then a decode window of N
steps over every running stream (rows of different lengths, one token each per step). The
window's steps are launched back to back, each fed the previous step's sampled tokens on the
device, so the host builds and launches step n+1 while the GPU computes step n; the host
waits once per window. The steps write a small tail pool (`cache.decode_window`), because a
step may write the main pools in place only when nothing launched still reads them. The next
window of decode rows may launch before the last is read back (`run(plan, ahead_of=...)`,
`EngineCore.launch_ahead`): the last window's tail pages go home first, in stream order, and its
last step's tokens feed the new one on the device, so the GPU never waits for the read-back.

The decode step is traced with `mx.compile` and replayed: building every layer's graph in
Python each step is what bounds a GPU's decode rate at small batches; for Llama-style models the
traced step is `model.decode.LeanDecoder` (mlx-lm's function in fewer primitives, each costing
host time at every replay). Prompt chunks run eagerly; each waits for what is in flight, so its
writes land in place.

Hybrid models' recurrent state rides along: a prompt chunk reads and writes its slot's state
in the state pool; a window gathers its rows' state once, feeds it through the traced steps,
and writes the last step's state back when the window is collected. A window's tokens past
a request's ending advance the state too, and state cannot be cut back: so each window keeps
its rows' starting state (`WindowStart`) until the next step is launched, and a session
whose slot was truncated to that start (its checkpoint, `SlotTable.truncation_point`) gets
it back — the next turn then computes the window's kept tokens again (at most a window's
worth), instead of the whole conversation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from kernels.argmax import argmax_rows

from .cache.batched import BatchedKVCache, WindowArrays
from .cache.pages import SlotView
from .model.decode import LeanDecoder
from .request import Request
from .sampling import RequestSampler
from .scheduler import PrefillChunk, StepPlan


@dataclass(slots=True)
class Launch:
    """The sampled tokens of one launched step (lazy until collected)."""

    step_id: int  # the cache's fence id of this step
    prefill_tokens: list[tuple[str, mx.array]] = field(default_factory=list)  # request id, uint32 [1]
    window_ids: list[str] = field(default_factory=list)  # decode rows, in batch order
    window_tokens: list[mx.array] = field(default_factory=list)  # per step, uint32 [B]
    tail_home: bool = False  # its tail pages were copied home by the next launch (launched ahead)
    window_arrays: WindowArrays | None = None  # its index arrays: the tail's rows to copy back
    window_start: WindowStart | None = None  # the rows' recurrent state before the window (hybrids)
    window_states: list[mx.array] = field(default_factory=list)  # the rows' recurrent state after it


@dataclass(frozen=True, slots=True)
class WindowStart:
    """A decode window's rows and their recurrent state at its start (the rows' checkpoints)."""

    views: tuple[SlotView, ...]
    starts: tuple[int, ...]  # each row's position at the window's start (tokens)
    rows: list[mx.array]  # `BatchedKVCache.read_window_states` order, [B, ...] each

    def restore(self, cache: BatchedKVCache) -> None:
        """Write back the starting state of every row whose slot was truncated to its start."""
        back = [i for i, (view, start) in enumerate(zip(self.views, self.starts))
                if not view.is_stale and view.num_tokens == start]
        if back:
            picked = mx.array(back, mx.int32)
            cache.write_window_states([self.views[i] for i in back], [mx.take(r, picked, axis=0) for r in self.rows])


class ModelRunner:
    """Runs scheduled steps of an mlx-lm model over a `BatchedKVCache`.

    Args:
        model (nn.Module): mlx-lm model whose attention goes through our seam.
        cache (BatchedKVCache): The paged cache; the runner writes its storage.
    """

    def __init__(self, model: nn.Module, cache: BatchedKVCache):
        self.model, self.cache = model, cache
        self._samplers: dict[str, RequestSampler] = {}
        self._lean = LeanDecoder.build(model)  # None: the model's own forward traces the step
        self._step = mx.compile(self._window_step)  # traced once per shape (rows, pages read), then replayed
        # Decode-step shapes traced so far, and the host seconds those launches took (a one-off cost a shape;
        # the status log reports both, so a burst of new batch sizes shows as what it costs).
        self.traces, self.trace_s = 0, 0.0
        self._window_start: WindowStart | None = None  # the last collected window's (hybrids)
        # Whether a decode window may launch before the one in flight is read back (`run(plan, ahead_of=...)`):
        # tail moves in place, ordered by the stream (MLX's CUDA backend; a scatter would copy whole pools the
        # window in flight still reads), and no recurrent state (the next window would read its rows' state
        # before the last window's is written back).
        self.can_run_ahead = cache.moves_in_place and not cache.state_arrays

    def run(self, plan: StepPlan, ahead_of: Launch | None = None) -> Launch:
        """Build and launch every forward of a step; nothing is waited for after the last launch.

        Args:
            plan (StepPlan): The scheduled step.
            ahead_of (Launch | None): The decode window still in flight (not read back), when this step is
                launched ahead of it (`can_run_ahead`; a plan of decode rows only): its tail pages are copied
                home first, in stream order, and its rows' last tokens feed this window on the device.

        Raises:
            CapacityExhausted: only if the plan asks for pages the scheduler did not reserve.
            ValueError: `ahead_of` with prompt chunks in either step, or where steps cannot run ahead.
        """
        if ahead_of is not None:
            if plan.prefills or ahead_of.prefill_tokens or not ahead_of.window_ids or not self.can_run_ahead:
                raise ValueError("only a decode window runs ahead of a decode window, on a tail pool without state")
            self.cache.copy_from_tail(ahead_of.window_arrays)  # ordered after its steps by the stream
            ahead_of.tail_home = True
        launch = Launch(step_id=self.cache.slots.launch_step())
        if self._window_start is not None:  # before any forward reads the state pool
            self._window_start.restore(self.cache)
            self._window_start = None
        for chunk in plan.prefills:
            self._prefill(chunk, launch)
        if plan.decodes:
            self._window(plan.decodes, plan.steps, launch, ahead_of)
        return launch

    def collect(self, launch: Launch) -> dict[str, list[int]]:
        """Wait for a launched step, read its tokens back, copy its tail pages home.

        Returns:
            dict[str, list[int]]: the tokens sampled for each request of the step, in order.
        """
        if launch.tail_home:  # the next window is in flight: wait for this one's tokens alone
            steps = _read_tokens(launch.window_tokens)
            self.cache.slots.complete_step(launch.step_id)
            return {rid: [step[row] for step in steps] for row, rid in enumerate(launch.window_ids)}
        mx.synchronize()
        sampled = {rid: [int(token.item())] for rid, token in launch.prefill_tokens}
        if launch.window_tokens:
            steps = _read_tokens(launch.window_tokens)
            for row, rid in enumerate(launch.window_ids):
                sampled[rid] = [step[row] for step in steps]
            self.cache.copy_from_tail(launch.window_arrays)  # in place: nothing is in flight
            if launch.window_start is not None:
                self.cache.write_window_states(launch.window_start.views, launch.window_states)
                self._window_start = launch.window_start
            mx.async_eval(self.cache.arrays, self.cache.state_arrays)
        self.cache.slots.complete_step(launch.step_id)
        return sampled

    def drain(self) -> None:
        """With nothing in flight, pass the fence so released pages return to the free list."""
        step_id = self.cache.slots.launch_step()
        mx.synchronize()
        self.cache.slots.complete_step(step_id)

    def forget(self, request_id: str) -> None:
        """Drop a finished request's sampler."""
        self._samplers.pop(request_id, None)

    # -- forwards ----------------------------------------------------------------

    def _prefill(self, chunk: PrefillChunk, launch: Launch) -> None:
        """One prompt chunk's forward (B=1); it samples only when it completes the prompt."""
        mx.synchronize()  # writes land in place only when nothing launched still reads the pools
        request = chunk.request
        batch = self.cache.batch([request.slot], chunk.num_tokens)
        if batch.prefetch:
            mx.eval(batch.prefetch)
        logits = self.model(mx.array(chunk.token_ids, dtype=mx.uint32)[None], cache=batch.layers)
        outputs = []
        if chunk.is_last:  # otherwise the logits are never evaluated, so never computed
            token = self._sampler(request)(logits[0, -1]).reshape(1).astype(mx.uint32)
            launch.prefill_tokens.append((request.request_id, token))
            outputs.append(token)
        mx.async_eval(*outputs, *self.cache.arrays, *self.cache.state_arrays)

    def _window(self, requests: tuple[Request, ...], num_steps: int, launch: Launch, ahead_of: Launch | None) -> None:
        """Launch `num_steps` decode steps over `requests`, each fed the last one's tokens (the first, those
        of the window `ahead_of` where a row was in it)."""
        cache = self.cache
        starts = np.array([r.slot.num_tokens for r in requests], np.int64)
        plans = cache.plan_window([r.slot for r in requests], num_steps)
        arrays = cache.window_indices(plans, starts)
        cache.copy_to_tail(arrays)
        views = tuple(r.slot for r in requests)
        states = cache.read_window_states(views)
        if states:
            launch.window_start = WindowStart(views, tuple(int(s) for s in starts), states)
        tokens = _first_tokens(requests, ahead_of)
        for step in arrays.steps:
            if not cache.use_tail:
                mx.synchronize()  # the step writes the main pools: in place only once the last step is done
            traces, started = self.traces, time.perf_counter()
            logits, written, states = self._step(tokens, step, cache.arrays, cache.tail_arrays, states)
            if self.traces != traces:
                self.trace_s += time.perf_counter() - started
            (cache.replace_tail_arrays if cache.use_tail else cache.replace_arrays)(written)
            tokens = self._sample(logits, requests)
            launch.window_tokens.append(tokens)
            mx.async_eval(tokens, *written, *states)
        launch.window_ids = [r.request_id for r in requests]
        launch.window_arrays, launch.window_states = arrays, states

    def _window_step(self, tokens: mx.array, indices, arrays: list[mx.array], tail_arrays: list[mx.array],
                     states: list[mx.array]):
        """The traced decode step: logits [B, vocab], the arrays it wrote (tail, or main pools), the
        rows' new recurrent state. Runs only when `mx.compile` traces a new shape."""
        self.traces += 1
        layers, written, views = self.cache.window_layers(arrays, tail_arrays, indices, states)
        logits = self._lean(tokens, layers) if self._lean else self.model(tokens[:, None], cache=layers)[:, -1]
        return logits, written.arrays, [a for view in views for a in view.cache]

    def _sample(self, logits: mx.array, requests: tuple[Request, ...]) -> mx.array:
        """uint32 [B]: greedy rows all at once, sampled rows each with its own PRNG stream."""
        tokens = argmax_rows(logits)  # uint32
        drawn = [i for i, r in enumerate(requests) if r.params.temperature > 0]
        if drawn:
            samples = [self._sampler(requests[i])(logits[i]) for i in drawn]
            tokens[mx.array(drawn)] = mx.stack(samples).astype(mx.uint32)
        return tokens

    def _sampler(self, request: Request) -> RequestSampler:
        if request.request_id not in self._samplers:
            self._samplers[request.request_id] = RequestSampler(request.params)
        return self._samplers[request.request_id]


def _read_tokens(window_tokens: list[mx.array]) -> list[list[int]]:
    """A window's sampled tokens, [N][B], read back once its last step is computed (each step feeds the
    next, so every earlier step is computed by then). No stacking on the device: a stack is a copy
    kernel per step."""
    last = np.array(window_tokens[-1])  # waits for the window, and for nothing launched after it
    return [np.array(t).tolist() for t in window_tokens[:-1]] + [last.tolist()]


def _first_tokens(requests: tuple[Request, ...], ahead_of: Launch | None) -> mx.array:
    """uint32 [B]: each row's newest token, taken on the device from the last step of the window in flight
    (`ahead_of`) for its rows, else from what was read back."""
    ids = [r.request_id for r in requests]
    if ahead_of is not None and ids == ahead_of.window_ids:
        return ahead_of.window_tokens[-1]
    rows = {rid: i for i, rid in enumerate(ahead_of.window_ids)} if ahead_of is not None else {}
    host = mx.array([0 if r.request_id in rows else r.output_token_ids[-1] for r in requests], dtype=mx.uint32)
    if not rows:
        return host
    picked = np.array([rows.get(rid, -1) for rid in ids], np.int32)
    from_window = mx.take(ahead_of.window_tokens[-1], mx.array(np.maximum(picked, 0)))
    return mx.where(mx.array(picked >= 0), from_window, host)
