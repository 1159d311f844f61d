"""First starts on one data folder convert a GGUF once (serve's children, compose services)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from .pipeline_helpers import REPO

# Each process stands at a barrier, then resolves the default model with a slow stand-in converter
# that logs every call: without the lock both would convert.
SCRIPT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from services.engine.model import paths

    log, barrier, me = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]

    def slow_convert(gguf_path, out_dir, dtype):
        with log.open("a") as f:
            f.write(me + "\\n")
        time.sleep(1.0)
        staging = Path(str(out_dir) + "." + me)
        staging.mkdir()
        staging.rename(out_dir)  # published whole, as convert_gguf does

    paths.convert_gguf = slow_convert
    (barrier / me).touch()
    while len(list(barrier.iterdir())) < 2:
        time.sleep(0.005)
    print(paths.resolve_model("default", dtype="float32"))
""")


def test_concurrent_first_starts_convert_once(tmp_path):
    log, barrier = tmp_path / "conversions.log", tmp_path / "barrier"
    barrier.mkdir()
    env = {**os.environ, "BUTTERMILK_DATA_DIR": str(tmp_path / "data")}
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, str(log), str(barrier), name], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name in ("a", "b")]  # fmt: skip
    outputs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    assert outputs[0][0] == outputs[1][0] and "SmolLM2-135M-Instruct-float32" in outputs[0][0]
    assert len(log.read_text().splitlines()) == 1
