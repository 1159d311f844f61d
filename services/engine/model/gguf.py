"""Offline importer: one llama GGUF file -> a folder `mlx_lm.utils.load` reads.

The folder holds `config.json`, `model.safetensors` (dequantized weights under
HF/mlx-lm llama names), `tokenizer.json`, `tokenizer_config.json`,
`special_tokens_map.json` and `generation_config.json`. Nothing is downloaded.

Sources for the formats handled here:
- GGUF metadata keys and tensor names: llama.cpp `gguf-py/gguf/constants.py`.
- Q/K row order: llama.cpp `convert_hf_to_gguf.py` `LlamaModel.permute`.
- Q4_0/Q4_1/Q8_0 blocks (32 weights per block) arrive from `mx.load` as MLX affine
  quantized triples (packed uint32 `weight`, `scales`, `biases`, group size 32).
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

from shared.errors import BadRequest, ModelNotFound

FORMAT_VERSION = 2  # bump when the written folder changes; cached conversions are keyed on it
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
GROUP_SIZE = 32  # weights per GGML Q4_0/Q4_1/Q8_0 block
_MAGIC = b"GGUF"
_TOKEN_CONTROL = 3  # llama.cpp TokenType.CONTROL: special tokens such as <|im_end|>
_TOKEN_USER_DEFINED = 4  # llama.cpp TokenType.USER_DEFINED: added, non-special tokens

_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def _byte_level_digits() -> pre_tokenizers.PreTokenizer:
    """llama.cpp pre type `smollm`: every digit alone, then GPT-2 byte-level splitting."""
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )


_PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {"smollm": _byte_level_digits}


def resolve_dtype(dtype: str | None) -> str:
    """Names the output dtype: `dtype` itself, or the fast default for the device.

    Args:
        dtype: "float32", "float16", "bfloat16" or None. None means float32 on the
            CPU (MLX's Linux CPU backend runs fp16/bf16 matmuls slowly but float32
            through BLAS) and float16 on a GPU.

    Returns:
        One of the keys of `DTYPES`.

    Raises:
        BadRequest: `dtype` is not one of those names.
    """
    if dtype is None:
        return "float32" if mx.default_device().type == mx.cpu else "float16"
    if dtype not in DTYPES:
        raise BadRequest(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    return dtype


def convert_gguf(
    gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: str | None = None, progress: bool = True
) -> Path:
    """Converts a llama GGUF file into an mlx-lm model folder, atomically.

    Everything is written to a hidden temp folder next to `out_dir` and renamed
    into place last, so `out_dir` exists only once complete.

    Args:
        gguf_path: The GGUF file, llama architecture. Q4_0/Q4_1/Q8_0 tensors are
            dequantized exactly; `mx.load` hands other GGML types over already
            dequantized to float16.
        out_dir: The folder to create; it must not exist yet.
        dtype: Weight dtype of the output, see `resolve_dtype`.
        progress: Show a tqdm bar over the tensors on stderr.

    Returns:
        `out_dir` as a Path.

    Raises:
        ModelNotFound: The file is missing, is not GGUF, or holds an unsupported
            architecture, tensor or tokenizer (only llama with a byte-level BPE
            tokenizer is supported).
        FileExistsError: `out_dir` already exists (possibly written meanwhile by
            another process converting the same file).
        BadRequest: Unknown `dtype`.
    """
    out_dir, dtype = Path(out_dir), resolve_dtype(dtype)
    tensors, meta = _read_gguf(Path(gguf_path))
    config = _model_config(meta, tensors, dtype)
    tokenizer_files = _tokenizer_files(meta, config)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        weights = _convert_weights(tensors, config, DTYPES[dtype], progress)
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        for name, content in {"config.json": config, **tokenizer_files}.items():
            _write_json(tmp / name, content)
        _fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _publish(tmp, out_dir)
    return out_dir


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


def _read_gguf(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Loads tensors and metadata of a llama GGUF file with `mx.load`.

    Returns:
        (tensors, metadata): quantized tensors as `name.weight` uint32 [rows, cols*bits/32],
        `name.scales` / `name.biases` float16 [rows, cols/32]; others as plain arrays.

    Raises:
        ModelNotFound: Missing file, wrong magic bytes, unreadable, or not llama.
    """
    if not path.is_file():
        raise ModelNotFound(f"GGUF file {path} does not exist")
    with path.open("rb") as f:
        if f.read(4) != _MAGIC:
            raise ModelNotFound(f"{path} is not a GGUF file (it does not start with the bytes 'GGUF')")
    try:
        tensors, meta = mx.load(str(path), format="gguf", return_metadata=True)
    except (RuntimeError, ValueError) as exc:
        raise ModelNotFound(f"cannot read GGUF file {path}: {exc}") from exc
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ModelNotFound(f"{path}: architecture {arch!r} is not supported; only 'llama' GGUF files are")
    return tensors, meta


