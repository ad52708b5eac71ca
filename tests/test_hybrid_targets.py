"""Hybrid-attention targets (recurrent-state layers beside attention) in the batched engine.

Tiny random mlx-lm models built from each family's own `ModelArgs`: Qwen3.5 (GatedDeltaNet
with full attention every 2nd or 4th layer), its MoE variant, and LFM2 (short convolutions).
Greedy output equals plain mlx-lm decoding at concurrency 1 and 8, with drafting off, with
lookup drafts (long accepted runs, partial rejections) and with a random DFlash drafter
(mostly rejected) at fixed depths; rows join and leave mid-run and chunked prefill splits the
prompts. Each state layer's rollback is checked exactly against a cache that never saw the
rejected positions."""

from __future__ import annotations

import asyncio
from pathlib import Path

import factories
import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from test_engine import (
    PlainPlainDraftPolicy,
    ScriptedEngine,
    check_invariants,
    plain_greedy,
    run_all,
    wait_idle,
)

from engine import AsyncEngine, EngineConfig, SamplingParams
from engine.models.loading import load_target_model
from engine.step.recurrent import replay
from engine.step.state_cache import RaggedStateCache
from engine.step.target import TargetAdapter, UnsupportedTargetError

FAMILIES = {
    "qwen3_5-i2": ("qwen3_5", {"full_attention_interval": 2}, {}),
    "qwen3_5-i4": ("qwen3_5", {"full_attention_interval": 4}, {}),
    "qwen3_5_moe": ("qwen3_5_moe", {}, {}),
    "qwen3_next": ("qwen3_next", {}, {}),
    # LFM2's head is tied: see `factories.build_target`.
    "lfm2": ("lfm2", {}, {"output_scale": 6.0, "embed_scale": 1.0}),
}
# Attention-only families beyond llama/qwen: MoE, gpt-oss (attention sinks, sliding layers
# of window 8 beside full ones, MoE) and Gemma 3 (window 8 every other layer). They keep the
# ragged cache and O(1) trims, and verify padded.
ATTENTION = {
    "qwen3_moe": ("qwen3_moe", {}, {}),
    "gpt_oss": ("gpt_oss", {}, {}),
    "gemma3_text": ("gemma3_text", {}, {}),
}


@pytest.fixture(scope="module")
def family_dirs(model_root: Path, tokenizer_dir: Path) -> dict[str, Path]:
    dirs = {}
    for seed, (name, (model_type, overrides, build)) in enumerate(
        {**FAMILIES, **ATTENTION}.items()
    ):
        config = factories.family_config(model_type, 0, **overrides)
        dirs[name] = factories.build_target(
            model_root / f"hybrid-{name}", tokenizer_dir, model_type, 20 + seed, config, **build
        )
    return dirs


@pytest.fixture(scope="module")
def hybrid_drafter_dir(model_root: Path, family_dirs, vocab_size: int) -> Path:
    """A random DFlash drafter in z-lab's layout for the 4-layer Qwen3.5 targets: it taps a
    GatedDeltaNet layer (0 of interval 2's) and an attention layer (1)."""
    config = factories.drafter_config(vocab_size, target_layer_ids=[0, 1], num_target_layers=4)
    return factories.build_drafter(model_root / "hybrid-drafter", config, seed=31)


@pytest.fixture(scope="module")
def references(family_dirs):
    """Plain mlx-lm greedy continuations, computed once per (family, prompt, length)."""
    models: dict[str, object] = {}
    memo: dict[tuple, list[int]] = {}

    def reference(name: str, prompt: list[int], n: int) -> list[int]:
        if name not in models:
            models[name] = load_target_model(family_dirs[name])[0]
        key = (name, tuple(prompt), n)
        if key not in memo:
            memo[key] = plain_greedy(models[name], prompt, n)
        return memo[key]

    return reference


def _prompts(vocab: int, n: int) -> list[list[int]]:
    """Repetitive prompts (lookup finds matches) of different lengths (9 to 24 tokens)."""
    out = []
    for i in range(n):
        unit = [3 + (i * 37 + 11 * j) % (vocab - 3) for j in range(3 + i % 4)]
        out.append((unit * 8)[: 9 + (5 * i) % 16])
    return out


