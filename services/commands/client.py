"""Talk to a running server: stream a completion, or check health and stats.

Prints the text as it streams (or one JSON object with --json). `--health` exits 0 when the
server answers `ok` (at least one engine is live) and 1 otherwise (with --allow-degraded: 0 on
any answer), for healthchecks.
"""

from __future__ import annotations

import argparse
import json
import sys

from .gateway import DEFAULT_ADDRESS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default=None, help=f"gateway endpoint (default $BUTTERMILK_ADDRESS or {DEFAULT_ADDRESS})")
    parser.add_argument("--prompt", help="prompt text")
    parser.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    parser.add_argument("--session", help="multi-turn session id (continues it; see --new-session)")
    parser.add_argument("--new-session", action="store_true", help="start --session with this prompt")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole request")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--health", action="store_true", help="check health (exit 0 if ok)")
    parser.add_argument("--allow-degraded", action="store_true", help="with --health: exit 0 on any answer")
    parser.add_argument("--stats", action="store_true", help="print server stats as JSON")


def run(args: argparse.Namespace) -> int:
    import os

    from shared.client import Client, ServerError

    address = args.address or os.environ.get("BUTTERMILK_ADDRESS") or DEFAULT_ADDRESS
    with Client(address) as client:
        try:
            if args.health:
                return _health(client, args.timeout, args.allow_degraded)
            if args.stats:
                print(client.stats().model_dump_json())
                return 0
            if not args.prompt:
                print("buttermilk: error: --prompt is required (or --health / --stats)", file=sys.stderr)
                return 2
            return _generate(client, args)
        except ServerError as exc:
            print(f"buttermilk: server error: {exc}", file=sys.stderr)
            return 1
        except TimeoutError as exc:
            print(f"buttermilk: timeout: {exc}", file=sys.stderr)
            return 1


def _health(client, timeout_s: float, allow_degraded: bool) -> int:
    try:
        health = client.health(timeout_s=min(timeout_s, 5.0))
    except TimeoutError:
        print(json.dumps({"status": "unreachable"}))
        return 1
    print(health.model_dump_json())
    return 0 if health.status == "ok" or allow_degraded else 1


def _generate(client, args: argparse.Namespace) -> int:
    options = {"max_tokens": args.max_tokens, "temperature": args.temperature, "stop": args.stop,
               "timeout_s": args.timeout, "seed": args.seed}  # fmt: skip
    if args.session:
        options |= {"session_id": args.session, "new_session": args.new_session}
    if args.chat:
        options["messages"] = [{"role": "user", "content": args.prompt}]
    else:
        options["prompt"] = args.prompt
    if args.json:
        result = client.generate(**options)
        print(json.dumps({"text": result.text, "token_ids": result.token_ids,
                          "finish_reason": result.finish_reason, "usage": result.usage.model_dump()}))  # fmt: skip
        return 0
    stream = client.stream(**options)
    while True:
        try:
            token = next(stream)
        except StopIteration as end:
            done = end.value
            break
        sys.stdout.write(token.text)
        sys.stdout.flush()
    print()
    print(f"[{done.finish_reason.value} | prompt {done.usage.prompt_tokens} tok "
          f"(cached {done.usage.cached_tokens}) | completion {done.usage.completion_tokens} tok]",
          file=sys.stderr)  # fmt: skip
    return 0
