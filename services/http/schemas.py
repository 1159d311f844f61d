"""OpenAI request bodies (chat completions, completions) and their translation to a `generate`.

Unknown fields are ignored, as vLLM does; known fields this server cannot honour (`n` > 1,
logprobs, tools, penalties, batch prompts, ...) are refused with a 400 naming the field.
Defaults follow OpenAI: temperature 1, top_p 1, completions `max_tokens` 16, chat without a
limit (the server caps it: `--max-tokens-cap` and the context). `max_completion_tokens` wins
over `max_tokens`. Extensions, as vLLM's, are top-level fields: `top_k`, and `session_id` with
`new_session` for multi-turn sessions that keep their KV between turns (a later turn sends
only its new messages or prompt). OpenAI's `user` (an end-user id) groups requests at the
gateway's tokenizer: one user's prompts share one turn of its round robin (`app._caller`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shared.protocol import MAX_TOKENS_LIMIT, ChatMessage, Generate

from .errors import ApiError

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_USER_CHARS = 256  # `user`: an end-user id, not a payload


class Loose(BaseModel):
    # NaN and Infinity: "a finite number"; strict: "2", true or 2.0 is no integer and "yes" no boolean, as on the wire
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


class StreamOptions(Loose):
    include_usage: bool = False


class TextPart(Loose):
    type: str
    text: str | None = None


class InMessage(Loose):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None


class CommonRequest(Loose):
    """Fields both endpoints share."""

    model: str
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # extension; 0 or -1 disables it (vLLM's spelling)
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    session_id: str | None = None  # extension: a multi-turn session
    new_session: bool = False  # extension: start `session_id`
    user: str | None = Field(None, max_length=MAX_USER_CHARS)  # the tokenizer's turns (app._caller); "": none

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def check_supported(self) -> None:
        """Refuse what this server cannot do.

        Raises:
            ApiError: 400 naming the first unsupported field.
        """
        if self.n != 1:
            raise ApiError.bad_request(f"n={self.n} is not supported; only one choice per request (n=1)", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ApiError.bad_request(f"{name} is not supported; leave it at 0", name)
        if self.logit_bias:
            raise ApiError.bad_request("logit_bias is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise ApiError.bad_request("stream_options needs stream=true", "stream_options")


class ChatCompletionRequest(CommonRequest):
    messages: list[InMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs or self.top_logprobs:
            raise ApiError.bad_request("logprobs are not supported", "logprobs")
        if self.tools:
            raise ApiError.bad_request("tools are not supported", "tools")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise ApiError.bad_request("only response_format {\"type\": \"text\"} is supported", "response_format")

    def chat_messages(self) -> list[dict]:
        """Messages as the chat template takes them (`developer` is `system`; text parts joined)."""
        out = []
        for i, m in enumerate(self.messages):
            content = m.content
            if isinstance(content, list):
                if any(p.type != "text" or p.text is None for p in content):
                    raise ApiError.bad_request("only text content parts are supported", f"messages[{i}].content")
                content = "".join(p.text for p in content)
            out.append({"role": "system" if m.role == "developer" else m.role, "content": content or ""})
        return out


class CompletionRequest(CommonRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    logprobs: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        for name, unsupported in (("echo", self.echo), ("best_of", (self.best_of or 1) != 1),
                                  ("suffix", self.suffix), ("logprobs", self.logprobs is not None)):  # fmt: skip
            if unsupported:
                raise ApiError.bad_request(f"{name} is not supported", name)
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list)) \
                and len(self.prompt) != 1:  # fmt: skip
            raise ApiError.bad_request(f"one prompt per request, got {len(self.prompt)}", "prompt")

    def single_prompt(self) -> dict:
        """`{"prompt": str}` or `{"token_ids": [...]}` for the one prompt given."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        return {"prompt": prompt} if isinstance(prompt, str) else {"token_ids": prompt}


def parse(cls: type[CommonRequest], body: Any) -> CommonRequest:
    """Validate a JSON body.

    Raises:
        ApiError: 400 naming the first invalid field.
    """
    if not isinstance(body, dict):
        raise ApiError.bad_request("the request body must be a JSON object")
    try:
        return cls.model_validate(body)
    except ValidationError as exc:
        raise _as_api_error(exc, {}) from None


# Generate fields whose errors name a differently spelled OpenAI field.
PARAMS = {"token_ids": "prompt", "max_tokens": "max_tokens"}


def to_generate(req: CommonRequest, request_id: str) -> Generate:
    """The `generate` message serving `req` (always one choice).

    Raises:
        ApiError: 400 when a value passes OpenAI's rules but not the wire protocol's limits
            (e.g. more than 16 stop strings, a negative seed).
    """
    fields: dict[str, Any] = {}
    if isinstance(req, ChatCompletionRequest):
        fields["messages"] = [ChatMessage(**m) for m in req.chat_messages()]
        max_tokens = req.max_completion_tokens or req.max_tokens or MAX_TOKENS_LIMIT
        params = {**PARAMS, "max_tokens": "max_completion_tokens" if req.max_completion_tokens else "max_tokens"}
    else:
        fields.update(req.single_prompt())
        max_tokens = req.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
        params = PARAMS
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    try:
        return Generate(
            id=request_id, max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
            top_k=req.top_k if req.top_k and req.top_k > 0 else None, seed=req.seed, stop=stop,
            session_id=req.session_id, new_session=req.new_session, stream=req.stream, **fields,
        )  # fmt: skip
    except ValidationError as exc:
        raise _as_api_error(exc, params) from None


UNION_TAGS = {"str", "int", "float", "bool", "function-after", "list", "dict"}


def _as_api_error(exc: ValidationError, params: dict[str, str]) -> ApiError:
    first = exc.errors(include_url=False, include_input=False)[0]
    return ApiError.bad_request(f"{_param(first['loc'], params) or 'body'}: {first['msg']}".replace("Value error, ", ""),
                                _param(first["loc"], params))  # fmt: skip


def _param(loc: tuple, params: dict[str, str]) -> str | None:
    """`("messages", 0, "content")` → `messages[0].content`, without pydantic's union tags."""
    if not loc:
        return None
    param = params.get(str(loc[0]), str(loc[0]))
    for part in loc[1:]:
        if isinstance(part, int):
            param += f"[{part}]"
        elif "[" not in part and part not in UNION_TAGS:
            param += f".{part}"
    return param
