"""Prompt recall: a fact told once, ~1,500 tokens of filler, then a question about it (`eval-kv`).

Each prompt is one chat turn: the fact's statement, Lee-corpus news text as filler (from the
corpus's second half), the question; the assistant's answer is started with a fixed prefix
and continued greedily. Every scheme answers twice: with its full cache, and under a sliding
window whose attention sinks are exactly the tokens through the statement (so the fact stays
while most of the filler is evicted). An answer *matches raw* when its tokens, up to EOS,
equal the raw full cache's; it *recalls* when it contains the fact's value.

Source: the passkey-retrieval test (Mohtashami & Jaggi, arXiv 2305.16300) with a natural-text
filler; sinks as in StreamingLLM (arXiv 2309.17453).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.nn as nn

from services.engine.cache import CacheOptions, Window, make_layer_caches

from .corpus import LEE_CORPUS, split_halves, text_token_ids
from .metrics import greedy_tokens

_FILLER_MARK = "\x00FILLER\x00"


@dataclass(frozen=True, slots=True)
class RecallFact:
    """A fact to tell once and ask for at the end."""

    statement: str  # told at the start, e.g. "My cat's name is Bartholomew."
    question: str  # asked at the end
    answer_prefix: str  # the answer's forced start; greedy decoding continues it
    value: str  # what a correct answer contains


FACTS = (
    RecallFact("My cat's name is Bartholomew.", "What is my cat's name?", "Your cat's name is", "Bartholomew"),
    RecallFact("The meeting is in room 714.", "In which room is the meeting?", "The meeting is in room", "714"),
    RecallFact("The secret word is pineapple.", "What is the secret word?", "The secret word is", "pineapple"),
)


@dataclass(frozen=True, slots=True)
class RecallPrompt:
    """One fact's prompt, tokenized."""

    fact: RecallFact
    token_ids: list[int]  # statement, filler, question, answer prefix (chat-templated when possible)
    fact_tokens: int  # tokens up to and including the statement: the sinks a window keeps


@dataclass(frozen=True, slots=True)
class RecallAnswer:
    """One greedy answer."""

    token_ids: tuple[int, ...]  # the continuation of the answer prefix, up to EOS
    text: str  # the same, decoded
    matches_raw: bool  # same tokens as the raw full cache's answer
    recalled: bool  # contains the fact's value


@dataclass(frozen=True, slots=True)
class RecallResult:
    """A scheme's answers, per fact, with its full cache and under the window."""

    full: tuple[RecallAnswer, ...]
    windowed: tuple[RecallAnswer, ...]
    window_size: int  # tokens, sinks included, of the `windowed` answers (sinks: each prompt's fact_tokens)


def recall_prompts(tokenizer, num_facts: int, filler_tokens: int) -> list[RecallPrompt]:
    """Prompts for the first `num_facts` of `FACTS`, each with `filler_tokens` tokens of filler.

    Raises:
        ValueError: `num_facts` outside 1..len(FACTS), or filler longer than the corpus half.
    """
    if not 1 <= num_facts <= len(FACTS):
        raise ValueError(f"recall facts must be 1..{len(FACTS)}, got {num_facts}")
    _, second_half = split_halves(LEE_CORPUS.read_text(encoding="utf-8"))
    filler = text_token_ids(tokenizer, second_half, filler_tokens, what="the Lee corpus's second half")
    return [_prompt(tokenizer, fact, filler) for fact in FACTS[:num_facts]]


def check_window(prompts: list[RecallPrompt], window_size: int) -> None:
    """Raise ValueError unless the window holds every prompt's fact tokens plus at least one more."""
    longest = max((p.fact_tokens for p in prompts), default=0)
    if window_size <= longest:
        raise ValueError(f"the recall window ({window_size} tokens) must exceed the {longest} tokens through the fact")


def _prompt(tokenizer, fact: RecallFact, filler: list[int]) -> RecallPrompt:
    content = f"{fact.statement}\n\n{_FILLER_MARK}\n\n{fact.question}"
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=False)
    else:
        text = content + "\n"
    head, tail = (text + fact.answer_prefix).split(_FILLER_MARK)
    head_ids = list(tokenizer.encode(head, add_special_tokens=False))
    return RecallPrompt(fact, head_ids + filler + list(tokenizer.encode(tail, add_special_tokens=False)),
                        len(head_ids))


def answer_tokens(model: nn.Module, tokenizer, prompt: RecallPrompt, scheme: str, *, window: Window | None,
                  max_new: int, chunk: int, raw_layers: frozenset[int] = frozenset()) -> list[int]:
    """Greedy answer of `prompt` under `scheme` (and `window`), cut before the first EOS (tokens)."""
    options = CacheOptions(scheme=scheme, max_context=len(prompt.token_ids) + max_new, window=window,
                           raw_layers=raw_layers)
    caches = make_layer_caches(model, options)
    tokens = greedy_tokens(model, caches, prompt.token_ids, max_new=max_new, chunk=chunk)
    eos = set(getattr(tokenizer, "eos_token_ids", ()) or ())
    return next((tokens[:i] for i, t in enumerate(tokens) if t in eos), tokens)


def recall(model: nn.Module, tokenizer, prompts: list[RecallPrompt], scheme: str, *, window_size: int,
           max_new: int, chunk: int, raw_layers: frozenset[int] = frozenset(),
           raw_answers: list[tuple[int, ...]] | None = None) -> RecallResult:
    """Answer every prompt under `scheme`, full and windowed, and compare with raw's answers.

    Args:
        model (nn.Module): mlx-lm model.
        tokenizer: Its tokenizer (decodes the answers; its EOS ends them).
        prompts (list[RecallPrompt]): From `recall_prompts`.
        scheme (str): Cache scheme spec.
        window_size (int): Window (tokens, sinks included); the sinks are each prompt's fact_tokens.
        max_new (int): Most answer tokens.
        chunk (int): Prefill chunk (tokens).
        raw_layers (frozenset[int]): Layers kept raw whatever the scheme.
        raw_answers (list[tuple[int, ...]] | None): The raw full cache's answers, per prompt
            (`None`: this run is raw's, and its full answers are the reference).

    Returns:
        RecallResult: Answers per prompt.

    Raises:
        ValueError: the window cannot hold a prompt's fact tokens plus one more.
    """
    def answer(prompt: RecallPrompt, window: Window | None) -> list[int]:
        return answer_tokens(model, tokenizer, prompt, scheme, window=window, max_new=max_new, chunk=chunk,
                             raw_layers=raw_layers)

    check_window(prompts, window_size)
    windows = [Window(window_size, p.fact_tokens) for p in prompts]
    full = [answer(p, None) for p in prompts]
    windowed = [answer(p, w) for p, w in zip(prompts, windows)]
    reference = [tuple(t) for t in full] if raw_answers is None else raw_answers

    def scored(tokens: list[int], prompt: RecallPrompt, raw: tuple[int, ...]) -> RecallAnswer:
        text = tokenizer.decode(tokens)
        return RecallAnswer(tuple(tokens), text, tuple(tokens) == tuple(raw), prompt.fact.value.lower() in text.lower())

    return RecallResult(tuple(scored(t, p, r) for t, p, r in zip(full, prompts, reference)),
                        tuple(scored(t, p, r) for t, p, r in zip(windowed, prompts, reference)), window_size)
