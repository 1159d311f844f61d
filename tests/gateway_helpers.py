"""Helpers for tests that drive `GatewayCore` directly, without sockets."""

from __future__ import annotations

from services.gateway.control import ToTokenizer
from shared.errors import ButtermilkError


def drive(core, sends, now=0.0):
    """Run `ToTokenizer` jobs inline, as the service does on its worker thread; the other sends."""
    out = []
    for send in sends:
        if isinstance(send, ToTokenizer):
            try:
                result = core.prompter.prepare(send.msg, send.turn)
            except ButtermilkError as exc:
                result = exc
            out += drive(core, core.on_prepared(send.request_id, send.msg, result, now), now)
        else:
            out.append(send)
    return out