def _requests(vocab: int, depth_of) -> list[tuple]:
    """Eight requests arriving over the run (rows join while others decode and leave)."""
    prompts = _prompts(vocab, 8)
    return [
        (f"r{i}", p, 10 + (7 * i) % 9, depth_of(i), 0.01 * (i % 4)) for i, p in enumerate(prompts)
    ]


async def _run(config: EngineConfig, requests, hybrid: bool = True, **params):
    async with AsyncEngine(config) as engine:
        failures = check_invariants(engine)
        verify = []
        engine.step_hooks.append(lambda r: verify.append(r.verify_tokens))
        results = await run_all(engine, requests, **params)
        await wait_idle(engine)
        assert engine.kv_bytes() == 0 and not engine._runner.states
        packed = engine._runner.packed
    assert not failures, failures[:5]
    if hybrid:
        assert packed is None  # hybrid rows verify padded
    return results


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("concurrency", [1, 8])
async def test_greedy_equals_mlx_lm_drafting_off_and_lookup(
    name, concurrency, family_dirs, references, vocab_size
):
    """Half the rows never draft, half draft by prompt lookup (depth 4) where their text
    matches (random targets leave the prompts' pattern soon: the scripted test below makes
    the long accepted runs); chunks of 8 split the longer prompts."""
    requests = _requests(vocab_size, lambda i: 0 if i % 2 else 4)
    config = EngineConfig(target=str(family_dirs[name]), max_num_seqs=concurrency,
                          num_speculative_tokens=4, prefill_chunk_tokens=8)  # fmt: skip
    results = await _run(config, requests)
    for (rid, prompt, n, _, _), (tokens, _) in zip(requests, results):
        assert tokens == references(name, prompt, n), (name, rid)


@pytest.mark.parametrize("name", [*FAMILIES, *ATTENTION])
async def test_greedy_equals_mlx_lm_with_partly_accepted_drafts(
    name, family_dirs, references, vocab_size
):
    """Random targets rarely repeat themselves, so a scripted drafter (it knows each
    request's greedy continuation and spoils it after 7, 2, 0, 5, 1 tokens in turn) makes rows
    keep different numbers of verify positions in the same step: every state layer's replay
    runs with per-row lengths from 1 to the whole width."""
    requests = _requests(vocab_size, lambda i: 7)
    expected = [p + references(name, p, n) for _, p, n, _, _ in requests]
    config = EngineConfig(target=str(family_dirs[name]), max_num_seqs=8,
                          num_speculative_tokens=7, prefill_chunk_tokens=8)  # fmt: skip
    engine = ScriptedEngine(config, expected, vocab_size, [7, 2, 0, 5, 1])
    async with engine:
        failures = check_invariants(engine)
        results = await run_all(engine, requests)
        await wait_idle(engine)
        assert engine.kv_bytes() == 0
        assert engine._runner.packed is None or name in ATTENTION
    assert not failures, failures[:5]
    accepted = 0
    for reference, (rid, prompt, _, _, _), (tokens, last) in zip(expected, requests, results):
        assert tokens == reference[len(prompt) :], (name, rid)
        accepted += last.accepted_tokens
    assert accepted > 20, accepted


@pytest.mark.parametrize("depth", [1, 3, 7])
@pytest.mark.parametrize("concurrency", [1, 8])
async def test_greedy_equals_mlx_lm_with_a_random_dflash_drafter(
    depth, concurrency, family_dirs, hybrid_drafter_dir, references, vocab_size
):
    name = "qwen3_5-i2"
    requests = _requests(vocab_size, lambda i: depth)
    config = EngineConfig(target=str(family_dirs[name]), drafter=str(hybrid_drafter_dir),
                          draft_sources=["dflash"], max_num_seqs=concurrency,
                          num_speculative_tokens=depth, prefill_chunk_tokens=8)  # fmt: skip
    results = await _run(config, requests)
    for (rid, prompt, n, _, _), (tokens, _) in zip(requests, results):
        assert tokens == references(name, prompt, n), (rid, depth)
    assert sum(last.drafted_tokens for _, last in results) > 0


