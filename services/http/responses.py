"""OpenAI response objects and Server-Sent Events for chat completions and completions.

A streamed chat completion is: a chunk whose delta is `{"role": "assistant", "content": ""}`,
one chunk per text delta, a chunk with an empty delta and `finish_reason`, with
`stream_options.include_usage` a chunk with no choices and the usage (the others then carry
`"usage": null`), and `data: [DONE]`. A streamed completion is the same without the role chunk.
An error after the stream started is sent as `data: {"error": {...}}` before `[DONE]`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from shared.protocol import Done, FinishReason, Usage

DONE_EVENT = b"data: [DONE]\n\n"
FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.CANCELLED: "abort"}


def sse(data: dict) -> bytes:
    """One Server-Sent Event carrying `data` as compact JSON."""
    return b"data: " + json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def usage_json(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


@dataclass(frozen=True, slots=True)
class Shape:
    """Names and fields of one completion's response objects.

    Attributes:
        id (str): `chatcmpl-...` or `cmpl-...`; the request id at the gateway too.
        model (str): the served model's id.
        is_chat (bool): chat completion objects, else text completion objects.
        include_usage (bool): streaming with `stream_options.include_usage`.
        session_id (str | None): echoed when the request used a session.
        created (int): Unix seconds.
    """

    id: str
    model: str
    is_chat: bool
    include_usage: bool = False
    session_id: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    def _base(self, obj: str) -> dict:
        base = {"id": self.id, "object": obj, "created": self.created, "model": self.model}
        if self.session_id is not None:
            base["session_id"] = self.session_id
        return base

    def response(self, text: str, done: Done) -> dict:
        """The non-streaming response object."""
        finish = FINISH_REASONS.get(done.finish_reason, done.finish_reason.value)
        if self.is_chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish}  # fmt: skip
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion" if self.is_chat else "text_completion"
        return {**self._base(obj), "choices": [choice], "usage": usage_json(done.usage)}

    def chunk(self, text: str | None = None, *, role: bool = False, finish: FinishReason | None = None) -> bytes:
        """One streamed chunk: the role announcement, a text delta, or the finish."""
        if self.is_chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None}
        choice["finish_reason"] = None if finish is None else FINISH_REASONS.get(finish, finish.value)
        obj = "chat.completion.chunk" if self.is_chat else "text_completion"
        body = {**self._base(obj), "choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        return sse(body)

    def usage_chunk(self, usage: Usage) -> bytes:
        """The last chunk under `include_usage`: no choices, the usage."""
        obj = "chat.completion.chunk" if self.is_chat else "text_completion"
        return sse({**self._base(obj), "choices": [], "usage": usage_json(usage)})
