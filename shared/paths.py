"""Where buttermilk keeps what it writes (converted models, kernel sources, a compiled library): one folder, one rule."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def data_dir() -> Path:
    """Buttermilk's data folder: `$BUTTERMILK_DATA_DIR`, else `~/.cache/buttermilk`.

    Raises:
        RuntimeError: the home folder is needed and cannot be found (no `$HOME`, no passwd entry).
    """
    return Path(os.environ.get("BUTTERMILK_DATA_DIR") or "~/.cache/buttermilk").expanduser()


def private_folder(folder: Path) -> bool:
    """Create `folder` (mode 0700) where missing; whether it can hold code this process runs: owned by this user,
    writable by no one else, and writable here. False on any OS error."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = folder.stat()
        if info.st_uid != os.getuid() or info.st_mode & 0o022:
            return False
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError:
        return False
    return True