async def test_moe_hybrid_with_a_random_dflash_drafter(
    family_dirs, hybrid_drafter_dir, references, vocab_size
):
    name = "qwen3_5_moe"
    requests = _requests(vocab_size, lambda i: 3)
    config = EngineConfig(target=str(family_dirs[name]), drafter=str(hybrid_drafter_dir),
                          draft_sources=["dflash"], max_num_seqs=8,
                          num_speculative_tokens=3, prefill_chunk_tokens=8)  # fmt: skip
    results = await _run(config, requests)
    for (rid, prompt, n, _, _), (tokens, _) in zip(requests, results):
        assert tokens == references(name, prompt, n), rid


async def test_seeded_sampling_is_the_same_at_every_depth(
    family_dirs, hybrid_drafter_dir, vocab_size
):
    """Uniforms are indexed by output position and a rejected position's go back, so a seeded
    request samples the same tokens whatever its drafts were."""
    requests = _requests(vocab_size, lambda i: 0)
    outputs = {}
    for depth in (0, 1, 3, 7):
        config = EngineConfig(target=str(family_dirs["qwen3_5-i2"]),
                              drafter=str(hybrid_drafter_dir), max_num_seqs=8,
                              num_speculative_tokens=depth, prefill_chunk_tokens=8)  # fmt: skip
        results = await _run(config, [r[:3] + (depth,) + r[4:] for r in requests],
                             temperature=1.0, seed=5)  # fmt: skip
        outputs[depth] = [tokens for tokens, _ in results]
    assert outputs[0] == outputs[1] == outputs[3] == outputs[7]
    assert len({tuple(t) for t in outputs[0]}) > 1


@pytest.mark.parametrize("drafter", [False, True])
async def test_prefix_cache_hit_equals_cold_start_and_partial_match_is_a_miss(
    drafter, family_dirs, hybrid_drafter_dir, references, vocab_size
):
    """A follow-up prompt (earlier prompt + answer + more) reuses the whole entry; a prompt
    sharing only part of an entry prefills cold (a state exists only at the entry's end).
    With a DFlash drafter the entry carries the target features too."""
    name = "qwen3_5-i2"
    first = _prompts(vocab_size, 1)[0]
    config = EngineConfig(target=str(family_dirs[name]), max_num_seqs=4,
                          drafter=str(hybrid_drafter_dir) if drafter else None,
                          num_speculative_tokens=4, prefix_cache_bytes=8 << 20)  # fmt: skip
    async with AsyncEngine(config) as engine:
        failures = check_invariants(engine)
        ((answer, _),) = await run_all(engine, [("a", first, 9, 4, 0)])
        follow_up = first + answer + [7, 8, 9]
        partial = first[:-2] + [11, 12, 13]
        (hit, hit_last), (miss, miss_last) = await run_all(
            engine, [("b", follow_up, 10, 4, 0), ("c", partial, 10, 4, 0.05)]
        )
        await wait_idle(engine)
        assert engine.kv_bytes() == 0
    assert not failures, failures[:5]
    assert answer == references(name, first, 9)
    # The row's cache held the prompt and the answer but its newest token.
    assert hit_last.cached_tokens == len(first) + len(answer) - 1
    assert hit == references(name, follow_up, 10)
    assert miss_last.cached_tokens == 0
    assert miss == references(name, partial, 10)


async def test_an_abort_leaks_nothing(family_dirs, vocab_size):
    config = EngineConfig(target=str(family_dirs["qwen3_5-i4"]), max_num_seqs=4,
                          num_speculative_tokens=4, prefill_chunk_tokens=8)  # fmt: skip
    async with AsyncEngine(config) as engine:
        streams = [
            engine.add_request(p, SamplingParams(max_tokens=40, ignore_eos=True), f"x{i}")
            for i, p in enumerate(_prompts(vocab_size, 6))
        ]
        await asyncio.sleep(0.05)
        for i in (0, 3, 5):
            engine.abort(f"x{i}")
        for _, stream in streams:
            async with stream:
                [o async for o in stream]
        await wait_idle(engine)
        assert engine.kv_bytes() == 0 and not engine._runner.states
        assert all(c.batch_size == 0 for c in engine._runner.cache)


