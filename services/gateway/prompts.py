"""From a `generate` to prompt token ids: tokenization, chat templates, session turns, caps.

Pure given a tokenizer (mlx-lm `TokenizerWrapper`, loaded without the weights). A first turn
(or a request without a session) is encoded whole: `prompt` with the tokenizer's special
tokens, `messages` through the chat template with a generation prompt. A later session turn
is encoded as a continuation of the conversation the engine already holds: `prompt` without
special tokens, `messages` as the text the template would add after the previous assistant
turn (see `chat_continuation`).
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.errors import BadRequest, ContextOverflow
from shared.protocol import Generate

# Placeholder conversation whose rendering is cut away to find what new messages add.
_PROBE_USER = "\u2063probe-user\u2063"
_PROBE_ASSISTANT = "\u2063probe-assistant\u2063"
_PROBE = ({"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_ASSISTANT})


@dataclass(frozen=True, slots=True)
class Turn:
    """Where a session stands before its next turn.

    Attributes:
        context_tokens (int): tokens of the whole conversation so far (prompts + completions).
        ended_by_eos (bool): the previous completion ended with an end-of-sequence token.
    """

    context_tokens: int
    ended_by_eos: bool


@dataclass(frozen=True, slots=True)
class Prompt:
    """A request's input as the engine gets it.

    Attributes:
        token_ids (list[int]): new input tokens (a session turn: only this turn's).
        context_tokens (int): tokens before decoding, history included.
        max_tokens (int): generation cap after capping to the context.
    """

    token_ids: list[int]
    context_tokens: int
    max_tokens: int


class Prompter:
    """Encodes generates and caps their `max_tokens`.

    Args:
        tokenizer: mlx-lm `TokenizerWrapper`.
        vocab_size (int): token ids must be below this.
        max_context (int): most tokens per sequence (prompt, history and output).
        max_tokens_cap (int): server cap on `max_tokens`.
    """

    def __init__(self, tokenizer, *, vocab_size: int, max_context: int, max_tokens_cap: int):
        if vocab_size < 1 or max_context < 2 or max_tokens_cap < 1:
            raise ValueError("need vocab_size >= 1, max_context >= 2, max_tokens_cap >= 1")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.max_tokens_cap = max_tokens_cap
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids)

    def prepare(self, msg: Generate, turn: Turn | None) -> Prompt:
        """Encode `msg` (a continuation of `turn` when given) and cap its `max_tokens`.

        Raises:
            BadRequest: a token id outside the vocabulary, a chat template that rejects the
                messages, or an input that encodes to no tokens.
            ContextOverflow: history plus input leaves no room for one generated token.
        """
        token_ids = self.encode(msg, turn)
        if not token_ids:
            raise BadRequest("the input encodes to no tokens")
        context = len(token_ids) + (turn.context_tokens if turn else 0)
        if context >= self.max_context:
            raise ContextOverflow.no_room(context, self.max_context, "session history plus input" if turn else "prompt")
        cap = min(msg.max_tokens, self.max_tokens_cap, self.max_context - context)
        return Prompt(token_ids=token_ids, context_tokens=context, max_tokens=cap)

    def encode(self, msg: Generate, turn: Turn | None) -> list[int]:
        """Token ids of the request's input (see the module docstring)."""
        if msg.token_ids is not None:
            bad = next((t for t in msg.token_ids if t >= self.vocab_size), None)
            if bad is not None:
                raise BadRequest(f"token id {bad} is outside the vocabulary ({self.vocab_size})")
            return list(msg.token_ids)
        if msg.prompt is not None:
            return list(self.tokenizer.encode(msg.prompt, add_special_tokens=turn is None))
        messages = [m.model_dump() for m in msg.messages]
        if turn is None:
            return list(self._render(messages, tokenize=True))
        text = chat_continuation(self._render, messages, self._eos_text(), turn.ended_by_eos)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _render(self, messages: list[dict], *, tokenize: bool = False, generation: bool = True):
        try:
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=generation, tokenize=tokenize
            )
        except Exception as exc:  # jinja and tokenizer errors have no common base class
            raise BadRequest(f"the chat template rejected the messages: {exc}") from None

    def _eos_text(self) -> str:
        return str(getattr(self.tokenizer, "eos_token", "") or "")


def chat_continuation(render, messages: list[dict], eos_text: str, ended_by_eos: bool) -> str:
    """The text a chat template adds for `messages` after an assistant turn already held.

    The template is rendered for a placeholder exchange with and without `messages`; the
    difference is what `messages` add. Before it goes whatever the template puts after an
    assistant's content (e.g. `<|im_end|>\\n`), less the end-of-sequence text when the
    previous completion already ended with that token.

    Args:
        render: `render(messages, generation=bool) -> str`, the chat template as text.
        messages (list[dict]): the new turn's messages.
        eos_text (str): the end-of-sequence token's text.
        ended_by_eos (bool): the previous completion ended with the end-of-sequence token.

    Raises:
        BadRequest: the template renders the placeholder in a way that cannot be cut.
    """
    base = render(list(_PROBE), generation=False)
    full = render([*_PROBE, *messages], generation=True)
    if not full.startswith(base) or _PROBE_ASSISTANT not in base:
        raise BadRequest("this model's chat template cannot continue a session; send token_ids")
    closing = base[base.rindex(_PROBE_ASSISTANT) + len(_PROBE_ASSISTANT) :]
    if ended_by_eos and eos_text and closing.startswith(eos_text):
        closing = closing[len(eos_text) :]
    return closing + full[len(base) :]
