"""Offline importer: one GGUF file -> a folder `mlx_lm.utils.load` reads.

The folder holds `config.json`, `model.safetensors` (dequantized weights under
HF/mlx-lm names), `tokenizer.json`, `tokenizer_config.json`,
`special_tokens_map.json` and `generation_config.json`. Nothing is downloaded.
Families (llama, gemma3) live in `gguf_arch`, file reading in `gguf_read`, and
SentencePiece vocabularies in `gguf_spm`; byte-level BPE vocabularies are built here.

Sources:
- GGUF metadata keys and token types: llama.cpp `gguf-py/gguf/constants.py`.
- Tokenizer settings that change encoding or stopping (llama.cpp `llama-vocab.cpp`): the
  end-of-generation tokens (`eos`, `eot`, `eom` ids) all stop generation (`eos_token_id` is
  written as their list); `add_bos_token` / `add_eos_token` wrap every encoding in BOS / EOS.
  llama.cpp ignores `add_space_prefix` and `remove_extra_whitespaces` for byte-level BPE, so
  do we; `add_sep_token` is refused, as is any other encoding setting this file cannot carry.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from tqdm import tqdm

from shared.errors import ModelNotFound

from ..dtypes import DTYPES, resolve_dtype
from .gguf_arch import Family, family
from .gguf_read import GGUFContents, read_gguf
from .gguf_spm import sentencepiece_tokenizer

FORMAT_VERSION = 3  # bump when the written folder changes; cached conversions are keyed on it
_TOKEN_CONTROL = 3  # llama.cpp TokenType.CONTROL: special tokens such as <|im_end|>
_TOKEN_USER_DEFINED = 4  # llama.cpp TokenType.USER_DEFINED: added, non-special tokens


def _byte_level_digits() -> pre_tokenizers.PreTokenizer:
    """llama.cpp pre type `smollm`: every digit alone, then GPT-2 byte-level splitting."""
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )


_PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {"smollm": _byte_level_digits}


def convert_gguf(
    gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: str | None = None, progress: bool = True
) -> Path:
    """Converts a GGUF file (llama or gemma3) into an mlx-lm model folder, atomically.

    Everything is written to a hidden temp folder next to `out_dir` and renamed
    into place last, so `out_dir` exists only once complete.

    Args:
        gguf_path: The GGUF file. Tensors are dequantized to float32 exactly (Q4_0/Q4_1/
            Q8_0 by `mx.dequantize`, other GGML types such as Q5_0, Q4_K, Q6_K by the
            `gguf` library, see `gguf_read`), then cast to `dtype`.
        out_dir: The folder to create; it must not exist yet.
        dtype: Weight dtype of the output, see `services.engine.dtypes.resolve_dtype`.
        progress: Show a tqdm bar over the tensors on stderr.

    Returns:
        `out_dir` as a Path.

    Raises:
        ModelNotFound: The file is missing, is not GGUF, or holds an unsupported
            architecture, tensor or tokenizer (llama and gemma3; byte-level BPE and
            SentencePiece vocabularies), or needs the `gguf` package, not installed.
        FileExistsError: `out_dir` already exists (possibly written meanwhile by
            another process converting the same file).
        BadRequest: Unknown `dtype`.
    """
    out_dir, dtype = Path(out_dir), resolve_dtype(dtype)
    contents = read_gguf(gguf_path)
    arch = family(contents.architecture)
    config = arch.config(contents.meta, contents.tensor_names) | {"torch_dtype": dtype} | _special_ids(contents.meta)
    stops = _stop_token_ids(contents.meta, arch)
    if len(stops) > 1:  # our loaders read the stop ids from config.json, mlx-lm from generation_config.json
        config["eos_token_id"] = stops
    tokenizer_files = _tokenizer_files(contents.meta, config, arch)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        weights = _convert_weights(contents, arch, config, DTYPES[dtype], progress)
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        for name, content in {"config.json": config, **tokenizer_files}.items():
            _write_json(tmp / name, content)
        _fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _publish(tmp, out_dir)
    return out_dir


def _convert_weights(
    contents: GGUFContents, arch: Family, config: dict[str, Any], dtype: mx.Dtype, progress: bool
) -> dict[str, mx.array]:
    """All model weights under mlx-lm names, dequantized, fixed up by the family, cast to `dtype`."""
    out = {}
    names = sorted(contents.tensor_names)
    for name in tqdm(names, desc="Converting GGUF", unit="tensor", file=sys.stderr, disable=not progress):
        hf_name = arch.hf_name(name)
        out[hf_name] = arch.transform(name, contents.load(name), config).astype(dtype)
        mx.eval(out[hf_name])
    return out


def _publish(tmp: Path, out_dir: Path) -> None:
    """Renames the finished `tmp` folder to `out_dir` (atomic on one filesystem).

    Raises:
        FileExistsError: `out_dir` appeared meanwhile; `tmp` is removed.
    """
    try:
        tmp.rename(out_dir)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if out_dir.exists():
            raise FileExistsError(f"{out_dir} was created by another process during the conversion") from exc
        raise


def _special_ids(meta: dict[str, Any]) -> dict[str, int]:
    """`bos_token_id`, `eos_token_id`, `pad_token_id`, `unk_token_id` present in the metadata."""
    keys = {"bos": "bos", "eos": "eos", "pad": "padding", "unk": "unknown"}
    ids = {f"{k}_token_id": meta.get(f"tokenizer.ggml.{g}_token_id") for k, g in keys.items()}
    return {k: v for k, v in ids.items() if v is not None}


def _stop_token_ids(meta: dict[str, Any], arch: Family) -> list[int]:
    """Every end-of-generation token id: EOS, end of turn (EOT; else the family's named one), end of message (EOM)."""
    tokens = meta["tokenizer.ggml.tokens"]
    eot = meta.get("tokenizer.ggml.eot_token_id")
    if eot is None and arch.end_of_turn in tokens:
        eot = tokens.index(arch.end_of_turn)
    ids = [meta.get("tokenizer.ggml.eos_token_id"), eot, meta.get("tokenizer.ggml.eom_token_id")]
    return list(dict.fromkeys(i for i in ids if i is not None))


def _encoding_flags(meta: dict[str, Any], *, bos_default: bool) -> tuple[bool, bool]:
    """(add BOS, add EOS) to every encoding with special tokens.

    Args:
        bos_default (bool): llama.cpp's default when the file does not say (SentencePiece: True).

    Raises:
        ModelNotFound: `add_sep_token` is set, or BOS/EOS is to be added without its id.
    """
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", bos_default))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    if meta.get("tokenizer.ggml.add_sep_token", False):
        raise ModelNotFound("GGUF tokenizer.ggml.add_sep_token is not supported by this importer")
    if add_eos and "tokenizer.ggml.eos_token_id" not in meta:
        raise ModelNotFound("GGUF add_eos_token is set but tokenizer.ggml.eos_token_id is missing")
    if add_bos and "tokenizer.ggml.bos_token_id" not in meta:
        if not bos_default or "tokenizer.ggml.add_bos_token" in meta:
            raise ModelNotFound("GGUF add_bos_token is set but tokenizer.ggml.bos_token_id is missing")
        add_bos = False
    return add_bos, add_eos


def _tokenizer_files(meta: dict[str, Any], config: dict[str, Any], arch: Family) -> dict[str, dict[str, Any] | str]:
    """The tokenizer files' contents (JSON objects, or JSON text), keyed by file name.

    Raises:
        ModelNotFound: A vocabulary that is neither byte-level BPE (`tokenizer.ggml.model`
            gpt2, with a known pre-tokenizer) nor SentencePiece ("llama").
    """
    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
    if kind == "llama":
        add_bos, add_eos = _encoding_flags(meta, bos_default=True)
        if add_eos:
            raise ModelNotFound("GGUF add_eos_token is not supported for SentencePiece vocabularies by this importer")
        tokenizer = sentencepiece_tokenizer(meta, arch.name)
    elif kind == "gpt2":
        if pre not in _PRE_TOKENIZERS:
            raise ModelNotFound(f"GGUF pre-tokenizer {pre!r} is not supported; known: {', '.join(_PRE_TOKENIZERS)}")
        add_bos, add_eos = _encoding_flags(meta, bos_default=False)
        tokenizer = _build_tokenizer(meta, _PRE_TOKENIZERS[pre](), add_bos, add_eos)
    else:
        raise ModelNotFound(f"GGUF tokenizer model {kind!r} is not supported; only 'gpt2' (byte-level BPE) "
                            "and 'llama' (SentencePiece) are")
    tokens = meta["tokenizer.ggml.tokens"]
    types = np.array(meta["tokenizer.ggml.token_type"])
    control = [tokens[i] for i in np.flatnonzero(types == _TOKEN_CONTROL)]
    named = {k.removesuffix("_id"): tokens[v] for k, v in _special_ids(meta).items()}
    extra = [t for t in control if t not in named.values()]
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "chat_template": meta.get("tokenizer.chat_template") or arch.chat_template,
        **named,
    }
    generation = {k: v for k, v in config.items() if k in ("bos_token_id", "pad_token_id")}
    stops = _stop_token_ids(meta, arch)  # mlx-lm reads its EOS ids from generation_config.json
    return {
        "tokenizer.json": tokenizer.to_str(pretty=True),  # 33 MB for Gemma: serialized in Rust
        "tokenizer_config.json": {k: v for k, v in tokenizer_config.items() if v is not None},
        "special_tokens_map.json": {**named, "additional_special_tokens": extra},
        "generation_config.json": generation | {"eos_token_id": stops[0] if len(stops) == 1 else stops},
    }


