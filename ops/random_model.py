"""Write an mlx-lm model folder with random weights of a known shape, and a synthetic tokenizer.

`buttermilk serve --model <folder>` loads it offline like any Hugging Face folder, so the whole
pipeline can be measured on a GPU host without downloading weights. The folder holds:

- `config.json`: the shape (`ops.bench_kv.RANDOM_MODELS`, or `tiny` for tests). The tokenizer's
  EOS is id `vocab_size`, outside the model's logits: greedy decode never ends a
  request early, so generation is bounded by `max_tokens`.
- `model.safetensors`: N(0, σ) and mlx-lm's default initialisation (seed 0, as `bench_kv`).
- `tokenizer.json` / `tokenizer_config.json`: a `tokenizers` WordLevel vocabulary of
  `vocab_size + 1` words, "t0" … "t{vocab_size-1}" and "<eos>", split on whitespace; unknown
  words map to "t0". Text "t5 t17" encodes to [5, 17]; token-id prompts need no tokenizer.

    python -m ops.random_model --shape llama-1b --out /tmp/random-llama-1b   # 1.24 G params, 2.47 GB bf16
    python -m ops.random_model --shape tiny --out /tmp/random-tiny --dtype float32
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

from ops.bench_kv import RANDOM_MODELS

# For tests and CPU dry runs: Llama layout, 2 layers, hidden 64, 2 KV heads of head_dim 16.
TINY = dict(
    model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=1000, rms_norm_eps=1e-5, rope_theta=10000.0,
    tie_word_embeddings=True, max_position_embeddings=4096,
)
SHAPES = {**{name: (family, config) for name, (family, config, _) in RANDOM_MODELS.items()}, "tiny": ("llama", TINY)}
DTYPES = ("bfloat16", "float16", "float32")
EOS = "<eos>"


def build_model(shape: str, dtype: str = "bfloat16"):
    """A random-initialised mlx-lm model of `shape` on MLX's default device (seed 0).

    Args:
        shape (str): a key of `SHAPES`.
        dtype (str): weight dtype, one of `DTYPES`.

    Returns:
        (nn.Module, dict): the model (parameters evaluated) and its config.

    Raises:
        KeyError: unknown shape.
    """
    import mlx.core as mx

    family, config = SHAPES[shape]
    module = importlib.import_module(f"mlx_lm.models.{family}")
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(config))
    model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    return model, config


def write_tokenizer(out_dir: Path, vocab_size: int, max_context: int) -> None:
    """Write a WordLevel `tokenizer.json` of `vocab_size` + 1 words and its `tokenizer_config.json`.

    Ids 0 … vocab_size-1 are "t0" … "t{vocab_size-1}"; id `vocab_size` is "<eos>", which the
    model (logits over `vocab_size` ids) can never sample.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)} | {EOS: vocab_size}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "unk_token": "t0",
              "model_max_length": max_context, "clean_up_tokenization_spaces": False}  # fmt: skip
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def is_complete(out_dir: Path, shape: str, dtype: str) -> bool:
    """Whether `out_dir` already holds this shape and dtype (written by `write_random_model`)."""
    try:
        config = json.loads((out_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return config.get("random_shape") == shape and config.get("torch_dtype") == dtype and all(
        (out_dir / f).is_file() for f in ("model.safetensors", "tokenizer.json", "tokenizer_config.json")
    )


def write_random_model(shape: str, out_dir: Path, *, dtype: str = "bfloat16", force: bool = False) -> dict:
    """Write the folder (see the module docstring); a complete folder of the same shape is kept.

    Args:
        shape (str): a key of `SHAPES`.
        out_dir (Path): created if missing; `config.json` is written last, so a folder with it
            (and `random_shape`) is complete.
        dtype (str): weight dtype, one of `DTYPES`.
        force (bool): rewrite even a complete folder.

    Returns:
        dict: `{"path", "shape", "dtype", "params", "weight_bytes", "reused"}`; params counts
        every weight element, weight_bytes is params × dtype size (bytes, = the safetensors
        payload; llama-1b bf16: 1,235,814,400 params, 2,471,628,800 bytes).

    Raises:
        ValueError: unknown shape or dtype.
    """
    if shape not in SHAPES or dtype not in DTYPES:
        raise ValueError(f"shape must be one of {sorted(SHAPES)} and dtype one of {DTYPES}")
    out_dir = Path(out_dir)
    reused = is_complete(out_dir, shape, dtype) and not force
    if not reused:
        import mlx.core as mx
        from mlx.utils import tree_flatten

        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").unlink(missing_ok=True)
        model, config = build_model(shape, dtype)
        weights = dict(tree_flatten(model.parameters()))
        mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
        write_tokenizer(out_dir, config["vocab_size"], config["max_position_embeddings"])
        full = {**config, "architectures": ["LlamaForCausalLM" if shape != "qwen3-1.7b" else "Qwen3ForCausalLM"],
                "torch_dtype": dtype, "random_shape": shape}  # fmt: skip
        (out_dir / "config.json").write_text(json.dumps(full, indent=2) + "\n")
    params = _param_count(out_dir)
    itemsize = {"bfloat16": 2, "float16": 2, "float32": 4}[dtype]
    return {"path": str(out_dir), "shape": shape, "dtype": dtype, "params": params,
            "weight_bytes": params * itemsize, "reused": reused}  # fmt: skip


def _param_count(out_dir: Path) -> int:
    """Elements of every tensor in `model.safetensors`, read from its header (no weights loaded)."""
    with open(out_dir / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    total = 0
    for name, info in header.items():
        if name != "__metadata__":
            count = 1
            for dim in info["shape"]:
                count *= dim
            total += count
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    parser.add_argument("--out", type=Path, required=True, help="the model folder to write")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument("--device", choices=("default", "cpu", "gpu"), default="default",
                        help="where the random weights are drawn (default: MLX's default device)")
    parser.add_argument("--force", action="store_true", help="rewrite a complete folder")
    args = parser.parse_args()
    if args.device != "default":
        import mlx.core as mx

        mx.set_default_device(mx.cpu if args.device == "cpu" else mx.gpu)
    print(json.dumps(write_random_model(args.shape, args.out, dtype=args.dtype, force=args.force)))


if __name__ == "__main__":
    main()