async def test_state_bytes_count_in_memory_and_admission(family_dirs):
    """Per row, each GatedDeltaNet layer holds a conv window [kernel - 1, 2 * key_dim +
    value_dim] and a state [value heads, dv, dk] (float32): computed here from the config."""
    config = factories.family_config("qwen3_5", 0)
    key_dim = config["linear_num_key_heads"] * config["linear_key_head_dim"]
    value_dim = config["linear_num_value_heads"] * config["linear_value_head_dim"]
    conv = (config["linear_conv_kernel_dim"] - 1) * (2 * key_dim + value_dim)
    state = config["linear_num_value_heads"] * config["linear_value_head_dim"] ** 2
    linear_layers = 2  # 4 layers, full attention every 2nd
    per_row = linear_layers * (conv + state) * 4
    attention_layers = 2
    per_token = attention_layers * 2 * config["num_key_value_heads"] * config["head_dim"] * 4
    engine_config = EngineConfig(target=str(family_dirs["qwen3_5-i2"]), max_num_seqs=4,
                                 num_speculative_tokens=0)  # fmt: skip
    async with AsyncEngine(engine_config) as engine:
        assert engine.scheduler.limits.bytes_per_row == per_row
        assert engine.scheduler.limits.bytes_per_token == per_token
        seen = []
        engine.step_hooks.append(lambda r: seen.append((r.batch_size, r.kv_bytes)))
        await run_all(engine, [(f"m{i}", [5, 6, 7, 8], 6, 0, 0) for i in range(3)])
    rows, kv_bytes = max(seen)
    assert rows == 3 and kv_bytes >= 3 * per_row


@pytest.mark.parametrize("keep", [[2, 4], [1, 1], [3, 2], [4, 4]])
def test_rollback_replay_equals_a_cache_that_never_saw_the_rejected_positions(family_dirs, keep):
    """Two rows verify 4 positions and keep `keep` of them (the replay runs over the longest
    kept span; not at all when both keep all 4): each state layer's state, and the next
    step's logits, equal mlx-lm's on the kept tokens alone."""
    model, _ = load_target_model(family_dirs["qwen3_5-i4"])
    target = TargetAdapter(model, [])
    prompts = [[5, 9, 11, 7, 5, 9], [8, 3, 3, 30, 2, 4]]
    verify = [[8, 20, 21, 22], [6, 1, 2, 3]]
    cache = target.new_cache(2)
    target(mx.array(prompts), cache)
    states = [c for c in cache if isinstance(c, RaggedStateCache)]
    for c in states:
        c.recording = True
    target(mx.array(verify), cache)
    for c in states:
        c.recording = False
        replay(c, keep)
    for c in cache:
        if not isinstance(c, RaggedStateCache):
            c.trim_rows([4 - k for k in keep])
    logits, _ = target(mx.array([[40], [41]]), cache)
    for row in range(2):
        reference = make_prompt_cache(model)
        model(mx.array([prompts[row] + verify[row][: keep[row]]]), cache=reference)
        expected = model(mx.array([[40 + row]]), cache=reference)
        assert mx.allclose(logits[row : row + 1], expected, atol=1e-5).item()
        for ours, theirs in zip(cache, reference):
            if isinstance(ours, RaggedStateCache):
                for a, b in zip(ours.cache, theirs.cache):
                    assert mx.allclose(a[row : row + 1], b, atol=1e-5).item()


