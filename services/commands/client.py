"""Talk to a running server: stream a completion, or check health and stats.

Prints the text as it streams (or one JSON object with --json). `--health` exits 0 when the
server answers `ok` (at least one engine is live) and 1 otherwise (with --allow-degraded: 0 on
any answer), for healthchecks. If no server answers within --connect-timeout-s (first, and
whenever the stream falls silent that long), it fails with a one-line error. Ctrl-C cancels
the request on the server and exits 130. A request the server refuses as invalid (bad option,
prompt over the context, unknown session) prints one line and exits 2; a server-side failure
(overloaded, engine failed, timeout) exits 1.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from shared.errors import ErrorCode
from shared.settings import DEFAULT_ADDRESS

CANCEL_WAIT_S = 2.0  # after Ctrl-C, how long to wait for the cancelled request's `done`
EXIT_INTERRUPTED = 130
# Server answers that refuse the request as given (HTTP's 400 and 404): exit 2, as for a bad flag. Others
# exit 1, `lease_expired` too: it may end a request already streaming.
USER_ERRORS = frozenset({ErrorCode.BAD_REQUEST, ErrorCode.CONTEXT_OVERFLOW, ErrorCode.MODEL_NOT_FOUND})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default=None, help=f"gateway endpoint (default $BUTTERMILK_ADDRESS or {DEFAULT_ADDRESS})")
    parser.add_argument("--prompt", help="prompt text")
    parser.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    parser.add_argument("--session", help="multi-turn session id, continued by later requests on the same connection "
                        "(a session without a lease ends with its connection, so each call of this command can only "
                        "start one; the Python client and the HTTP API continue sessions)")  # fmt: skip
    parser.add_argument("--new-session", action="store_true", help="start --session with this prompt")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole request")
    parser.add_argument("--connect-timeout-s", type=float, default=5.0,
                        help="seconds to wait for the server to answer at all (also when a stream falls silent)")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--health", action="store_true", help="check health (exit 0 if ok)")
    parser.add_argument("--allow-degraded", action="store_true", help="with --health: exit 0 on any answer")
    parser.add_argument("--stats", action="store_true", help="print server stats as JSON")


class _Unreachable(Exception):
    pass


def _usage_error(message: str) -> int:
    print(f"buttermilk: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    import asyncio
    import os

    from shared.client import AsyncClient, ServerError, validate_address

    address = args.address or os.environ.get("BUTTERMILK_ADDRESS") or DEFAULT_ADDRESS
    for flag, value in (("--timeout", args.timeout), ("--connect-timeout-s", args.connect_timeout_s)):
        if not (math.isfinite(value) and value > 0):
            return _usage_error(f"{flag} must be a positive number of seconds, not {value}")
    validate_address(address)  # raises a one-line error (exit 2) for e.g. a missing tcp://
    if args.health and args.stats:
        return _usage_error("--health and --stats are separate calls: give one")
    if args.new_session and not args.session:
        return _usage_error("--new-session needs --session ID")
    options = None
    if not (args.health or args.stats):
        if args.prompt is None:
            return _usage_error("--prompt is required (or --health / --stats)")
        if not args.prompt:
            return _usage_error("--prompt is empty: nothing to generate from")
        options = _options(args)
        AsyncClient.build_generate(request_id="check", **options)  # one-line ProtocolError (exit 2)

    async def main() -> int:
        async with AsyncClient(address) as client:
            try:
                if args.health:
                    return await _health(client, min(args.timeout, args.connect_timeout_s), args.allow_degraded)
                try:
                    if args.stats:
                        print((await client.stats(timeout_s=args.connect_timeout_s)).model_dump_json())
                        return 0
                    await client.health(timeout_s=args.connect_timeout_s)
                except TimeoutError:
                    raise _Unreachable from None
                return await _generate(client, args, options)
            except _Unreachable:
                print(f"buttermilk: error: no server answered at {address} within {args.connect_timeout_s:g} s "
                      "(is buttermilk serve running?)", file=sys.stderr)  # fmt: skip
                return 1
            except ServerError as exc:
                if exc.code in USER_ERRORS:  # the request's own fault, as a bad flag is
                    return _usage_error(str(exc))
                print(f"buttermilk: server error: {exc}", file=sys.stderr)
                return 1
            except TimeoutError as exc:
                print(f"buttermilk: timeout: {exc}", file=sys.stderr)
                return 1

    return asyncio.run(main())


async def _health(client, timeout_s: float, allow_degraded: bool) -> int:
    try:
        health = await client.health(timeout_s=timeout_s)
    except TimeoutError:
        print(json.dumps({"status": "unreachable"}))
        return 1
    print(health.model_dump_json())
    return 0 if health.status == "ok" or allow_degraded else 1


def _options(args: argparse.Namespace) -> dict:
    options = {"max_tokens": args.max_tokens, "temperature": args.temperature, "stop": args.stop,
               "seed": args.seed}  # fmt: skip
    if args.session:
        options |= {"session_id": args.session, "new_session": args.new_session}
    if args.chat:
        options["messages"] = [{"role": "user", "content": args.prompt}]
    else:
        options["prompt"] = args.prompt
    return options


async def _next_or_probe(client, stream, probe_s: float):
    """The stream's next token (StopAsyncIteration at its end); while it is silent for
    `probe_s`, check the server still answers (raises _Unreachable when it does not)."""
    import asyncio

    step = asyncio.ensure_future(stream.__anext__())
    try:
        while True:
            finished, _ = await asyncio.wait({step}, timeout=probe_s)
            if finished:
                return step.result()
            try:
                await client.health(timeout_s=probe_s)
            except TimeoutError:
                raise _Unreachable from None
    finally:
        if not step.done():
            step.cancel()
            await asyncio.gather(step, return_exceptions=True)


async def _generate(client, args: argparse.Namespace, options: dict) -> int:
    import asyncio
    import signal

    from shared.client import ServerError

    stream = await client.stream(timeout_s=args.timeout, **options)
    loop = asyncio.get_running_loop()
    reader = asyncio.current_task()
    interrupted = False

    def on_sigint() -> None:
        nonlocal interrupted
        interrupted = True
        reader.cancel()

    loop.add_signal_handler(signal.SIGINT, on_sigint)
    texts: list[str] = []
    ids: list[int] = []
    try:
        while True:
            try:
                token = await _next_or_probe(client, stream, args.connect_timeout_s)
            except StopAsyncIteration:
                break
            texts.append(token.text)
            ids.extend(token.token_ids)
            if not args.json:
                sys.stdout.write(token.text)
                sys.stdout.flush()
    except (ServerError, TimeoutError, _Unreachable):
        if texts and not args.json:
            print()  # the error line starts on a line of its own
        raise
    except asyncio.CancelledError:
        if not interrupted:
            raise
        reader.uncancel()
        loop.remove_signal_handler(signal.SIGINT)
        await _cancel_quietly(stream)
        if not args.json:
            print()
        print("buttermilk: interrupted (request cancelled)", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        loop.remove_signal_handler(signal.SIGINT)
    done = stream.done
    if args.json:
        print(json.dumps({"text": "".join(texts), "token_ids": ids,
                          "finish_reason": done.finish_reason.value, "usage": done.usage.model_dump()}))  # fmt: skip
        return 0
    print()
    print(f"[{done.finish_reason.value} | prompt {done.usage.prompt_tokens} tok "
          f"(cached {done.usage.cached_tokens}) | completion {done.usage.completion_tokens} tok]",
          file=sys.stderr)  # fmt: skip
    return 0


async def _cancel_quietly(stream) -> None:
    """Send `cancel` and wait up to CANCEL_WAIT_S for the request's terminal message."""
    import asyncio

    async def drain() -> None:
        async for _ in stream:
            pass

    try:
        await stream.cancel()
        await asyncio.wait_for(drain(), timeout=CANCEL_WAIT_S)
    except Exception:  # noqa: BLE001 - best effort: we are exiting anyway
        pass
