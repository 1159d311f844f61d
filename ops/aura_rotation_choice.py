"""Which rotation AURA uses for a head_dim that is not a power of two, measured at equal bytes.

Candidates, for d = 80, 96, 192 (each a seeded +-1 diagonal, then):
- `padded`: zero-pad to the next power of two n and apply Sylvester's rotation there; all n
  rotated coordinates are coded (n * bits code bits for d elements);
- `block`: block-diagonal Sylvester rotations over the binary split of d (80 = 64 + 16,
  96 = 64 + 32, 192 = 128 + 64), one norm for the whole vector;
- `hadamard`: one Hadamard matrix of order d, `H_m (x) H_{2^k}` (`kernels.rotation`).

Data: the default model's real queries, keys and values (post-RoPE) on the Lee corpus. A
d-wide "head" is the concatenation of the model's 64-wide heads cut to d (kv heads 0, 1, 2,
and the query heads that share them), so outlier channels and RoPE structure stay real.
Metrics, eval-kv style, over every layer and query position: keys, mean KL(P || P_hat) of the
causal attention distributions (scale 1/sqrt(d)) with quantized keys; values, the relative
squared error of the attention output `P V` with quantized values. Bits per element include
the fp16 scale. Equal bytes: the padded curve is interpolated (log KL against bits per
element) at each integer width of the others.

    python -m ops.aura_rotation_choice [--tokens 256]   # JSON to ops/results/aura_rotation_choice.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).parent / "results"
DIMS = (80, 96, 192)
BITS = (2, 3, 4, 5, 6, 8)


def capture(num_tokens: int) -> list[dict[str, np.ndarray]]:
    """Per layer: q [n_heads, T, 64], k and v [n_kv_heads, T, 64] of the default model (float64)."""
    import mlx.core as mx
    from mlx_lm.models import cache as mlx_cache

    from services.engine.cache.protocol import AttendingCache
    from services.engine.model.loader import load_model
    from services.eval.corpus import corpus_token_ids

    class Recorder(mlx_cache.KVCache, AttendingCache):
        def attend(self, queries, keys, values, *, scale, mask, sinks=None):
            self.queries = queries
            return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)

    loaded = load_model("default")
    caches = [Recorder() for _ in loaded.model.layers]
    ids = corpus_token_ids(loaded.tokenizer, num_tokens)
    mx.eval(loaded.model(mx.array(ids)[None], cache=caches))
    as_np = lambda a: np.array(a[0].astype(mx.float32)).astype(np.float64)  # noqa: E731
    return [{"q": as_np(c.queries), "k": as_np(c.keys[..., :num_tokens, :]), "v": as_np(c.values[..., :num_tokens, :])}
            for c in caches]


def heads_of_width(layer: dict[str, np.ndarray], d: int) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """(queries [T, d] per query head of group, keys [T, d], values [T, d]) of one layer."""
    n_heads, n_kv = layer["q"].shape[0], layer["k"].shape[0]
    group = n_heads // n_kv

    def cat(x):
        return np.concatenate(list(x), axis=-1)[:, :d]

    queries = [cat(layer["q"][j::group][:n_kv]) for j in range(group)]
    return queries, cat(layer["k"]), cat(layer["v"])


def signs(n: int, seed: int) -> np.ndarray:
    from kernels.rotation import hadamard_signs

    return hadamard_signs(n, seed)


def sylvester(n: int) -> np.ndarray:
    from kernels.reference import sylvester_hadamard

    return sylvester_hadamard(n)


def rotation(kind: str, d: int, seed: int) -> np.ndarray:
    """R [n, d] with orthonormal columns: y = R x has the norm of x."""
    from kernels.rotation import hadamard_matrix

    if kind == "padded":
        n = 1 << (d - 1).bit_length()
        return (sylvester(n) * signs(n, seed)[None, :] / math.sqrt(n))[:, :d]
    if kind == "block":
        blocks, rest = [], d
        while rest:
            size = 1 << (rest.bit_length() - 1)
            blocks.append(sylvester(size) / math.sqrt(size))
            rest -= size
        out, at = np.zeros((d, d)), 0
        for b in blocks:
            out[at : at + len(b), at : at + len(b)] = b
            at += len(b)
        return out * signs(d, seed)[None, :]
    return hadamard_matrix(d) * signs(d, seed)[None, :] / math.sqrt(d)


def round_trip(x: np.ndarray, r: np.ndarray, bits: int) -> np.ndarray:
    """AURA encode + decode of x [T, d] with rotation R [n, d] (CACHES.md, float64)."""
    from kernels.lloyd_max import lloyd_max_codebook, lloyd_max_thresholds

    codebook, thresholds = lloyd_max_codebook(bits), lloyd_max_thresholds(bits)
    n = r.shape[0]
    norm = np.linalg.norm(x, axis=-1, keepdims=True)
    u = math.sqrt(n) * (x @ r.T) / np.where(norm > 0, norm, 1)
    c = codebook[np.searchsorted(thresholds, u)]
    return (norm / np.linalg.norm(c, axis=-1, keepdims=True) * c) @ r


def attention_errors(queries, keys, values, keys_hat, values_hat) -> tuple[float, float]:
    """(mean KL(P || P_hat) over positions 1.., relative squared error of P V) for one head set."""
    t, d = keys.shape
    causal = np.tril(np.ones((t, t), bool))
    kls, errs = [], []
    for q in queries:
        s, s_hat = (np.where(causal, q @ k.T / math.sqrt(d), -np.inf) for k in (keys, keys_hat))
        logp, logp_hat = (z - z.max(-1, keepdims=True) for z in (s, s_hat))
        logp = np.where(causal, logp - np.log(np.exp(logp).sum(-1, keepdims=True)), 0)
        logp_hat = np.where(causal, logp_hat - np.log(np.exp(logp_hat).sum(-1, keepdims=True)), 0)
        p = np.where(causal, np.exp(logp), 0)
        kls.append((p * (logp - logp_hat)).sum(-1)[1:].mean())
        out, out_hat = p @ values, p @ values_hat
        errs.append(((out - out_hat) ** 2).sum() / (out**2).sum())
    return float(np.mean(kls)), float(np.mean(errs))


def measure(layers, d: int) -> list[dict]:
    rows = []
    for kind in ("padded", "block", "hadamard"):
        for bits in BITS:
            kl, err = [], []
            for index, layer in enumerate(layers):
                queries, keys, values = heads_of_width(layer, d)
                rk, rv = rotation(kind, d, 2 * index), rotation(kind, d, 2 * index + 1)
                a, b = attention_errors(queries, keys, values, round_trip(keys, rk, bits), round_trip(values, rv, bits))
                kl.append(a), err.append(b)
            n = rotation(kind, d, 0).shape[0]
            rows.append({"rotation": kind, "bits": bits, "bits_per_element": round((n * bits + 16) / d, 4),
                         "key_kl": float(np.mean(kl)), "value_rel_err": float(np.mean(err))})
            print(json.dumps({"head_dim": d, **rows[-1]}), flush=True)
    return rows


def at_equal_bytes(rows: list[dict]) -> list[dict]:
    """Per integer width of the unpadded rotations: their errors and the padded one's at the same bytes."""
    padded = sorted((r for r in rows if r["rotation"] == "padded"), key=lambda r: r["bits_per_element"])
    x = [r["bits_per_element"] for r in padded]

    def interp(target, key):
        if not x[0] <= target <= x[-1]:
            return None
        return float(np.exp(np.interp(target, x, [math.log(r[key]) for r in padded])))

    out = []
    for bits in BITS:
        block, full = (next(r for r in rows if r["rotation"] == k and r["bits"] == bits) for k in ("block", "hadamard"))
        bpe = full["bits_per_element"]
        out.append({"bits": bits, "bits_per_element": bpe,
                    **{f"key_kl_{k}": v for k, v in (("hadamard", full["key_kl"]), ("block", block["key_kl"]),
                                                     ("padded", interp(bpe, "key_kl")))},
                    **{f"value_rel_err_{k}": v for k, v in (("hadamard", full["value_rel_err"]),
                                                            ("block", block["value_rel_err"]),
                                                            ("padded", interp(bpe, "value_rel_err")))}})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--out", type=Path, default=RESULTS / "aura_rotation_choice.json")
    args = parser.parse_args()
    layers = capture(args.tokens)
    result = {"benchmark": "aura_rotation_choice", "model": "default (SmolLM2-135M)", "corpus": "Lee",
              "tokens": args.tokens, "layers": len(layers), "dims": {}}
    for d in DIMS:
        rows = measure(layers, d)
        result["dims"][str(d)] = {"curves": rows, "equal_bytes": at_equal_bytes(rows)}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for d in DIMS:
        print(f"head_dim {d}: bits  b/elem  key KL hadamard / block / padded   value err hadamard / block / padded")
        for r in result["dims"][str(d)]["equal_bytes"]:
            fmt = lambda v: "   n/a  " if v is None else f"{v:.2e}"  # noqa: E731
            print(f"  {r['bits']}  {r['bits_per_element']:6.3f}  {fmt(r['key_kl_hadamard'])} {fmt(r['key_kl_block'])} "
                  f"{fmt(r['key_kl_padded'])}   {fmt(r['value_rel_err_hadamard'])} {fmt(r['value_rel_err_block'])} "
                  f"{fmt(r['value_rel_err_padded'])}")


if __name__ == "__main__":
    main()
