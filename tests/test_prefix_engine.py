"""The prefix cache in the engine: 16 clients sharing a system prompt, eviction under pressure,
sessions, windows; tokens and logits against cold runs of the same scheme.

A cold run is the same request alone on an engine without a prefix cache. Logits are those of
the prompt's last position (what samples the first token), recorded at the runner's sampler.
"""

from __future__ import annotations

import numpy as np
import pytest

from services.engine.cache import CacheOptions, Window
from services.engine.cache.schemes import SCHEMES
from services.engine.core import EngineCore
from services.engine.request import Request
from shared.protocol import SamplingParams
from services.eval.corpus import corpus_token_ids
from tests.test_engine_core import greedy, random_prompts, tiny_loaded

PAGE = 16
# Mean KL(raw || scheme) of each scheme on the default model (README quality table, eval-kv).
SCHEME_KL = {"affine8": 0.0004, "affine4": 0.061, "aura8v8": 0.0002, "aura8v4": 0.0072, "aura4v4": 0.052,
             "aura4v2": 0.160}  # fmt: skip


def kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    """KL(p || q) of the softmax distributions of two logit vectors, float64 (nats)."""
    lp = p_logits.astype(np.float64) - np.logaddexp.reduce(p_logits.astype(np.float64))
    lq = q_logits.astype(np.float64) - np.logaddexp.reduce(q_logits.astype(np.float64))
    return float(np.sum(np.exp(lp) * (lp - lq)))


def assert_close_to_cold(warm: np.ndarray, cold: np.ndarray, scheme: str, name: str) -> None:
    """Equal within the scheme's tolerance. Another prompt chunking rounds the K/V differently:
    float32 rounding, relative to the largest logit, as in test_batched_cache. A compressed
    vector near a code boundary may then flip its code, so cold and warm are two roundings of the
    scheme, each about its mean KL `K` from raw: for small differences KL is a squared distance
    (half the Fisher quadratic form), so sqrt(KL) obeys the triangle inequality and the two are at
    most (2 sqrt(K))^2 = 4K apart; that bound is required (one prompt of aura4v4 measured 0.062
    against a mean of 0.052 on one CPU's BLAS), and the same top-1 token wherever cold is confident
    in it (probability >= 1/2: flipped codes move logits by tenths, which reorders near-ties only).
    Wrong pages or positions cost far more (KL of order 1)."""
    if np.allclose(warm, cold, rtol=0, atol=2e-4 * np.abs(cold).max()):
        return
    assert scheme in SCHEME_KL, f"{name}: max |logit difference| {np.abs(warm - cold).max()}"
    assert kl(cold, warm) <= 4 * SCHEME_KL[scheme], f"{name}: KL {kl(cold, warm)}"
    shifted = cold.astype(np.float64) - cold.max()
    if 1 / np.exp(shifted).sum() >= 0.5:
        assert warm.argmax() == cold.argmax(), name


def record(core: EngineCore) -> tuple[dict, list]:
    """Record each request's prompt logits (float32 [vocab]) and every prompt chunk (id, start, tokens)."""
    logits, chunks = {}, []
    sampler, schedule = core.runner._sampler, core.scheduler.schedule

    def recording_sampler(request):
        inner = sampler(request)

        def sample(row):
            logits[request.request_id] = row
            return inner(row)

        return sample

    def recording_schedule():
        plan = schedule()
        chunks.extend((c.request.request_id, c.start, c.num_tokens) for c in plan.prefills)
        return plan

    core.runner._sampler, core.scheduler.schedule = recording_sampler, recording_schedule
    return logits, chunks


def make_core(loaded, scheme="raw", *, prefix_cache=True, capacity_tokens=32768, window=None, **kwargs):
    options = CacheOptions(scheme=scheme, max_context=4096, window=window)
    kwargs = {"max_slots": 16, "step_token_budget": 256, "page_size": PAGE, "run_ahead": True} | kwargs
    return EngineCore(loaded, options, capacity_tokens=capacity_tokens, prefix_cache=prefix_cache, **kwargs)


def run(core: EngineCore, requests: list[Request], on_step=None) -> dict[str, list]:
    """Add every request, step until idle; returns the tokens and outputs of each."""
    results = {}
    for request in requests:
        core.add_request(request)
        results[request.request_id] = {"tokens": [], "outputs": []}
    while core.has_unfinished():
        if on_step is not None:
            on_step(core)
        for out in core.step():
            results[out.request_id]["tokens"] += out.new_token_ids
            results[out.request_id]["outputs"].append(out)
    return results


def cold_logits(loaded, scheme: str, prompts: list[list[int]]) -> list[np.ndarray]:
    """Prompt logits of each prompt run alone, one after the other, without a prefix cache."""
    core = make_core(loaded, scheme, prefix_cache=False)
    logits, _ = record(core)
    for i, prompt in enumerate(prompts):
        run(core, [Request(f"cold{i}", prompt, SamplingParams(max_tokens=1))])
    return [np.array(logits[f"cold{i}"]) for i in range(len(prompts))]


