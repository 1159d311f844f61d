"""Tiny random-initialized hybrid models (recurrent + attention layers), as mlx-lm 0.32.2 defines them.

No hybrid weights exist offline, so each family is a few-layer config with random weights,
float32. `amplify` makes the recurrence long-lived and loud (A_log = -4: a decay of
exp(-exp(-4)) per token; conv weights x30), so state leaking between rows or across padding
would change the logits visibly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn

from services.engine import attention
from services.engine.model.loader import LoadedModel

VOCAB = 128

# Per family: mlx-lm module name and ModelArgs fields (the smallest shape with every layer kind).
CONFIGS: dict[str, dict] = {
    "qwen3_next": dict(  # GatedDeltaNet layers 0-2, attention at 3, MoE MLPs
        model_type="qwen3_next", hidden_size=64, num_hidden_layers=4, intermediate_size=96,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_value_heads=4,
        linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2, shared_expert_intermediate_size=32,
        mlp_only_layers=[], moe_intermediate_size=32, rms_norm_eps=1e-6, vocab_size=VOCAB, rope_theta=10000.0,
        partial_rotary_factor=0.25, max_position_embeddings=4096, full_attention_interval=2,
    ),
    "lfm2": dict(  # short convolutions with attention at layers 1 and 3
        model_type="lfm2", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, norm_eps=1e-5, conv_bias=False, conv_L_cache=3,
        block_dim=64, block_multiple_of=16, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False,
        block_ff_dim=96, layer_types=["conv", "full_attention", "conv", "full_attention"],
    ),
    "nemotron_h": dict(  # Mamba2, attention, MLP blocks: caches only for M and *, so index != layer
        model_type="nemotron_h", vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
        max_position_embeddings=4096, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        attention_bias=False, mamba_num_heads=4, mamba_head_dim=16, mamba_proj_bias=False, ssm_state_size=16,
        conv_kernel=4, n_groups=2, mlp_bias=False, layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True,
        hybrid_override_pattern=["M", "-", "*", "M", "-", "M", "*", "-"],
    ),
    "falcon_h1": dict(  # every layer runs Mamba2 and attention in parallel (one CacheList per layer);
        # lm_head_multiplier = embedding_multiplier keeps the logits of order 1
        model_type="falcon_h1", hidden_size=64, num_hidden_layers=2, intermediate_size=96, head_dim=16,
        num_attention_heads=4, num_key_value_heads=2, mamba_d_conv=4, mamba_d_head=16, mamba_d_ssm=64,
        mamba_d_state=16, mamba_n_groups=1, mamba_n_heads=4, mamba_rms_norm=True, vocab_size=VOCAB,
        max_position_embeddings=4096, rope_theta=10000.0, lm_head_multiplier=5.656854249492381,
    ),
    "jamba": dict(  # Mamba (selective scan) layers, attention at layer 1, MoE every other layer
        model_type="jamba", hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_offset=1, attn_layer_period=2, expert_layer_offset=1,
        expert_layer_period=2, mamba_d_conv=4, mamba_d_state=8, mamba_expand=2, num_experts=4,
        num_experts_per_tok=2, rms_norm_eps=1e-6, max_position_embeddings=4096, vocab_size=VOCAB,
    ),
}
FAMILIES = tuple(CONFIGS)


def _amplify(model: nn.Module) -> None:
    """A_log = -4 and conv weights x30 in every recurrent mixer."""
    updates = []
    for name, param in nn.utils.tree_flatten(model.parameters()):
        if name.endswith("A_log"):
            updates.append((name, mx.full(param.shape, -4.0, param.dtype)))
        elif name.endswith(("conv1d.weight", "conv.conv.weight")):
            updates.append((name, param * 30))
    model.load_weights(updates, strict=False)


def make_hybrid(family: str, *, seed: int = 0, amplify: bool = False, **overrides) -> nn.Module:
    """A random-initialized tiny model of `family` (float32, eval mode), our attention seam installed.

    `overrides` replace fields of the family's config (e.g. `head_dim=64`).
    """
    attention.install()
    module = importlib.import_module(f"mlx_lm.models.{family}")
    attention.install()  # rebind in a module imported just now
    args = module.ModelArgs.from_dict(CONFIGS[family] | overrides)
    mx.random.seed(seed)
    model = module.Model(args)
    model.set_dtype(mx.float32)
    if amplify:
        _amplify(model)
    model.eval()
    mx.eval(model.parameters())
    return model


def hand_state_bytes(family: str) -> int:
    """Recurrent state bytes per slot from the config (float32): conv window + SSM / delta state per layer."""
    c = CONFIGS[family]
    if family == "qwen3_next":
        layers = sum((i + 1) % c["full_attention_interval"] != 0 for i in range(c["num_hidden_layers"]))
        conv_dim = 2 * c["linear_num_key_heads"] * c["linear_key_head_dim"] + c["linear_num_value_heads"] * c["linear_value_head_dim"]
        ssm = c["linear_num_value_heads"] * c["linear_value_head_dim"] * c["linear_key_head_dim"]
        per_layer = (c["linear_conv_kernel_dim"] - 1) * conv_dim + ssm
    elif family == "lfm2":
        layers = c["layer_types"].count("conv")
        per_layer = (c["conv_L_cache"] - 1) * c["hidden_size"]
    elif family == "nemotron_h":
        layers = c["hybrid_override_pattern"].count("M")
        inner = c["mamba_num_heads"] * c["mamba_head_dim"]
        per_layer = ((c["conv_kernel"] - 1) * (inner + 2 * c["n_groups"] * c["ssm_state_size"])
                     + inner * c["ssm_state_size"])
    elif family == "falcon_h1":
        layers = c["num_hidden_layers"]
        per_layer = ((c["mamba_d_conv"] - 1) * (c["mamba_d_ssm"] + 2 * c["mamba_n_groups"] * c["mamba_d_state"])
                     + c["mamba_n_heads"] * c["mamba_d_head"] * c["mamba_d_state"])
    else:  # jamba
        layers = c["num_hidden_layers"] - c["num_hidden_layers"] // c["attn_layer_period"]
        inner = c["mamba_expand"] * c["hidden_size"]
        per_layer = (c["mamba_d_conv"] - 1) * inner + inner * c["mamba_d_state"]
    return 4 * layers * per_layer


def loaded_hybrid(model: nn.Module, eos=()) -> LoadedModel:
    """A `LoadedModel` around a tiny hybrid (no tokenizer: only its EOS ids)."""
    config = {k: v for k, v in dataclasses.asdict(model.args).items() if not k.startswith("_")}
    return LoadedModel(model=model, tokenizer=SimpleNamespace(eos_token_ids=set(eos)), path=Path("tiny"),
                       config=config)


@contextlib.contextmanager
def uncompiled():
    """Run with `mx.compile` off (restored on exit).

    On the CPU backend every fused kernel `mx.compile` builds is a C++ compile the first time
    it is seen (cached under $TMPDIR/mlx): a new model family costs 20-60 such kernels, about
    1-2 s each on a 2-core CI machine. Tests of hybrids therefore run uncompiled, except the
    one that traces the engine's decode windows (`tests/test_hybrid_engine.py`).
    """
    mx.disable_compile()
    try:
        yield
    finally:
        mx.enable_compile()
