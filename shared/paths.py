"""Where buttermilk keeps what it writes (converted models, kernel sources): one folder, one rule."""

from __future__ import annotations

import os
from pathlib import Path


def data_dir() -> Path:
    """Buttermilk's data folder: `$BUTTERMILK_DATA_DIR`, else `~/.cache/buttermilk`.

    Raises:
        RuntimeError: the home folder is needed and cannot be found (no `$HOME`, no passwd entry).
    """
    return Path(os.environ.get("BUTTERMILK_DATA_DIR") or "~/.cache/buttermilk").expanduser()
