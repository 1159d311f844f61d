"""The evaluation text: the Lee background corpus, shipped in `data/` (see `data/README.md`)."""

from __future__ import annotations

from pathlib import Path

LEE_CORPUS = Path(__file__).parent / "data" / "lee_background.cor"
LEE_SHA256 = "5d78d6dafd953bbf65797bef09a9ffb9ec430583381be705f8fd460000f370fb"
_CHARS_PER_TOKEN = 5  # first guess of the prefix to encode (English BPE: ~4.8 chars per token)
_MARGIN_TOKENS = 64  # tokens encoded past the cut


def lee_documents() -> list[str]:
    """The corpus's 300 news documents, one per line of the file, in file order."""
    return LEE_CORPUS.read_text(encoding="utf-8").splitlines()


def corpus_token_ids(tokenizer, num_tokens: int) -> list[int]:
    """The first `num_tokens` tokens of the Lee corpus (no special tokens added).

    Raises:
        ValueError: the corpus has fewer than `num_tokens` tokens.
    """
    return text_token_ids(tokenizer, LEE_CORPUS.read_text(encoding="utf-8"), num_tokens, what="the Lee corpus")


def text_token_ids(tokenizer, text: str, num_tokens: int, *, what: str = "the text") -> list[int]:
    """The first `num_tokens` tokens of `text` (no special tokens added).

    Args:
        tokenizer: The model's tokenizer (`encode(text, add_special_tokens=...)`).
        text (str): Any text.
        num_tokens (int): Tokens wanted.
        what (str): How the error message names the text.

    Returns:
        list[int]: Token ids of the text, cut to `num_tokens`. Only a prefix of the text is
        encoded, `_MARGIN_TOKENS` past the cut, so the kept tokens equal those of encoding
        the whole text (byte-level BPE never merges across that many tokens).

    Raises:
        ValueError: the text has fewer than `num_tokens` tokens.
    """
    chars = _CHARS_PER_TOKEN * (num_tokens + _MARGIN_TOKENS)
    while True:
        ids = list(tokenizer.encode(text[:chars], add_special_tokens=False))
        if len(ids) >= num_tokens + _MARGIN_TOKENS or chars >= len(text):
            break
        chars *= 2
    if len(ids) < num_tokens:
        raise ValueError(f"{what} has {len(ids)} tokens, fewer than the {num_tokens} asked for")
    return ids[:num_tokens]


def split_halves(text: str) -> tuple[str, str]:
    """Cut a text in two at the line break nearest its middle character.

    The Lee corpus (one document per line) splits into its first and last 150 documents.
    A text without a line break is cut at its middle character.

    Returns:
        tuple[str, str]: The first half and the second (the line break itself dropped).
    """
    middle = len(text) // 2
    before, after = text.rfind("\n", 0, middle + 1), text.find("\n", middle)
    candidates = [i for i in (before, after) if i > 0]
    if not candidates:
        return text[:middle], text[middle:]
    cut = min(candidates, key=lambda i: abs(i - middle))
    return text[:cut], text[cut + 1 :]


def prompt_token_ids(tokenizer, num_prompts: int, prompt_tokens: int) -> list[list[int]]:
    """Prompts for free-running generation: the opening tokens of evenly spaced documents.

    Documents are taken from the second half of the corpus, so they do not overlap the
    teacher-forced text at its start.

    Args:
        tokenizer: The model's tokenizer.
        num_prompts (int): How many prompts (at most 150).
        prompt_tokens (int): Tokens per prompt (each chosen document is longer than this).

    Returns:
        list[list[int]]: `num_prompts` prompts of `prompt_tokens` tokens each.
    """
    documents = lee_documents()
    half = len(documents) // 2
    picked = [documents[half + i * (len(documents) - half) // num_prompts] for i in range(num_prompts)]
    return [list(tokenizer.encode(doc, add_special_tokens=False))[:prompt_tokens] for doc in picked]
