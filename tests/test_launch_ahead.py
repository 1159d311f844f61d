"""Decode windows launched ahead of the read-back (`EngineCore.launch_ahead`): the GPU's order.

On a CPU the engine takes the GPU's path (a tail pool) when its cache is built with a GPU as the
default device, and these tests let its windows run ahead although its tail moves are MLX scatters
(ordered by their data; the engine itself runs ahead only with CUDA's in-place moves, which the
stream orders): they check the bookkeeping (tokens fed on the device, tail pages copied home in
order, EOS found a window late, aborts, sessions, the fence), which a GPU's run shares, against
plain greedy loops.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from kernels import cuda_kv
from services.engine.cache import CacheOptions, Window, make_layer_caches
from services.engine.request import Request
from services.engine.sampling import RequestSampler
from shared.protocol import SamplingParams
from tests.test_engine_core import assert_all_free, drive, greedy, make_core, random_prompts, tiny_loaded


def _first_new_token(tokens: list[int], at_least: int) -> tuple[int, list[int]]:
    """(index, [token]) of the first token at or after `at_least` that no earlier token equals: an EOS that
    stops the stream exactly there."""
    index = next(i for i in range(at_least, len(tokens)) if tokens[i] not in tokens[:i])
    return index, [tokens[index]]


@pytest.fixture
def ahead_core(monkeypatch):
    """`make_core` on the GPU's path, counting the windows launched ahead of a read-back."""

    def make(model, eos=(), **kwargs):
        with monkeypatch.context() as patch:
            if not cuda_kv.is_available():
                patch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu, 0))
            core = make_core(tiny_loaded(model, eos=eos), **kwargs)
        if not cuda_kv.is_available():  # MLX's scatters move the tail pages here, ordered by their data
            assert not core.runner.can_run_ahead
            core.runner.can_run_ahead = True
        assert core.cache.use_tail and core.runner.can_run_ahead
        run, core.ahead, core.prefilled = core.runner.run, [], []

        def counted(plan, ahead_of=None):
            core.ahead.append(ahead_of is not None)
            core.prefilled.append({chunk.request.request_id for chunk in plan.prefills})
            return run(plan, ahead_of)

        core.runner.run = counted
        return core

    return make


@pytest.mark.parametrize("window", [None, Window(8, 2)], ids=["full", "window8"])
def test_streams_get_their_tokens_alone_with_windows_launched_ahead(tiny_llama, ahead_core, window):
    """Streams of 4 lengths, one stopped by EOS mid-window: each gets what a greedy loop alone gets."""
    options = CacheOptions(max_context=4096, window=window)
    prompts, max_tokens = random_prompts([3, 20, 9, 1], seed=21), [14, 9, 40, 27]
    stop_at, eos = _first_new_token(greedy(tiny_llama, options, prompts[2], 40), at_least=5)  # r2's, a window in
    core = ahead_core(tiny_llama, eos=eos, window=window, page_size=4, decode_window=4)
    requests = [Request(f"r{i}", p, SamplingParams(max_tokens=m)) for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    results = drive(core, {0: requests})
    for i, prompt in enumerate(prompts):
        assert results[f"r{i}"]["tokens"] == greedy(tiny_llama, options, prompt, max_tokens[i], eos=eos), f"r{i}"
    assert results["r2"]["reason"] == "stop" and len(results["r2"]["tokens"]) == stop_at + 1
    assert sum(core.ahead) >= 4  # most windows ran ahead: 27 tokens in windows of 4
    assert_all_free(core)


def test_a_prompt_that_arrives_while_windows_run_ahead_joins_after_the_window_in_flight(tiny_llama, ahead_core):
    core = ahead_core(tiny_llama, decode_window=4)
    first, late = random_prompts([6, 11], seed=22)
    results = drive(core, {0: [Request("a", first, SamplingParams(max_tokens=30))],
                           5: [Request("b", late, SamplingParams(max_tokens=12))]})
    assert results["a"]["tokens"] == greedy(tiny_llama, core.options, first, 30)
    assert results["b"]["tokens"] == greedy(tiny_llama, core.options, late, 12)
    joined = [i for i, ids in enumerate(core.prefilled) if "b" in ids]
    assert len(joined) == 1 and not core.ahead[joined[0]]  # after the window in flight was read back
    assert any(core.ahead[: joined[0]]) and any(core.ahead[joined[0] + 1 :])  # a alone, then both, ran ahead
    assert_all_free(core)


def test_an_abort_while_a_window_runs_ahead_ends_only_that_stream(tiny_llama, ahead_core):
    core = ahead_core(tiny_llama, decode_window=4)
    prompts = random_prompts([4, 9, 17], seed=23)
    requests = [Request(f"r{i}", p, SamplingParams(max_tokens=24)) for i, p in enumerate(prompts)]

    def abort_r1(step, c):
        request = c.scheduler.requests.get("r1")
        if request is not None and request.num_output_tokens >= 6 and c.in_flight:
            c.abort(["r1"])

    results = drive(core, {0: requests}, on_step=abort_r1)
    assert results["r1"]["reason"] == "cancelled" and 6 <= len(results["r1"]["tokens"]) < 24
    assert results["r1"]["tokens"] == greedy(tiny_llama, core.options, prompts[1], 24)[:len(results["r1"]["tokens"])]
    for i in (0, 2):
        assert results[f"r{i}"]["tokens"] == greedy(tiny_llama, core.options, prompts[i], 24)
    assert any(core.ahead)
    assert_all_free(core)


def test_a_sampled_stream_draws_what_its_own_sampler_draws_alone(tiny_llama, ahead_core):
    """Seeded sampling (tokens that vary step to step) fed from one window into the one launched ahead."""
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=26)
    prompt, other = random_prompts([6, 13], seed=2)
    core = ahead_core(tiny_llama, decode_window=4)
    results = drive(core, {0: [Request("s", prompt, params), Request("g", other, SamplingParams(max_tokens=30))]})
    caches, sampler = make_layer_caches(tiny_llama, core.options), RequestSampler(params)
    logits, expected = tiny_llama(mx.array(prompt)[None], cache=caches)[0, -1], []
    for _ in range(26):
        expected.append(int(sampler(logits).item()))
        logits = tiny_llama(mx.array([expected[-1:]]), cache=caches)[0, -1]
    assert results["s"]["tokens"] == expected and len(set(expected)) > 10
    assert results["g"]["tokens"] == greedy(tiny_llama, core.options, other, 30)
    assert sum(core.ahead) >= 4
    assert_all_free(core)


