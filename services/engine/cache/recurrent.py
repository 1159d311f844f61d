"""`RecurrentStateCache`: per-layer state of recurrent mixers (Mamba2, GatedDeltaNet).

Hybrid models keep a fixed-size state per recurrent layer instead of K/V per token:
a short convolution window and the SSM / delta-rule state. mlx-lm's models index
it as a list (`cache[0]`, `cache[1]`) and ask for an SSM mask; nothing grows with
the sequence, so `nbytes` is constant after the first token.
"""

from __future__ import annotations

import mlx.core as mx


class RecurrentStateCache:
    """Fixed-size recurrent state for one layer (single sequence, no padding).

    Args:
        num_arrays (int): State arrays the layer keeps (e.g. 2: conv window, SSM state).
    """

    def __init__(self, num_arrays: int):
        self.cache: list[mx.array | None] = [None] * num_arrays
        self.left_padding = None  # mlx-lm models read these two for padded batches
        self.lengths = None
        self.offset = 0  # tokens seen (some hybrid models read it for positions)

    def __getitem__(self, idx: int) -> mx.array | None:
        return self.cache[idx]

    def __setitem__(self, idx: int, value: mx.array) -> None:
        self.cache[idx] = value

    def make_mask(self, N: int):
        """No mask: a single unpadded sequence."""
        return None

    def advance(self, N: int) -> None:
        """Count N more tokens as seen."""
        self.offset += N

    @property
    def nbytes(self) -> int:
        """Bytes of state held (constant in sequence length)."""
        return sum(c.nbytes for c in self.cache if c is not None)

    def size(self) -> int:
        return 0

    def empty(self) -> bool:
        return self.cache[0] is None

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        return 0

    @property
    def state(self) -> list[mx.array | None]:
        return list(self.cache)

    @state.setter
    def state(self, arrays) -> None:
        self.cache = list(arrays)

    @property
    def meta_state(self) -> dict[str, str]:
        return {"num_arrays": str(len(self.cache)), "offset": str(self.offset)}
