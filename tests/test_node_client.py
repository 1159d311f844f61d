"""The Node.js client (clients/node) against a live `buttermilk serve`: same greedy text as the
Python client, structured errors for malformed input, leases, cancel and concurrent streams.

Skipped only when `node` or `npm` is not on PATH. `npm ci` runs first if `node_modules` is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess

import pytest

from shared.client import Client
from tests.pipeline_helpers import REPO, Server

NODE = shutil.which("node")
NPM = shutil.which("npm")
CLIENT_DIR = REPO / "clients" / "node"
LIBRARY_URL = (CLIENT_DIR / "buttermilk.mjs").as_uri()
NPM_TIMEOUT_S = 180
NODE_TIMEOUT_S = 60
PROMPT = "The capital of France is"
MAX_TOKENS = 8

pytestmark = pytest.mark.skipif(
    NODE is None or NPM is None, reason="node and npm must be on PATH to test the Node.js client"
)


def node_env() -> dict[str, str]:
    # The venv's OpenBLAS preload makes node print pthread_create warnings; node needs none of it.
    return {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}


def run_node(*args: str, timeout_s: float = NODE_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run([NODE, *args], cwd=CLIENT_DIR, env=node_env(), capture_output=True, text=True,
                          timeout=timeout_s)  # fmt: skip


def run_node_script(script: str, address: str) -> dict:
    """Run an ES-module snippet that gets (library URL, address) as argv[1:] and prints JSON."""
    proc = run_node("--input-type=module", "-e", script, LIBRARY_URL, address)
    assert proc.returncode == 0, f"node failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def node_client():
    if not (CLIENT_DIR / "node_modules").is_dir():
        verb = "ci" if (CLIENT_DIR / "package-lock.json").exists() else "install"
        proc = subprocess.run([NPM, verb, "--no-audit", "--no-fund"], cwd=CLIENT_DIR, env=node_env(),
                              capture_output=True, text=True, timeout=NPM_TIMEOUT_S)  # fmt: skip
        assert proc.returncode == 0, f"npm {verb} failed:\n{proc.stdout}\n{proc.stderr}"
    return CLIENT_DIR


@pytest.fixture(scope="module")
def server(tmp_path_factory, node_client):
    srv = Server.start(tmp_path_factory.mktemp("node-client"))
    try:
        yield srv
    finally:
        try:
            srv.stop()
        finally:
            srv.kill_everything()
            try:  # whatever is left of the server's process group
                os.killpg(srv.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def assert_alive(srv: Server) -> None:
    assert srv.proc.poll() is None, f"server exited:\n{srv.log()[-4000:]}"
    with Client(srv.address) as client:
        health = client.health()
    assert health.status == "ok" and health.engines_live == 1


def test_cli_json_matches_python_client(server):
    with Client(server.address) as client:
        ref = client.generate(prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0)

    proc = run_node("cli.mjs", "--address", server.address, "--prompt", PROMPT,
                    "--max-tokens", str(MAX_TOKENS), "--temperature", "0", "--json")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) == {"text", "token_ids", "finish_reason", "usage"}
    assert out["text"] == ref.text and out["text"].strip()
    assert out["token_ids"] == ref.token_ids
    assert out["finish_reason"] == ref.finish_reason
    assert out["usage"] == ref.usage.model_dump()

    usage = out["usage"]
    assert out["finish_reason"] in {"length", "stop"}
    assert usage["prompt_tokens"] > 0 and usage["cached_tokens"] == 0
    if out["finish_reason"] == "length":
        assert usage["completion_tokens"] == len(out["token_ids"]) == MAX_TOKENS
    else:  # the end-of-sequence token is counted but not sent
        assert usage["completion_tokens"] == len(out["token_ids"]) + 1 <= MAX_TOKENS

    # Streaming text mode prints the same text, then a newline.
    proc = run_node("cli.mjs", "--address", server.address, "--prompt", PROMPT,
                    "--max-tokens", str(MAX_TOKENS), "--temperature", "0")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ref.text + "\n"


MALFORMED = """
const [libraryUrl, address] = process.argv.slice(1);
const { ButtermilkClient, ButtermilkError } = await import(libraryUrl);
const client = await new ButtermilkClient(address).connect();
const out = {};
try {
  for await (const _ of client.generate({ id: "bad-1", prompt: "Hello", max_tokens: "8" },
                                        { timeoutMs: 20000 })) {}
  out.error = null;
} catch (e) {
  out.error = { isButtermilkError: e instanceof ButtermilkError, code: e.code, message: e.message,
                retryAfterMs: e.retryAfterMs, requestId: e.requestId, fromServer: e.fromServer };
}
out.health = await client.health();
out.after = await client.complete({ prompt: "Hello", max_tokens: 2 });
client.close();
console.log(JSON.stringify(out));
"""


def test_malformed_request_gets_structured_error(server):
    out = run_node_script(MALFORMED, server.address)
    error = out["error"]
    assert error is not None, "a max_tokens string was accepted"
    assert error["isButtermilkError"] and error["fromServer"]
    assert error["code"] == "bad_request"
    assert "max_tokens" in error["message"]
    assert error["requestId"] == "bad-1"
    assert error["retryAfterMs"] is None
    assert out["health"]["type"] == "health_ok" and out["health"]["status"] == "ok"
    assert out["after"]["finish_reason"] in {"length", "stop"}  # the same connection still works

    # The CLI reports a server error as JSON and exits 1.
    proc = run_node("cli.mjs", "--address", server.address, "--prompt", "x", "--max-tokens", "0", "--json")
    assert proc.returncode == 1
    assert json.loads(proc.stdout)["error"]["code"] == "bad_request"
    assert "bad_request" in proc.stderr
    assert_alive(server)


LEASE_CANCEL_CONCURRENT = """
const [libraryUrl, address] = process.argv.slice(1);
const { ButtermilkClient } = await import(libraryUrl);
const client = await new ButtermilkClient(address).connect();
const out = {};
out.lease = await client.openLease(1.5);             // renewed every 0.5 s by the heartbeat
await new Promise((resolve) => setTimeout(resolve, 2500));
out.renewed = await client.renewLease();             // still alive: the heartbeat kept it
out.stats = await client.stats();
const stream = client.generate({ prompt: "Count from one to one hundred:", max_tokens: 200 });
let tokens = 0;
for await (const token of stream) {
  if (tokens === 0) await client.cancel(stream.id);
  tokens += token.token_ids.length;
}
out.cancelled = { done: stream.done, tokens, leaseId: client.leaseId };
out.concurrent = await Promise.all([client.complete({ prompt: "One, two,", max_tokens: 6 }),
                                    client.complete({ prompt: "Red, green,", max_tokens: 6 })]);
