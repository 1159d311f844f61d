"""The HTTP adapter alone: real uvicorn on loopback, a scripted stand-in for the gateway core.

The stand-in answers each generate with fixed messages, so every error class (including the
internal errors a live server cannot be made to produce on purpose) is checked for its
status, body shape and retry headers, and a disconnect is seen to send the core a cancel.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from contextlib import contextmanager
from types import SimpleNamespace

import openai
import pytest

from services.gateway.engines import EngineTable
from services.gateway.local import LocalClients, is_local, tokenizer_key
from services.gateway.metrics import GatewayMetrics
from services.gateway.pool import RequestPool
from services.http.app import MAX_BODY_BYTES, HttpOptions, build_app
from services.http.errors import KINDS
from services.http.server import bind, make_server
from shared import protocol as p
from shared.errors import ButtermilkError, ErrorCode

GEOMETRY = p.Geometry(slots=4, capacity_tokens=1000, bytes_per_token=10, kv_cache="raw", max_context=64)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


class ScriptedPort:
    """A gateway stand-in: `script(msg)` lists the messages the core would address to the client."""

    def __init__(self, script, *, live: bool = True):
        self.script, self.seen, self.local, self.is_serving = script, [], LocalClients(), True
        engines = EngineTable(600.0)
        if live:
            engines.register(p.Hello(engine_id="e0", epoch=0, geometry=GEOMETRY), b"e0", time.monotonic())
        self.core = SimpleNamespace(engines=engines, pool=RequestPool(1, 0, 1.0))

    async def submit(self, identity: bytes, msg: p.Message) -> None:
        self.seen.append(msg)
        for reply in self.script(msg):
            self.local.deliver(identity, reply.model_copy(update={"id": msg.id}))


@contextmanager
def serving(port: ScriptedPort, metrics: GatewayMetrics | None = None, options: HttpOptions | None = None):
    """The app on 127.0.0.1 (a free port) in a thread; yields its base URL."""
    sock = bind("127.0.0.1:0")
    server = make_server(build_app(port, metrics or GatewayMetrics(), options or HttpOptions(model_id="m")))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def api(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=10)


def refuse(code: ErrorCode, **extra):
    """A script answering every generate with `error {code}`."""
    error = p.Error(code=code, message=f"refused: {code.value}", **extra)
    return lambda msg: [error] if isinstance(msg, p.Generate) else []


def error_of(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert list(body) == ["error"] and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize(("code", "extra", "error_class", "status", "kind", "should_retry"), [
    (ErrorCode.INTERNAL, {}, openai.InternalServerError, 500, "server_error", None),
    (ErrorCode.ENGINE_FAILED, {}, openai.InternalServerError, 503, "server_error", "true"),
    (ErrorCode.UNAVAILABLE, {}, openai.InternalServerError, 503, "server_error", "true"),  # shutting down
    (ErrorCode.OVERLOADED, {"retry_after_ms": 250}, openai.RateLimitError, 429, "rate_limit_error", "true"),
    (ErrorCode.QUEUE_TIMEOUT, {}, openai.RateLimitError, 429, "rate_limit_error", "true"),
    (ErrorCode.CONTEXT_OVERFLOW, {}, openai.BadRequestError, 400, "invalid_request_error", "false"),
])  # fmt: skip
def test_core_errors_keep_their_status_shape_and_headers(code, extra, error_class, status, kind, should_retry):
    with serving(ScriptedPort(refuse(code, **extra))) as url, pytest.raises(error_class) as caught:
        api(url).chat.completions.create(**CHAT)
    error, headers = error_of(caught.value), caught.value.response.headers
    assert caught.value.status_code == status and error["type"] == kind
    assert error["code"] == ("context_length_exceeded" if code == ErrorCode.CONTEXT_OVERFLOW else code.value)
    assert error["param"] == ("messages" if code == ErrorCode.CONTEXT_OVERFLOW else None)
    assert headers.get("x-should-retry") == should_retry
    if "retry_after_ms" in extra:
        assert headers["retry-after-ms"] == "250" and headers["retry-after"] == "1"


def test_every_wire_code_has_an_http_kind_that_retries_as_the_code_says():
    """Each `ErrorCode` maps to its own kind (none falls back to `internal`'s 500), retryable codes to a
    429 or 503 with `x-should-retry: true`, the others to a kind that does not promise a retry."""
    retryable = {cls.code for cls in ButtermilkError.__subclasses__() if cls.retryable}
    assert retryable  # the classes name the retryable codes
    for code in ErrorCode:
        assert code in KINDS, code
        kind = KINDS[code]
        if code in retryable:
            assert kind.status in (429, 503) and kind.should_retry is True, code
        else:
            assert kind.should_retry is not True, code


def test_a_crash_in_the_adapter_is_a_logged_500():
    def crash(msg):
        raise RuntimeError("boom")

    with serving(ScriptedPort(crash)) as url, pytest.raises(openai.InternalServerError) as caught:
        api(url).completions.create(model="m", prompt="x")
    assert caught.value.status_code == 500 and error_of(caught.value)["code"] == "internal"


def test_no_live_engine_is_503_not_ready_and_counted():
    metrics = GatewayMetrics()
    with serving(ScriptedPort(refuse(ErrorCode.INTERNAL), live=False), metrics) as url:
        with pytest.raises(openai.InternalServerError) as caught:
            api(url).chat.completions.create(**CHAT)
        ready = http.client.HTTPConnection(url.removeprefix("http://"))
        ready.request("GET", "/ready")
        assert ready.getresponse().status == 503
    assert caught.value.status_code == 503 and error_of(caught.value)["code"] == "not_ready"
    assert caught.value.response.headers["retry-after-ms"] == "1000"
    sample = metrics.registry.get_sample_value
    assert sample("buttermilk:request_received_total") == 1
    assert sample("buttermilk:request_failure_total", {"code": "not_ready"}) == 1


def raw(url: str, method: str, path: str, body: bytes | None = None) -> tuple[int, dict, dict]:
    conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=10)
    conn.request(method, path, body=body, headers={"content-type": "application/json"})
    resp = conn.getresponse()
    status, headers, payload = resp.status, dict(resp.getheaders()), json.loads(resp.read())
    conn.close()
    return status, headers, payload


def test_http_level_errors_are_in_openai_shape():
    with serving(ScriptedPort(refuse(ErrorCode.INTERNAL))) as url:
        cases = [
            (raw(url, "POST", "/v1/chat/completions", b"{not json"), 400, "bad_request", None),
            (raw(url, "POST", "/v1/chat/completions", b"x" * (MAX_BODY_BYTES + 1)), 413, "request_too_large", None),
            (raw(url, "POST", "/v1/chat/completions", json.dumps({**CHAT, "n": 3}).encode()), 400, "bad_request", "n"),
            (raw(url, "POST", "/v1/chat/completions", json.dumps({**CHAT, "top_k": -5}).encode()), 400, "bad_request",
             "top_k"),  # 0 and -1 mean off; below that is a mistake
            (raw(url, "POST", "/v1/chat/completions", json.dumps({**CHAT, "temperature": float("nan")}).encode()), 400,
             "bad_request", "temperature"),  # Python's json writes and reads NaN
            *[(raw(url, "POST", "/v1/chat/completions", json.dumps({**CHAT, name: value}).encode()), 400, "bad_request",
               name) for name, value in (("max_tokens", "2"), ("max_tokens", True), ("max_tokens", 2.5), ("seed", "7"),
                                         ("stream", "yes"), ("stream", 1))],  # no coercion: types as on the wire
            (raw(url, "POST", "/v1/chat/completions", json.dumps({**CHAT, "model": "x"}).encode()), 404,
             "model_not_found", "model"),
            (raw(url, "POST", "/v1/completions", b'{"model": "m", "x": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"), 400,
             "bad_request", None),  # nests past Python's recursion limit
            (raw(url, "DELETE", "/v1/sessions/" + "a" * 257), 400, "bad_request", "session_id"),  # ids: 256 at most
            *[(raw(url, "POST", "/v1/chat/completions", json.dumps({**CHAT, "user": user}).encode()), 400,
               "bad_request", "user") for user in ("u" * 257, 7, "\udcff")],  # an end-user id: 256 characters at most
            (raw(url, "GET", "/v1/nowhere"), 404, "not_found", None),
            (raw(url, "GET", "/v1/models/gpt-4"), 404, "model_not_found", "model"),
            (raw(url, "GET", "/v1/chat/completions"), 405, "method_not_allowed", None),
        ]  # fmt: skip
        for (status, headers, body), want_status, want_code, want_param in cases:
            assert status == want_status and headers["x-should-retry"] == "false"
            if want_param == "temperature":
                assert "finite number" in body["error"]["message"], body
            assert body["error"]["code"] == want_code and body["error"]["param"] == want_param
            assert set(body["error"]) == {"message", "type", "param", "code"}


def test_an_error_after_the_stream_started_is_an_error_event():
    def script(msg):
        if not isinstance(msg, p.Generate):
            return []
        return [p.Token(id="x", text="Hel", token_ids=[1], index=0),
                p.Error(code=ErrorCode.ENGINE_FAILED, message="engine e0 (epoch 0) failed mid-request")]  # fmt: skip

    with serving(ScriptedPort(script)) as url:
        stream = api(url).chat.completions.create(**CHAT, stream=True)
        with pytest.raises(openai.APIError, match="failed mid-request"):
            for _ in stream:
                pass


def test_disconnect_mid_stream_sends_the_core_a_cancel():
    port = ScriptedPort(lambda msg: [p.Token(id="x", text="Hi", token_ids=[1], index=0)]
                        if isinstance(msg, p.Generate) else [])  # fmt: skip
    with serving(port) as url:
        conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=10)
        conn.request("POST", "/v1/chat/completions", body=json.dumps({**CHAT, "stream": True}))
        resp = conn.getresponse()
        assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
        assert resp.readline().startswith(b"data: {")  # the role chunk
        conn.close()
        deadline = time.monotonic() + 10
        while not any(isinstance(m, p.Cancel) for m in port.seen) and time.monotonic() < deadline:
            time.sleep(0.02)
    generate, cancel = port.seen
    assert isinstance(cancel, p.Cancel) and cancel.id == generate.id and len(port.local) == 0


def test_a_callers_requests_take_one_turn_at_the_tokenizer():
    """Each HTTP request is a connection of its own, with its own mailbox; at the tokenizer's round robin
    (`tokenizer_key`) those naming the same OpenAI `user` share one turn, and those naming none (or "") share their
    client address's."""
    identities = []

    class Recording(ScriptedPort):
        async def submit(self, identity, msg):
            identities.append(identity)
            await super().submit(identity, msg)

    done = p.Done(id="x", finish_reason="stop", usage=p.Usage(prompt_tokens=1, completion_tokens=0))
    users = ("alice", "alice", "bob", None, None, "", "al/ice", "127.0.0.1")
    with serving(Recording(lambda msg: [done] if isinstance(msg, p.Generate) else [])) as url:
        for user in users:
            body = json.dumps({**CHAT, **({"user": user} if user is not None else {})}).encode()
            assert raw(url, "POST", "/v1/chat/completions", body)[0] == 200
    key = dict(zip(users, map(tokenizer_key, identities), strict=True))  # a user's last request's key
    assert len(set(identities)) == len(users) and len(set(key.values())) == 5  # alice, bob, al/ice, 127.0.0.1, peer
    assert tokenizer_key(identities[0]) == key["alice"] and tokenizer_key(identities[3]) == key[None] == key[""]
    assert all(is_local(k) for k in key.values())  # never a ZeroMQ peer's identity


def test_a_client_gone_while_sending_its_body_is_logged_as_gone_not_as_a_failure():
    """A body cut short by the client's disconnect ends the handler quietly: no 500 traceback at error level."""
    import socket

    from structlog.testing import capture_logs

    scripted = ScriptedPort(lambda msg: [])
    with serving(scripted) as url, capture_logs() as logs:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=5) as conn:
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"model\": \"m\"")  # 13 of the 1000 bytes promised
        deadline = time.monotonic() + 10
        while not any(e["event"] == "http_client_gone" for e in logs) and time.monotonic() < deadline:
            time.sleep(0.02)
    events = [(e["event"], e["log_level"]) for e in logs if e["event"].startswith("http_")]
    assert events == [("http_client_gone", "info")] and scripted.seen == []  # nothing reached the gateway


def test_the_served_model_is_retrieved_by_its_name_or_alias():
    """Other names are 404 `model_not_found` (test_http_level_errors_are_in_openai_shape)."""
    options = HttpOptions(model_id="m", aliases=frozenset({"default", "mlx-community/Llama-3.2-1B"}))
    with serving(ScriptedPort(lambda msg: []), options=options) as url:
        client = api(url)
        card = client.models.list().data[0].model_dump()
        for name in ("m", "default", "mlx-community/Llama-3.2-1B"):  # the SDK sends the slash percent-encoded
            assert client.models.retrieve(name).model_dump() == card