@pytest.mark.parametrize("name", list(ATTENTION))
async def test_moe_sliding_and_gpt_oss_equal_mlx_lm_drafting_off_lookup_and_dflash(
    name, family_dirs, hybrid_drafter_dir, references, vocab_size
):
    """Prompts of 9-24 tokens against windows of 8; a random DFlash drafter (depth 3) on some
    rows, lookup or nothing on the others."""
    requests = _requests(vocab_size, lambda i: (0, 3, 4)[i % 3])
    sources = [None, ["dflash"], ["lookup"]]
    config = EngineConfig(target=str(family_dirs[name]), drafter=str(hybrid_drafter_dir),
                          max_num_seqs=8, num_speculative_tokens=4,
                          prefill_chunk_tokens=8)  # fmt: skip
    async with AsyncEngine(config) as engine:
        failures = check_invariants(engine)

        async def one(i, rid, prompt, n, depth, delay):
            await asyncio.sleep(delay)
            params = SamplingParams(max_tokens=n, ignore_eos=True, num_speculative_tokens=depth,
                                    draft_sources=sources[i % 3])  # fmt: skip
            tokens, last = [], None
            async for out in engine.generate(prompt, params, request_id=rid):
                tokens, last = tokens + out.token_ids, out
            return tokens, last

        results = await asyncio.gather(*[one(i, *r) for i, r in enumerate(requests)])
        await wait_idle(engine)
        assert engine.kv_bytes() == 0 and not engine._runner.states
    assert not failures, failures[:5]
    for (rid, prompt, n, _, _), (tokens, _) in zip(requests, results):
        assert tokens == references(name, prompt, n), (name, rid)
    assert sum(last.drafted_tokens for _, last in results) > 0


def _tiny(model_type: str, **fields):
    import importlib

    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    base = dict(model_type=model_type, vocab_size=64, hidden_size=32, intermediate_size=64,
                max_position_embeddings=256, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, num_hidden_layers=2, rms_norm_eps=1e-6,
                tie_word_embeddings=False)  # fmt: skip
    return module.Model(module.ModelArgs.from_dict({**base, **fields}))


@pytest.mark.parametrize("model_type", ["falcon_h1", "nemotron_h"])
def test_unsupported_families_fail_at_load_with_their_name(model_type):
    """Falcon-H1 keeps attention and Mamba in one layer (a `CacheList`); Nemotron-H has no
    `model.layers` and fewer caches than blocks. Both are refused when the target is tapped
    (what `load_pair` does), never mid-step."""
    if model_type == "falcon_h1":
        model = _tiny("falcon_h1", mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8,
                      mamba_d_state=8, mamba_n_groups=1, mamba_d_conv=4)  # fmt: skip
    else:
        model = _tiny("nemotron_h", attention_bias=False, mamba_num_heads=4, mamba_head_dim=8,
                      mamba_proj_bias=False, ssm_state_size=8, conv_kernel=4, n_groups=1,
                      mlp_bias=False, layer_norm_epsilon=1e-5, use_bias=False,
                      use_conv_bias=True, hybrid_override_pattern=["M", "*"])  # fmt: skip
    with pytest.raises(UnsupportedTargetError, match=model_type):
        TargetAdapter(model, [])


def test_the_single_request_loop_rolls_hybrid_states_back(
    family_dirs, hybrid_drafter_dir, references, vocab_size
):
    """`flashbatch generate`'s loop (`engine.step.speculative.generate`) on a hybrid target with a
    random drafter at depth 7: mlx-lm's caches cannot trim a state, so it takes the engine's."""
    from engine.models.loading import load_pair
    from engine.step.speculative import generate

    pair = load_pair(family_dirs["qwen3_5-i2"], hybrid_drafter_dir)
    for prompt in _prompts(vocab_size, 3):
        params = SamplingParams(max_tokens=12, ignore_eos=True, num_speculative_tokens=7)
        result = generate(pair.target, prompt, params, drafter=pair.drafter, prefill_chunk=8)
        assert result.token_ids == references("qwen3_5-i2", prompt, 12)
        assert result.drafted > 0


