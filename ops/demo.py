"""The README's main job: serve the default model, answer one prompt through the gateway, stop.

Starts `buttermilk serve` (controller, gateway, one engine) as real processes on a private
ipc:// address, waits until an engine is live, streams the answer to one chat prompt
through the Python client, prints the usage line, then shuts the server down (SIGTERM, no
orphans). Exit status: 0 on success, the server's status if it fails to start.

    python -m ops.demo [--prompt TEXT] [--max-tokens N] [serve flags ...]
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shared.client import Client, ServerError

START_TIMEOUT_S = 180.0


def wait_until_live(client: Client, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            sys.exit(server.returncode or 1)
        try:
            if client.health(timeout_s=1.0).engines_live > 0:
                return
        except (TimeoutError, ServerError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"server not ready after {START_TIMEOUT_S:.0f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", default="What is the capital of France?")
    parser.add_argument("--max-tokens", type=int, default=48)
    args, serve_flags = parser.parse_known_args()
    with tempfile.TemporaryDirectory(prefix="buttermilk-demo-") as tmp:
        address = f"ipc://{Path(tmp) / 'gateway.sock'}"
        argv = [sys.executable, "-m", "services.cli", "serve", "--model", "default", "--address", address,
                "--run-dir", str(Path(tmp) / "run"), "--http-address", "off", *serve_flags]
        server = subprocess.Popen(argv)
        try:
            with Client(address) as client:
                wait_until_live(client, server)
                print(f"\n>>> {args.prompt}\n", flush=True)
                stream = client.stream(messages=[{"role": "user", "content": args.prompt}],
                                       max_tokens=args.max_tokens, temperature=0.0)
                done = None
                while True:
                    try:
                        sys.stdout.write(next(stream).text)
                        sys.stdout.flush()
                    except StopIteration as stop:
                        done = stop.value
                        break
                print(f"\n\n[{done.finish_reason}; prompt {done.usage.prompt_tokens} tokens, "
                      f"completion {done.usage.completion_tokens} tokens]", flush=True)
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
