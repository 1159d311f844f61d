"""A hybrid model through the whole stack: a model folder mlx-lm loads, `serve`, a session.

No hybrid weights exist offline: the folder holds a tiny random nemotron_h (Mamba2 and
attention; cache index != layer index) with the default model's tokenizer files. Processes
run with `mx.compile` off (see `tests.hybrid_models.uncompiled`).
"""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import pytest

from shared.client import AsyncClient

from .hybrid_models import CONFIGS, hand_state_bytes, make_hybrid, uncompiled
from .pipeline_helpers import Server, reference_generation, run, wait_idle

pytestmark = [pytest.mark.model, pytest.mark.slow]

FAMILY = "nemotron_h"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@pytest.fixture(scope="module")
def hybrid_folder(tmp_path_factory, default_model):
    """A loadable folder: config.json, model.safetensors (random, float32) and the default tokenizer."""
    folder = tmp_path_factory.mktemp("hybrid-model")
    vocab = default_model.model.args.vocab_size
    config = CONFIGS[FAMILY] | {"vocab_size": vocab}
    model = make_hybrid(FAMILY, amplify=True, vocab_size=vocab)
    mx.save_safetensors(str(folder / "model.safetensors"), dict(nn.utils.tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(config | {"eos_token_id": default_model.config.get("eos_token_id")}))
    for name in TOKENIZER_FILES:
        shutil.copy(default_model.path / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def hybrid_loaded(hybrid_folder):
    from services.engine.model.loader import load_model

    return load_model(str(hybrid_folder))


@pytest.fixture(autouse=True)
def _uncompiled_processes(monkeypatch):
    monkeypatch.setenv("MLX_DISABLE_COMPILE", "1")  # inherited by the CLI and serve processes


def test_a_session_on_a_served_hybrid_equals_the_whole_conversation(tmp_path, hybrid_folder, hybrid_loaded):
    first, second = list(range(100, 140)), list(range(300, 317))
    server = Server.start(tmp_path, "--model", str(hybrid_folder))

    async def main():
        async with AsyncClient(server.address) as client:
            one = await client.generate(token_ids=first, max_tokens=12, session_id="h", new_session=True)
            two = await client.generate(token_ids=second, max_tokens=12, session_id="h")
            await client.close_session("h")
        await wait_idle(server.address)  # raises unless every reservation, slot and session was released
        return one, two

    try:
        one, two = run(main())
        log = server.log()
    finally:
        status = server.stop() if server.proc.poll() is None else server.proc.returncode
        if status != 0:
            server.kill_everything()
    assert status == 0, server.log()[-3000:]
    assert f"state_bytes_per_slot={hand_state_bytes(FAMILY)}" in log  # the engine's HELLO geometry
    history = first + one.token_ids
    if one.finish_reason == "stop":
        history.append(next(iter(hybrid_loaded.tokenizer.eos_token_ids)))
    whole = history + second
    assert two.usage.prompt_tokens == len(whole)
    assert len(history) - 8 <= two.usage.cached_tokens <= len(history)  # at most a decode window recomputed
    with uncompiled():
        _, want, _ = reference_generation(hybrid_loaded, whole, 12)
    assert two.token_ids == [t for t in want if t not in hybrid_loaded.tokenizer.eos_token_ids]