@pytest.mark.parametrize("name", ["qwen3_5-i2", "lfm2"])
async def test_lookaheads_used_and_discarded_and_whole_prompts_prefilled_together(
    name, family_dirs, references, vocab_size
):
    """Plain, plain, drafting steps in turn with a lookahead after every plain step: one is
    used, the next discarded (a state cannot be trimmed: the state before it comes back),
    also while staggered rows join. Whole prompts arriving together are prefilled in one
    right-padded forward (mlx-lm's per-row `lengths` keep the padding out of the states)."""
    together = [
        (f"t{i}", p[: 3 + 2 * i], 12, None, 0) for i, p in enumerate(_prompts(vocab_size, 6))
    ]
    staggered = [(f"s{i}", p, 14, None, 0.02 * i) for i, p in enumerate(_prompts(vocab_size, 6))]
    expected = [p + references(name, p, n) for _, p, n, _, _ in together + staggered]
    config = EngineConfig(target=str(family_dirs[name]), max_num_seqs=8)
    engine = ScriptedEngine(config, expected, vocab_size, [2, 0, 3],
                            depth_policy=PlainPlainDraftPolicy(True))  # fmt: skip
    counts = {"_discard": 0, "_prefill_together": 0}
    async with engine:
        runner = engine._runner
        for method in counts:
            original = getattr(runner, method)

            def counted(*args, _original=original, _method=method):
                counts[_method] += 1
                return _original(*args)

            setattr(runner, method, counted)
        failures = check_invariants(engine)
        results = await run_all(engine, together) + await run_all(engine, staggered)
        await wait_idle(engine)
        assert engine.kv_bytes() == 0
    assert not failures, failures[:5]
    for (rid, prompt, n, _, _), (tokens, _) in zip(together + staggered, results):
        assert tokens == references(name, prompt, n), (name, rid)
    assert counts["_discard"] > 3 and counts["_prefill_together"] > 0, counts


@pytest.mark.parametrize("drafter", [False, True])
async def test_prefix_shared_in_flight_and_left_by_an_abort_equals_cold_start(
    drafter, family_dirs, hybrid_drafter_dir, references, vocab_size
):
    """In-flight sharing under the whole-prefix rule: a request whose prompt extends one being
    prefilled waits for it and reuses all of it; one sharing only part of it is not held and
    prefills cold; a request aborted mid-prefill leaves the state at the positions it had
    computed, which the request it held reuses whole. All equal plain greedy decoding."""
    name = "qwen3_5-i2"
    unit_a, unit_b = _prompts(vocab_size, 2)
    base, other = (unit_a * 9)[:80], (unit_b * 9)[:80]
    extends, partial, after_abort = base + [7, 8, 9], base[:-2] + [11, 12], other + [5, 6]
    config = EngineConfig(target=str(family_dirs[name]), max_num_seqs=8,
                          drafter=str(hybrid_drafter_dir) if drafter else None,
                          num_speculative_tokens=4, prefill_chunk_tokens=16,
                          prefix_cache_bytes=8 << 20)  # fmt: skip
    async with AsyncEngine(config) as engine:
        failures = check_invariants(engine)
        aborted_at = []

        def abort_mid_prefill(result) -> None:
            request = engine.scheduler.requests.get("d")
            if request is not None and not aborted_at and request.prefilled >= 32:
                aborted_at.append(request.prefilled)
                engine.abort("d")

        engine.step_hooks.append(abort_mid_prefill)
        requests = [("a", base, 6, 4, 0), ("b", extends, 6, 4, 0), ("c", partial, 6, 4, 0),
                    ("d", other, 30, 4, 0), ("e", after_abort, 6, 4, 0)]  # fmt: skip
        results = dict(zip("abcde", await run_all(engine, requests)))
        await wait_idle(engine)
        assert engine.kv_bytes() == 0
        assert engine.scheduler.holds == 2  # b (for a) and e (for d)
    assert not failures, failures[:5]
    assert results["b"][1].cached_tokens == len(base)
    assert results["c"][1].cached_tokens == 0
    assert results["d"][1].finish_reason == "abort"
    assert aborted_at and results["e"][1].cached_tokens == aborted_at[0] < len(other)
    for rid, prompt in (("a", base), ("b", extends), ("c", partial), ("e", after_abort)):
        assert results[rid][0] == references(name, prompt, 6), rid
