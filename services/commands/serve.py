"""Serve a model: start the controller, the gateway and N engines as supervised processes.

Internal sockets are ipc:// endpoints in a private run folder; clients connect to `--address`.
A dead engine is restarted at epoch+1; the death of the gateway or controller, or an engine's
configuration error, stops everything with a non-zero status. Ctrl-C or SIGTERM stops all
processes. Every gateway, controller and engine setting can be given here too.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from shared.errors import BadRequest
from shared.settings import ControllerSettings, EngineSettings, GatewaySettings, ModelSettings, ServeSettings

from .gateway import served_model_names
from .options import add_model_arguments, add_settings_arguments, parse_settings

# Fields serve decides for its children rather than passing through.
_PLANNED = {"engine_cmd_address", "engine_out_address", "controller_address", "engine_id", "epoch",
            "device", "model", "dtype"}  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    seen = set(ModelSettings.model_fields)
    for cls in (ServeSettings, GatewaySettings, ControllerSettings, EngineSettings):
        add_settings_arguments(parser, cls, skip=seen | _PLANNED - set(ServeSettings.model_fields))
        seen |= set(cls.model_fields)


def visible_gpus() -> list[str]:
    """CUDA GPU ids this process may use (CUDA_VISIBLE_DEVICES, else `nvidia-smi -L`), without touching CUDA.

    Returns an empty list without CUDA GPUs (an Apple GPU is one device every engine shares).
    """
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [g.strip() for g in listed.split(",") if g.strip() and g.strip() != "-1"]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.split(":")[0].removeprefix("GPU ").strip() for line in out.splitlines() if line.startswith("GPU ")]


def resolve_device(spec: str, gpus: list[str]) -> str:
    """`auto` -> `gpu` where a GPU exists (CUDA, or Apple's Metal), else `cpu`; other specs as given.

    Raises:
        BadRequest: a spec other than auto, cpu, gpu or gpu:N, or a `gpu` spec on a machine without one
            (before any engine starts).
    """
    import mlx.core as mx

    kind, colon, index = spec.partition(":")
    if spec not in ("auto", "cpu", "gpu") and not (kind == "gpu" and colon and index.isdigit()):
        raise BadRequest(f"--device {spec!r}: expected auto, cpu, gpu or gpu:N")
    has_gpu = bool(gpus) or mx.is_available(mx.gpu)  # CUDA GPUs listed, or MLX's own GPU (Metal, CUDA)
    if spec == "auto":
        return "gpu" if has_gpu else "cpu"
    if spec.startswith("gpu") and not has_gpu:
        raise BadRequest(f"--device {spec}: this machine has no GPU (CUDA or Metal); use --device cpu or auto")
    return spec


def engine_placement(spec: str, index: int, gpus: list[str]) -> tuple[str, dict[str, str]]:
    """(device, environment) of engine `index`: on CUDA each engine sees exactly one GPU.

    `gpu` puts engine i on GPU `gpus[i % len(gpus)]`, `gpu:N` every engine on GPU N; the engine
    then runs on its only visible device, `gpu:0`. Without CUDA GPUs (CPU, Apple), engines share.
    """
    if spec == "cpu" or not gpus:
        return ("gpu:0" if spec.startswith("gpu") else spec), {}
    gpu = gpus[index % len(gpus)] if spec == "gpu" else spec.partition(":")[2]
    return "gpu:0", {"CUDA_VISIBLE_DEVICES": gpu}


def weights_dtype(dtype: str, device: str) -> str:
    """`auto` resolved for a device: float32 on the CPU (BLAS matmuls), float16 on a GPU."""
    if dtype != "auto":
        return dtype
    return "float32" if device == "cpu" else "float16"


def child_flags(values: dict) -> list[str]:
    """`{"max_queue": 4, "log_json": True}` → `["--max-queue", "4", "--log-json"]`."""
    flags = []
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags += [flag] if value else []
        elif isinstance(value, tuple):
            flags += [flag, ",".join(str(v) for v in value)]
        else:
            flags += [flag, str(value)]
    return flags


def build_plan(args: argparse.Namespace, run_dir: Path):
    """Child command lines for the settings given (flags and environment).

    Raises:
        ModelNotFound: `--model` names nothing usable (checked before anything starts).
        BadRequest: a setting fails validation.
        ValueError: `--kv-cache` names no scheme (checked before anything starts).
        BadRequest: `--max-context` past the model's advertised context, a bad window, or
            `--device gpu` without a GPU (all checked before anything starts).
    """
    from mlx_lm.utils import load_config

    from services.engine.cache.schemes import check_scheme
    from services.engine.model.loader import LoadedModel
    from services.engine.model.paths import resolve_model
    from services.engine.runtime import cache_options
    from services.http.server import DISABLED
    from services.supervisor import ChildSpec, SupervisorPlan

    serve = parse_settings(ServeSettings, args)
    model = parse_settings(ModelSettings, args)
    for cls in (GatewaySettings, ControllerSettings, EngineSettings):
        parse_settings(cls, args)  # validate now: a bad value is a usage error, not a crash
    check_scheme(model.kv_cache)  # every engine would refuse an unknown scheme
    gpus = visible_gpus()
    device = resolve_device(serve.device, gpus)
    dtype = weights_dtype(model.dtype, "cpu" if device == "cpu" else "gpu")
    path = resolve_model(model.model, dtype=dtype)  # converts a GGUF once, here, not per engine
    config = load_config(path)  # as the gateway reads it
    cache_options(model, LoadedModel(model=None, tokenizer=None, path=path, config=config))  # --max-context, window
    given = {n: v for n, v in vars(args).items() if v is not None}
    ipc = {"engine_cmd_address": f"ipc://{run_dir}/engine-cmd",
           "engine_out_address": f"ipc://{run_dir}/engine-out",
           "controller_address": f"ipc://{run_dir}/controller"}  # fmt: skip
    common = {"model": str(path), "dtype": dtype}

    def argv(command: str, cls, **planned) -> tuple[str, ...]:
        values = {n: given[n] for n in cls.model_fields if n in given and n not in _PLANNED}
        fields = {**values, **{n: v for n, v in {**common, **ipc}.items() if n in cls.model_fields}, **planned}
        return (command, *child_flags(fields))

    placements = [engine_placement(device, i, gpus) for i in range(serve.engines)]
    engines = tuple(
        ChildSpec(f"e{i}", argv("engine", EngineSettings, engine_id=f"e{i}", device=placements[i][0]),
                  is_engine=True, env=tuple(placements[i][1].items()))
        for i in range(serve.engines)
    )  # fmt: skip
    gateway = GatewaySettings(**{n: v for n, v in given.items() if n in GatewaySettings.model_fields})
    names = gateway.served_model_name or served_model_names(model.model)  # the gateway gets a folder path
    return SupervisorPlan(
        controller=ChildSpec("controller", argv("controller", ControllerSettings)),
        gateway=ChildSpec("gateway", argv("gateway", GatewaySettings, served_model_name=names)),
        engines=engines,
        controller_address=ipc["controller_address"],
        client_address=gateway.address,
        drain_timeout_s=gateway.drain_timeout_s,
        http_address=None if gateway.http_address == DISABLED else gateway.http_address,
    )


def run(args: argparse.Namespace) -> int:
    from services.http.server import check_free
    from services.supervisor import Supervisor, check_client_address
    from shared.logging import configure_logging

    serve = parse_settings(ServeSettings, args)
    model = parse_settings(ModelSettings, args)
    configure_logging(json=model.log_json, level=model.log_level)
    own_dir = serve.run_dir is None
    run_dir = Path(tempfile.mkdtemp(prefix="buttermilk-") if own_dir else serve.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        plan = build_plan(args, run_dir)
        check_client_address(plan.client_address)  # a bad or busy address: exit 2 before any child
        if plan.http_address is not None:
            check_free(plan.http_address)
        return Supervisor(plan).run()
    finally:
        if own_dir:
            shutil.rmtree(run_dir, ignore_errors=True)
