"""Fused input projections: one matmul for the Linear layers that read the same input.

A decode step at small batch is bound by the host's cost per launched kernel, and a Llama-style
layer launches q, k and v projections and gate and up projections separately, all reading the
same activations. vLLM fuses them into one weight (`QKVParallelLinear`,
`MergedColumnParallelLinear`); we do the same without touching mlx-lm's model code: the
sibling Linear modules are replaced by views of one fused module, which runs the single matmul
when the first sibling is called with an input and hands the others their column slice of it.

The attention and MLP modules of mlx-lm call their projections on one input array in turn
(`self.q_proj(x), self.k_proj(x), self.v_proj(x)`), which is what this relies on: the fused
output is reused only for the identical array object, so any other call pattern still computes
the right values (one matmul per call, as before).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusedLinear:
    """The concatenation of sibling `nn.Linear` layers `[out_1 + ... + out_n, in]` (not a Module:
    its views own its arrays, once, for `parameters()`)."""

    def __init__(self, linears: list[nn.Linear]):
        self.weight = mx.concatenate([m.weight for m in linears], axis=0)
        self.bias = mx.concatenate([m.bias for m in linears]) if "bias" in linears[0] else None
        self.bounds = [0]
        for m in linears:
            self.bounds.append(self.bounds[-1] + m.weight.shape[0])
        self._input: mx.array | None = None
        self._outputs: list[mx.array | None] = []

    def output(self, x: mx.array, index: int) -> mx.array:
        """Columns of sibling `index` of `x @ W.T (+ b)`, x [..., in] -> [..., out_index]."""
        if self._input is not x or self._outputs[index] is None:
            y = mx.addmm(self.bias, x, self.weight.T) if self.bias is not None else x @ self.weight.T
            self._input = x
            self._outputs = [y[..., a:b] for a, b in zip(self.bounds, self.bounds[1:])]
        out, self._outputs[index] = self._outputs[index], None
        if all(o is None for o in self._outputs):
            self._input = None  # every sibling has its slice: hold no activations past the call
        return out


class FusedView(nn.Module):
    """Sibling `index` of a `FusedLinear`, in place of the `nn.Linear` it replaced."""

    def __init__(self, fused: FusedLinear, index: int):
        super().__init__()
        object.__setattr__(self, "fused", fused)  # not a child: its weight is listed once, by view 0
        self.index = index
        if index == 0:
            self.weight = fused.weight
            if fused.bias is not None:
                self.bias = fused.bias

    def __call__(self, x: mx.array) -> mx.array:
        return self.fused.output(x, self.index)


def fuse_projections(model: nn.Module) -> int:
    """Replace every group of sibling plain `nn.Linear` projections (`GROUPS`) by views of one matmul.

    Groups whose members are not all unquantized `nn.Linear` with the same input width and bias
    presence are left alone (quantized layers keep their own kernels).

    Returns:
        int: Groups fused.
    """
    fused = 0
    for _, module in model.named_modules():
        for names in GROUPS:
            linears = [getattr(module, n, None) for n in names]
            if not all(type(m) is nn.Linear for m in linears):
                continue
            if len({(m.weight.shape[1], "bias" in m, m.weight.dtype) for m in linears}) != 1:
                continue
            group = FusedLinear(linears)
            mx.eval(group.weight, group.bias)  # one group's copy at a time, then the originals go
            for i, name in enumerate(names):
                setattr(module, name, FusedView(group, i))
            fused += 1
    return fused
