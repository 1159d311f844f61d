"""`calibrate-kv`: sensitivities against an independent computation, the knapsack against brute force,
the calibration end to end on the tiny model, and the command on the default model."""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from services.engine.cache import CacheOptions, make_layer_caches
from services.engine.cache.report import bits_per_element
from services.eval.allocate import allocate, scheme_spec
from services.eval.calibrate import CalibrationConfig, aura_overhead_bits, calibrate
from services.eval.calibrate_report import affine_comparisons, markdown_report, results_dict
from services.eval.corpus import LEE_CORPUS, split_halves, text_token_ids
from services.eval.metrics import KLReference, kl_divergence, logprob_chunks
from services.eval.replay import RecordedRun, can_replay
from services.eval.sensitivity import Sensitivity, measure_sensitivity, predicted_kl
from tests.conftest import make_tiny_llama


class ByteTokenizer:
    """Token id = byte value mod 128 (the tiny llama's vocabulary)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [b % 128 for b in text.encode()]


def _caches(model, scheme: str, tokens: int = 64) -> list:
    return make_layer_caches(model, CacheOptions(scheme=scheme, max_context=tokens))


def test_split_halves_cuts_at_the_middle_line():
    assert split_halves("aa\nbb\ncc\ndd") == ("aa\nbb", "cc\ndd")
    assert split_halves("abcdef") == ("abc", "def")
    first, second = split_halves(LEE_CORPUS.read_text(encoding="utf-8"))
    assert len(first.splitlines()) == 150 and len(second.splitlines()) == 150


def test_text_token_ids_prefix_and_short_text():
    text = "hello world " * 50
    assert text_token_ids(ByteTokenizer(), text, 30) == ByteTokenizer().encode(text)[:30]
    with pytest.raises(ValueError, match="the second half has 5 tokens"):
        text_token_ids(ByteTokenizer(), "short", 6, what="the second half")


def test_kl_reference_equals_the_direct_float64_kl():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((12, 500)) * 3
    noisy = logits + rng.standard_normal(logits.shape) * 0.05
    log_p = (logits - np.log(np.exp(logits).sum(-1, keepdims=True))).astype(np.float32)
    log_q = (noisy - np.log(np.exp(noisy).sum(-1, keepdims=True))).astype(np.float32)
    direct = kl_divergence(log_p, log_q)
    np.testing.assert_allclose(KLReference.from_logprobs(log_p).kl(log_q), direct, rtol=1e-5)
    np.testing.assert_allclose(KLReference.from_logprobs(log_p).kl(log_p), 0.0, atol=1e-9)


def test_replay_gives_the_full_forward_and_restores_the_layers():
    model = make_tiny_llama(n_layers=3)
    ids = [int(t) for t in np.random.default_rng(2).integers(0, 128, 24)]
    run = RecordedRun(model, _caches(model, "raw"), ids, chunk=8)
    layers = list(model.layers)
    assert can_replay(model)
    for start in range(3):
        scheme = f"raw+{start}=aura2v3"
        caches = _caches(model, scheme)  # outside the replay: building probes the model with a forward
        with run.replaying(model, start):
            replayed = list(logprob_chunks(model, caches, ids, chunk=8))
        full = list(logprob_chunks(model, _caches(model, scheme), ids, chunk=8))
        for a, b in zip(replayed, full):
            np.testing.assert_allclose(a, b, atol=1e-6)
    assert all(a is b for a, b in zip(model.layers, layers))


def test_sensitivity_equals_independent_full_runs():
    model = make_tiny_llama(n_layers=2)
    ids = [int(t) for t in np.random.default_rng(3).integers(0, 128, 24)]
    seen = []
    sensitivity = measure_sensitivity(model, ids, chunk=8, widths=(2, 4, 8), on_run=seen.append)
    assert sensitivity.layers == (0, 1) and len(seen) == 2 * 5 + 2  # + affine8 per layer
    raw = np.concatenate(list(logprob_chunks(model, _caches(model, "raw"), ids, chunk=8)))
    for layer in (0, 1):
        for w in (2, 4, 8):
            for table, scheme in ((sensitivity.key_kl, f"aura{w}v8"), (sensitivity.value_kl, f"aura8v{w}")):
                logprobs = np.concatenate(list(logprob_chunks(model, _caches(model, f"raw+{layer}={scheme}"), ids,
                                                              chunk=8)))
                assert table[layer][w] == pytest.approx(kl_divergence(raw, logprobs).mean(), rel=1e-4)
    assert sensitivity.key_kl[0][8] == sensitivity.value_kl[0][8]
    assert [row["raw"] for row in sensitivity.whole_kl] == [0.0, 0.0]
    for layer in (0, 1):
        logprobs = np.concatenate(list(logprob_chunks(model, _caches(model, f"raw+{layer}=affine8"), ids, chunk=8)))
        assert sensitivity.whole_kl[layer]["affine8"] == pytest.approx(kl_divergence(raw, logprobs).mean(), rel=1e-4)
    assert Sensitivity.from_dict(json.loads(json.dumps(sensitivity.to_dict()))) == sensitivity


def _synthetic(seed: int, n_layers: int = 3, widths=(2, 3, 4, 8)) -> Sensitivity:
    """Random, deliberately non-convex costs (not monotone either); raw free, affine8 random."""
    rng = np.random.default_rng(seed)
    key = tuple({w: float(rng.uniform(0, 1) / w) for w in widths} for _ in range(n_layers))
    value = tuple({w: float(rng.uniform(0, 1) / w) for w in widths} for _ in range(n_layers))
    for k, v in zip(key, value):  # the 8/8 run is one measurement: K and V tables share it
        v[8] = k[8]
    whole = tuple({"raw": 0.0, "affine8": float(rng.uniform(0, 0.2))} for _ in range(n_layers))
    return Sensitivity(tuple(range(n_layers)), widths, key, value, 16, whole)


def _layer_cost(sensitivity: Sensitivity, index: int, scheme: str) -> float:
    match = re.fullmatch(r"aura(\d)v(\d)", scheme)
    return sensitivity.layer_kl(index, int(match[1]), int(match[2])) if match else sensitivity.whole_kl[index][scheme]


@pytest.mark.parametrize("seed", range(4))
def test_allocation_is_the_brute_force_optimum(seed):
    sensitivity = _synthetic(seed)
    widths, n, whole_bits = sensitivity.widths, 3, {"raw": 32.0, "affine8": 8.5}
    options = [(f"aura{k}v{v}", (k + v) / 2 + 0.25) for k in widths for v in widths] + list(whole_bits.items())
    for target in (2.25, 3.0, 3.6, 4.25, 5.25, 8.25, 9.0, 12.0, 17.0):
        allocation = allocate(sensitivity, target_bits=target, overhead_bits=0.25, whole_bits=whole_bits)
        best = min(
            sum(_layer_cost(sensitivity, i, name) for i, (name, _) in enumerate(combo))
            for combo in itertools.product(options, repeat=n) if sum(b for _, b in combo) / n <= target + 1e-9
        )
        assert allocation.predicted_kl == pytest.approx(best, abs=1e-12)
        bits = dict(options)
        assert allocation.bits_per_element == pytest.approx(sum(bits[s] for s in allocation.schemes) / n)
        assert allocation.bits_per_element <= target + 1e-12
        aura_only = allocate(sensitivity, target_bits=target, overhead_bits=0.25)
        assert all(s.startswith("aura") for s in aura_only.schemes)
        assert aura_only.predicted_kl == pytest.approx(predicted_kl(sensitivity, *_widths(aura_only.schemes)))
    assert "raw" in allocate(sensitivity, target_bits=32.0, overhead_bits=0.25, whole_bits=whole_bits).schemes
    with pytest.raises(ValueError, match="below the narrowest"):
        allocate(sensitivity, target_bits=2.2, overhead_bits=0.25)


def _widths(schemes: tuple[str, ...]) -> tuple[list[int], list[int]]:
    pairs = [re.fullmatch(r"aura(\d)v(\d)", s) for s in schemes]
    return [int(m[1]) for m in pairs], [int(m[2]) for m in pairs]


def test_spec_is_applied_by_the_cache_factory_at_the_predicted_bits():
    model = make_tiny_llama(n_layers=3)
    spec = scheme_spec((0, 1, 2), ("aura4v4", "aura8v8", "aura4v2"))
    assert spec == "aura4v4+1=aura8v8+2=aura4v2"
    caches = _caches(model, spec)
    mx.eval(model(mx.array([[1, 2, 3]]), cache=caches))
    assert bits_per_element(caches) == (4 + 4 + 8 + 8 + 4 + 2) / 6 + 16 / 64
    assert aura_overhead_bits(model) == 16 / 64


def test_calibrate_end_to_end_on_the_tiny_model():
    model = make_tiny_llama(n_layers=3)
    config = CalibrationConfig(budgets=(3.25, 4.25), reference_schemes=("affine4", "aura4v4"),
                               calibration_tokens=16, heldout_tokens=16, chunk=8, widths=(2, 3, 4, 8))
    text = LEE_CORPUS.read_text(encoding="utf-8")[:4000]
    calibration = calibrate(model, ByteTokenizer(), text, config)
    assert [r.scheme for r in calibration.references] == ["raw", "affine4", "aura4v4"]
    assert calibration.references[0].quality.mean_kl == 0.0
    points = calibration.points
    assert [p.allocation.target_bits for p in points] == [3.25, 4.25, 5.0]  # + affine4's bits
    assert [set(row) for row in calibration.sensitivity.whole_kl] == [{"raw", "affine8"}] * 3
    for point in points:
        allocation = point.allocation
        assert point.heldout.scheme == allocation.spec
        assert point.heldout.bits_per_element == pytest.approx(allocation.bits_per_element, abs=1e-12)
        assert allocation.bits_per_element <= allocation.target_bits
        assert allocation.predicted_kl == pytest.approx(
            sum(_layer_cost(calibration.sensitivity, i, s) for i, s in enumerate(allocation.schemes)))
        assert point.calibration_kl > 0 and point.heldout.quality.mean_kl > 0
    assert [c.affine for c in affine_comparisons(calibration)] == ["affine4"]
    json.dumps(results_dict(calibration, config, model="tiny", dtype="float32", text="lee"))
    report = markdown_report(calibration)
    assert "calibrated ≤ 4.25" in report and calibration.points[0].allocation.spec in report


def test_calibrate_rejects_bad_settings_before_measuring():
    model = make_tiny_llama(n_layers=2)
    text = LEE_CORPUS.read_text(encoding="utf-8")[:4000]
    for config, message in (
        (CalibrationConfig(budgets=(2.0,)), "at least 2.25"),
        (CalibrationConfig(reference_schemes=("affine3",)), "unknown KV cache scheme"),
        (CalibrationConfig(widths=(1, 8)), "2..10"),
        (CalibrationConfig(calibration_tokens=0), "calibration_tokens"),
    ):
        with pytest.raises(ValueError, match=message):
            calibrate(model, ByteTokenizer(), text, config)


def buttermilk(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", "calibrate-kv", *args], capture_output=True,
                          text=True, timeout=600)


@pytest.mark.model
def test_command_writes_spec_files_and_reuses_its_sensitivities(tmp_path):
    args = ["--calibration-tokens", "8", "--heldout-tokens", "8", "--chunk", "8", "--widths", "8",
            "--schemes", "affine8", "--budgets", "8.25"]
    proc = buttermilk(*args, "--out", str(tmp_path / "a"))
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "a" / "calibrate_kv.json").read_text())
    assert [p["allocation"]["target_bits"] for p in report["calibrated"]] == [8.25, 8.5]
    heldout_bits = [p["heldout"]["bits_per_element"] for p in report["calibrated"]]
    assert heldout_bits[0] == 8.25  # widths 8 only: nothing pays for an affine8 layer
    assert heldout_bits[1] == pytest.approx(report["calibrated"][1]["allocation"]["bits_per_element"])
    assert heldout_bits[1] <= 8.5
    assert [row["raw"] for row in report["sensitivity"]["whole_kl"]] == [0.0] * 30
    assert len(report["sensitivity"]["layers"]) == 30 and report["affine_comparisons"][0]["affine"] == "affine8"
    assert (tmp_path / "a" / "calibrated_8.25.kvcache").read_text() == "aura8v8\n"
    assert (tmp_path / "a" / "calibrate_kv.png").read_bytes()[:4] == b"\x89PNG"
    assert "| calibrated ≤ 8.25 | 8.25 |" in proc.stdout
    reused = buttermilk(*args, "--sensitivity", str(tmp_path / "a" / "calibrate_kv.json"), "--out", str(tmp_path / "b"))
    assert reused.returncode == 0, reused.stderr
    assert json.loads((tmp_path / "b" / "calibrate_kv.json").read_text())["sensitivity"] == report["sensitivity"]
    other = buttermilk(*args, "--calibration-tokens", "9", "--sensitivity", str(tmp_path / "a" / "calibrate_kv.json"))
    assert other.returncode == 2 and "calibration_tokens" in other.stderr
    del report["source"]["aura_gains"]  # a table measured before the gain search: AURA codes of one gain
    (tmp_path / "old.json").write_text(json.dumps(report))
    old = buttermilk(*args, "--sensitivity", str(tmp_path / "old.json"))
    assert old.returncode == 2 and "'aura_gains': (1, 9)" in old.stderr, old.stderr


@pytest.mark.model
def test_command_user_errors_are_one_line(tmp_path):
    binary = tmp_path / "latin1.txt"
    binary.write_bytes("caf\xe9\n".encode("latin-1"))
    for args, message in ((["--text", str(binary)], "is not UTF-8"), (["--budgets", "2"], "at least 2.25"),
                          (["--text", str(tmp_path / "missing.txt")], "missing.txt")):
        proc = buttermilk(*args, "--out", str(tmp_path))
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
