"""A lean decode forward for Llama-style models: mlx-lm's function in fewer primitives.

At decode, MLX spends host time on every primitive of the step's graph (~1.6 µs per view on
the CPU backend, ~4.5 µs per launching primitive on CUDA); with mlx-lm's forward the host, not
the GPU, set the pace at small batches (issue 10); this one launches fewer (`ops/step_ops.py` counts
them, `ops/gpu_time.py` times them). mlx-lm's modules run `[B, L, D]` activations: each Linear
adds a weight transpose and a flatten/unflatten around its matmul, and attention reshapes and
transposes q, k, v and its output — about 30 views per layer that launch nothing. This forward
runs the same modules' weights on `[B, D]` activations (one token per row): the weights'
transposes are taken once (evaluated views, no copy), 2 to 32 rows project in one launch on CUDA without a bias
(`kernels.skinny_gemm`, where MLX's cuBLASLt call costs ~20 µs more host time), the MLP's SwiGLU reads the fused gate/up output in one
launch (`kernels.swiglu`), q, k and v come out of the fused projection
normalized (Qwen3) and rotated in one launch (`kernels.qkv_rope`; in a decode window on CUDA, the
same launch writes k and v, coded in a compressed layer, into their tail rows), each residual add runs in one
launch with the RMSNorm after it (`kernels.fused_norm`), and each layer's cache
(`PagedLayerCache`) is called directly. One row on CUDA (single-stream decode, where the host's
launches set the pace) also folds each add and RMSNorm into the projection after it, and the
SwiGLU into the gate/up projection (`kernels.norm_gemv`): 7 launches a layer instead of 10; its o and down
projections stream the weights with more bytes in flight than MLX's gemv (`kernels.row_gemv`).

It serves the model types whose decoder layer is mlx-lm's Llama block with fused projections
(`model.fuse`): llama (and mistral), qwen2 (q/k/v bias), qwen3 (q/k RMSNorm), with mlx's `nn.RoPE` or
Llama 3's RoPE. Anything else (quantized layers, other families or RoPEs, hybrids) keeps mlx-lm's forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from kernels import norm_gemv, row_gemv, skinny_gemm
from kernels.fused_norm import add_rms_norm
from kernels.qkv_rope import RopeSpec, split_qkv_rope, split_qkv_rope_store, stores
from kernels.swiglu import swiglu_halves

from .fuse import FusedView

FAMILIES = ("mlx_lm.models.llama", "mlx_lm.models.qwen2", "mlx_lm.models.qwen3")


@dataclass(frozen=True, slots=True)
class _Proj:
    """A projection `x @ weight.T (+ bias)` of [B, in] activations: without a bias on CUDA, one row by
    `kernels.row_gemv` and 2 to 32 rows by `kernels.skinny_gemm`, each one launch; else MLX's matmul (`addmm`
    with a bias) on the weight's transpose, an evaluated view (shares the buffer), so no step traces a
    Transpose."""

    weight: mx.array  # [out, in], as stored
    weight_t: mx.array  # [in, out]
    bias: mx.array | None
    row: row_gemv.RowTuning | None  # the one-row launch, resolved once (None: MLX's gemv)

    @classmethod
    def of(cls, weight: mx.array, bias: mx.array | None = None) -> _Proj:
        t = weight.T
        mx.eval(t)
        return cls(weight, t, bias, row_gemv.launch_for(weight) if bias is None else None)

    def __call__(self, x: mx.array) -> mx.array:
        if self.bias is not None:
            return mx.addmm(self.bias, x, self.weight_t)
        if self.row is not None and x.shape[0] == 1 and x.dtype == self.weight.dtype:
            return row_gemv.launch(x, self.weight, self.row)
        return skinny_gemm.launch(x, self.weight) if skinny_gemm.serves(x, self.weight) else x @ self.weight_t


@dataclass(frozen=True, slots=True)
class _Layer:
    """One decoder layer's weights and modules, as the lean forward reads them."""

    input_norm: nn.Module
    post_norm: nn.Module
    qkv: _Proj  # hidden -> (n_heads + 2 * n_kv_heads) * head_dim
    o: _Proj  # n_heads * head_dim -> hidden
    gate_up: _Proj  # hidden -> 2 * intermediate
    down: _Proj  # intermediate -> hidden
    q_norm: nn.Module | None
    k_norm: nn.Module | None
    rope: RopeSpec
    n_heads: int
    n_kv_heads: int
    head_dim: int
    scale: float