out.closed = await client.closeLease();
out.leaseError = client.leaseError;
out.numOrphans = client.numOrphans;
client.close();
console.log(JSON.stringify(out));
"""


def test_lease_cancel_and_concurrent_streams(server):
    out = run_node_script(LEASE_CANCEL_CONCURRENT, server.address)
    lease_id = out["lease"]["lease_id"]
    assert out["renewed"]["type"] == "lease" and out["renewed"]["lease_id"] == lease_id
    assert out["stats"]["num_leases"] >= 1 and len(out["stats"]["engines"]) == 1
    assert out["leaseError"] is None

    done = out["cancelled"]["done"]
    assert done["type"] == "done" and done["finish_reason"] == "cancelled"
    assert 1 <= done["usage"]["completion_tokens"] < 200
    assert out["cancelled"]["tokens"] <= done["usage"]["completion_tokens"]

    first, second = out["concurrent"]
    assert first["id"] != second["id"]
    for completion in (first, second):
        assert completion["finish_reason"] in {"length", "stop"}
        assert 1 <= completion["usage"]["completion_tokens"] <= 6
        assert len(completion["token_ids"]) <= completion["usage"]["completion_tokens"]
    assert out["closed"] == {"v": 1, "type": "lease_closed", "id": out["closed"]["id"], "lease_id": lease_id}
    assert out["numOrphans"] == 0
    assert_alive(server)
