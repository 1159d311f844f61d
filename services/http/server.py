"""uvicorn inside the gateway process, on the gateway's own event loop.

The listening socket is bound before anything else starts (`bind`), so a busy or malformed
`--http-address` is a one-line error. `serve_with_http` runs the gateway service and the
HTTP server side by side; when either ends (a stop signal, a failure), both stop. Signals
stay with the gateway (`install_stop_handlers`): uvicorn's own handlers are not installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket

import uvicorn

from shared.errors import BadRequest, ButtermilkError

DISABLED = "off"


class HttpAddressInUse(ButtermilkError):
    """Another process already listens on `--http-address`."""


def parse_address(address: str) -> tuple[str, int]:
    """`HOST:PORT` (IPv6 as `[::1]:8000`) → (host, port).

    Raises:
        BadRequest: not of that form, or a port outside 0..65535.
    """
    host, sep, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise BadRequest(f"invalid --http-address {address!r}: expected HOST:PORT (e.g. 127.0.0.1:8000) or {DISABLED}")
    return host, int(port)


def bind(address: str) -> socket.socket:
    """A listening TCP socket on `address` (port 0: any free port).

    Raises:
        BadRequest: a malformed address or a host that cannot be bound.
        HttpAddressInUse: something already listens there.
    """
    host, port = parse_address(address)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise BadRequest(f"invalid --http-address {address!r}: {exc.strerror}") from None
    family, kind, proto, _, sockaddr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(sockaddr)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise HttpAddressInUse(f"--http-address {address}: address already in use "
                                   "(is another buttermilk serve running?)") from None  # fmt: skip
        raise BadRequest(f"invalid --http-address {address!r}: {exc.strerror}") from None
    sock.setblocking(False)
    return sock


def check_free(address: str) -> None:
    """Bind `address` once and release it (serve checks before it starts any process).

    Raises:
        BadRequest, HttpAddressInUse: as `bind`.
    """
    bind(address).close()


class EmbeddedServer(uvicorn.Server):
    """uvicorn's server without its signal handlers: the gateway owns SIGINT and SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def make_server(app, *, log_level: str = "warning") -> EmbeddedServer:
    config = uvicorn.Config(app, log_config=None, log_level=log_level, access_log=False, lifespan="off",
                            timeout_graceful_shutdown=2)  # fmt: skip
    return EmbeddedServer(config)


async def serve_with_http(service, server: EmbeddedServer, sock: socket.socket) -> None:
    """Run the gateway service and the HTTP server until either ends; then stop both.

    Raises:
        Exception: whatever ended the gateway service or the HTTP server, after both stopped.
    """
    tasks = [asyncio.create_task(service.run()), asyncio.create_task(server.serve(sockets=[sock]))]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        service.stop()
        server.should_exit = True
        await asyncio.gather(*tasks, return_exceptions=True)
        sock.close()
    for task in done:
        if task.exception() is not None:
            raise task.exception()
