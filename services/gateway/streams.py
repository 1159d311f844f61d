"""One request's life at the gateway: its phase, its engine placement and its output text.

Pure: `Stream` is the per-request record the gateway core owns and mutates; its `text`
(`shared/text_stream.TextStream`) turns engine token ids into text deltas with stop strings applied.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from shared.protocol import SamplingParams
from shared.text_stream import TextStream


class Phase(Enum):
    PREPARING = "preparing"  # being tokenized off the event loop
    QUEUED = "queued"  # waiting in the request pool
    RESERVING = "reserving"  # admitted; waiting for the controller's reservation
    RUNNING = "running"  # sent to its engine


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
