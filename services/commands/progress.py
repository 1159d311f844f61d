"""A progress bar on stderr for the long evaluation commands (`eval-kv`, `calibrate-kv`)."""

from __future__ import annotations


class RunProgress:
    """Counts finished runs (one scheme's pass) on a tqdm bar that appears with the first one, so an error
    before any run stays a one-line message.

    Args:
        total (int): Runs expected.
        desc (str): The bar's label (the command's name).
    """

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.bar = total, desc, None

    def step(self, scheme: str) -> None:
        """One run finished; `scheme` (its spec, cut to 40 characters) is shown beside the bar."""
        from tqdm import tqdm

        if self.bar is None:
            self.bar = tqdm(total=self.total, desc=self.desc, unit="run")
        self.bar.set_postfix_str(scheme[:40], refresh=False)
        self.bar.update()
        self.bar.refresh()  # runs take minutes: show each one now, not at tqdm's next redraw

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