def shared_prompt_run(loaded, scheme: str, system: list[int], questions: list[list[int]], max_tokens: int):
    """16 clients at once: the system prompt plus each question. Checks what every acceptance run
    shares; returns (core, prompt logits, results)."""
    core = make_core(loaded, scheme)
    logits, chunks = record(core)
    shared = (len(system) // PAGE) * PAGE  # full pages of the system prompt
    most_live = []

    def measure(core):  # bytes held while all 16 are past their prompt, against their page tables
        live = [r for r in core.scheduler.running if not r.is_prefill]
        if len(live) == 16:
            tables = [r.slot.page_table for r in live]
            assert all(t[: shared // PAGE] == tables[0][: shared // PAGE] for t in tables)
            own = sum(len(t) - shared // PAGE for t in tables)  # pages past the system prompt's
            assert len({p for t in tables for p in t}) == shared // PAGE + own
            stats, page_bytes = core.stats(), PAGE * core.cache.bytes_per_token
            most_live.append((stats.held_tokens * stats.bytes_per_token, (shared // PAGE + own) * page_bytes,
                              sum(len(t) for t in tables) * page_bytes))  # fmt: skip

    prompts = [system + q for q in questions]
    requests = [Request(f"q{i}", p, SamplingParams(max_tokens=max_tokens)) for i, p in enumerate(prompts)]
    results = run(core, requests, on_step=measure)
    computed = {f"q{i}": 0 for i in range(16)}
    for rid, _, num in chunks:
        computed[rid] += num
    assert computed == {f"q{i}": len(p) - (shared if i else 0) for i, p in enumerate(prompts)}
    assert [results[f"q{i}"]["outputs"][-1].num_cached_tokens for i in range(16)] == [0] + [shared] * 15
    assert most_live, "the 16 requests were never live together"
    held, once, copies = most_live[0]  # the pool holds the prefix once, not 16 times
    assert held == once == copies - 15 * shared * core.cache.bytes_per_token
    stats = core.stats()
    assert (stats.prefix_hit_tokens, stats.prefix_query_tokens) == (15 * shared, sum(map(len, prompts)))
    assert (stats.used_slots, stats.per_request, stats.held_tokens, stats.free_tokens) == (
        0, {}, 0, stats.capacity_tokens)  # fmt: skip
    assert stats.cached_pages == stats.evictable_pages >= shared // PAGE
    return core, {k: np.array(v) for k, v in logits.items()}, results


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_sixteen_clients_share_a_system_prompt(tiny_llama, scheme):
    """A 1,000-token system prompt, 16 questions, all at once: the first request computes the
    prompt; each of the others waits for it, maps its 62 full pages and computes only the rest
    (8 system tokens and its question); logits equal a cold run (raw: all 15, else 2)."""
    loaded = tiny_loaded(tiny_llama)
    system = random_prompts([1000], seed=3)[0]
    questions = random_prompts(np.random.default_rng(4).integers(5, 40, 16), seed=5)
    _, logits, results = shared_prompt_run(loaded, scheme, system, questions, max_tokens=16)
    compared = range(1, 16) if scheme == "raw" else (1, 15)
    colds = cold_logits(loaded, scheme, [system + questions[i] for i in compared])
    for i, cold in zip(compared, colds):
        assert_close_to_cold(logits[f"q{i}"], cold, scheme, f"q{i}")
    if scheme == "raw":  # and the streams go on exactly as alone
        for i in (0, 1, 15):
            expected = greedy(tiny_llama, CacheOptions(max_context=4096), system + questions[i], 16)
            assert results[f"q{i}"]["tokens"] == expected, f"q{i}"


def test_eviction_under_pressure_spares_pages_in_use(tiny_llama):
    """Cached pages stay after the load and are reclaimed when capacity is needed; a stream holding
    shared pages meanwhile is never disturbed."""
    loaded = tiny_loaded(tiny_llama)
    core = make_core(loaded, capacity_tokens=1024, max_slots=8)  # 64 pages
    system, questions = random_prompts([200], seed=7)[0], random_prompts([5, 9, 13, 17], seed=8)
    run(core, [Request(f"w{i}", system + q, SamplingParams(max_tokens=8)) for i, q in enumerate(questions)])
    # Then strangers: the system pages are now the least recently used.
    strangers = random_prompts([240, 240], seed=9)
    run(core, [Request(f"l{i}", p, SamplingParams(max_tokens=2)) for i, p in enumerate(strangers)])
    stats = core.stats()
    assert (stats.free_tokens, stats.held_tokens, stats.used_slots, stats.per_request) == (1024, 0, 0, {})
    assert stats.cached_pages == stats.evictable_pages >= 12 + 2 * 15 and stats.evicted_pages == 0
    free_list = 64 - stats.cached_pages
    # A long stream maps the 12 system pages; a stranger's 600-token prompt needs 38 pages, more
    # than the free list holds: cached pages are evicted, never those the stream holds.
    holder = Request("holder", system + [3, 1, 4], SamplingParams(max_tokens=40))
    big = Request("big", random_prompts([600], seed=10)[0], SamplingParams(max_tokens=4))
    results = run(core, [holder, big])
    stats = core.stats()
    assert stats.evicted_pages >= 38 - (free_list - 1)  # the holder's first own page came first
    assert results["holder"]["outputs"][-1].num_cached_tokens == 192
    assert core.cache.slots.prefix.match(system + [0], max_positions=300).num_pages == 12  # held: spared
    options = CacheOptions(max_context=4096)
    assert results["holder"]["tokens"] == greedy(tiny_llama, options, holder.prompt_token_ids, 40)
    assert results["big"]["tokens"] == greedy(tiny_llama, options, big.prompt_token_ids, 4)
    assert (stats.free_tokens, stats.held_tokens, stats.used_slots, stats.per_request) == (1024, 0, 0, {})


def test_sessions_and_strangers_share_one_prefix_mechanism(tiny_llama):
    """A session's first turn maps the cached system prompt; after it closes, a stateless client
    sending the whole conversation again maps the pages the session computed."""
    loaded = tiny_loaded(tiny_llama)
    core = make_core(loaded)
    system, (q1, q2, q3) = random_prompts([100], seed=11)[0], random_prompts([7, 6, 5], seed=12)
    run(core, [Request("warm", system + [1, 2], SamplingParams(max_tokens=2))])
    first = run(core, [Request("t1", system + q1, SamplingParams(max_tokens=10), session_id="s")])["t1"]
    assert first["outputs"][-1].num_cached_tokens == 96
    second = run(core, [Request("t2", q2, SamplingParams(max_tokens=10), session_id="s")])["t2"]
    history = system + q1 + first["tokens"]
    assert second["outputs"][-1].num_cached_tokens == len(history) - 1  # the slot's own KV
    core.close_session("s")
    conversation = history + q2 + second["tokens"]
    again = run(core, [Request("stateless", conversation + q3, SamplingParams(max_tokens=6))])["stateless"]
    assert again["outputs"][-1].num_cached_tokens == ((len(conversation) - 1) // PAGE) * PAGE
    options = CacheOptions(max_context=4096)
    assert first["tokens"] == greedy(tiny_llama, options, system + q1, 10)
    assert second["tokens"] == greedy(tiny_llama, options, history + q2, 10)
    assert again["tokens"] == greedy(tiny_llama, options, conversation + q3, 6)


def test_a_window_shares_only_what_its_ring_never_overwrites(tiny_llama):
    """Window of 64 with 16 sinks: requests that stay inside it share their full prompt pages;
    those that will wrap the ring share only the sink page. Tokens equal the windowed reference."""
    loaded = tiny_loaded(tiny_llama)
    window = Window(64, 16)
    core = make_core(loaded, window=window)
    system = random_prompts([40], seed=13)[0]
    tails = random_prompts([3, 4, 5, 6], seed=14)
    inside = [Request(f"in{i}", system + t, SamplingParams(max_tokens=10)) for i, t in enumerate(tails[:2])]
    wrapping = [Request(f"out{i}", system + t, SamplingParams(max_tokens=50)) for i, t in enumerate(tails[2:])]
    results = run(core, inside + wrapping)
    cached = {rid: r["outputs"][-1].num_cached_tokens for rid, r in results.items()}
    assert cached == {"in0": 0, "in1": 32, "out0": 16, "out1": 16}
    options = CacheOptions(max_context=4096, window=window)
    for request in inside + wrapping:
        expected = greedy(tiny_llama, options, request.prompt_token_ids, request.params.max_tokens)
        assert results[request.request_id]["tokens"] == expected, request.request_id


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["raw", "aura4v4"])
def test_default_model_sixteen_clients_share_a_system_prompt(default_model, scheme):
    """The acceptance run on SmolLM2-135M: 1,000 tokens of the Lee corpus as the system prompt."""
    tok = default_model.tokenizer
    system = corpus_token_ids(tok, 1000)
    questions = [tok.encode(f" Question {i}: what does the text say about item {7 * i}?") for i in range(16)]
    _, logits, _ = shared_prompt_run(default_model, scheme, system, questions, max_tokens=8)
    colds = cold_logits(default_model, scheme, [system + questions[i] for i in (1, 15)])
    for i, cold in zip((1, 15), colds):
        assert_close_to_cold(logits[f"q{i}"], cold, scheme, f"q{i}")