class LeanDecoder:
    """Decode forward of a fused Llama-style model: tokens [B] -> logits [B, vocab].

    Computes what `model(tokens[:, None], cache=caches)[:, -1]` computes (same weights, same
    caches, the same operations), with fewer graph nodes; on CUDA the fused RMSNorms (after each
    residual add, and Qwen3's on q and k) sum their squares in another order, and so do projections of
    2 to 32 half-precision rows (`kernels.skinny_gemm`, against cuBLAS) and of one (`kernels.norm_gemv` and
    `kernels.row_gemv`, against MLX's gemv), so a value may differ in its last bit (and a bf16 model's logits by that, carried through the layers). Build it with `LeanDecoder.build`, which returns None for a model it
    does not serve (other families, RoPEs other than `nn.RoPE` and Llama 3's, quantized or biased
    MLPs, weights of mixed dtypes).
    """

    def __init__(self, model: nn.Module, layers: list[_Layer]):
        inner = model.model
        self._embed, self._layers = inner.embed_tokens, layers
        self._next_norms = [layer.input_norm for layer in layers[1:]] + [inner.norm]  # the norm after each layer
        self._unbiased = all(layer.qkv.bias is None for layer in layers)  # norm_gemv adds no bias
        head = inner.embed_tokens if model.args.tie_word_embeddings else model.lm_head
        self._head = _Proj.of(head.weight)

    @classmethod
    def build(cls, model: nn.Module) -> LeanDecoder | None:
        """The lean forward of `model`, or None when its layers are not fused plain Llama blocks."""
        inner = getattr(model, "model", None)
        blocks = getattr(inner, "layers", None)
        if not blocks or type(model).__module__ not in FAMILIES:
            return None
        if not model.args.tie_word_embeddings and type(getattr(model, "lm_head", None)) is not nn.Linear:
            return None
        if type(inner.embed_tokens) is not nn.Embedding or type(getattr(inner, "norm", None)) is not nn.RMSNorm:
            return None
        if "bias" in getattr(model, "lm_head", {}):
            return None
        layers = [_layer(block) for block in blocks]
        if any(layer is None for layer in layers):
            return None
        dtype = inner.embed_tokens.weight.dtype  # the fused norm kernel computes in one dtype, as the model's must
        weights = [inner.norm.weight] + [w for layer in layers for w in (
            layer.input_norm.weight, layer.post_norm.weight, layer.qkv.weight, layer.o.weight, layer.gate_up.weight,
            layer.down.weight)]
        weights += [n.weight for layer in layers for n in (layer.q_norm, layer.k_norm) if n is not None]
        return cls(model, layers) if all(w.dtype == dtype for w in weights) else None

    def __call__(self, tokens: mx.array, caches: list) -> mx.array:
        """Logits of the next token.

        Args:
            tokens (mx.array): uint32 [B], each row's newest token.
            caches (list): One `PagedLayerCache` per layer (one token per row planned).

        Returns:
            mx.array: [B, vocab] in the model's dtype.
        """
        x = self._embed(tokens)  # [B, hidden]
        if self._unbiased and norm_gemv.serves(x, self._head.weight):
            return self._one_row(x, caches)
        normed = self._layers[0].input_norm(x)
        for layer, cache, next_norm in zip(self._layers, caches, self._next_norms):
            x, normed = add_rms_norm(x, _attention(layer, layer.qkv(normed), cache), layer.post_norm.weight,
                                     layer.post_norm.eps)
            mlp = layer.down(swiglu_halves(layer.gate_up(normed)))
            x, normed = add_rms_norm(x, mlp, next_norm.weight, next_norm.eps)
        return self._head(normed)

    def _one_row(self, x: mx.array, caches: list) -> mx.array:
        """The forward of one row [1, hidden] with each norm inside the projection after it (`kernels.norm_gemv`)."""
        mlp = None  # the sublayer output the next norm adds to x
        for layer, cache in zip(self._layers, caches):
            x, qkv = norm_gemv.norm_gemv(x, mlp, layer.input_norm.weight, layer.input_norm.eps, layer.qkv.weight)
            x, act = norm_gemv.norm_gemv(x, _attention(layer, qkv, cache), layer.post_norm.weight, layer.post_norm.eps,
                                         layer.gate_up.weight, swiglu=True)
            mlp = layer.down(act)
        final = self._next_norms[-1]  # the model's last norm
        return norm_gemv.norm_gemv(x, mlp, final.weight, final.eps, self._head.weight)[1]


