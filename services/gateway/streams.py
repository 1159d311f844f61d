"""One request's life at the gateway: its phase, its engine placement and its output text.

Pure: `TextStream` turns engine token ids into UTF-8-safe text deltas with stop strings
applied; `Stream` is the per-request record the gateway core owns and mutates.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from services.engine.stops import StopMatcher
from shared.detok import IncrementalDetokenizer
from shared.protocol import SamplingParams


class Phase(Enum):
    PREPARING = "preparing"  # being tokenized off the event loop
    QUEUED = "queued"  # waiting in the session pool
    RESERVING = "reserving"  # admitted; waiting for the controller's reservation
    RUNNING = "running"  # sent to its engine


@dataclass(slots=True)
class Delta:
    """Output of one engine chunk, ready for a `token` message."""

    text: str
    token_ids: list[int]  # tokens consumed (end-of-sequence tokens excluded)
    stopped: bool  # a stop string matched in this chunk: abort the engine request


class TextStream:
    """Detokenizes a completion incrementally and cuts it at the first stop string.

    Args:
        detokenizer (IncrementalDetokenizer): fresh for this completion (`shared/detok.py`),
            seeded with the prompt's tail as in-process generation does.
        stops (tuple[str, ...]): stop strings; the output ends before the first one.
        eos_token_ids (frozenset[int]): tokens that end the completion and are not shown.
    """

    def __init__(self, detokenizer: IncrementalDetokenizer, stops: tuple[str, ...], eos_token_ids: frozenset[int]):
        self._detok = detokenizer
        self._matcher = StopMatcher(stops)
        self._eos = eos_token_ids
        self.num_consumed = 0  # completion tokens read, up to the stop or end-of-sequence
        self.num_sent = 0  # tokens handed out in deltas (end-of-sequence excluded)
        self.ended_by_eos = False

    @property
    def stopped(self) -> bool:
        """Whether a stop string matched; later tokens are ignored."""
        return self._matcher.stopped

    @property
    def closed(self) -> bool:
        return self.stopped or self.ended_by_eos

    def feed(self, token_ids: list[int]) -> Delta:
        """Consume tokens in order until the stream closes; return the text safe to show."""
        parts, shown = [], []
        for token in token_ids:
            if self.closed:
                break
            self.num_consumed += 1
            if token in self._eos:
                self.ended_by_eos = True
                break
            shown.append(token)
            parts.append(self._matcher.feed(self._detok.add(token)))
        self.num_sent += len(shown)
        return Delta("".join(parts), shown, self.stopped)

    def finish(self) -> str:
        """Flush the detokenizer and held-back text at the end (empty after a stop)."""
        if self.stopped:
            return ""
        return self._matcher.feed(self._detok.flush()) + self._matcher.flush()


@dataclass(slots=True)
class Stream:
    """A generate the gateway is serving; `request_id` is unique in this gateway process.

    The input fields (`token_ids`, `context_tokens`, `sampling`, `text`) are set by `prepared`
    once the request is tokenized; until then the stream is PREPARING.
    """

    request_id: str
    client: bytes  # ROUTER identity of the client connection
    client_id: str  # the client's `id` for this request
    stream: bool  # False: send the completion in one `token` message before `done`
    lease_id: str | None = None
    session_id: str | None = None  # the session's internal id (controller, engine)
    new_session: bool = False
    session_tokens: int | None = None  # a continued turn: the history the client was told, tokens
    token_ids: list[int] = field(default_factory=list)  # input sent to the engine (a turn: new tokens only)
    context_tokens: int = 0  # tokens before decoding, session history included
    sampling: SamplingParams | None = None
    text: TextStream | None = None
    phase: Phase = Phase.PREPARING
    engine_id: str | None = None  # set once reserved
    epoch: int | None = None
    resv_id: str | None = None
    deadline: float | None = None  # RESERVING: monotonic seconds by which the controller must answer
    cancel_requested: bool = False  # the client cancelled; end as `cancelled`
    client_gone: bool = False  # the connection closed: send it nothing more
    held_text: list[str] = field(default_factory=list)  # text kept back when not streaming
    held_ids: list[int] = field(default_factory=list)
    arrived_at: float = 0.0  # monotonic seconds the generate reached the core

    def prepared(self, token_ids: list[int], context_tokens: int, sampling: SamplingParams, text: TextStream) -> None:
        """Set the input once tokenized; the stream then waits for a pool place."""
        self.token_ids, self.context_tokens, self.sampling, self.text = token_ids, context_tokens, sampling, text
        self.phase = Phase.QUEUED

    @property
    def num_reserved_tokens(self) -> int:
        """Prompt (new tokens) plus capped max_tokens: what the controller must hold."""
        return len(self.token_ids) + self.sampling.max_tokens

    def on_engine(self, engine_id: str, epoch: int) -> bool:
        return self.phase is Phase.RUNNING and (self.engine_id, self.epoch) == (engine_id, epoch)
