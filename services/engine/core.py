"""`EngineCore`: continuous batching over a `BatchedKVCache`, with no sockets (vLLM V1's inner loop).

`step()` = collect → update → schedule → run (`collect()` then `launch()`, which a caller may
also call apart, taking in requests in between): the previous step's tokens are read back
(the runner waits for it), aborts are applied, the scheduler records the tokens and decides
(pure), and the runner builds and launches the step's forwards — a decode window of several
steps when no prompt waits — without waiting. On a GPU (`run_ahead`) a step's tokens come out of
the following `step()` call, and the GPU computes while the caller handles what `step()`
returned; `has_unfinished()` stays true until they have come out. While only decode rows run,
`step()` launches the next window before reading the last one back (`launch_ahead()`), so the
GPU goes from window to window without waiting for the host. On the CPU a decode window
is computed by the time its launch returns, so the same call reads it back (then the next
`step()` has nothing in flight): its tokens, a prompt's first one above all, are not held back.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import mlx.core as mx

from shared.errors import BadRequest, ButtermilkError
from shared.protocol import FinishReason

from .cache.batched import BatchedKVCache
from .cache.factory import CacheOptions
from .cache.report import geometry as model_geometry
from .model.fuse import fuse_projections
from .model.loader import LoadedModel
from .request import Request, RequestStatus
from .runner import Launch, ModelRunner
from .scheduler import Scheduler, StepPlan


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one step produced for one request.

    `num_prompt_tokens` counts every token the request conditions on (a session's history
    plus this turn's new tokens); `num_cached_tokens` is the part of it that was not computed:
    held by the session's slot, or mapped from the prefix cache.
    """

    request_id: str
    new_token_ids: list[int]  # tokens read back this step, in order (the EOS token included when it ended the request)
    finish_reason: FinishReason | None  # None while running
    num_prompt_tokens: int  # tokens
    num_cached_tokens: int  # tokens
    tokens_held: int  # KV tokens the request's slot holds now (0 once freed; a session keeps its own)
    bytes_held: int  # bytes of those tokens, all layers, K and V, metadata included, plus the slot's recurrent state
    error: ButtermilkError | None = None  # set when finish_reason is ERROR


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Capacity and what is held, per request and per kept session, and the prefix cache's activity."""

    capacity_tokens: int  # KV tokens of the cache
    free_tokens: int  # tokens a request can take: free pages and unreferenced cached pages
    used_slots: int  # slots held by requests and sessions
    max_slots: int
    bytes_per_token: int  # one token position across all layers
    state_bytes_per_slot: int  # recurrent state of one slot, all layers (hybrid models; else 0)
    per_request: dict[str, tuple[int, int]]  # unfinished request id -> (tokens held, bytes held)
    sessions: dict[str, int]  # session id -> tokens held by its slot
    held_tokens: int = 0  # tokens of pages held by slots, a shared page counted once
    cached_pages: int = 0  # pages of K/V the prefix cache can hand out, held or not
    evictable_pages: int = 0  # of them, pages no slot holds (counted in free_tokens)
    prefix_query_tokens: int = 0  # tokens looked up in the prefix cache at admission, since start
    prefix_hit_tokens: int = 0  # of them, tokens mapped instead of computed
    evicted_pages: int = 0  # cached pages reclaimed for new K/V, since start

    @property
    def prefix_hit_rate(self) -> float | None:
        """Share of looked-up tokens found in the prefix cache (None before any lookup)."""
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else None