def _scalar(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    """A metadata value as a Python scalar (mx.load gives 0-d arrays), or `default` if absent."""
    value = meta.get(key, default)
    return value.item() if isinstance(value, mx.array) else value


def _float32_literal(value: float) -> float:
    """The shortest decimal naming the same float32 (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def _model_config(meta: dict[str, Any], tensors: dict[str, mx.array], dtype: str) -> dict[str, Any]:
    """Builds the HF/mlx-lm llama `config.json` from `llama.*` GGUF metadata.

    Raises:
        ModelNotFound: Rope scaling or partial rotary dims (not supported here).
    """
    if _scalar(meta, "llama.rope.scaling.type", "none") != "none":
        raise ModelNotFound("GGUF rope scaling is not supported by this importer")
    n_heads = _scalar(meta, "llama.attention.head_count")
    hidden = _scalar(meta, "llama.embedding_length")
    head_dim = _scalar(meta, "llama.attention.key_length", hidden // n_heads)
    if _scalar(meta, "llama.rope.dimension_count", head_dim) != head_dim:
        raise ModelNotFound("GGUF partial rotary embeddings are not supported by this importer")
    n_layers = _scalar(meta, "llama.block_count")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": _scalar(meta, "llama.feed_forward_length"),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": _scalar(meta, "llama.attention.head_count_kv", n_heads),
        "head_dim": head_dim,
        "rms_norm_eps": _float32_literal(_scalar(meta, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32_literal(_scalar(meta, "llama.rope.freq_base", 10000.0)),
        "rope_traditional": False,
        "rope_scaling": None,
        "vocab_size": tensors["token_embd.weight"].shape[0],
        "max_position_embeddings": _scalar(meta, "llama.context_length"),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in tensors,
        "layer_types": ["full_attention"] * n_layers,
        "sliding_window": None,
        "hidden_act": "silu",
        "torch_dtype": dtype,
    }
    config.update(_special_ids(meta))
    stops = _stop_token_ids(meta)
    if len(stops) > 1:
        config["eos_token_id"] = stops
    return config


def _special_ids(meta: dict[str, Any]) -> dict[str, int]:
    """`bos_token_id`, `eos_token_id`, `pad_token_id`, `unk_token_id` present in the metadata."""
    keys = {"bos": "bos", "eos": "eos", "pad": "padding", "unk": "unknown"}
    ids = {f"{k}_token_id": _scalar(meta, f"tokenizer.ggml.{g}_token_id") for k, g in keys.items()}
    return {k: v for k, v in ids.items() if v is not None}


def _stop_token_ids(meta: dict[str, Any]) -> list[int]:
    """Every end-of-generation token id: EOS, end of turn (EOT), end of message (EOM), in that order."""
    ids = [_scalar(meta, f"tokenizer.ggml.{kind}_token_id") for kind in ("eos", "eot", "eom")]
    return list(dict.fromkeys(i for i in ids if i is not None))


def _encoding_flags(meta: dict[str, Any]) -> tuple[bool, bool]:
    """(add BOS, add EOS) to every encoding with special tokens.

    Raises:
        ModelNotFound: `add_sep_token` is set, or BOS/EOS is to be added without its id.
    """
    add_bos = bool(_scalar(meta, "tokenizer.ggml.add_bos_token", False))
    add_eos = bool(_scalar(meta, "tokenizer.ggml.add_eos_token", False))
    if _scalar(meta, "tokenizer.ggml.add_sep_token", False):
        raise ModelNotFound("GGUF tokenizer.ggml.add_sep_token is not supported by this importer")
    for flag, kind in ((add_bos, "bos"), (add_eos, "eos")):
        if flag and _scalar(meta, f"tokenizer.ggml.{kind}_token_id") is None:
            raise ModelNotFound(f"GGUF add_{kind}_token is set but tokenizer.ggml.{kind}_token_id is missing")
    return add_bos, add_eos


def _hf_name(gguf_name: str) -> str:
    """Maps a GGUF tensor name (`blk.3.attn_q.weight`) to its mlx-lm one (`model.layers.3.self_attn.q_proj.weight`).

    Raises:
        ModelNotFound: A tensor a llama model does not have (e.g. `rope_freqs`).
    """
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{suffix}"
    raise ModelNotFound(f"GGUF tensor {gguf_name!r} is not part of a llama model this importer supports")


def _dequantize(tensors: dict[str, mx.array], name: str) -> mx.array:
    """Tensor `name` in float32: a quantized triple dequantized, or a plain array cast.

    Bits come from the packed width: a row of `in` weights packs into `in*bits/32`
    uint32 and has `in/32` scales, so bits = packed_cols / scales_cols (4 or 8).
    Scales and biases are widened to float32 first so x = scale*q + bias is exact.
    """
    w = tensors[name]
    base = name.removesuffix(".weight")
    if f"{base}.scales" not in tensors:
        return w.astype(mx.float32)
    scales = tensors[f"{base}.scales"].astype(mx.float32)
    biases = tensors[f"{base}.biases"].astype(mx.float32)
    bits = w.shape[-1] // scales.shape[-1]
    return mx.dequantize(w, scales, biases, group_size=GROUP_SIZE, bits=bits)


def unpermute_rope_rows(w: mx.array, n_head: int) -> mx.array:
    """Undoes llama.cpp's Q/K row permutation for its RoPE layout.

    llama.cpp `convert_hf_to_gguf.py` `LlamaModel.permute` writes
    `w.reshape(n_head, 2, head_dim // 2, in).swapaxes(1, 2).reshape(w.shape)`: in
    each head, GGUF row `2*k + half` holds HF row `half*head_dim/2 + k`. This
    reshapes to (n_head, head_dim/2, 2, in) and swaps back.

    Args:
        w: GGUF rows [n_head*head_dim, in] (any float dtype).
        n_head: Query heads for `attn_q`, KV heads for `attn_k`.

    Returns:
        HF rows, same shape and dtype.
    """
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _convert_weights(
    tensors: dict[str, mx.array], config: dict[str, Any], dtype: mx.Dtype, progress: bool
) -> dict[str, mx.array]:
    """All model weights under mlx-lm names, dequantized, Q/K un-permuted, cast to `dtype`."""
    names = sorted(n for n in tensors if not n.endswith((".scales", ".biases")))
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    out = {}
    for name in tqdm(names, desc="Converting GGUF", unit="tensor", file=sys.stderr, disable=not progress):
        w = _dequantize(tensors, name)
        kind = name.split(".")[-2]
        if kind in heads and name.endswith(".weight"):
            w = unpermute_rope_rows(w, heads[kind])
        hf_name = _hf_name(name)
        out[hf_name] = w.astype(dtype)
        mx.eval(out[hf_name])
    return out


def _tokenizer_files(meta: dict[str, Any], config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The tokenizer files' contents, keyed by file name.

    Raises:
        ModelNotFound: Not a byte-level BPE vocabulary (`tokenizer.ggml.model` != gpt2)
            or a pre-tokenizer type without a known HF equivalent.
    """
    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
    if kind != "gpt2":
        raise ModelNotFound(f"GGUF tokenizer model {kind!r} is not supported; only byte-level BPE ('gpt2') is")
    if pre not in _PRE_TOKENIZERS:
        raise ModelNotFound(f"GGUF pre-tokenizer {pre!r} is not supported; known: {', '.join(_PRE_TOKENIZERS)}")
    tokens = meta["tokenizer.ggml.tokens"]
    types = np.array(meta["tokenizer.ggml.token_type"])
    control = [tokens[i] for i in np.flatnonzero(types == _TOKEN_CONTROL)]
    named = {k.removesuffix("_id"): tokens[v] for k, v in _special_ids(meta).items()}
    extra = [t for t in control if t not in named.values()]
    add_bos, add_eos = _encoding_flags(meta)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "chat_template": meta.get("tokenizer.chat_template"),
        **named,
    }
    generation = {k: v for k, v in config.items() if k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return {
        "tokenizer.json": json.loads(_build_tokenizer(meta, _PRE_TOKENIZERS[pre](), add_bos, add_eos).to_str()),
        "tokenizer_config.json": {k: v for k, v in tokenizer_config.items() if v is not None},
        "special_tokens_map.json": {**named, "additional_special_tokens": extra},
        "generation_config.json": generation,
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
        bos_id = _scalar(meta, "tokenizer.ggml.bos_token_id")
        specials.append((tokens[bos_id], bos_id))
        bos = f"{tokens[bos_id]}:0 "
    if add_eos:
        eos_id = _scalar(meta, "tokenizer.ggml.eos_token_id")
        specials.append((tokens[eos_id], eos_id))
        eos = f" {tokens[eos_id]}:0"
    template = processors.TemplateProcessing(
        single=f"{bos}$A:0{eos}", pair=f"{bos}$A:0{eos} {bos}$B:1{eos}", special_tokens=list(dict.fromkeys(specials))
    )
    return processors.Sequence([byte_level, template])


def _added_tokens(tokens: list[str], types: np.ndarray, token_type: int, *, special: bool) -> list[AddedToken]:
    """The tokens of one llama.cpp token type as verbatim (unnormalized) added tokens."""
    return [AddedToken(tokens[i], special=special, normalized=False) for i in np.flatnonzero(types == token_type)]


def _write_json(path: Path, content: dict[str, Any]) -> None:
    """Writes `content` as indented UTF-8 JSON."""
    path.write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


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
