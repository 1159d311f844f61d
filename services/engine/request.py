"""The engine's `Request`: one object for a request's life on the engine (vLLM V1's model).

Progress is `num_computed_tokens` (positions whose K/V are written or launched) against the
tokens known so far; there is no prefill or decode state, only that gap. Only the scheduler
changes `status`; every ending goes through its idempotent `finish`.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from shared.errors import BadRequest, ButtermilkError, ContextOverflow
from shared.protocol import FinishReason

from .cache.pages import SlotView
from shared.protocol import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"


FINISHED_STATUSES = frozenset(
    {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    }
)

_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.CANCELLED,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


def cap_max_tokens(prompt_tokens: int, max_tokens: int, max_context: int) -> int:
    """Cap generation so prompt + output fits the context (tokens).

    Raises:
        BadRequest: an empty prompt.
        ContextOverflow: the prompt alone leaves no room for one generated token.
    """
    if prompt_tokens == 0:
        raise BadRequest("the prompt is empty: nothing to generate from")
    if prompt_tokens >= max_context:
        raise ContextOverflow.no_room(prompt_tokens, max_context)
    return min(max_tokens, max_context - prompt_tokens)


class ReadOnlyTokens(Sequence[int]):
    """A read-only view of a token list that grows underneath it (vLLM's `ConstantList`)."""

    __slots__ = ("_tokens",)

    def __init__(self, tokens: list[int]):
        self._tokens = tokens

    def __getitem__(self, index):
        return self._tokens[index]

    def __len__(self) -> int:
        return len(self._tokens)

    def __iter__(self) -> Iterator[int]:
        return iter(self._tokens)

    def __repr__(self) -> str:
        return f"ReadOnlyTokens({self._tokens!r})"


@dataclass(eq=False)
class Request:
    """One generation request on the engine.

    Args:
        request_id (str): Unique among the engine's unfinished requests.
        prompt_token_ids (list[int]): This request's new tokens (a session turn: only the turn's).
        params (SamplingParams): How to sample; `params.max_tokens` is capped at admission.
        session_id (str | None): Keep the slot and its K/V after finishing; a later request
            with the same id continues from there.
        session_tokens (int | None): A continued turn: the session's history length as its
            client was told it, tokens; what the engine holds beyond that is cut first.
    """

    request_id: str
    prompt_token_ids: list[int] = field(repr=False)
    params: SamplingParams = field(repr=False)
    session_id: str | None = None
    session_tokens: int | None = None
    status: RequestStatus = field(default=RequestStatus.WAITING, init=False)
    slot: SlotView | None = field(default=None, init=False)  # held from admission to finish
    num_cached_tokens: int = field(default=0, init=False)  # session positions already in the slot
    prefill_token_ids: list[int] = field(default_factory=list, init=False, repr=False)  # to compute before sampling
    num_computed_tokens: int = field(default=0, init=False)  # positions written or launched
    num_pending_outputs: int = field(default=0, init=False)  # sampled, launched, not read back yet
    max_tokens: int = field(default=0, init=False)  # params.max_tokens capped to the context
    error: ButtermilkError | None = field(default=None, init=False)
    _output_token_ids: list[int] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self):
        self.prefill_token_ids = list(self.prompt_token_ids)
        self.max_tokens = self.params.max_tokens

    @property
    def slot_id(self) -> int | None:
        return None if self.slot is None else self.slot.slot_id

    @property
    def output_token_ids(self) -> ReadOnlyTokens:
        """Tokens generated and read back so far (EOS included when it ended the request)."""
        return ReadOnlyTokens(self._output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens this request conditions on: session history plus `prefill_token_ids`."""
        return self.num_cached_tokens + len(self.prefill_token_ids)

    @property
    def is_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status in FINISHED_STATUSES

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self.status)

    def history_token_ids(self) -> list[int]:
        """Everything after the cached positions: prefill tokens then outputs."""
        return self.prefill_token_ids + self._output_token_ids

    def append_output(self, token_id: int) -> None:
        """Record one token read back from the runner."""
        self._output_token_ids.append(token_id)
