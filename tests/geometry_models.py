"""Random-initialized models of the geometries beyond llama's (float32, small enough for exhaustive tests).

- `llama80` / `llama96`: llama with head_dim 80 and 96 (phi-2 / phi-3 widths), GQA 4:2;
- `deepseek_v2`: keys of 192 (128 no-RoPE + 64 RoPE) and values of 128 per head (DeepSeek-V2's
  split), the cache storing every head;
- `mla`: DeepSeek-V3 / Kimi multi-head latent attention: the cache holds one latent of 96 and
  its RoPE part of 32 per token, which the model multiplies out per head (`make_kimi_k25`: the
  same attention under Kimi K2.5's wrapper).
"""

from __future__ import annotations

import mlx.core as mx

from services.engine import attention
from tests.conftest import make_tiny_llama

VOCAB = 128
GEOMETRIES = ("llama80", "llama96", "deepseek_v2", "mla")


def make_deepseek_v2(*, seed: int = 0, n_layers: int = 2):
    """DeepSeek-V2 attention: K 192 / V 128 per head, 4 heads (no MoE: dense MLP layers)."""
    attention.install()
    from mlx_lm.models import deepseek_v2

    args = deepseek_v2.ModelArgs(
        model_type="deepseek_v2", vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=n_layers,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64, q_lora_rank=None, qk_rope_head_dim=64,
        v_head_dim=128, qk_nope_head_dim=128, max_position_embeddings=4096, rope_scaling={"factor": 1.0},
    )
    return _init(lambda: deepseek_v2.Model(args), seed)


def make_mla(*, seed: int = 0, n_layers: int = 2):
    """DeepSeek-V3 MLA: the cache holds a latent of 96 and a RoPE key of 32 per token (one kv "head")."""
    attention.install()
    from mlx_lm.models import deepseek_v3

    args = deepseek_v3.ModelArgs(
        model_type="deepseek_v3", vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=n_layers,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=96, q_lora_rank=64, qk_rope_head_dim=32,
        v_head_dim=64, qk_nope_head_dim=48, max_position_embeddings=4096,
    )
    return _init(lambda: deepseek_v3.Model(args), seed)


def make_kimi_k25(*, seed: int = 0, n_layers: int = 2):
    """Kimi K2.5's language model (mlx-lm `kimi_k25`: DeepSeek-V3 MLA under a multimodal wrapper)."""
    attention.install()
    from mlx_lm.models import kimi_k25

    text = dict(model_type="deepseek_v3", vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                num_hidden_layers=n_layers, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64,
                q_lora_rank=64, qk_rope_head_dim=32, v_head_dim=64, qk_nope_head_dim=48, max_position_embeddings=4096)
    return _init(lambda: kimi_k25.Model(kimi_k25.ModelArgs(text_config=text)), seed)


def _init(build, seed: int):
    """`build()`'s model with the constructors' random init drawn after seeding: MLX draws a random array
    when it is created, so a seed set after construction would leave the weights to whatever ran before."""
    mx.random.seed(seed)
    model = build()
    mx.eval(model.parameters())
    return model


def make_geometry_model(name: str, *, seed: int = 0):
    """One of `GEOMETRIES`."""
    if name.startswith("llama"):
        return make_tiny_llama(seed=seed, head_dim=int(name.removeprefix("llama")), vocab=VOCAB)
    return {"deepseek_v2": make_deepseek_v2, "mla": make_mla}[name](seed=seed)
