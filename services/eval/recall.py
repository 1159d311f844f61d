"""Passkey retrieval: a pass key told once, ~1,500 tokens of filler, then asked for (`eval-kv`).

Each prompt is plain text in the layout of Mohtashami & Jaggi's passkey test ("Landmark
Attention", arXiv 2305.16300): their instruction, "The pass key is 68127. Remember it. 68127 is
the pass key.", the filler, then "What is the pass key? The pass key is", continued greedily.
The filler is Lee-corpus news text (the start of the corpus's second half) rather than their
repeated "The grass is green..." sentences: natural text gives attention more to get wrong, and
the raw cache retrieves every key with either. The keys are copied from the prompt, not known
to the model, so a wrong answer is a retrieval failure, not a gap in the model's knowledge. No
chat template: wrapped in one, the default (instruct) model explains what a pass key is instead
of copying it, even with the raw cache.

Every scheme answers twice: with its full cache, and under a sliding window whose attention
sinks are exactly the tokens through the key's statement (so the key stays while most of the
filler is evicted; sinks as in StreamingLLM, arXiv 2309.17453). An answer's *value* is its
first run of digits; it *matches raw* when that equals the raw full cache's value, and
*recalls* when it equals the key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import mlx.nn as nn

from services.engine.cache import CacheOptions, Window, make_layer_caches
from services.engine.cache.centering import KeyMeans

from .corpus import LEE_CORPUS, split_halves, text_token_ids
from .metrics import greedy_tokens

INSTRUCTION = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
               "I will quiz you about the important information there.\n\n")  # Mohtashami & Jaggi's
PASS_KEYS = ("68127", "40913", "27584", "93046", "51738")  # five digits, as in the paper; raw retrieves each
_QUESTION = "What is the pass key?"
_ANSWER_PREFIX = "The pass key is"


@dataclass(frozen=True, slots=True)
class RecallFact:
    """A fact to tell once and ask for at the end."""

    statement: str  # told after the instruction, e.g. "The pass key is 68127. Remember it. ..."
    question: str  # asked after the filler
    answer_prefix: str  # the answer's forced start; greedy decoding continues it
    value: str  # the correct answer's value


FACTS = tuple(RecallFact(f"The pass key is {key}. Remember it. {key} is the pass key.", _QUESTION, _ANSWER_PREFIX,
                         key) for key in PASS_KEYS)


@dataclass(frozen=True, slots=True)
class RecallPrompt:
    """One fact's prompt, tokenized."""

    fact: RecallFact
    token_ids: list[int]  # instruction and statement, filler, question and answer prefix
    fact_tokens: int  # tokens up to and including the statement: the sinks a window keeps


@dataclass(frozen=True, slots=True)
class RecallAnswer:
    """One greedy answer."""

    token_ids: tuple[int, ...]  # the continuation of the answer prefix, up to EOS
    text: str  # the same, decoded
    value: str  # its first run of digits ("" when there is none)
    matches_raw: bool  # same value as the raw full cache's answer
    recalled: bool  # the value is the pass key


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


def answer_value(text: str) -> str:
    """The first run of digits in an answer ("" when there is none): what the passkey test scores."""
    match = re.search(r"\d+", text)
    return match[0] if match else ""


def _prompt(tokenizer, fact: RecallFact, filler: list[int]) -> RecallPrompt:
    head = list(tokenizer.encode(f"{INSTRUCTION}{fact.statement}\n", add_special_tokens=False))
    tail = list(tokenizer.encode(f"\n{fact.question} {fact.answer_prefix}", add_special_tokens=False))
    return RecallPrompt(fact, head + filler + tail, len(head))


def answer_tokens(model: nn.Module, tokenizer, prompt: RecallPrompt, scheme: str, *, window: Window | None,
                  max_new: int, chunk: int, raw_layers: frozenset[int] = frozenset(),
                  key_means: KeyMeans | None = None) -> list[int]:
    """Greedy answer of `prompt` under `scheme` (and `window`), cut before the first EOS (tokens)."""
    options = CacheOptions(scheme=scheme, max_context=len(prompt.token_ids) + max_new, window=window,
                           raw_layers=raw_layers, key_means=key_means)
    caches = make_layer_caches(model, options)
    tokens = greedy_tokens(model, caches, prompt.token_ids, max_new=max_new, chunk=chunk)
    eos = set(getattr(tokenizer, "eos_token_ids", ()) or ())
    return next((tokens[:i] for i, t in enumerate(tokens) if t in eos), tokens)


def recall(model: nn.Module, tokenizer, prompts: list[RecallPrompt], scheme: str, *, window_size: int,
           max_new: int, chunk: int, raw_layers: frozenset[int] = frozenset(),
           raw_answers: list[tuple[int, ...]] | None = None, key_means: KeyMeans | None = None) -> RecallResult:
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
        key_means (KeyMeans | None): Center compressed layers' keys on these (`cache.centering`).

    Returns:
        RecallResult: Answers per prompt.

    Raises:
        ValueError: the window cannot hold a prompt's fact tokens plus one more.
    """
    def answer(prompt: RecallPrompt, window: Window | None) -> list[int]:
        return answer_tokens(model, tokenizer, prompt, scheme, window=window, max_new=max_new, chunk=chunk,
                             raw_layers=raw_layers, key_means=key_means)

    check_window(prompts, window_size)
    windows = [Window(window_size, p.fact_tokens) for p in prompts]
    full = [answer(p, None) for p in prompts]
    windowed = [answer(p, w) for p, w in zip(prompts, windows)]
    reference = [tuple(t) for t in full] if raw_answers is None else raw_answers

    def scored(tokens: list[int], prompt: RecallPrompt, raw: tuple[int, ...]) -> RecallAnswer:
        text = tokenizer.decode(tokens)
        value = answer_value(text)
        return RecallAnswer(tuple(tokens), text, value, value == answer_value(tokenizer.decode(raw)),
                            value == prompt.fact.value)

    return RecallResult(tuple(scored(t, p, r) for t, p, r in zip(full, prompts, reference)),
                        tuple(scored(t, p, r) for t, p, r in zip(windowed, prompts, reference)), window_size)
