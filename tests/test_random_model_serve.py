"""Random-weight model folders (`ops.random_model`) load offline and serve token-id requests;
engines show their device in `stats`; the load benchmark's figures are computed right."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from ops.random_model import TINY, write_random_model
from ops.serve_bench import cpu_table, paired_costs, scaling
from ops.serve_load import RequestRecord, summarize
from ops.serving import ServeProcess, cpu_seconds, serve_roles

MAX_CONTEXT = 256


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models") / "tiny"
    info = write_random_model("tiny", folder, dtype="float32")
    return folder, info


def tiny_params() -> int:
    """Llama weights of TINY counted by hand: embedding (tied), per layer q/k/v/o, MLP, 2 norms; final norm."""
    h, v, i, layers = TINY["hidden_size"], TINY["vocab_size"], TINY["intermediate_size"], TINY["num_hidden_layers"]
    q = TINY["num_attention_heads"] * TINY["head_dim"]
    kv = TINY["num_key_value_heads"] * TINY["head_dim"]
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h
    return v * h + layers * per_layer + h


def test_folder_loads_offline_with_an_unreachable_eos(tiny_folder):
    from services.engine.model.loader import load_model

    folder, info = tiny_folder
    assert info["params"] == tiny_params() and info["weight_bytes"] == 4 * tiny_params()
    loaded = load_model(str(folder), dtype="float32")
    vocab = TINY["vocab_size"]
    assert loaded.tokenizer.eos_token_ids == {vocab}  # one past the model's logits
    assert loaded.tokenizer.encode("t5 t17 t999") == [5, 17, 999]
    assert loaded.model.model.embed_tokens.weight.shape == (vocab, TINY["hidden_size"])
    again = write_random_model("tiny", folder, dtype="float32")
    assert again["reused"] and again["params"] == info["params"]


def test_serve_answers_token_ids_like_in_process_generation_and_shows_the_device(tiny_folder, tmp_path):
    from services.engine.model.loader import load_model
    from shared.client import AsyncClient
    from tests.pipeline_helpers import reference_generation

    folder, _ = tiny_folder
    prompt = [(7 * i + 3) % TINY["vocab_size"] for i in range(40)]
    os.environ["CUDA_VISIBLE_DEVICES"] = "7"  # inherited by the engine: stats must relay its value
    try:
        server = ServeProcess.launch(["--model", str(folder), "--device", "cpu", "--dtype", "float32",
                                      "--max-context", str(MAX_CONTEXT), "--capacity-tokens", "1024",
                                      "--max-slots", "4"], log_path=tmp_path / "serve.log")  # fmt: skip
    finally:
        del os.environ["CUDA_VISIBLE_DEVICES"]

    async def ask():
        async with AsyncClient(server.address) as client:
            done = await client.generate(token_ids=prompt, max_tokens=12, temperature=0.0, timeout_s=60)
            return done, await client.stats()

    try:
        server.wait_ready(120)
        done, stats = asyncio.run(ask())
        roles = serve_roles(server.proc.pid)
    finally:
        assert server.stop() == 0, (tmp_path / "serve.log").read_text()[-3000:]
    _, expected_ids, _ = reference_generation(load_model(str(folder), dtype="float32"), prompt, 12, MAX_CONTEXT)
    assert (done.finish_reason, done.token_ids) == ("length", expected_ids)
    assert done.text == "".join(f" t{t}" for t in expected_ids)  # words after the prompt's, space-separated
    [engine] = stats.engines
    assert (engine.device, engine.cuda_visible_devices, engine.epoch) == ("cpu", "7", 0)
    assert set(roles) == {"gateway", "controller", "engine e0"} and roles["engine e0"] == engine.pid


def test_cpu_seconds_reads_what_the_process_itself_counts():
    """/proc's user + system time of a child equals its own `time.process_time()` (10 ms ticks)."""
    burn = "import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n" \
           "print(time.process_time(), flush=True)\nsys.stdin.read()"  # fmt: skip
    child = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        own = float(child.stdout.readline())  # the child now blocks on stdin, using no CPU
        assert abs(cpu_seconds(child.pid) - own) <= 0.03 and own >= 0.3
    finally:
        child.communicate("")
    with pytest.raises(OSError):
        cpu_seconds(child.pid)  # reaped


def test_cpu_table_figures():
    # 0.5 s of gateway CPU over a 2 s level of 10,000 tokens: a quarter core, 50 µs a token.
    table = cpu_table({"gateway": (1.0, 1.5), "engine e0": (3.0, 5.0)}, wall_s=2.0, tokens=10_000)
    assert table == {"engine e0": {"cpu_s": 2.0, "cores_busy": 1.0, "us_per_token": 200.0},
                     "gateway": {"cpu_s": 0.5, "cores_busy": 0.25, "us_per_token": 50.0}}  # fmt: skip


