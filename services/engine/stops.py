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
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, self._pending = True, ""
            return buf[:cut]
        hold = self._longest_stop_prefix_suffix(buf)
        self._pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold]

    def flush(self) -> str:
        """Release held-back text at the end of generation."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out

    def _longest_stop_prefix_suffix(self, buf: str) -> int:
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best
