"""What key centering buys: held-out mean KL of each scheme with keys stored as they come and centered.

Means come from the first `CALIBRATION_TOKENS` tokens of the Lee corpus's first half
(`KeyMeans.measure`); KL(raw || scheme) is measured on `--tokens` tokens of its second half,
teacher-forced in chunks of `--chunk`, on the default model. Also per layer: the share of the
held-out keys' energy that centering leaves (`E|k - mu|^2 / E|k|^2`), the figure every codec's error
follows (keys read from mlx-lm's own cache). JSON to stdout and `ops/results/eval_kv/centering_gain.json`.

    python -m ops.centering_gain [--schemes aura4v4,aura4v2] [--tokens 1024]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx
import numpy as np

RESULTS = Path(__file__).parent / "results" / "eval_kv"
SCHEMES = "affine8,affine6,affine4,aura8v8,aura8v4,aura5v3,aura4v4,aura4v2,aura3v3"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--schemes", default=SCHEMES)
    parser.add_argument("--tokens", type=int, default=1024, help="held-out tokens (default 1024)")
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--out", type=Path, default=RESULTS / "centering_gain.json")
    args = parser.parse_args()

    from mlx_lm.models.cache import make_prompt_cache

    from services.engine.cache import CacheOptions, make_layer_caches
    from services.engine.cache.centering import CALIBRATION_TOKENS, KeyMeans
    from services.engine.model.loader import load_model
    from services.eval.corpus import LEE_CORPUS, split_halves, text_token_ids
    from services.eval.metrics import KLReference, logprob_chunks

    loaded = load_model(args.model)
    model, tok = loaded.model, loaded.tokenizer
    first, second = split_halves(LEE_CORPUS.read_text(encoding="utf-8"))
    means = KeyMeans.measure(model, text_token_ids(tok, first, CALIBRATION_TOKENS))
    held = text_token_ids(tok, second, args.tokens)

    def run(scheme: str, key_means) -> list[np.ndarray]:
        caches = make_layer_caches(model, CacheOptions(scheme=scheme, max_context=len(held), key_means=key_means))
        return list(logprob_chunks(model, caches, held, chunk=args.chunk))

    reference = [KLReference.from_logprobs(c) for c in run("raw", None)]

    def mean_kl(chunks) -> float:
        return float(np.concatenate([r.kl(c) for r, c in zip(reference, chunks)]).mean())

    plain_caches = make_prompt_cache(model)  # mlx-lm's own: its keys as the model wrote them
    model(mx.array([held]), cache=plain_caches)
    energy = []
    for cache, mean in zip(plain_caches, means.means):
        keys = np.array(cache.keys[0, :, : len(held)], dtype=np.float64)  # [H, T, D]
        energy.append(round(float(((keys - np.array(mean)) ** 2).sum(-1).mean() / (keys ** 2).sum(-1).mean()), 3))
    rows = []
    for scheme in (s for s in args.schemes.split(",") if s):
        plain, centered = mean_kl(run(scheme, None)), mean_kl(run(scheme, means))
        rows.append({"scheme": scheme, "mean_kl": plain, "mean_kl_centered": centered, "ratio": centered / plain})
        print(json.dumps(rows[-1]), flush=True)
    report = {"model": loaded.path.name, "device": str(mx.default_device()), "held_out_tokens": len(held),
              "mean_tokens": CALIBRATION_TOKENS, "chunk": args.chunk,
              "held_out_key_energy_left_per_layer": energy, "results": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "results"}))


if __name__ == "__main__":
    main()