def _attention(layer: _Layer, qkv: mx.array, cache) -> mx.array:
    """Self-attention of one token per row from its fused projection: qkv [B, (heads + 2 * kv) * head_dim] ->
    [B, hidden]."""
    heads, kv = layer.n_heads, layer.n_kv_heads
    split = dict(n_heads=heads, n_kv_heads=kv, head_dim=layer.head_dim, rope=layer.rope, offset=cache.offset,
                 q_norm=layer.q_norm, k_norm=layer.k_norm)
    target = cache.store_target
    if target is not None and stores(cache.spec.fmt, layer.head_dim, layer.rope, qkv.dtype):
        q = split_qkv_rope_store(qkv, cache.spec.fmt, cache.spec.key_mean, *target, **split)  # k, v land in place
        k = v = None  # decode attention reads the pools
    else:
        q, k, v = split_qkv_rope(qkv, **split)
        k, v = cache.update_and_fetch(k, v)
    out = cache.attend(q, k, v, scale=layer.scale, mask=None, flat=True)  # [B, heads * head_dim]
    return layer.o(out)


def _fused(views: tuple) -> object | None:
    """The FusedLinear behind sibling views, if they are exactly its views in order."""
    if not all(type(v) is FusedView for v in views):
        return None
    fused = views[0].fused
    if any(v.fused is not fused or v.index != i for i, v in enumerate(views)) or len(fused.bounds) != len(views) + 1:
        return None
    return fused


def _layer(block: nn.Module) -> _Layer | None:
    attn, mlp = getattr(block, "self_attn", None), getattr(block, "mlp", None)
    if attn is None or mlp is None or type(block).__module__ not in FAMILIES:
        return None
    qkv = _fused((getattr(attn, "q_proj", None), getattr(attn, "k_proj", None), getattr(attn, "v_proj", None)))
    gate_up = _fused((getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)))
    o, down = getattr(attn, "o_proj", None), getattr(mlp, "down_proj", None)
    if qkv is None or gate_up is None or gate_up.bias is not None or type(o) is not nn.Linear:
        return None
    if gate_up.bounds[2] != 2 * gate_up.bounds[1]:  # `swiglu_halves` takes [gate | up] of equal widths
        return None
    if type(down) is not nn.Linear or "bias" in down:
        return None
    norms = [getattr(block, "input_layernorm", None), getattr(block, "post_attention_layernorm", None)]
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    if any(type(n) is not nn.RMSNorm for n in norms + [q_norm, k_norm] if n is not None) or None in norms:
        return None
    rope = RopeSpec.of(getattr(attn, "rope", None))
    if rope is None:  # YaRN, LongRoPE, ...: mlx-lm's forward calls the module
        return None
    head_dim = (qkv.bounds[2] - qkv.bounds[1]) // attn.n_kv_heads
    return _Layer(
        input_norm=norms[0], post_norm=norms[1],
        qkv=_Proj.of(qkv.weight, qkv.bias), o=_Proj.of(o.weight, o.bias if "bias" in o else None),
        gate_up=_Proj.of(gate_up.weight), down=_Proj.of(down.weight),
        q_norm=q_norm, k_norm=k_norm, rope=rope,
        n_heads=attn.n_heads, n_kv_heads=attn.n_kv_heads, head_dim=head_dim, scale=attn.scale,
    )
