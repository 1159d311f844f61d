"""Run the controller: the token-capacity ledger, leases and sessions, on one ROUTER socket.

Settings come from BUTTERMILK_* environment variables; flags override them. The helpers
`add_settings_arguments`/`parse_settings` turn any settings class into flags the same way for
the gateway, engine and serve commands.
"""

from __future__ import annotations

import argparse
import types
import typing

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.errors import BadRequest

DEFAULT_CONTROLLER_ADDRESS = "tcp://127.0.0.1:5558"


class ControllerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="BUTTERMILK_", extra="ignore")

    controller_address: str = Field(DEFAULT_CONTROLLER_ADDRESS, description="ROUTER endpoint to bind")
    session_idle_ttl_s: float = Field(300.0, gt=0, description="a session without a turn ends after this many seconds")
    engine_timeout_s: float = Field(5.0, gt=0, description="an engine silent this long is declared dead, seconds")
    retry_after_ms: int = Field(250, ge=0, description="hint sent with overloaded when no engine has room")
    gateway_timeout_s: float = Field(30.0, gt=0, description="a gateway silent this long loses its reservations, leases and sessions, seconds")
    max_leases: int = Field(10_000, ge=1, description="leases open at once, all clients together")
    log_json: bool = Field(False, description="JSON log lines")
    log_level: str = Field("info", description="debug, info, warning or error")


def add_settings_arguments(parser: argparse.ArgumentParser, cls: type[BaseSettings], *, skip=()) -> None:
    """Add one `--flag-name` per field of `cls` (defaults stay with the settings)."""
    for name, info in cls.model_fields.items():
        if name in skip:
            continue
        flag = "--" + name.replace("_", "-")
        kind = _scalar_type(info.annotation)
        if kind is bool:
            parser.add_argument(flag, dest=name, action="store_true", default=None, help=info.description)
        else:
            parser.add_argument(flag, dest=name, type=kind, help=f"{info.description} (default {info.default})")


def parse_settings(cls: type[BaseSettings], args: argparse.Namespace):
    """Settings from the environment, overridden by the flags that were given.

    Raises:
        BadRequest: a value fails the settings' validation.
    """
    overrides = {n: getattr(args, n) for n in cls.model_fields if getattr(args, n, None) is not None}
    try:
        return cls(**overrides)
    except ValidationError as exc:
        raise BadRequest(str(exc)) from None


def _scalar_type(annotation) -> type:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation if annotation in (bool, int, float, str) else str


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser, ControllerSettings)


def run(args: argparse.Namespace) -> int:
    import asyncio

    from services.controller.ledger import Ledger
    from services.controller.service import ControllerCore, ControllerService
    from services.supervisor import die_with_parent, install_stop_handlers
    from shared.logging import configure_logging

    settings = parse_settings(ControllerSettings, args)
    configure_logging(json=settings.log_json, level=settings.log_level)
    die_with_parent()
    ledger = Ledger(
        session_idle_ttl_s=settings.session_idle_ttl_s,
        retry_after_ms=settings.retry_after_ms,
        engine_timeout_s=settings.engine_timeout_s,
        gateway_timeout_s=settings.gateway_timeout_s,
        max_leases=settings.max_leases,
    )
    service = ControllerService(ControllerCore(ledger), settings.controller_address)

    async def main() -> None:
        install_stop_handlers(service.stop)
        await service.run()

    asyncio.run(main())
    return 0
