"""Run one engine: load the model on a device and serve continuous batches for the gateway.

The engine connects to the gateway (engine-cmd, engine-out) and the controller, says HELLO
with its geometry, heartbeats, and steps its `EngineCore` while it has work (`services.engine.service`). Settings come
from BUTTERMILK_* environment variables; flags override them.
"""

from __future__ import annotations

import argparse
import os
import time

from shared.errors import BadRequest
from shared.settings import EngineSettings, ModelSettings

from .options import add_model_arguments, add_settings_arguments, parse_settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_settings_arguments(parser, EngineSettings, skip=ModelSettings.model_fields)


def select_device(spec: str) -> None:
    """Make `spec` ("cpu" or "gpu:N") MLX's default device; call before loading the model.

    Raises:
        BadRequest: an unknown spec or a GPU index this machine lacks.
    """
    import mlx.core as mx

    if spec == "cpu":
        mx.set_default_device(mx.cpu)
        return
    kind, _, index = spec.partition(":")
    if kind != "gpu" or not index.isdigit():
        raise BadRequest(f"--device {spec!r}: expected cpu or gpu:N")
    if not mx.is_available(mx.gpu) or int(index) >= mx.device_count(mx.gpu):
        raise BadRequest(f"--device {spec!r}: no such GPU on this machine")
    mx.set_default_device(mx.Device(mx.gpu, int(index)))


def describe_device(spec: str) -> str:
    """`spec` ("cpu" or "gpu:N", already selected) with the device's name and PCI bus id.

    E.g. "gpu:0 (NVIDIA H200, 00000000:1B:00.0)": the index is the one this process sees
    (after CUDA_VISIBLE_DEVICES), the bus id names the physical GPU. Parts MLX does not give
    (Apple GPUs have no bus id) are left out.
    """
    import mlx.core as mx

    if spec == "cpu":
        return "cpu"
    try:
        info = mx.device_info(mx.Device(mx.gpu, int(spec.partition(":")[2])))
    except (RuntimeError, ValueError):  # a backend without device info: the spec alone
        return spec
    parts = [str(info[k]) for k in ("device_name", "pci_bus_id") if info.get(k)]
    return f"{spec} ({', '.join(parts)})" if parts else spec


def build_service(settings: EngineSettings):
    """Load the model, build the `EngineCore` and wrap it in an `EngineService`.

    Raises:
        ModelNotFound, BadRequest: as `open_model` and `EngineCore` raise them.
    """
    from services.engine.core import EngineCore
    from services.engine.runtime import open_model
    from services.engine.service import EngineAddresses, EngineService
    from shared.protocol import Geometry, Hello

    loaded, options = open_model(settings)
    core = EngineCore(
        loaded, options, capacity_tokens=pool_capacity(settings, loaded, options), max_slots=settings.max_slots,
        step_token_budget=settings.step_token_budget, page_size=settings.page_size,
        decode_window=settings.decode_window, prefix_cache=not settings.no_prefix_cache,
    )  # fmt: skip
    geo = core.geometry
    log_pool(settings.engine_id, geo)
    # Admission counts tokens; the cache allocates pages, so each slot may waste a partial page.
    slack = geo["max_slots"] * (geo["page_size"] - 1)
    geometry = Geometry(
        slots=geo["max_slots"], capacity_tokens=max(1, geo["capacity_tokens"] - slack),
        bytes_per_token=geo["bytes_per_token"], kv_cache=str(geo["kv_cache"]),
        max_context=geo["max_context"], window_tokens=geo.get("window_tokens"),
        state_bytes_per_slot=geo["state_bytes_per_slot"],
    )  # fmt: skip
    epoch = settings.epoch if settings.epoch is not None else int(time.time())
    hello = Hello(engine_id=settings.engine_id, epoch=epoch, geometry=geometry, model=loaded.path.name,
                  pid=os.getpid(), device=describe_device(settings.device),
                  cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"))  # fmt: skip
    addresses = EngineAddresses(
        gateway_cmd=settings.engine_cmd_address, gateway_out=settings.engine_out_address,
        controller=settings.controller_address,
    )  # fmt: skip
    return EngineService(core, hello, addresses, wait_timeout_s=settings.wait_timeout_s,
                         drain_timeout_s=settings.drain_timeout_s,
                         status_interval_s=settings.status_interval_s,
                         launch_hold=settings.launch_hold)  # fmt: skip


def pool_capacity(settings: EngineSettings, loaded, options) -> int:
    """KV tokens to allocate: `--capacity-tokens`, or what a KV memory budget holds.

    A budget (`--kv-memory-gib` or `--kv-memory-fraction` of the device's memory), less a
    hybrid model's recurrent state (allocated for every slot), is divided by the scheme's bytes
    per token from the scheme registry (`services/engine/sizing.py`), in whole pages: the figure
    `buttermilk pool-size` predicts for an attention-only model.

    Raises:
        BadRequest: both a budget and `--capacity-tokens`, both budgets, or a budget that
            holds no page.
    """
    from services.engine import sizing
    from services.engine.cache.state_pool import probe_state_specs

    if settings.kv_memory_gib is None and settings.kv_memory_fraction is None:
        return settings.capacity_tokens
    if "capacity_tokens" in settings.model_fields_set:
        raise BadRequest("give --capacity-tokens or a KV memory budget (--kv-memory-gib, --kv-memory-fraction), not both")
    try:
        budget = sizing.budget_bytes(memory_gib=settings.kv_memory_gib, memory_fraction=settings.kv_memory_fraction)
        geometry = sizing.KVGeometry.from_config(loaded.config, loaded.dtype)
        per_token = sizing.bytes_per_token(options.scheme, geometry, raw_layers=options.raw_layers)
        state = settings.max_slots * sum(s.nbytes for s in probe_state_specs(loaded.model))
        return sizing.capacity_tokens(budget, per_token, page_size=settings.page_size, state_bytes=state)
    except ValueError as exc:
        raise BadRequest(f"KV memory budget: {exc}") from None


def log_pool(engine_id: str, geo: dict) -> None:
    """Log the pool's size and vLLM's "maximum concurrency" line at the context cap."""
    from services.engine.sizing import GIB, concurrency_line, max_concurrency
    from shared.logging import get_logger

    capacity, context = geo["capacity_tokens"], geo["max_context"]
    concurrency = max_concurrency(capacity, context, page_size=geo["page_size"], window=geo.get("window_tokens"))
    get_logger("engine", engine_id=engine_id).info(
        "kv_pool", kv_cache=geo["kv_cache"], bytes_per_token=geo["bytes_per_token"], capacity_tokens=capacity,
        kv_gib=round(capacity * geo["bytes_per_token"] / GIB, 3), max_slots=geo["max_slots"],
        message=f"KV cache size: {capacity:,} tokens; {concurrency_line(context, concurrency)}",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from services.supervisor import OVERRUN_S, die_with_parent, install_stop_handlers
    from shared.logging import configure_logging

    settings = parse_settings(EngineSettings, args)
    configure_logging(json=settings.log_json, level=settings.log_level)
    die_with_parent()
    select_device(settings.device)
    service = build_service(settings)
    install_stop_handlers(service.stop, settings.drain_timeout_s + OVERRUN_S)
    return service.run()
