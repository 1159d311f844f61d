"""The OpenAI-compatible HTTP API, `/health`, `/ready` and `/metrics`: a Starlette app on the gateway.

An adapter only: each completion becomes one `generate` handed to the gateway core through
an `Exchange`, so HTTP clients share the ZeroMQ clients' admission, FIFO pool, reservations,
leases and cancellation. A streamed response's headers wait for the first thing the core
says, so a refusal (queue full, context too long, ...) still gets its HTTP status; after
that, tokens are relayed as Server-Sent Events as they arrive. A client that disconnects,
before or during the stream, cancels its request.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models,
DELETE /v1/sessions/{session_id} (ends a multi-turn session), GET /health (the gateway's
event loop answers; never runs a generation), GET /ready (503 until an engine is live;
`?engine_id=e0` asks for one engine), GET /metrics (Prometheus text format).
"""

from __future__ import annotations

import functools
import json
import secrets
import time
from dataclasses import dataclass, field

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.gateway.metrics import GatewayMetrics
from shared.errors import ErrorCode, one_line
from shared.logging import get_logger
from shared.protocol import Done, Error, SessionClose, SessionClosed, Stats, StatsReply, Token

from .errors import NOT_READY, ApiError
from .exchange import Exchange, GatewayPort
from .responses import DONE_EVENT, Shape, sse
from .schemas import ChatCompletionRequest, CompletionRequest, parse, to_generate

MAX_BODY_BYTES = 8 * 1024 * 1024
NOT_READY_RETRY_MS = 1000
CONTROL_TIMEOUT_S = 2.0  # longest wait for the controller's stats or session-close answer
log = get_logger("http")


@dataclass(frozen=True, slots=True)
class HttpOptions:
    """What the API says about the model it serves.

    Attributes:
        model_id (str): the id `/v1/models` lists.
        aliases (frozenset[str]): other `model` values accepted (e.g. `default`).
        max_context (int): tokens per sequence (`max_model_len`).
        created (int): Unix seconds the server started.
    """

    model_id: str
    aliases: frozenset[str] = frozenset()
    max_context: int = 0
    created: int = field(default_factory=lambda: int(time.time()))


def build_app(port: GatewayPort, metrics: GatewayMetrics, options: HttpOptions) -> Starlette:
    """The ASGI app; run it on the gateway's event loop (`services/http/server.py`)."""
    api = Api(port, metrics, options)
    routes = [
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model:path}", api.model, methods=["GET"]),  # ids may hold "/" (a Hugging Face repo)
        Route("/v1/sessions/{session_id}", api.close_session, methods=["DELETE"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/ready", api.ready, methods=["GET"]),
        Route("/metrics", api.scrape, methods=["GET"]),
    ]
    return Starlette(routes=routes, exception_handlers={ApiError: _api_error, HTTPException: _http_error})


def _guarded(endpoint):
    """Any unexpected exception becomes a logged 500 in OpenAI's shape."""

    @functools.wraps(endpoint)
    async def wrapper(self, request: Request):
        try:
            return await endpoint(self, request)
        except ApiError:
            raise
        except ClientDisconnect:  # gone while sending its body: nobody to answer, nothing was started
            log.info("http_client_gone", path=request.url.path)
            return Response(status_code=499)
        except Exception:
            log.exception("http_handler_failed", path=request.url.path)
            return ApiError(ErrorCode.INTERNAL, "internal error").response()

    return wrapper


class Api:
    """The route handlers (see the module docstring)."""

    def __init__(self, port: GatewayPort, metrics: GatewayMetrics, options: HttpOptions):
        self.port, self.metrics, self.options = port, metrics, options

    @_guarded
    async def chat(self, request: Request) -> Response:
        return await self._complete(request, parse(ChatCompletionRequest, await _json(request)))

    @_guarded
    async def completions(self, request: Request) -> Response:
        return await self._complete(request, parse(CompletionRequest, await _json(request)))

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._card()]})

    async def model(self, request: Request) -> Response:
        self._check_model(request.path_params["model"])
        return JSONResponse(self._card())

    def _card(self) -> dict:
        return {"id": self.options.model_id, "object": "model", "created": self.options.created,
                "owned_by": "buttermilk", "max_model_len": self.options.max_context}  # fmt: skip

    def _check_model(self, name: str) -> None:
        """Raises: ApiError 404 `model_not_found` for a name this server does not serve (nor alias)."""
        if name != self.options.model_id and name not in self.options.aliases:
            raise ApiError(ErrorCode.MODEL_NOT_FOUND, f"the model {name!r} does not exist; this server serves "
                           f"{self.options.model_id!r}", param="model")  # fmt: skip

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        engines = self.port.core.engines
        wanted = request.query_params.get("engine_id")
        ready = self.port.is_serving and (engines.get(wanted) is not None if wanted else engines.num_live > 0)
        body = {"status": "ready" if ready else "not_ready", "engines_live": engines.num_live}
        return JSONResponse(body, status_code=200 if ready else 503)

    @_guarded
    async def scrape(self, request: Request) -> Response:
        reply = await self._control(Stats()) if self.port.is_serving else None
        stats = reply if isinstance(reply, StatsReply) else None
        self.metrics.refresh(pool=self.port.core.pool.stats(), preparing=self.port.core.num_preparing,
                             engines=self.port.core.engines, stats=stats)
        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)

    @_guarded
    async def close_session(self, request: Request) -> Response:
        session_id = request.path_params["session_id"]
        self._check_serving()
        try:
            close = SessionClose(session_id=session_id)
        except ValidationError as exc:
            raise ApiError.bad_request(one_line(exc), "session_id") from None
        reply = await self._control(close)
        if isinstance(reply, Error):
            raise ApiError.from_wire(reply)
        if not isinstance(reply, SessionClosed):
            raise ApiError(ErrorCode.INTERNAL, "the controller did not answer in time")
        return JSONResponse({"id": session_id, "object": "session", "deleted": True})

    # ---- completions --------------------------------------------------------------------

    async def _complete(self, request: Request, req: ChatCompletionRequest | CompletionRequest) -> Response:
        is_chat = isinstance(req, ChatCompletionRequest)
        self._check_model(req.model)
        req.check_supported()
        shape = Shape(id=("chatcmpl-" if is_chat else "cmpl-") + secrets.token_hex(12), model=self.options.model_id,
                      is_chat=is_chat, include_usage=req.include_usage, session_id=req.session_id)  # fmt: skip
        generate = to_generate(req, shape.id)
        self._check_ready()
        exchange = Exchange(self.port, request.receive, _caller(request, req.user))
        try:
            await exchange.start(generate)
            first = await exchange.next()
            if first is None:
                return Response(status_code=499)  # the client is gone; nobody reads this
            if isinstance(first, Error):
                raise ApiError.from_wire(first, param="messages" if is_chat else "prompt")
            if req.stream:
                stream, exchange = EventStream(_events(shape, first, exchange), exchange), None  # it owns the exchange
                return stream
            return await _collect(shape, first, exchange)
        finally:
            if exchange is not None:
                exchange.close()

    def _check_serving(self) -> None:
        if not self.port.is_serving:
            raise ApiError(NOT_READY, "the gateway is not serving yet", retry_after_ms=NOT_READY_RETRY_MS)

    def _check_ready(self) -> None:
        """503 when no engine is live (counted like any refused request)."""
        if self.port.is_serving and self.port.core.engines.num_live > 0:
            return
        now = time.monotonic()
        self.metrics.received(now)
        self.metrics.refused(NOT_READY, now)
        raise ApiError(NOT_READY, "no engine is ready yet; retry shortly", retry_after_ms=NOT_READY_RETRY_MS)

    async def _control(self, msg) -> object | None:
        """Send a control message through the core; its reply, or None after CONTROL_TIMEOUT_S."""
        exchange = Exchange(self.port)
        try:
            await exchange.send(msg)
            return await exchange.next(timeout_s=CONTROL_TIMEOUT_S)
        finally:
            exchange.close()


