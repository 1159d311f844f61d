"""The sliding-window rule with attention sinks, as pure index math (no arrays of ours).

One rule for prefill and decode alike (StreamingLLM, Xiao et al. 2023, arXiv 2309.17453):
the first `keep` positions are pinned; once the window is full the other
`max_size - keep` storage indices form a FIFO ring, position p living at index
`keep + (p - keep) mod (max_size - keep)`; a query at position q attends to the sinks
plus the most recent `max_size - keep` positions up to and including q.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Window:
    """A sliding window over a layer's KV storage.

    Attributes:
        max_size (int): Tokens stored per layer, sinks included.
        keep (int): Leading positions pinned forever (attention sinks), `0 <= keep < max_size`.
    """

    max_size: int
    keep: int = 0

    def __post_init__(self):
        if self.max_size < 1 or not 0 <= self.keep < self.max_size:
            raise ValueError(
                f"window needs 0 <= keep < max_size, got max_size={self.max_size} keep={self.keep}"
            )

    @property
    def ring(self) -> int:
        """Storage indices in the FIFO ring (tokens)."""
        return self.max_size - self.keep

    def storage_index(self, positions: np.ndarray) -> np.ndarray:
        """Storage index of each absolute position (int64 array, same shape)."""
        positions = np.asarray(positions, dtype=np.int64)
        ring = self.keep + (positions - self.keep) % self.ring
        return np.where(positions < self.keep, positions, ring)

    def stored_positions(self, num_seen: int) -> np.ndarray:
        """Absolute position held at each live storage index after `num_seen` tokens, in index order."""
        live = min(num_seen, self.max_size)
        indices = np.arange(live, dtype=np.int64)
        if num_seen <= self.max_size:
            return indices
        # Ring index i holds the latest p < num_seen with storage_index(p) == i.
        last = num_seen - 1
        back = (self.storage_index(np.array(last)) - indices) % self.ring
        return np.where(indices < self.keep, indices, last - back)

    def visible(self, query_positions: np.ndarray, key_positions: np.ndarray) -> np.ndarray:
        """Boolean mask [Lq, Lk]: may query i attend to key j under the rule."""
        q = np.asarray(query_positions, dtype=np.int64)[:, None]
        k = np.asarray(key_positions, dtype=np.int64)[None, :]
        return (k <= q) & ((k < self.keep) | (k > q - self.ring))

    def compose(self, other: "Window | None") -> "Window":
        """The tighter of two windows (an architectural one and the user's): the smaller wins."""
        if other is None or self.max_size <= other.max_size:
            return self
        return other
