"""Incremental, UTF-8-safe detokenization that keeps every character (leading spaces too).

mlx-lm's streaming detokenizers drop the first token's leading space, so a streamed
completion of "The capital of France is" reads "Paris" instead of " Paris" and prompt +
completion no longer reconstruct the text. This one follows the offsets scheme of vLLM and
text-generation-inference: decode a short window of recent tokens twice (with and without
the newest ones) and emit the difference; hold text back while it ends in U+FFFD (an
incomplete UTF-8 sequence split across byte-level tokens).
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    Args:
        tokenizer: Anything with `decode(ids: list[int]) -> str` (HF or mlx-lm wrapper).
        context_ids (list[int]): Tokens already shown (e.g. the prompt's tail), used only so
            the first delta decodes with its real left context.
    """

    def __init__(self, tokenizer, context_ids: list[int] | None = None):
        self._decode = tokenizer.decode
        self._ids: list[int] = list(context_ids or [])[-4:]
        self._prefix = 0  # window start
        self._read = len(self._ids)  # tokens already turned into emitted text

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes ("" while a character is incomplete)."""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) <= len(before) or after.endswith(REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]

    def flush(self) -> str:
        """Text still held back at the end (an incomplete character shows as U+FFFD)."""
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return after[len(before) :]