@pytest.mark.parametrize("ending", ["length", "stop"])
def test_a_session_turn_ended_a_window_early_continues_exactly(tiny_llama, ahead_core, ending):
    """A turn whose stream ran a window past its end (launched ahead): the next turn sees exactly the history."""
    options = CacheOptions(max_context=4096)
    first, second = random_prompts([11, 7], seed=22)
    stop_at, eos = _first_new_token(greedy(tiny_llama, options, first, 20), at_least=6)
    eos = eos if ending == "stop" else []
    core = ahead_core(tiny_llama, eos=eos, decode_window=4)
    turn1 = drive(core, {0: [Request("t1", first, SamplingParams(max_tokens=20), session_id="s")]})
    said = turn1["t1"]["tokens"]
    assert turn1["t1"]["reason"] == ending and len(said) == (stop_at + 1 if ending == "stop" else 20)
    assert any(core.ahead)
    turn2 = drive(core, {0: [Request("t2", second, SamplingParams(max_tokens=10), session_id="s")]})
    assert turn2["t2"]["tokens"] == greedy(tiny_llama, options, first + said + second, 10, eos=eos)
    assert core.close_session("s") > 0
    assert_all_free(core)


def test_steps_are_read_back_before_the_next_launch_without_a_tail_pool(tiny_llama, monkeypatch):
    """The CPU's engine (no tail pool: its steps write the main pools in place) never launches ahead."""
    with monkeypatch.context() as patch:  # the CPU's path, whatever device runs the test
        patch.setattr(mx, "default_device", lambda: mx.Device(mx.cpu, 0))
        core = make_core(tiny_loaded(tiny_llama), decode_window=4)
    assert not core.cache.use_tail and not core.runner.can_run_ahead
    core.add_request(Request("a", random_prompts([5])[0], SamplingParams(max_tokens=20)))
    while core.has_unfinished():
        core.step()
        assert not core.can_launch_ahead and core.launch_ahead() == []
    assert_all_free(core)


def test_a_tail_pool_moved_by_scatters_or_a_session_on_a_sliding_window_reads_back_first(tiny_llama, monkeypatch):
    """Scatter moves (no CUDA) would copy whole pools the window in flight reads; a session's turn on a ring
    could lose its history (its end is found a window late): both read each window back before the next."""
    with monkeypatch.context() as patch:
        patch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu, 0))
        core = make_core(tiny_loaded(tiny_llama), window=Window(8, 2), page_size=4, decode_window=4)
    assert core.cache.use_tail and core.cache.moves_in_place == cuda_kv.is_available()
    assert core.runner.can_run_ahead == cuda_kv.is_available()
    core.runner.can_run_ahead = True  # as on CUDA
    prompt = random_prompts([9], seed=25)[0]
    core.add_request(Request("t", prompt, SamplingParams(max_tokens=30), session_id="s"))
    core.add_request(Request("u", prompt, SamplingParams(max_tokens=30)))
    while core.has_unfinished():
        core.step()
        assert not core.can_launch_ahead or "t" not in core.scheduler.requests
