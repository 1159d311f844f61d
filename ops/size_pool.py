"""Size an engine's KV pool: bytes per token per scheme, and what a memory budget buys.

Pure arithmetic from CACHES.md ("Bytes per token"): per layer and token,
`2 (K, V) x n_kv_heads x head_dim x bits_per_element / 8` bytes, with the scheme's
metadata (scales, biases) included in bits_per_element. A window caps each session's
tokens at its size. Prints JSON: per scheme, bytes per token, `--capacity-tokens` to pass
to `buttermilk serve` for the budget, and how many sessions of `--context` tokens fit.

    python -m ops.size_pool --memory-gib 8 [--n-layers 30 --n-kv-heads 3 --head-dim 64]
        [--dtype-bytes 2] [--context 4096] [--window 0] [--schemes raw,affine8,aura4v4]
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx

from services.engine.cache import schemes

_RAW_DTYPES = {2: mx.float16, 4: mx.float32}


def bits_per_element(scheme: str, *, head_dim: int, dtype_bytes: int) -> float:
    """Stored bits per K or V element, metadata included (CACHES.md table).

    Raises:
        ValueError: unknown scheme.
    """
    return schemes.bits_per_element(scheme, head_dim=head_dim, dtype=_RAW_DTYPES[dtype_bytes])


def bytes_per_token(scheme: str, *, n_layers: int, n_kv_heads: int, head_dim: int, dtype_bytes: int) -> float:
    """KV bytes one token costs across all layers (bytes)."""
    return n_layers * 2 * n_kv_heads * head_dim * bits_per_element(scheme, head_dim=head_dim, dtype_bytes=dtype_bytes) / 8


def size(scheme: str, *, memory_bytes: float, context: int, window: int, **geometry) -> dict:
    """Capacity in tokens for a memory budget, and sessions of `context` tokens that fit."""
    per_token = bytes_per_token(scheme, **geometry)
    capacity = int(memory_bytes // per_token)
    per_session = min(context, window) if window else context
    return {"scheme": scheme, "bytes_per_token": round(per_token, 1), "capacity_tokens": capacity,
            "sessions_at_context": capacity // per_session, "tokens_per_session": per_session}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory-gib", type=float, required=True, help="memory given to the KV pool (GiB)")
    parser.add_argument("--n-layers", type=int, default=30)
    parser.add_argument("--n-kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype-bytes", type=int, default=2, help="raw element size: 2 (fp16/bf16), 4 (fp32 on CPU)")
    parser.add_argument("--context", type=int, default=4096, help="tokens per session (prompt + output)")
    parser.add_argument("--window", type=int, default=0, help="sliding window per session (0: none)")
    parser.add_argument("--schemes", default="raw,affine8,affine4,aura8v8,aura8v4,aura5v3,aura4v4,aura4v2")
    args = parser.parse_args()
    geometry = {"n_layers": args.n_layers, "n_kv_heads": args.n_kv_heads, "head_dim": args.head_dim,
                "dtype_bytes": args.dtype_bytes}
    rows = [size(s, memory_bytes=args.memory_gib * 2**30, context=args.context, window=args.window, **geometry)
            for s in args.schemes.split(",")]
    print(json.dumps({"memory_gib": args.memory_gib, **geometry, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