class EngineCore:
    """The engine's inner loop: requests in, token batches out.

    The engine fuses the model's sibling projections in place (`model.fuse`: one matmul for
    q/k/v and one for gate/up): the model computes the same function with fewer kernels.

    Args:
        loaded (LoadedModel): Model and tokenizer (EOS ids end requests).
        options (CacheOptions): Scheme, window and context cap.
        capacity_tokens (int): KV tokens to allocate, all slots together.
        max_slots (int): Sequences held at once, kept sessions included. Default: 64.
        step_token_budget (int): Tokens per step, decode rows and prompt chunks together. Default: 512.
        page_size (int): Tokens per page. Default: 16.
        decode_window (int | None): Most decode steps per host sync while no prompt waits; a prompt that
            arrives meanwhile waits for the window's end. None: 16 where steps are launched ahead of the
            host (a GPU; measured 1.12-1.20x the tok/s of 8 on the H200, `ops/results/decode_window_ab_gpu.json`),
            else 8 (the CPU, whose steps run one after another).
        prefix_cache (bool): Share the full pages of common prompt prefixes between requests.
            Default: True.
        run_ahead (bool | None): Return a step's tokens from the next `step()` call, launching the next step
            before reading this one back. None: where steps compute while the host goes on (a GPU: where the
            cache keeps a tail pool), not on the CPU, whose launches wait for their steps.

    Raises:
        ValueError: a budget not above `max_slots` (a prompt could starve), a cache kind the
            engine does not store, an unknown scheme, or a model whose forward the caches cannot serve.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        options: CacheOptions,
        *,
        capacity_tokens: int,
        max_slots: int = 64,
        step_token_budget: int = 512,
        page_size: int = 16,
        decode_window: int | None = None,
        prefix_cache: bool = True,
        run_ahead: bool | None = None,
    ):
        if step_token_budget <= max_slots:
            raise ValueError(f"step_token_budget {step_token_budget} must exceed max_slots {max_slots} "
                             "(prompt chunks get what a full decode batch leaves)")
        self.loaded, self.options = loaded, options
        self._model_geometry = model_geometry(loaded)
        prefix_key = f"{loaded.path.resolve()}|{self._model_geometry['dtype']}" if prefix_cache else None
        self.cache = BatchedKVCache.for_model(
            loaded.model, options, capacity_tokens=capacity_tokens,
            page_size=page_size, max_slots=max_slots, prefix_key=prefix_key,
        )
        if decode_window is None:
            decode_window = 16 if self.cache.use_tail else 8
        self.scheduler = Scheduler(
            self.cache.slots, step_token_budget=step_token_budget, max_context=options.max_context,
            eos_token_ids=loaded.tokenizer.eos_token_ids,
            decode_window=min([decode_window, *(w.ring for w in self.cache.windows if w is not None)]),
        )
        fuse_projections(loaded.model)  # in place: one matmul for q/k/v and for gate/up (fewer launches)
        self.runner = ModelRunner(loaded.model, self.cache)
        self._check_geometry()
        self._in_flight: deque[tuple[StepPlan, Launch]] = deque()  # oldest first; two when one ran ahead
        self.run_ahead = self.cache.use_tail if run_ahead is None else run_ahead
        self._ring_windows = any(w is not None for w in self.cache.windows)
        self._aborts: set[str] = set()
        self.read_back_s = 0.0  # the last read-back's wait for its step and the read, seconds

    def _check_geometry(self) -> None:
        """Run one token through a scratch slot, so a model the caches cannot serve fails at start.

        Raises:
            ValueError: the forward failed (e.g. an attention the caches do not implement);
                the message names the scheme.
        """
        view = self.cache.acquire()
        try:
            batch = self.cache.batch([view], 1)
            mx.eval(self.loaded.model(mx.zeros((1, 1), mx.uint32), cache=batch.layers), self.cache.arrays,
                    self.cache.state_arrays)
        except (ValueError, TypeError, IndexError) as exc:
            raise ValueError(f"the engine cannot serve this model with --kv-cache {self.options.scheme}: {exc}") from exc
        finally:
            self.cache.release(view)
            self.runner.drain()

    def add_request(self, request: Request) -> None:
        """Queue a request; errors are raised here and leave no state.

        Raises:
            BadRequest: duplicate id, empty prompt, a token id outside the vocabulary, top_k
                not below the vocabulary size, or a session with a turn in progress.
            ContextOverflow: the prompt (with the session's history) leaves no room to generate.
            CapacityExhausted: the prompt does not fit the cache's free space now.
        """
        vocab = self._model_geometry["vocab_size"]
        if any(not 0 <= t < vocab for t in request.prompt_token_ids):
            raise BadRequest(f"prompt_token_ids must be in [0, {vocab})")
        if request.params.top_k is not None and request.params.top_k >= vocab:
            raise BadRequest(f"top_k must be below the vocabulary size {vocab}, got {request.params.top_k}")
        self.scheduler.add(request)

    def abort(self, request_ids: Iterable[str]) -> None:
        """Cancel requests (idempotent); applied at the next read-back or launch, whichever comes first."""
        self._aborts.update(request_ids)

    def close_session(self, session_id: str) -> int:
        """Free a kept session's slot (after its turn in progress, which is aborted).

        With no step in flight the pages are back on the free list when this returns;
        otherwise they return after the step fence, like any release.

        Returns:
            int: tokens the slot held (0 if the session is unknown).
        """
        held, active = self.scheduler.close_session(session_id)
        if active is not None:
            self.abort([active.request_id])
        elif held and not self._in_flight:
            self.runner.drain()
        return held

    @property
    def in_flight(self) -> bool:
        """Whether a launched step awaits its read-back (with `run_ahead`, between calls of `step()`)."""
        return bool(self._in_flight)

    @property
    def windows_in_flight(self) -> int:
        """Steps launched and not yet read back: 2 while one runs ahead of another."""
        return len(self._in_flight)

    @property
    def steps_in_flight(self) -> int:
        """Decode steps of the oldest step in flight (0: none)."""
        return self._in_flight[0][0].steps if self._in_flight else 0

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._in_flight) or bool(self._aborts)

    def step(self) -> list[RequestOutput]:
        """Launch the next step ahead where it can (`launch_ahead`), read back the oldest in flight, launch the
        next if none runs; return what the read-back produced (plus aborts, failures).

        A caller that takes in requests or sends tokens between the read-back and the launch (the engine
        service) lets a request that arrived while the step in flight ran join the very next one, and its
        clients hear their tokens before the next step's launch, not after it."""
        outputs = self.launch_ahead() + self.collect()
        return outputs + (self.launch() if not self._in_flight else [])

    def collect(self) -> list[RequestOutput]:
        """Wait for the oldest step in flight (if any), read it back and apply aborts; return what they produced."""
        return self._read_back()

    @property
    def can_launch_ahead(self) -> bool:
        """Whether the next decode window may launch before the one in flight is read back: one decode window
        in flight, no prompt waiting or part-computed, steps that run ahead of the host (`run_ahead`) on a tail
        pool without recurrent state (`ModelRunner.can_run_ahead`). Then the GPU goes from one window to the next
        without waiting for the host's read-back and launch (the window's EOS is not known yet: rows that
        ended in it compute one window more, whose tokens `Scheduler.update` drops). Not for a session's turn
        on a sliding-window model: positions launched past a turn's end can be cut from a ring only until it
        wraps (`SlotTable.truncation_point`), and one window more would often lose the session's whole cache."""
        if len(self._in_flight) != 1 or not self.run_ahead or not self.runner.can_run_ahead:
            return False
        plan, launch = self._in_flight[0]
        if self._ring_windows and any(r.session_id is not None for r in plan.decodes):
            return False  # a turn's end found a window late: a wrapped ring could not keep its history
        return bool(launch.window_ids) and not plan.prefills and self.scheduler.decodes_only

    def launch_ahead(self) -> list[RequestOutput]:
        """`launch()` the next step if `can_launch_ahead`, else nothing; returns what `launch()` returns."""
        return self.launch() if self.can_launch_ahead else []

    def launch(self) -> list[RequestOutput]:
        """Apply aborts, schedule and launch the next step; return the aborted and failed requests (and, without
        `run_ahead`, the step's outputs).

        Without `run_ahead` (the CPU, where a decode window is computed by the time its launch returns) the step
        just launched is read back too: holding its tokens for the next call would only delay them by a step (a
        prompt's first token by a whole decode window).

        Raises:
            RuntimeError: if a step is still in flight and `can_launch_ahead` does not hold (`collect()` it first).
        """
        ahead_of = None
        if self._in_flight:
            if not self.can_launch_ahead:
                raise RuntimeError("launch() with a step in flight: collect() it first")
            ahead_of = self._in_flight[0][1]
        outputs = self._apply_aborts()  # those that came after the read-back are not scheduled
        plan = self.scheduler.schedule()
        outputs += [self._output(r, []) for r in plan.failed]
        if plan.has_work:
            self._in_flight.append((plan, self.runner.run(plan, ahead_of)))
            if not self.run_ahead:
                outputs += self._read_back()
                self.runner.drain()  # pages the step's finished requests released return now
        elif not self._in_flight:
            self.runner.drain()
        return outputs

    def _read_back(self) -> list[RequestOutput]:
        """Collect the oldest step in flight (if any) and apply aborts: what they finished or produced."""
        previous = self._in_flight.popleft() if self._in_flight else None
        started = time.monotonic()
        sampled = self.runner.collect(previous[1]) if previous else {}
        self.read_back_s = time.monotonic() - started
        outputs = self._apply_aborts()
        if previous:
            outputs += [self._output(r, tokens) for r, tokens in self.scheduler.update(previous[0], sampled)]
        return outputs

    def stats(self) -> EngineStats:
        slots = self.cache.slots
        prefix = slots.prefix
        return EngineStats(
            capacity_tokens=slots.capacity_tokens,
            free_tokens=slots.free_tokens,
            used_slots=slots.used_slots,
            max_slots=slots.max_slots,
            bytes_per_token=slots.bytes_per_token,
            state_bytes_per_slot=slots.state_bytes_per_slot,
            per_request={rid: _held(r) for rid, r in self.scheduler.requests.items()},
            sessions={sid: s.slot.tokens_held if s.slot else 0 for sid, s in self.scheduler.sessions.items()},
            held_tokens=slots.num_held_pages * slots.page_size,
            cached_pages=prefix.num_cached_pages,
            evictable_pages=prefix.num_evictable_pages,
            prefix_query_tokens=prefix.counters.query_tokens,
            prefix_hit_tokens=prefix.counters.hit_tokens,
            evicted_pages=prefix.counters.evicted_pages,
        )

    @property
    def has_prefix_cache(self) -> bool:
        return self.cache.slots.prefix.is_enabled

    @property
    def geometry(self) -> dict:
        """What the engine announces in HELLO (sizes in tokens and bytes)."""
        g, cache = self._model_geometry, self.cache
        return {
            "n_layers": g["n_layers"],
            "n_kv_heads": g["n_kv_heads"],
            "head_dim": g["head_dim"],
            "dtype": g["dtype"],
            "kv_cache": self.options.scheme,
            "page_size": cache.page_size,
            "capacity_tokens": cache.capacity_tokens,
            "bytes_per_token": cache.bytes_per_token,
            "state_bytes_per_slot": cache.state_bytes_per_slot,
            "max_slots": cache.slots.max_slots,
            "max_context": self.options.max_context,
            "window_tokens": cache.slots.max_live_tokens,
        }

    def _apply_aborts(self) -> list[RequestOutput]:
        outputs = []
        for request_id in sorted(self._aborts):
            request = self.scheduler.requests.get(request_id)
            if request is not None and self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED):
                outputs.append(self._output(request, []))
        self._aborts.clear()
        return outputs

    def _output(self, request: Request, new_token_ids: list[int]) -> RequestOutput:
        if request.is_finished:
            self.runner.forget(request.request_id)
        tokens, nbytes = _held(request)
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            finish_reason=request.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            tokens_held=tokens,
            bytes_held=nbytes,
            error=request.error,
        )


def _held(request: Request) -> tuple[int, int]:
    """(tokens, bytes) the request's slot holds now; (0, 0) once it was released."""
    if request.slot is None or request.slot.is_stale:
        return 0, 0
    return request.slot.tokens_held, request.slot.nbytes
