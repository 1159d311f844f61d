"""Size a KV pool per scheme: `python -m ops.size_pool` is `buttermilk pool-size` (see its --help)."""

from __future__ import annotations

import sys

from services.commands.pool_size import main

if __name__ == "__main__":
    sys.exit(main())
