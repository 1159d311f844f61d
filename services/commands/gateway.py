"""Run the gateway: clients' ROUTER socket, tokenizer and chat templates, queue, streaming.

Loads only the tokenizer and config of `--model` (never the weights). Also serves the
OpenAI-compatible HTTP API, /health, /ready and /metrics on `--http-address` (`off`: none),
on the same event loop. Settings come from BUTTERMILK_* environment variables; flags override them.
"""

from __future__ import annotations

import argparse

from shared.errors import BadRequest
from shared.settings import GatewaySettings, ModelSettings

from .options import add_model_arguments, add_settings_arguments, parse_settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_settings_arguments(parser, GatewaySettings, skip=ModelSettings.model_fields)


def build_core(settings: GatewaySettings, observer=None):
    """Load the tokenizer of `settings.model` and build a `GatewayCore` around it.

    Args:
        settings (GatewaySettings): parsed settings.
        observer (StreamObserver | None): told every request and engine fact (metrics).

    Raises:
        ModelNotFound: the model spec names nothing usable.
        BadRequest: `max_context` above the model's advertised context.
    """
    from mlx_lm.utils import load_config, load_tokenizer

    from services.engine.dtypes import resolve_dtype
    from services.engine.model.loader import LoadedModel, lift_length_limit
    from services.engine.model.paths import resolve_model
    from services.engine.runtime import cache_options
    from services.gateway.clients import ClientLimits
    from services.gateway.core import GatewayCore
    from services.gateway.engines import EngineTable
    from services.gateway.prompts import Prompter
    from services.gateway.pool import RequestPool
    from shared.errors import ModelNotFound

    path = resolve_model(settings.model, dtype=resolve_dtype(settings.dtype))
    try:
        config = load_config(path)
        tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
        lift_length_limit(tokenizer)
    except (OSError, ValueError) as exc:
        raise ModelNotFound(f"could not load the tokenizer from {path}: {exc}") from exc
    # A LoadedModel without weights: the same context rules as the engines.
    options = cache_options(settings, LoadedModel(model=None, tokenizer=tokenizer, path=path, config=config))
    text_config = config.get("text_config", config)
    prompter = Prompter(
        tokenizer, vocab_size=int(text_config.get("vocab_size") or len(tokenizer)), max_context=options.max_context,
        max_tokens_cap=settings.max_tokens_cap,
    )  # fmt: skip
    pool = RequestPool(
        settings.max_active_requests, settings.max_queue, settings.queue_timeout_s,
        client_max_active=settings.client_max_active, client_max_queued=settings.client_max_queued,
    )  # fmt: skip
    limits = ClientLimits(
        max_active=settings.client_max_active, max_queued=settings.client_max_queued,
        max_sessions=settings.client_max_sessions, max_leases=settings.client_max_leases,
        max_pending_control=settings.client_max_pending_control,
    )  # fmt: skip
    return GatewayCore(prompter, pool, EngineTable(settings.engine_timeout_s),
                       control_timeout_s=settings.control_timeout_s, limits=limits, observer=observer)  # fmt: skip


def served_model_names(spec: str) -> str:
    """The default `--served-model-name` for a `--model` spec: its name, then the spec itself."""
    from pathlib import Path

    from services.engine.model.paths import DEFAULT_MODEL_NAME

    path = Path(spec).expanduser()
    name = DEFAULT_MODEL_NAME if spec == "default" else (path.stem if path.suffix.lower() == ".gguf" else path.name)
    return ",".join(dict.fromkeys(n for n in (name, spec) if n))


def http_options(settings: GatewaySettings, max_context: int):
    """The model id (the first served name) and aliases the HTTP API answers to."""
    from services.http.app import HttpOptions

    names = [n.strip() for n in (settings.served_model_name or served_model_names(settings.model)).split(",") if n.strip()]
    if not names:
        raise BadRequest("--served-model-name: give at least one name")
    return HttpOptions(model_id=names[0], aliases=frozenset(names[1:]), max_context=max_context)


def run(args: argparse.Namespace) -> int:
    import asyncio

    from services.gateway.metrics import GatewayMetrics
    from services.gateway.service import GatewayAddresses, GatewayService
    from services.http.app import build_app
    from services.http.server import DISABLED, bind, make_server, serve_with_http
    from services.supervisor import OVERRUN_S, die_with_parent, install_stop_handlers
    from shared.logging import configure_logging, get_logger

    settings = parse_settings(GatewaySettings, args)
    configure_logging(json=settings.log_json, level=settings.log_level)
    die_with_parent()
    addresses = GatewayAddresses(
        client=settings.address, engine_cmd=settings.engine_cmd_address,
        engine_out=settings.engine_out_address, controller=settings.controller_address,
    )  # fmt: skip
    sock = None if settings.http_address == DISABLED else bind(settings.http_address)  # fail before loading
    metrics = GatewayMetrics()
    core = build_core(settings, observer=metrics)
    options = http_options(settings, core.prompter.max_context)
    service = GatewayService(core, addresses, drain_timeout_s=settings.drain_timeout_s)

    async def main() -> None:
        install_stop_handlers(service.stop, settings.drain_timeout_s + OVERRUN_S)
        if sock is None:
            await service.run()
            return
        host, port = sock.getsockname()[:2]
        get_logger("gateway").info("http_ready", url=f"http://{host}:{port}/v1", model=options.model_id)
        await serve_with_http(service, make_server(build_app(service, metrics, options)), sock)

    asyncio.run(main())
    return 0
