"""The `buttermilk` CLI as a user runs it: real subprocesses, real default model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.model


def buttermilk(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], capture_output=True, text=True, timeout=300)


def test_generate_says_paris():
    proc = buttermilk("generate", "--model", "default", "--prompt", "The capital of France is",
                      "--max-tokens", "12", "--temperature", "0")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "decode" in proc.stderr and "KV" in proc.stderr


def test_generate_json_fields():
    proc = buttermilk("generate", "--model", "default", "--prompt", "Hello", "--max-tokens", "5", "--json")
    out = json.loads(proc.stdout)
    assert out["generated_tokens"] == len(out["token_ids"]) <= 5
    # 30 layers x K,V x 3 KV heads x 64 dims x 4 bytes (float32) per cached token.
    cached = out["prompt_tokens"] + out["generated_tokens"] - (out["finish_reason"] == "length")
    assert out["kv_bytes"] == cached * 30 * 2 * 3 * 64 * 4
    assert out["kv_cache"] == "raw"


def test_prompt_longer_than_context_names_both_numbers():
    proc = buttermilk("generate", "--model", "default", "--prompt", "one two three four five six", "--max-context", "4")
    assert proc.returncode == 2
    assert "6 tokens" in proc.stderr and "4 tokens" in proc.stderr
    assert "Traceback" not in proc.stderr
    # Past the model's 8,192 positions: our one-line error, no warning from transformers' tokenizer.
    proc = buttermilk("generate", "--model", "default", "--prompt", "word " * 9000)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "prompt (9001 tokens) plus one generated token needs 9002 tokens" in proc.stderr


@pytest.mark.parametrize("model", ["/nonexistent/model", "tests/conftest.py"])
def test_bad_model_is_a_clear_error(model):
    proc = buttermilk("generate", "--model", model, "--prompt", "hi")
    assert proc.returncode == 2
    assert model in proc.stderr and "Traceback" not in proc.stderr


def test_inspect_layer_trace_table_shows_each_layers_window():
    proc = buttermilk("inspect", "--model", "default", "--layer-trace", "--kv-window-size", "64", "--kv-window-keep", "4",
                      "--max-context", "2048")
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("layer ")]
    assert len(rows) == 30 and all(" window=64+4 " in row for row in rows), rows[:2]


def test_inspect_layer_trace_json():
    proc = buttermilk("inspect", "--model", "default", "--layer-trace", "--json", "--max-context", "2048")
    report = json.loads(proc.stdout)
    assert (report["n_layers"], report["n_heads"], report["n_kv_heads"], report["head_dim"]) == (30, 9, 3, 64)
    assert report["max_context"] == 2048 and len(report["layers"]) == 30
    layer = report["layers"][0]
    assert layer["bytes_per_token"] == 2 * 3 * 64 * 4 and layer["ratio_to_raw"] == 1.0


def test_environment_sets_and_flags_override(monkeypatch):
    monkeypatch.setenv("BUTTERMILK_MAX_CONTEXT", "3")
    proc = buttermilk("generate", "--model", "default", "--prompt", "The capital of France is", "--max-tokens", "2")
    assert proc.returncode == 2 and "capped at 3 tokens" in proc.stderr
    proc = buttermilk("generate", "--model", "default", "--prompt", "The capital of France is", "--max-tokens", "2",
                      "--max-context", "64")
    assert proc.returncode == 0, proc.stderr


def test_max_context_above_advertised_is_refused():
    proc = buttermilk("generate", "--model", "default", "--prompt", "hi", "--max-context", "100000")
    assert proc.returncode == 2 and "100000" in proc.stderr and "8192" in proc.stderr


def test_a_bad_settings_variable_is_named_as_such(monkeypatch):
    monkeypatch.setenv("BUTTERMILK_MAX_CONTEXT", "0")
    proc = buttermilk("generate", "--model", "default", "--prompt", "hi")
    assert proc.returncode == 2 and "BUTTERMILK_MAX_CONTEXT: Input should be greater than or equal to 1" in proc.stderr
    monkeypatch.delenv("BUTTERMILK_MAX_CONTEXT")
    monkeypatch.setenv("BUTTERMILK_KV_RAW_LAYERS", "0,29")  # the flag's spelling; the environment takes JSON
    proc = buttermilk("generate", "--model", "default", "--prompt", "hi")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "BUTTERMILK_KV_RAW_LAYERS='[0,29]'" in proc.stderr


def test_unknown_kv_cache_scheme_lists_choices():
    proc = buttermilk("generate", "--model", "default", "--prompt", "hi", "--kv-cache", "zip9")
    assert proc.returncode == 2 and "zip9" in proc.stderr and "aura4v4" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(("args", "message"), [
    (("generate", "--prompt", "hi", "--seed", "-1"), "--seed: Input should be greater than or equal to 0"),
    (("generate", "--prompt", ""), "the prompt is empty"),
    (("generate", "--prompt", "hi", "--top-k", "-3"), "--top-k -3: expected a positive count, or 0 to turn it off"),
    (("generate", "--prompt", "hi", "--temperature", "nan"), "--temperature: Input should be a finite number"),
    (("inspect", "--kv-cache", "aura11v9"), "--kv-cache"),
    (("generate", "--prompt", "hi", "--max-context", "0"), "--max-context: Input should be greater than or equal to 1"),
    (("generate", "--prompt", "hi", "--kv-raw-layers", "x"), "argument --kv-raw-layers: expected comma-separated layer"),
    (("generate", "--max-tokens", "abc"), "argument --max-tokens: invalid int value"),
    (("generate", "--prompt", "hi", "--bogus"), "unrecognized arguments: --bogus (see buttermilk generate --help)"),
])
def test_user_errors_are_one_line(args, message):
    proc = buttermilk(*args, "--model", "default")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(("buttermilk: error:", "buttermilk generate: error:"))
    assert "usage:" not in proc.stderr  # argparse's usage block is not repeated: one line
    assert message in proc.stderr and "Traceback" not in proc.stderr and "pydantic.dev" not in proc.stderr