async def _collect(shape: Shape, msg, exchange: Exchange) -> Response:
    """A non-streamed completion: the one `token` message, then `done` (or an error)."""
    parts = []
    while msg is not None:
        if isinstance(msg, Token):
            parts.append(msg.text)
        elif isinstance(msg, Done):
            return JSONResponse(shape.response("".join(parts), msg))
        elif isinstance(msg, Error):
            raise ApiError.from_wire(msg)
        msg = await exchange.next()
    return Response(status_code=499)  # the client is gone


async def _events(shape: Shape, msg, exchange: Exchange):
    """Server-Sent Events of a streamed completion, from its first message to `[DONE]`."""
    if shape.is_chat:
        yield shape.chunk(role=True)
    while msg is not None:
        if isinstance(msg, Token) and msg.text:
            yield shape.chunk(msg.text)
        elif isinstance(msg, Done):
            yield shape.chunk(finish=msg.finish_reason)
            if shape.include_usage:
                yield shape.usage_chunk(msg.usage)
            yield DONE_EVENT
            return
        elif isinstance(msg, Error):
            yield sse(ApiError.from_wire(msg).body())
            yield DONE_EVENT
            return
        msg = await exchange.next()


class EventStream:
    """An ASGI response relaying `events` as `text/event-stream`; closes the exchange at the end."""

    def __init__(self, events, exchange: Exchange):
        self.events, self.exchange = events, exchange

    async def __call__(self, scope, receive, send) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                   (b"x-accel-buffering", b"no")]  # fmt: skip
        try:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            pass  # the client went away mid-send; close() cancels the request
        finally:
            self.exchange.close()
            await self.events.aclose()


def _caller(request: Request, user: str | None) -> str:
    """Whose turn a request takes at the gateway's tokenizer (`LocalClients.open`): its OpenAI `user`, else its
    client's address (X-Forwarded-For's from a proxy uvicorn trusts: loopback, or uvicorn's `FORWARDED_ALLOW_IPS`).

    `user` is taken as given, as OpenAI does: where callers are not trusted, a proxy should set it.
    """
    if user:
        return f"user/{user}"
    return f"peer/{request.client.host if request.client else ''}"


async def _json(request: Request):
    """The request body as JSON, at most MAX_BODY_BYTES.

    Raises:
        ApiError: 413 for a larger body, 400 for one that is not JSON (or nests past Python's recursion limit).
    """
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise _too_large()
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise _too_large()
    try:
        return json.loads(body)
    except ValueError as exc:
        raise ApiError.bad_request(f"the request body is not valid JSON ({exc})") from None
    except RecursionError:
        raise ApiError.bad_request("the request body is not valid JSON (nested too deeply)") from None


def _too_large() -> ApiError:
    return ApiError("request_too_large", f"the request body exceeds {MAX_BODY_BYTES} bytes", status=413)


async def _api_error(request: Request, exc: ApiError) -> Response:
    return exc.response()


async def _http_error(request: Request, exc: HTTPException) -> Response:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "bad_request")
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return ApiError(code, message, status=exc.status_code).response()
