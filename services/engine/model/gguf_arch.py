"""The model families the GGUF importer knows: config, tensor names and weight fix-ups.

Each family turns `{arch}.*` GGUF metadata into the HF/mlx-lm `config.json`, maps GGUF tensor
names to mlx-lm names, and undoes what llama.cpp's converter did to the weights.

Sources: llama.cpp `convert_hf_to_gguf.py` (`LlamaModel.permute`, `Gemma3Model.norm_shift`),
`src/llama-model.cpp` (`LLM_ARCH_GEMMA3` hyper-parameters) and `gguf-py/gguf/tensor_mapping.py`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from typing import Any

import mlx.core as mx
import numpy as np

from shared.errors import ModelNotFound

_LLAMA_LAYER = {
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
_GEMMA3_LAYER = {
    **{k: v for k, v in _LLAMA_LAYER.items() if k != "ffn_norm"},
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# Gemma 3 as llama.cpp runs it (llama-model.cpp, LLM_ARCH_GEMMA3); not stored in the file.
GEMMA3_SLIDING_WINDOW_PATTERN = 6  # layers 5, 11, 17, ... are global, the others sliding
GEMMA3_ROPE_LOCAL_BASE = 10000.0  # RoPE base of the sliding layers
_GEMMA3_27B_LAYERS = 62  # the one size whose attention scale is 1/sqrt(hidden/heads), not 1/sqrt(head_dim)

# Google's Gemma 3 chat template (tokenizer_config.json of google/gemma-3-*-it), text parts only:
# a system message prefixes the first user turn; "assistant" is spelled "model".
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for item in message['content'] if item['type'] == 'text' -%}{{ item['text'] | trim }}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def float32_literal(value: float) -> float:
    """The shortest decimal naming the same float32 (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


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


class Family(ABC):
    """One architecture: subclasses name it and give its `config` (and, where needed, `transform`)."""

    name = ""
    layer_tensors: dict[str, str] = {}
    chat_template: str | None = None  # used when the file has none
    end_of_turn: str | None = None  # token text ending a chat turn, when the file names no EOT id

    @abstractmethod
    def config(self, meta: dict[str, Any], tensor_names: tuple[str, ...]) -> dict[str, Any]:
        """The HF/mlx-lm `config.json` (without dtype and special token ids).

        Raises:
            ModelNotFound: A feature of the file this importer or mlx-lm cannot express.
        """

    def hf_name(self, gguf_name: str) -> str:
        """Maps `blk.3.attn_q.weight` to `model.layers.3.self_attn.q_proj.weight`.

        Raises:
            ModelNotFound: A tensor this family does not have (e.g. `rope_freqs`).
        """
        base, _, suffix = gguf_name.rpartition(".")
        if base in _GLOBAL:
            return f"{_GLOBAL[base]}.{suffix}"
        parts = base.split(".")
        if len(parts) == 3 and parts[0] == "blk" and parts[2] in self.layer_tensors:
            return f"model.layers.{parts[1]}.{self.layer_tensors[parts[2]]}.{suffix}"
        raise ModelNotFound(f"GGUF tensor {gguf_name!r} is not part of a {self.name} model this importer supports")

    def transform(self, gguf_name: str, w: mx.array, config: dict[str, Any]) -> mx.array:
        """Undoes llama.cpp's changes to one float32 tensor (identity by default)."""
        return w

    def _get(self, meta: dict[str, Any], key: str, default: Any = None) -> Any:
        return meta.get(f"{self.name}.{key}", default)

    def _attention(self, meta: dict[str, Any]) -> dict[str, Any]:
        """Head geometry, norm epsilon and RoPE base shared by llama-like families.

        Raises:
            ModelNotFound: Partial rotary embeddings, or keys and values of different widths.
        """
        n_heads, hidden = self._get(meta, "attention.head_count"), self._get(meta, "embedding_length")
        head_dim = self._get(meta, "attention.key_length", hidden // n_heads)
        if self._get(meta, "attention.value_length", head_dim) != head_dim:
            raise ModelNotFound("GGUF keys and values of different widths are not supported by this importer")
        if self._get(meta, "rope.dimension_count", head_dim) != head_dim:
            raise ModelNotFound("GGUF partial rotary embeddings are not supported by this importer")
        return {
            "hidden_size": hidden,
            "intermediate_size": self._get(meta, "feed_forward_length"),
            "num_hidden_layers": self._get(meta, "block_count"),
            "num_attention_heads": n_heads,
            "num_key_value_heads": self._get(meta, "attention.head_count_kv", n_heads),
            "head_dim": head_dim,
            "rms_norm_eps": float32_literal(self._get(meta, "attention.layer_norm_rms_epsilon")),
            "rope_theta": float32_literal(self._get(meta, "rope.freq_base", 10000.0)),
            "max_position_embeddings": self._get(meta, "context_length"),
            "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        }


class Llama(Family):
    """Llama (and SmolLM2): llama.cpp permutes Q/K rows for its RoPE layout."""

    name = "llama"
    layer_tensors = _LLAMA_LAYER

    def config(self, meta: dict[str, Any], tensor_names: tuple[str, ...]) -> dict[str, Any]:
        if self._get(meta, "rope.scaling.type", "none") != "none":
            raise ModelNotFound("GGUF rope scaling is not supported by this importer")
        config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **self._attention(meta)}
        return config | {
            "rope_traditional": False,
            "rope_scaling": None,
            "tie_word_embeddings": "output.weight" not in tensor_names,
            "attention_bias": "blk.0.attn_q.bias" in tensor_names,
            "mlp_bias": "blk.0.ffn_up.bias" in tensor_names,
            "layer_types": ["full_attention"] * config["num_hidden_layers"],
            "sliding_window": None,
            "hidden_act": "silu",
        }

    def transform(self, gguf_name: str, w: mx.array, config: dict[str, Any]) -> mx.array:
        heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
        kind = gguf_name.split(".")[-2]
        if kind in heads and gguf_name.endswith(".weight"):
            return unpermute_rope_rows(w, heads[kind])
        return w


class Gemma3(Family):
    """Gemma 3 (text): QK-norm, four norms per layer, sliding layers with every sixth global.

    llama.cpp stores every RMSNorm weight as `1 + w` (Gemma computes `x * (1 + w)`); mlx-lm's
    `gemma3_text` adds the 1 itself, so it is subtracted here. Q/K rows are not permuted.
    """

    name = "gemma3"
    layer_tensors = _GEMMA3_LAYER
    chat_template = GEMMA_CHAT_TEMPLATE
    end_of_turn = "<end_of_turn>"

    def config(self, meta: dict[str, Any], tensor_names: tuple[str, ...]) -> dict[str, Any]:
        if self._get(meta, "final_logit_softcapping"):
            raise ModelNotFound("GGUF gemma3 with final logit soft-capping is not supported (mlx-lm has none)")
        base = self._attention(meta)
        n_layers, window = base["num_hidden_layers"], self._get(meta, "attention.sliding_window")
        pattern = GEMMA3_SLIDING_WINDOW_PATTERN if window else 1  # pattern 1: every layer global
        scalar = base["head_dim"]
        if n_layers == _GEMMA3_27B_LAYERS:
            scalar = base["hidden_size"] // base["num_attention_heads"]
        return {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", **base} | {
            "rope_local_base_freq": GEMMA3_ROPE_LOCAL_BASE,
            "rope_scaling": self._rope_scaling(meta),
            "query_pre_attn_scalar": scalar,
            "sliding_window": window or base["max_position_embeddings"],
            "sliding_window_pattern": pattern,
            "layer_types": [
                "full_attention" if i % pattern == pattern - 1 else "sliding_attention" for i in range(n_layers)
            ],
            "tie_word_embeddings": "output.weight" not in tensor_names,
            "hidden_activation": "gelu_pytorch_tanh",
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
        }

    def _rope_scaling(self, meta: dict[str, Any]) -> dict[str, Any] | None:
        """Linear RoPE scaling of the global layers (Gemma 3 4B and larger), else None.

        Raises:
            ModelNotFound: Any other scaling type.
        """
        kind = self._get(meta, "rope.scaling.type", "none")
        if kind == "none":
            return None
        if kind != "linear":
            raise ModelNotFound(f"GGUF gemma3 rope scaling {kind!r} is not supported; only 'linear' is")
        return {"rope_type": "linear", "factor": float32_literal(self._get(meta, "rope.scaling.factor"))}

    def transform(self, gguf_name: str, w: mx.array, config: dict[str, Any]) -> mx.array:
        return w - 1.0 if gguf_name.endswith("norm.weight") else w


FAMILIES: dict[str, Family] = {f.name: f for f in (Llama(), Gemma3())}


def family(architecture: str | None) -> Family:
    """The family of a GGUF `general.architecture`.

    Raises:
        ModelNotFound: An architecture this importer does not know.
    """
    if architecture not in FAMILIES:
        known = ", ".join(repr(name) for name in FAMILIES)
        raise ModelNotFound(f"GGUF architecture {architecture!r} is not supported; supported: {known}")
    return FAMILIES[architecture]
