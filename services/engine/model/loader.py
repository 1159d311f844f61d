"""Load a model and tokenizer with mlx-lm from a local folder (never from a hub)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from shared.errors import ModelNotFound

from .. import attention
from ..dtypes import DTYPES, resolve_dtype
from .paths import resolve_model

@dataclass(frozen=True)
class LoadedModel:
    """A model ready to run.

    Attributes:
        model (nn.Module): mlx-lm model instance.
        tokenizer: mlx-lm `TokenizerWrapper` (chat template, EOS ids, streaming detokenizer).
        path (Path): The local folder it was loaded from.
        config (dict): Its `config.json`.
    """

    model: nn.Module
    tokenizer: object
    path: Path
    config: dict

    @property
    def advertised_context(self) -> int:
        """The model's advertised context window (tokens): `max_position_embeddings`."""
        cfg = self.config.get("text_config", self.config)
        return int(cfg.get("max_position_embeddings") or cfg.get("max_seq_len") or 4096)

    @property
    def dtype(self) -> mx.Dtype:
        from ..cache import model_dtype

        return model_dtype(self.model)


def load_model(spec: str, *, dtype: str = "auto") -> LoadedModel:
    """Resolve `spec` to a local folder and load it with mlx-lm's loader.

    Args:
        spec (str): `"default"`, `"gemma3-270m"`, a local HF/MLX folder, or a `.gguf` file.
        dtype (str): Weight dtype: "auto", "float32", "float16" or "bfloat16".

    Raises:
        ModelNotFound: the spec names nothing loadable.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    attention.install()  # before mlx-lm imports the model's module
    from mlx_lm.utils import load as mlx_load

    dtype = resolve_dtype(dtype)
    path = resolve_model(spec, dtype=dtype)
    try:
        model, tokenizer = mlx_load(str(path))
    except Exception as exc:  # mlx-lm raises several kinds for a broken folder
        raise ModelNotFound(f"could not load model from {path}: {exc}") from exc
    attention.install()  # rebinds in the model module mlx-lm just imported
    lift_length_limit(tokenizer)
    float_params = [p for _, p in nn.utils.tree_flatten(model.parameters()) if mx.issubdtype(p.dtype, mx.floating)]
    if float_params and float_params[0].dtype != DTYPES[dtype]:
        model.set_dtype(DTYPES[dtype])
    mx.eval(model.parameters())
    config = json.loads((path / "config.json").read_text())
    return LoadedModel(model=model, tokenizer=tokenizer, path=path, config=config)


def lift_length_limit(tokenizer) -> None:
    """Let a tokenizer encode any length without transformers' "longer than the specified maximum
    sequence length" warning: `--max-context` decides what fits, and an overflow is refused with
    its own error.

    Args:
        tokenizer: an mlx-lm `TokenizerWrapper` (or a Hugging Face tokenizer).
    """
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    if hasattr(hf, "model_max_length"):
        hf.model_max_length = int(1e30)  # transformers' own "no limit" (VERY_LARGE_INTEGER)
