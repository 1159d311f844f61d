"""Run the controller: the token-capacity ledger, leases and sessions, on one ROUTER socket.

Settings (`shared.settings.ControllerSettings`) come from BUTTERMILK_* environment variables;
flags override them.
"""

from __future__ import annotations

import argparse

from shared.settings import ControllerSettings

from .options import add_settings_arguments, parse_settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser, ControllerSettings)


def run(args: argparse.Namespace) -> int:
    import asyncio

    from services.controller.ledger import Ledger
    from services.controller.service import ControllerCore, ControllerService
    from services.supervisor import OVERRUN_S, die_with_parent, install_stop_handlers
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
        install_stop_handlers(service.stop, OVERRUN_S)
        await service.run()

    asyncio.run(main())
    return 0
