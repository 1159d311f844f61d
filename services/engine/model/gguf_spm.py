"""A SentencePiece vocabulary in a GGUF (`tokenizer.ggml.model` = "llama") as a HF tokenizer.

The file holds the pieces, their scores and token types but no merges and no `tokenizer.json`.
transformers rebuilds the tokenizer such a file describes (for Gemma: BPE with byte fallback,
spaces written as "▁", merges recovered from the vocabulary, control tokens special and
user-defined ones matched whole); this module hands it the metadata and adds the BOS the
file asks for (`tokenizer.ggml.add_bos_token`, true by default for SentencePiece as in llama.cpp).

Source: transformers `integrations/gguf/gguf_tokenizer_mapping.py` (`convert_gguf_tokenizer`).
"""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer, processors

from shared.errors import ModelNotFound

_TOKENIZER_KEYS = {  # GGUF key -> transformers' tokenizer_dict key
    "tokenizer.ggml.model": "tokenizer_type",
    "tokenizer.ggml.pre": "pre_tokenizer_type",
    "tokenizer.ggml.tokens": "tokens",
    "tokenizer.ggml.scores": "scores",
    "tokenizer.ggml.token_type": "token_type",
    "tokenizer.ggml.merges": "merges",
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.unknown_token_id": "unk_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
    "tokenizer.ggml.add_space_prefix": "add_prefix_space",
}


def adds_bos(meta: dict[str, Any]) -> bool:
    """Whether plain text gets a BOS token first (llama.cpp's default for SentencePiece: yes)."""
    return bool(meta.get("tokenizer.ggml.add_bos_token", True)) and "tokenizer.ggml.bos_token_id" in meta


def sentencepiece_tokenizer(meta: dict[str, Any], architecture: str) -> Tokenizer:
    """The HF tokenizer of a SentencePiece GGUF vocabulary.

    Args:
        meta (dict[str, Any]): GGUF metadata (`tokenizer.ggml.*` lists of 1 entry per token id).
        architecture (str): `general.architecture`; transformers fixes some families' files
            (e.g. gemma3: runs of spaces respelled with "▁", merges in vocabulary order).

    Returns:
        Tokenizer: Encodes with a leading BOS when `adds_bos(meta)`; decodes back to the text.

    Raises:
        ModelNotFound: transformers has no GGUF tokenizer conversion for this file.
    """
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    except ImportError as exc:
        raise ModelNotFound("this transformers version cannot convert GGUF SentencePiece vocabularies") from exc
    spec = {name: meta[key] for key, name in _TOKENIZER_KEYS.items() if key in meta}
    try:
        tokenizer, _ = convert_gguf_tokenizer(architecture, spec)
    except (ValueError, KeyError) as exc:
        raise ModelNotFound(f"cannot build the GGUF tokenizer: {exc}") from exc
    if adds_bos(meta):
        bos = meta["tokenizer.ggml.tokens"][meta["tokenizer.ggml.bos_token_id"]]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, meta["tokenizer.ggml.bos_token_id"])]
        )
    return tokenizer
