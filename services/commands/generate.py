"""Generate text from a prompt in process, streaming it to stdout.

Prints the text as it is generated, then one summary line on stderr (prompt tokens,
generated tokens, prefill and decode tok/s, KV bytes); with --json, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys

from shared.errors import BadRequest

from .options import add_model_arguments, flag, settings_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--prompt", required=True, help="prompt text")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 disables it (default)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")


def encode_prompt(tokenizer, prompt: str, *, chat: bool) -> list[int]:
    """Token ids of the prompt, through the chat template when `chat` is set.

    Raises:
        BadRequest: the prompt is not valid UTF-8 (e.g. raw bytes from the shell).
    """
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadRequest(f"the prompt is not valid UTF-8 (byte at position {exc.start})") from exc
    if chat:
        messages = [{"role": "user", "content": prompt}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    return list(tokenizer.encode(prompt, add_special_tokens=True))


def run(args: argparse.Namespace) -> int:
    from shared.logging import configure_logging
    from services.engine.cache import make_layer_caches
    from services.engine.generate import GenerationStats, generate
    from services.engine.runtime import open_model
    from pydantic import ValidationError

    from shared.errors import one_line
    from shared.protocol import SamplingParams

    settings = settings_from_args(args)
    configure_logging(json=settings.log_json, level=settings.log_level)
    if args.top_k < -1:  # -1 is off too, as in vLLM and the HTTP API
        raise BadRequest(f"--top-k {args.top_k}: expected a positive count, or 0 to turn it off")
    loaded, options = open_model(settings)
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=max(args.top_k, 0) or None,
                                seed=args.seed, max_tokens=args.max_tokens)  # fmt: skip
    except ValidationError as exc:
        raise BadRequest(one_line(exc, flag)) from None
    token_ids = encode_prompt(loaded.tokenizer, args.prompt, chat=args.chat)
    caches = make_layer_caches(loaded.model, options)
    stats = GenerationStats()
    pieces = []
    for text in generate(loaded.model, loaded.tokenizer, token_ids, caches, params,
                         max_context=options.max_context, stop=tuple(args.stop), prefill_chunk=settings.prefill_chunk, stats=stats):
        pieces.append(text)
        if not args.json:
            sys.stdout.write(text)
            sys.stdout.flush()
    if args.json:
        print(json.dumps({
            "text": "".join(pieces), "token_ids": stats.token_ids, "finish_reason": stats.finish_reason,
            "prompt_tokens": stats.prompt_tokens, "generated_tokens": stats.generated_tokens,
            "prefill_tokens_per_s": round(stats.prefill_tokens_per_s, 2),
            "decode_tokens_per_s": round(stats.decode_tokens_per_s, 2),
            "kv_bytes": stats.kv_bytes, "kv_cache": options.scheme,
        }))
    else:
        print(file=sys.stdout, flush=True)  # before the stats line on stderr (unbuffered)
        print(f"[prompt {stats.prompt_tokens} tok | generated {stats.generated_tokens} tok ({stats.finish_reason}) | "
              f"prefill {stats.prefill_tokens_per_s:.1f} tok/s | decode {stats.decode_tokens_per_s:.1f} tok/s | "
              f"KV {stats.kv_bytes} bytes ({options.scheme})]", file=sys.stderr)
    return 0
