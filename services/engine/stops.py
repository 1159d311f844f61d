"""Stop strings over streamed text, including stops that span token boundaries."""

from __future__ import annotations


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