def _build_tokenizer(
    meta: dict[str, Any], pre_tokenizer: pre_tokenizers.PreTokenizer, add_bos: bool = False, add_eos: bool = False
) -> Tokenizer:
    """A HF byte-level BPE tokenizer from `tokenizer.ggml.tokens` (id order) and `.merges` ("a b").

    Control tokens (type 3) become special added tokens, user-defined ones (type 4)
    plain added tokens; both are matched verbatim before BPE. With `add_bos` / `add_eos`,
    an encoding with special tokens starts with BOS / ends with EOS.
    """
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False, byte_fallback=False)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = _post_processor(meta, add_bos, add_eos)
    types = np.array(meta["tokenizer.ggml.token_type"])
    tok.add_special_tokens(_added_tokens(tokens, types, _TOKEN_CONTROL, special=True))
    tok.add_tokens(_added_tokens(tokens, types, _TOKEN_USER_DEFINED, special=False))
    return tok


def _post_processor(meta: dict[str, Any], add_bos: bool, add_eos: bool) -> processors.PostProcessor:
    """Byte-level offsets, plus BOS/EOS around each sequence when the GGUF asks for them."""
    byte_level = processors.ByteLevel(trim_offsets=False)
    if not (add_bos or add_eos):
        return byte_level
    tokens = meta["tokenizer.ggml.tokens"]
    specials = []
    bos = eos = ""
    if add_bos:
        bos_id = meta["tokenizer.ggml.bos_token_id"]
        specials.append((tokens[bos_id], bos_id))
        bos = f"{tokens[bos_id]}:0 "
    if add_eos:
        eos_id = meta["tokenizer.ggml.eos_token_id"]
        specials.append((tokens[eos_id], eos_id))
        eos = f" {tokens[eos_id]}:0"
    template = processors.TemplateProcessing(
        single=f"{bos}$A:0{eos}", pair=f"{bos}$A:0{eos} {bos}$B:1{eos}", special_tokens=list(dict.fromkeys(specials))
    )
    return processors.Sequence([byte_level, template])


def _added_tokens(tokens: list[str], types: np.ndarray, token_type: int, *, special: bool) -> list[AddedToken]:
    """The tokens of one llama.cpp token type as verbatim (unnormalized) added tokens."""
    return [AddedToken(tokens[i], special=special, normalized=False) for i in np.flatnonzero(types == token_type)]


def _write_json(path: Path, content: dict[str, Any] | str) -> None:
    """Writes `content` as indented UTF-8 JSON (a str is taken as JSON text already)."""
    text = content if isinstance(content, str) else json.dumps(content, indent=2, ensure_ascii=False)
    path.write_text(text + "\n", encoding="utf-8")


def _fsync_tree(folder: Path) -> None:
    """Flushes every file of `folder` and the folder itself to disk before it is published."""
    for path in folder.iterdir():
        with path.open("rb") as f:
            os.fsync(f.fileno())
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
