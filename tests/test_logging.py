"""Log records of processes that share one stderr (as serve's children do) stay one per line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WRITERS, RECORDS = 4, 400
CODE = (
    "from shared.logging import configure_logging, get_logger\n"
    "configure_logging(json=True)\n"
    "log = get_logger('writer')\n"
    f"for i in range({RECORDS}):\n"
    "    log.info('event', i=i, pad='x' * 300)\n"
)


def test_records_of_processes_sharing_stderr_never_run_together():
    """Four writers, one pipe: each record (~400 bytes, under PIPE_BUF) must arrive whole, in one write.
    With structlog's PrintLogger (the newline written apart) this failed three runs out of three."""
    read, write = os.pipe()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", CODE], stderr=write, env=env) for _ in range(WRITERS)]
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        lines = pipe.read().decode().splitlines()
    assert all(p.wait(timeout=60) == 0 for p in procs)
    records = [json.loads(line) for line in lines]  # a record run into another is not one JSON object
    assert len(records) == WRITERS * RECORDS
    assert sorted(r["i"] for r in records) == sorted(list(range(RECORDS)) * WRITERS)
