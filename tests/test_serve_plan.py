"""`buttermilk serve`'s plan: which device and environment each engine gets (no GPU needed)."""

from __future__ import annotations

import argparse

import pytest

from services.commands import serve


def test_gpu_puts_one_engine_on_each_gpu_and_each_sees_only_its_own():
    placements = [serve.engine_placement("gpu", i, ["0", "1"]) for i in range(4)]
    assert placements == [("gpu:0", {"CUDA_VISIBLE_DEVICES": gpu}) for gpu in "0101"]


def test_gpu_n_pins_every_engine_and_cpu_or_no_cuda_shares():
    assert serve.engine_placement("gpu:3", 1, ["0", "1", "2", "3"]) == ("gpu:0", {"CUDA_VISIBLE_DEVICES": "3"})
    assert serve.engine_placement("cpu", 2, ["0", "1"]) == ("cpu", {})
    assert serve.engine_placement("gpu", 2, []) == ("gpu:0", {})  # an Apple GPU: one device for all


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4, 6")
    assert serve.visible_gpus() == ["4", "6"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert serve.visible_gpus() == []


@pytest.mark.model
def test_the_plan_gives_each_engine_its_device(monkeypatch, tmp_path):
    monkeypatch.setattr(serve, "visible_gpus", lambda: ["0", "1"])
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    plan = serve.build_plan(parser.parse_args(["--engines", "3", "--dtype", "float32"]), tmp_path)
    assert [dict(e.env) for e in plan.engines] == [{"CUDA_VISIBLE_DEVICES": g} for g in "010"]
    assert all(e.argv[e.argv.index("--device") + 1] == "gpu:0" for e in plan.engines)


def test_an_unknown_kv_cache_scheme_stops_the_plan_before_any_process(tmp_path):
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    with pytest.raises(ValueError, match="aura11v4"):
        serve.build_plan(parser.parse_args(["--kv-cache", "aura11v4"]), tmp_path)
    with pytest.raises(ValueError, match="bad layer override"):
        serve.build_plan(parser.parse_args(["--kv-cache", "aura4v4+x=raw"]), tmp_path)


def test_gpu_without_a_gpu_is_refused_and_auto_falls_back(monkeypatch):
    from shared.errors import BadRequest

    import mlx.core as mx

    monkeypatch.setattr(mx, "is_available", lambda device: False)  # no GPU of MLX's either
    with pytest.raises(BadRequest, match="--device gpu:1: this machine has no GPU"):
        serve.resolve_device("gpu:1", [])
    assert serve.resolve_device("auto", []) == "cpu" and serve.resolve_device("auto", ["0"]) == "gpu"
    assert serve.resolve_device("gpu", ["0"]) == "gpu" and serve.resolve_device("cpu", []) == "cpu"
    for spec in ("tpu", "gpu:", "gpu:x", "cpu:0"):  # refused before any process starts
        with pytest.raises(BadRequest, match="expected auto, cpu, gpu or gpu:N"):
            serve.resolve_device(spec, ["0"])


def test_a_tcp_port_past_65535_is_refused_not_wrapped():
    from services.supervisor import BadAddress, check_client_address

    with pytest.raises(BadAddress, match="port 99999 is past 65535"):  # zmq would listen on 34463
        check_client_address("tcp://127.0.0.1:99999")


@pytest.mark.model
def test_a_context_past_the_models_stops_the_plan_before_any_process(tmp_path):
    from shared.errors import BadRequest

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    with pytest.raises(BadRequest, match="--max-context 100000 exceeds the model's advertised context of 8192"):
        serve.build_plan(parser.parse_args(["--max-context", "100000", "--device", "cpu"]), tmp_path)
