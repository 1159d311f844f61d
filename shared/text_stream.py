"""A completion's text: detokenize, end at end-of-sequence, cut at the first stop string.

The one implementation for the gateway's streams (`services/gateway/streams.py`) and in-process
generation (`services/engine/generate.py`). Pure: no I/O, no clocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.detok import IncrementalDetokenizer


class StopMatcher:
    """Holds back text that could still become a stop string; cuts at the first stop.

    Args:
        stops (tuple[str, ...]): Non-empty stop strings.
    """

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self._pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Add a text delta; return the text that is safe to emit now."""
        if self.stopped:
            return ""
        buf = self._pending + text
        cut = self._first_match(buf)
        held_from = len(buf) - self._longest_stop_prefix_suffix(buf)
        if cut is not None and cut <= held_from:  # no longer stop can still start before it
            self.stopped, self._pending = True, ""
            return buf[:cut]
        self._pending = buf[held_from:]
        return buf[:held_from]

    def flush(self) -> str:
        """Release held-back text at the end of generation (cut at a stop it contains)."""
        if self.stopped:
            return ""
        out, self._pending = self._pending, ""
        cut = self._first_match(out)
        self.stopped = cut is not None
        return out if cut is None else out[:cut]

    def _first_match(self, buf: str) -> int | None:
        return min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=None)

    def _longest_stop_prefix_suffix(self, buf: str) -> int:
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best


@dataclass(slots=True)
class Delta:
    """Output of one `TextStream.feed`: at the gateway, one engine chunk's `token` message."""

    text: str  # safe to show now
    token_ids: list[int]  # tokens shown (end-of-sequence and tokens after a stop excluded)
    stopped: bool  # a stop string matched in this batch: generation should end


class TextStream:
    """Detokenizes a completion incrementally and cuts it at the first stop string.

    Args:
        detokenizer (IncrementalDetokenizer): fresh for this completion (`shared/detok.py`),
            seeded with the prompt's tail.
        stops (tuple[str, ...]): stop strings; the output ends before the first one.
        eos_token_ids (frozenset[int]): tokens that end the completion and are not shown.
    """

    def __init__(self, detokenizer: IncrementalDetokenizer, stops: tuple[str, ...], eos_token_ids: frozenset[int]):
        self._detok = detokenizer
        self._matcher = StopMatcher(stops)
        self._eos = eos_token_ids
        self.num_consumed = 0  # completion tokens read, up to the stop or end-of-sequence
        self.num_sent = 0  # tokens handed out in deltas (end-of-sequence excluded)
        self.ended_by_eos = False

    @property
    def stopped(self) -> bool:
        """Whether a stop string matched; later tokens are ignored."""
        return self._matcher.stopped

    @property
    def closed(self) -> bool:
        return self.stopped or self.ended_by_eos

    def feed(self, token_ids: list[int]) -> Delta:
        """Consume tokens in order until the stream closes; return the text safe to show."""
        parts, shown = [], []
        for token in token_ids:
            if self.closed:
                break
            self.num_consumed += 1
            if token in self._eos:
                self.ended_by_eos = True
                break
            shown.append(token)
            parts.append(self._matcher.feed(self._detok.add(token)))
        self.num_sent += len(shown)
        return Delta("".join(parts), shown, self.stopped)

    def finish(self) -> str:
        """Flush the detokenizer and held-back text at the end (empty after a stop)."""
        if self.stopped:
            return ""
        return self._matcher.feed(self._detok.flush()) + self._matcher.flush()
