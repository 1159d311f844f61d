"""Teacher-forced runs that start part-way up the model, replaying the raw run below.

When only layer `l`'s K/V are compressed, layers `0 .. l-1` compute exactly what they computed
in the raw run, so their outputs can be replayed from a recording instead of recomputed: a
sensitivity run then costs `n_layers - l` layers, half the model on average.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import cache as mlx_cache

from .metrics import logprob_chunks


class _StandIn:
    """Takes a layer's place in the model's layer list; its attributes (`use_sliding`, ...) still read."""

    def __init__(self, layer, outputs: list[mx.array]):
        self.layer, self.outputs = layer, outputs

    def __getattr__(self, name: str):
        return getattr(self.layer, name)


class _Recorder(_StandIn):
    """Calls the layer and keeps its output, chunk by chunk."""

    def __call__(self, x, *args, **kwargs):
        out = self.layer(x, *args, **kwargs)
        self.outputs.append(out)
        return out


class _Replay(_StandIn):
    """Returns the recorded output of the next chunk, computing nothing."""

    def __init__(self, layer, outputs: list[mx.array]):
        super().__init__(layer, outputs)
        self._next = iter(outputs)

    def __call__(self, x, *args, **kwargs):
        return next(self._next)


def can_replay(model: nn.Module) -> bool:
    """Whether skipping layers is exact for this model.

    True when the model's layers are a list and every layer has a plain full-attention cache
    in mlx-lm's template: the attention mask is then `"causal"` whatever the skipped caches
    hold. Windowed or recurrent layers read masks or state from caches a replay leaves empty.
    """
    if not isinstance(getattr(model, "layers", None), list) or not hasattr(model, "make_cache"):
        return False
    return all(type(c) is mlx_cache.KVCache for c in model.make_cache())


class RecordedRun:
    """A raw teacher-forced run: its log-probabilities and every layer's output per chunk.

    Args:
        model (nn.Module): mlx-lm model.
        caches (list): Fresh raw per-layer caches; filled in place.
        token_ids (list[int]): Input tokens.
        chunk (int): Tokens per forward; replays use the same chunks.

    Memory: `n_layers * len(token_ids) * hidden_size` activations in the model dtype
    (70 MB for the default model at 1,024 tokens), held only when `can_replay(model)`.
    """

    def __init__(self, model: nn.Module, caches: list, token_ids: list[int], *, chunk: int):
        self.enabled = can_replay(model)
        self.outputs: list[list[mx.array]] = [[] for _ in range(len(model.layers))] if self.enabled else []
        self.logprobs: list[np.ndarray] = []
        with self._swapped(model, [_Recorder(layer, out) for layer, out in zip(model.layers, self.outputs)]):
            for logprobs in logprob_chunks(model, caches, token_ids, chunk=chunk):
                mx.eval([out[-1] for out in self.outputs])
                self.logprobs.append(logprobs)

    @contextmanager
    def replaying(self, model: nn.Module, start: int) -> Iterator[None]:
        """Within the block, layers below `start` replay this run instead of computing.

        Each model call must be the next chunk of the recorded run, in order (build caches
        before: `make_layer_caches` probes the model with a forward); a model for which
        `can_replay` is False runs every layer (same results, full cost).
        """
        with self._swapped(model, [_Replay(model.layers[i], self.outputs[i]) for i in range(start)] if self.enabled else []):
            yield

    @contextmanager
    def _swapped(self, model: nn.Module, stand_ins: list) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        layers = model.layers
        saved = layers[: len(stand_ins)]
        layers[: len(stand_ins)] = stand_ins
        try:
            yield
        finally:
            layers[: len(stand_ins)] = saved
