"""The scheduler: who runs this step and with how many tokens. Pure: no arrays, no I/O.

It owns `waiting` and `running`, the kept sessions, and the per-step token budget, and
commits page allocations through the cache's `SlotTable` (bookkeeping only). Like vLLM V1
there is no prefill or decode phase: each request has `num_computed_tokens` against what
it knows, decode rows cost one token each, and what is left of the budget goes to prompt
chunks, so a long prompt never stalls running streams.

Steps may be pipelined (on a GPU the runner builds step n while step n-1 computes), so `schedule`
counts tokens that are launched but not read back (`num_pending_outputs`), and `update`
ignores rows of requests that ended meanwhile.

Prefix reuse is one mechanism for sessions and strangers: at admission a request's slot (a
session's, holding its history, or a new one) is extended with the cached pages that continue
its tokens (`PrefixCache.match`), and only the rest is prefilled; its prompt's pages are
published as it computes them, and the pages of a finished turn when it ends. A request whose
prefix another request is computing right now waits for it rather than computing it twice.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from shared.errors import BadRequest, ButtermilkError, CapacityExhausted

from .cache.pages import SlotTable, SlotView
from .cache.prefix import PrefixHit
from .request import Request, RequestStatus, cap_max_tokens


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """Prompt tokens of one request computed in one forward this step."""

    request: Request
    start: int  # index of the first token in `request.prefill_token_ids`
    num_tokens: int
    is_last: bool  # completes the prompt, so the forward samples the first output token

    @property
    def token_ids(self) -> list[int]:
        return self.request.prefill_token_ids[self.start : self.start + self.num_tokens]


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What one step computes."""

    prefills: tuple[PrefillChunk, ...] = ()  # one B=1 forward each
    decodes: tuple[Request, ...] = ()  # rows of the decode window, one token per row and step
    failed: tuple[Request, ...] = ()  # requests ended with an error while scheduling
    steps: int = 1  # decode steps in the window (more than one only when no prompt waits)

    @property
    def has_work(self) -> bool:
        return bool(self.prefills or self.decodes)

    @property
    def sampling(self) -> tuple[Request, ...]:
        """Requests that get a token from this step."""
        return tuple(c.request for c in self.prefills if c.is_last) + self.decodes


@dataclass(slots=True)
class Session:
    """A slot kept between the turns of one conversation."""

    slot: SlotView | None  # None until its first turn is admitted
    token_ids: list[int]  # every token of the conversation so far: prompts and the outputs reported

    @property
    def tail_token_ids(self) -> list[int]:
        """History tokens whose K/V the slot does not hold (the next turn computes them)."""
        return self.token_ids[self.slot.num_tokens if self.slot else 0 :]
    request: Request | None = None  # the turn in progress
    is_closing: bool = False  # release the slot when the turn in progress ends


