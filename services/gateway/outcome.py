"""What a stream tells its client and keeps for its session when the engine reports. Pure.

`emit` turns a text delta into a `token` message (or holds it back for `stream: false`),
`done_message` builds the `done` a finished request gets, and `session_outcome` decides what
a session keeps after a turn: the history is what the client was told (prompt plus reported
completion), whatever the engine generated after a stop string matched.
"""

from __future__ import annotations

from shared.protocol import Done, EngineFinished, FinishReason, Token, Usage

from .control import ToClient
from .prompts import Turn
from .session_table import SessionRecord
from .streams import Stream


def emit(stream: Stream, text: str, token_ids: list[int], index: int, *, final: bool = False) -> list[ToClient]:
    """The `token` message for a delta (none when empty, or held back when not streaming)."""
    if not stream.stream:
        stream.held_text.append(text)
        stream.held_ids.extend(token_ids)
        text, token_ids, index = "".join(stream.held_text), stream.held_ids, 0
        if not final:
            return []
    if stream.client_gone or not (text or token_ids):
        return []
    return [ToClient(stream.client, Token(id=stream.client_id, text=text, token_ids=token_ids, index=index))]


def reported_completion_tokens(stream: Stream, msg: EngineFinished) -> int:
    """Completion tokens the client is told of: up to the stop string's end, else all."""
    return stream.text.num_consumed if stream.text.stopped else msg.usage.completion_tokens


def done_message(stream: Stream, msg: EngineFinished) -> Done:
    reason = msg.reason
    if stream.text.stopped:
        reason = FinishReason.STOP
    elif stream.cancel_requested:
        reason = FinishReason.CANCELLED
    usage = Usage(prompt_tokens=msg.usage.prompt_tokens, completion_tokens=reported_completion_tokens(stream, msg),
                  cached_tokens=msg.usage.cached_tokens)  # fmt: skip
    return Done(id=stream.client_id, finish_reason=reason, usage=usage)


def session_outcome(
    stream: Stream, msg: EngineFinished, record: SessionRecord | None, failed: bool
) -> tuple[int | None, Turn | None]:
    """What a session keeps after this turn: (KV tokens for the ledger, history for the gateway).

    `(None, None)` ends the session. A turn the engine refused before running leaves the
    session as it was (a refused first turn starts none); a turn that failed while running
    ends it, since the history the engine kept is then unknown here. The history is the
    prompt plus the completion as reported to the client; the engine cuts what it holds
    beyond that when the next turn arrives (`EngineGenerate.session_tokens`).
    """
    if stream.session_id is None or msg.tokens_held is None or record is None:
        return None, None
    if failed:
        unchanged = msg.refused and record.turn is not None
        return (msg.tokens_held, None) if unchanged else (None, None)
    context = msg.usage.prompt_tokens + reported_completion_tokens(stream, msg)
    return msg.tokens_held, Turn(context_tokens=context, ended_by_eos=stream.text.ended_by_eos)