def test_level_summary_figures():
    # Two requests sent at t=0 and t=1; tokens at the times listed (two share one message).
    records = [RequestRecord(0, 0.0, [0.1, 0.2, 0.2, 0.5]), RequestRecord(1, 1.0, [1.3, 1.4, 1.5])]
    records.append(RequestRecord(2, 1.0, finish_reason=None, error_code="engine_failed"))
    level = summarize(records, concurrency=2)
    assert level["completion_tokens"] == 7 and level["wall_s"] == 1.5
    assert level["throughput_tok_s"] == round(7 / 1.5, 1)
    assert level["failed"] == {"engine_failed": 1} and level["requests"] == 3
    assert level["ttft_ms"] == {"p50": 100.0, "p95": 300.0}  # TTFTs 0.1 and 0.3 s
    assert level["ttft_first_ms"] == {"p50": 100.0, "p95": 300.0}  # each client's first request
    assert level["ttft_next_ms"] == {"p50": None, "p95": None}
    # TPOT: (0.5 - 0.1) / 3 and (1.5 - 1.3) / 2 seconds; nearest rank p50 is the smaller.
    assert level["tpot_ms"] == {"p50": 100.0, "p95": round(0.4 / 3 * 1000, 2)}
    # ITL gaps: 0.1, 0.0, 0.3, 0.1, 0.1 (s) -> sorted 0, .1, .1, .1, .3
    assert level["itl_ms"] == {"p50": 100.0, "p95": 300.0}
    json.dumps(level)  # JSON-ready


def test_ttft_is_split_into_first_requests_and_follow_ups():
    # Client 0 sends at 0.0 (first token at 0.05 s) and again at 0.5 (0.7: 200 ms); client 1 at 0.0 (0.1)
    # and 0.6 (0.9: 300 ms); client 1's third request failed and counts in neither.
    records = [RequestRecord(0, 0.5, [0.7, 0.8]), RequestRecord(1, 0.0, [0.1]), RequestRecord(0, 0.0, [0.05]),
               RequestRecord(1, 0.6, [0.9]), RequestRecord(1, 1.0, error_code="engine_failed")]
    level = summarize(records, concurrency=2)
    assert level["ttft_first_ms"] == {"p50": 50.0, "p95": 100.0}
    assert level["ttft_next_ms"] == {"p50": 200.0, "p95": 300.0}


def test_scaling_rows_and_their_ideal():
    # One engine: 1,000 tok/s at 16 clients, 1,500 at 32. Two engines at 32 clients serve 16 each, so
    # they could reach 2 × 1,000 = 2,000 tok/s: an ideal of 2,000 / 1,500; 8 clients had no 4-client level.
    data = {"serve_e1": {"levels": [{"concurrency": 16, "throughput_tok_s": 1000.0},
                                    {"concurrency": 32, "throughput_tok_s": 1500.0},
                                    {"concurrency": 8, "throughput_tok_s": 600.0}]},
            "serve_e2": {"engines": [{}, {}], "levels": [{"concurrency": 32, "throughput_tok_s": 1800.0},
                                                        {"concurrency": 8, "throughput_tok_s": 630.0}]}}  # fmt: skip
    assert scaling(data) == [
        {"run": "serve_e2", "concurrency": 32, "tok_s": 1800.0, "e1_tok_s": 1500.0, "ratio": 1.2, "ideal_ratio": 1.333},
        {"run": "serve_e2", "concurrency": 8, "tok_s": 630.0, "e1_tok_s": 600.0, "ratio": 1.05},
    ]  # fmt: skip


def test_paired_costs_per_round_and_their_median():
    # Rounds: core 1,100 vs serve 1,000 (10% a token), 900 vs 1,000 (-10%), 1,300 vs 1,000 (30%).
    assert paired_costs([1100.0, 900.0, 1300.0], [1000.0] * 3) == {"rounds_pct": [10.0, -10.0, 30.0],
                                                                  "cost_per_token_pct": 10.0}  # fmt: skip
    # An even count: the middle two of -10, 10, 20, 30 average to 15.
    assert paired_costs([900.0, 1100.0, 1200.0, 1300.0], [1000.0] * 4)["cost_per_token_pct"] == 15.0
    with pytest.raises(ValueError):
        paired_costs([1.0, 2.0], [1.0])