class Scheduler:
    """Decides each step's prefill chunks and decode rows.

    Args:
        slots (SlotTable): The cache's bookkeeping; the scheduler reserves pages through it.
        step_token_budget (int): Tokens per step, decode rows and prompt chunks together.
        max_context (int): Tokens per sequence (prompt, history and outputs).
        eos_token_ids (Iterable[int]): Tokens that end a request with "stop".
        decode_window (int): Most decode steps per step while no prompt waits (one host sync
            per window; tokens past an EOS or a cancel inside a window are dropped). Default: 8.
    """

    def __init__(self, slots: SlotTable, *, step_token_budget: int, max_context: int, eos_token_ids: Iterable[int],
                 decode_window: int = 8):
        self.slots, self.step_token_budget, self.max_context = slots, step_token_budget, max_context
        self.decode_window = max(1, min(decode_window, slots.page_size))
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: deque[Request] = deque()
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self.sessions: dict[str, Session] = {}

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- admission ---------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Validate and queue a request; on error nothing changes.

        A continued turn with `session_tokens` first cuts the session's history to that length
        (the client's view of it); the cut stays even if the request is then refused.

        Raises:
            BadRequest: duplicate id, empty prompt, its session has a turn in progress, or it
                holds fewer than `session_tokens` (the session is then closed).
            ContextOverflow: history plus prompt leave no room for one generated token.
            CapacityExhausted: the prompt does not fit the cache's free space now.
        """
        if request.request_id in self.requests:
            raise BadRequest(f"request id {request.request_id!r} is already in use")
        if not request.prompt_token_ids:
            raise BadRequest("prompt_token_ids is empty")
        session = self.sessions.get(request.session_id) if request.session_id is not None else None
        if session is not None and session.request is not None:
            raise BadRequest(f"session {request.session_id!r} already has a request in progress")
        if request.session_tokens is not None:
            self._cut_history(request.session_id, session, request.session_tokens)
        cached = session.slot.num_tokens if session and session.slot else 0
        tail = session.tail_token_ids if session else []
        num_prompt = cached + len(tail) + len(request.prompt_token_ids)
        max_tokens = cap_max_tokens(num_prompt, request.params.max_tokens, self.max_context)
        held = len(session.slot.page_table) if session and session.slot else 0
        tokens = (session.token_ids if session else []) + list(request.prompt_token_ids)
        extent = self.max_context if request.session_id is not None else num_prompt + max_tokens
        hit = self.slots.prefix.match(tokens, start_tokens=cached, max_positions=extent)
        needed = self.slots.pages_for(num_prompt) - held - hit.num_pages + hit.num_revived
        if needed > self.slots.num_free_pages + self.slots.num_pending_pages:
            raise CapacityExhausted(
                f"the prompt needs {num_prompt} KV tokens; {self.slots.free_tokens} of "
                f"{self.slots.capacity_tokens} are free"
            )
        request.num_cached_tokens = request.num_computed_tokens = cached
        request.prefill_token_ids = tail + list(request.prompt_token_ids)
        request.max_tokens, request.slot = max_tokens, session.slot if session else None
        if request.session_id is not None:
            self.sessions[request.session_id] = session or Session(slot=None, token_ids=[])
            self.sessions[request.session_id].request = request
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def _match(self, request: Request) -> PrefixHit:
        """The cached pages that would continue a waiting request's slot (a query)."""
        return self.slots.prefix.match(self._tokens(request), start_tokens=request.num_cached_tokens,
                                       max_positions=self._extent(request))

    def _tokens(self, request: Request) -> list[int]:
        """Every token the request conditions on, from position 0: its session's history, its prompt."""
        session = self.sessions.get(request.session_id) if request.session_id is not None else None
        return (session.token_ids if session else []) + list(request.prompt_token_ids)

    def _extent(self, request: Request) -> int:
        """Most positions the request's slot can reach (a session's next turns go on in it)."""
        return self.max_context if request.session_id is not None else request.num_prompt_tokens + request.max_tokens

    def _admit(self, request: Request, hit: PrefixHit) -> bool:
        """Give the head of `waiting` its slot, the cached pages of `hit` and the pages of the rest of
        its prompt, if they are free; the rest of the prompt is then all it prefills."""
        held = len(request.slot.page_table) if request.slot else 0
        needed = self.slots.pages_for(request.num_prompt_tokens) - held - hit.num_pages + hit.num_revived
        if needed > self.slots.num_free_pages:
            return False
        if request.slot is None:
            if not self.slots.can_acquire():
                return False
            request.slot = self.slots.acquire()
            if request.session_id is not None:
                self.sessions[request.session_id].slot = request.slot
        self.slots.prefix.map(request.slot, hit)
        request.num_cached_tokens = request.num_computed_tokens = request.num_cached_tokens + hit.num_tokens
        request.prefill_token_ids = request.prefill_token_ids[hit.num_tokens :]
        self.slots.reserve([(request.slot, len(request.prefill_token_ids))])
        self.slots.prefix.publish(request.slot, self._tokens(request), max_positions=self._extent(request))
        request.status = RequestStatus.RUNNING
        return True

    # -- scheduling ----------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Pick this step's decode rows and window, then prompt chunks under what is left of the budget."""
        steps = self._window_steps()
        decodes, failed = self._schedule_decodes(steps)
        prefills = self._schedule_prefills(self.step_token_budget - len(decodes))
        return StepPlan(prefills=tuple(prefills), decodes=tuple(decodes), failed=tuple(failed), steps=steps)

    @property
    def decodes_only(self) -> bool:
        """No prompt waits or is part-computed: the next step is a decode window of every running stream."""
        return not self.waiting and not any(r.is_prefill for r in self.running)

    def _window_steps(self) -> int:
        """Decode steps this step: a window while no prompt waits, capped by every row's remaining
        tokens and by the free pages (else one step, and rows that cannot grow fail as usual)."""
        if not self.decodes_only:
            return 1
        remaining = [r.max_tokens - r.num_output_tokens - r.num_pending_outputs for r in self.running]
        steps = max(1, min([self.decode_window, *[n for n in remaining if n > 0]]))
        needed = sum(self.slots.pages_needed(r.slot, steps) for r in self.running)
        return steps if needed <= self.slots.num_free_pages else 1

    def _schedule_decodes(self, steps: int) -> tuple[list[Request], list[Request]]:
        decodes, failed = [], []
        for request in self.running:
            if request.is_prefill or request.num_output_tokens + request.num_pending_outputs >= request.max_tokens:
                continue
            needed = self.slots.pages_needed(request.slot, steps)
            if needed > self.slots.num_free_pages:
                # With pages waiting on the fence, try again next step; otherwise the stream cannot
                # grow: it fails once its launched tokens are read back (they are delivered first).
                if not self.slots.num_pending_pages and not request.num_pending_outputs:
                    failed.append(request)
                continue
            if needed:
                self.slots.reserve([(request.slot, steps)])
            request.num_computed_tokens += steps
            request.num_pending_outputs += steps
            decodes.append(request)
        for request in failed:
            error = CapacityExhausted(f"the KV cache is full ({self.slots.capacity_tokens} tokens): cannot grow")
            self.finish(request, RequestStatus.FINISHED_ERROR, error)
        return decodes, failed

    def _schedule_prefills(self, budget: int) -> list[PrefillChunk]:
        """Prompt chunks in arrival order, each cut at the request's own boundaries.

        A request's prompt is cut every `prefill_chunk_tokens` from its own start, never where
        the step's budget runs out: a chunk that does not fit waits for a later step. So a
        request's K/V (and its quantized codes) do not depend on what else is scheduled.
        """
        chunks = []
        for request in self.running:
            if request.is_prefill:
                if self._next_chunk(request) > budget:
                    return chunks
                chunks.append(self._chunk(request))
                budget -= chunks[-1].num_tokens
        while self.waiting:
            request, hit = self.waiting[0], self._match(self.waiting[0])
            if hit.is_blocked or self._next_chunk(request, hit.num_tokens) > budget or not self._admit(request, hit):
                break
            self.running.append(self.waiting.popleft())
            chunks.append(self._chunk(request))
            budget -= chunks[-1].num_tokens
        return chunks

    @property
    def prefill_chunk_tokens(self) -> int:
        """Prompt tokens per chunk: what the budget always leaves after a full decode batch."""
        return max(1, self.step_token_budget - self.slots.max_slots)

    def _next_chunk(self, request: Request, num_mapped: int = 0) -> int:
        """Tokens of the request's next prompt chunk (`num_mapped` more cached at admission)."""
        return min(self.prefill_chunk_tokens, request.num_prompt_tokens - request.num_computed_tokens - num_mapped)

    def _chunk(self, request: Request) -> PrefillChunk:
        num = self._next_chunk(request)
        start = request.num_computed_tokens - request.num_cached_tokens
        request.num_computed_tokens += num
        is_last = not request.is_prefill
        request.num_pending_outputs += is_last
        return PrefillChunk(request=request, start=start, num_tokens=num, is_last=is_last)

    # -- results ---------------------------------------------------------------------

    def update(self, plan: StepPlan, sampled: Mapping[str, list[int]]) -> list[tuple[Request, list[int]]]:
        """Record the tokens a step sampled; returns (request, tokens it kept) in plan order.

        Rows of requests that ended after the step was scheduled are ignored, and so are the
        tokens a window sampled after a request's EOS or last allowed token.
        """
        updated = []
        for request in plan.sampling:
            if request.is_finished:
                continue
            kept = []
            for token in sampled[request.request_id]:
                request.num_pending_outputs -= 1
                request.append_output(token)
                kept.append(token)
                if token in self.eos_token_ids:
                    self.finish(request, RequestStatus.FINISHED_STOPPED)
                elif request.num_output_tokens >= request.max_tokens:
                    self.finish(request, RequestStatus.FINISHED_LENGTH)
                if request.is_finished:
                    break
            updated.append((request, kept))
        return updated

    def finish(self, request: Request, status: RequestStatus, error: ButtermilkError | None = None) -> bool:
        """End a request (idempotent): record why, free its slot or keep it for its session.

        Returns:
            bool: False when it had already ended.
        """
        if request.is_finished:
            return False
        request.status, request.error = status, error
        (self.running if request in self.running else self.waiting).remove(request)
        del self.requests[request.request_id]
        session = self.sessions.get(request.session_id) if request.session_id is not None else None
        if request.slot is not None:
            self.slots.prefix.end_claims(request.slot)
        if session is None:
            if request.slot is not None:
                written = request.slot.num_tokens
                tokens = (request.prompt_token_ids + list(request.output_token_ids))[:written]
                self.slots.prefix.publish(request.slot, tokens, max_positions=written)
                self.slots.release(request.slot)
            return True
        session.request = None
        if session.slot is None or session.is_closing:
            self._drop_session(request.session_id)
        else:
            self._keep_history(session, request)
        return True

    def _keep_history(self, session: Session, request: Request) -> None:
        """The session keeps the request's prompt and the outputs read back; K/V past them goes.

        Positions launched past them (a window's tokens after the ending) are forgotten, back to
        the most positions the slot can keep exactly (`SlotTable.truncation_point`): for a
        wrapped window ring that is nothing, for recurrent state the window's start; the next
        turn computes the rest again (`num_cached_tokens` says how much was kept).
        """
        session.token_ids = session.token_ids + request.prompt_token_ids + list(request.output_token_ids)
        valid = len(session.token_ids)
        if session.slot.num_tokens > valid:
            self.slots.truncate(session.slot, self.slots.truncation_point(session.slot, valid))
        held = session.token_ids[: session.slot.num_tokens]
        self.slots.prefix.publish(session.slot, held, max_positions=self.max_context)

    # -- sessions --------------------------------------------------------------------

    def _cut_history(self, session_id: str, session: Session | None, num_tokens: int) -> None:
        """Forget the session's history beyond `num_tokens`: its tokens, and K/V past them.

        As in `_keep_history`, a K/V cut that cannot be exact for a windowed layer resets the
        slot, and the turn computes the whole (cut) conversation again.

        Raises:
            BadRequest: no such session, or it holds fewer tokens (the session is closed then).
        """
        held = len(session.token_ids) if session is not None else 0
        if session is None or num_tokens > held:
            if session is not None:
                self._drop_session(session_id)
            raise BadRequest(f"session {session_id!r} holds {held} tokens here, not {num_tokens}; start it again")
        session.token_ids = session.token_ids[:num_tokens]
        if session.slot is not None and session.slot.num_tokens > num_tokens:
            exact = self.slots.can_truncate(session.slot, num_tokens)
            self.slots.truncate(session.slot, num_tokens if exact else 0)

    def close_session(self, session_id: str) -> tuple[int, Request | None]:
        """Free a session's slot, or mark it to be freed when its turn in progress ends.

        Returns:
            tuple[int, Request | None]: tokens the slot held (0 if unknown), and the turn in
            progress (the caller aborts it), if any.
        """
        session = self.sessions.get(session_id)
        if session is None:
            return 0, None
        held = session.slot.tokens_held if session.slot else 0
        if session.request is not None:
            session.is_closing = True
            return held, session.request
        self._drop_session(session_id)
        return held, None

    def _drop_session(self, session_id: str) -> None:
        session = self.sessions.pop(session_id)
        if session.slot is not None:  # its conversation stays cached for a client that sends it again
            held = session.token_ids[: session.slot.num_tokens]
            self.slots.prefix.publish(session.slot, held, max_positions=session.slot.num_tokens)
            self.slots.release(session.slot)
