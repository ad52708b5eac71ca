"""The engine core: continuous batching with per-request draft sessions, on real MLX models.

Every feature is checked against plain mlx-lm decoding of the same prompt; invariants are
checked after every step through the engine's step hooks."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import mlx.core as mx
import pytest
from factories import ScriptedDrafter
from mlx_lm.generate import generate_step

from engine import (
    AsyncEngine,
    EngineClosed,
    EngineConfig,
    EngineOverloaded,
    InvalidRequest,
    SamplingParams,
    TargetAdapter,
)
from engine.models.loading import load_target_model
from engine.step.runner import ModelRunner
from scheduler.depth import FixedDepthPolicy


def plain_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    steps = generate_step(
        mx.array(prompt_ids), model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1)
    )
    return [int(token) for token, _ in steps]


class ScriptedEngine(AsyncEngine):
    """The engine with a scripted drafter (knows each request's continuation), so partial,
    full and zero acceptance happen in batched steps."""

    def __init__(self, config: EngineConfig, references, vocab_size, script, **kw) -> None:
        super().__init__(config, **kw)
        self._scripted = (references, vocab_size, script)

    def _load(self):
        model, tokenizer = load_target_model(self.config.target)
        drafter = ScriptedDrafter(*self._scripted, strict=False)
        packed = self.config.packed_verify
        runner = ModelRunner(TargetAdapter(model, [1]), drafter, packed_verify=packed)
        return runner, tokenizer


def check_invariants(engine: AsyncEngine):
    """After every step: target cache = committed - 1; drafter context + pending = target."""
    failures: list[str] = []

    def hook(result) -> None:
        lengths = engine._runner.cache_lengths()
        draft_rows = engine._runner.draft_rows()
        for request in engine.scheduler.running:
            committed = len(request.prompt_ids) + request.generated
            length = lengths[request.request_id]
            if length != committed - 1:
                failures.append(
                    f"{request.request_id}: cache {length} != committed-1 {committed - 1}"
                )
            if request.request_id in draft_rows:
                context, pending = draft_rows[request.request_id]
                if context + pending != length:
                    failures.append(f"{request.request_id}: draft {context}+{pending} != {length}")

    engine.step_hooks.append(hook)
    return failures


async def wait_idle(engine: AsyncEngine) -> None:
    for _ in range(500):
        if engine.idle:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("engine did not become idle")


def random_requests(n: int, vocab: int, seed: int):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))]
        max_tokens = rng.randint(1, 28)
        depth = rng.choice([None, 0, 1, 3, 5])
        delay = rng.uniform(0, 0.3)
        out.append((f"r{i}", prompt, max_tokens, depth, delay))
    return out


async def run_all(engine: AsyncEngine, requests, **params):
    async def one(request_id, prompt, max_tokens, depth, delay):
        await asyncio.sleep(delay)
        sp = SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, num_speculative_tokens=depth, **params
        )
        tokens, last = [], None
        async for out in engine.generate(prompt, sp, request_id=request_id):
            tokens += out.token_ids
            last = out
        return tokens, last

    return await asyncio.gather(*[one(*r) for r in requests])


@pytest.mark.parametrize("target_name", ["qwen3", "llama"])
async def test_batch_invariance_with_dflash(
    target_name, qwen3_target_dir, llama_target_dir, drafter_dir, vocab_size
):
    target_dir = qwen3_target_dir if target_name == "qwen3" else llama_target_dir
    requests = random_requests(24, vocab_size, seed=1)
    config = EngineConfig(
        target=str(target_dir), drafter=str(drafter_dir), max_num_seqs=8, prefill_chunk_tokens=16
    )
    async with AsyncEngine(config) as engine:
        failures = check_invariants(engine)
        results = await run_all(engine, requests)
        await wait_idle(engine)
        assert engine.kv_bytes() == 0
    assert not failures, failures[:5]
    model, _ = load_target_model(target_dir)
    for (request_id, prompt, max_tokens, depth, _), (tokens, last) in zip(requests, results):
        assert tokens == plain_greedy(model, prompt, max_tokens), request_id
        assert last.finish_reason == "length" and last.completion_tokens == max_tokens
        if depth == 0 or max_tokens == 1:
            assert last.drafted_tokens == 0


async def test_batch_invariance_with_accepted_drafts(qwen3_target_dir, vocab_size):
    """Rows accept different numbers of drafts in the same step; output stays exact."""
    requests = random_requests(24, vocab_size, seed=2)
    model, _ = load_target_model(qwen3_target_dir)
    references = [p + plain_greedy(model, p, m) for _, p, m, _, _ in requests]
    # A fixed depth (each request still capped by its own num_speculative_tokens) keeps the
    # accepted count independent of measured step times.
    config = EngineConfig(
        target=str(qwen3_target_dir), max_num_seqs=10, prefill_chunk_tokens=24,
        num_speculative_tokens=15,
    )  # fmt: skip
    engine = ScriptedEngine(config, references, vocab_size, [7, 2, 0, 5, 1])
    async with engine:
        failures = check_invariants(engine)
        results = await run_all(engine, requests)
        await wait_idle(engine)
        assert engine.kv_bytes() == 0
    assert not failures, failures[:5]
    accepted = 0
    for reference, (_, prompt, _, _, _), (tokens, last) in zip(references, requests, results):
        assert tokens == reference[len(prompt) :]
        accepted += last.accepted_tokens
    assert accepted > 100, accepted


async def test_drafting_off_engine_wide_loads_no_draft_source(qwen3_target_dir, drafter_dir):
    """`num_speculative_tokens=0` for the engine: no request can draft, so no drafter and no
    lookup index are loaded (plain steps would otherwise keep their sessions up to date)."""
    config = EngineConfig(
        target=str(qwen3_target_dir), drafter=str(drafter_dir), num_speculative_tokens=0
    )
    async with AsyncEngine(config) as engine:
        assert engine.draft_sources == ()
        assert engine._runner.drafter is None and engine._runner.lookup is None
        results = await run_all(engine, [(f"p{i}", [5, 6, 7 + i], 12, None, 0) for i in range(4)])
    model, _ = load_target_model(qwen3_target_dir)
    for i, (tokens, last) in enumerate(results):
        assert tokens == plain_greedy(model, [5, 6, 7 + i], 12)
        assert last.drafted_tokens == 0


async def test_a_request_that_may_not_draft_opens_no_draft_session(qwen3_target_dir, drafter_dir):
    """`num_speculative_tokens=0` on one request of a drafting engine: the runner opens no
    DFlash session and no lookup index for it (the one rule of `scheduler.sources.may_draft`;
    the session would only cost catch-up writes), while the request beside it drafts, and
    both equal plain greedy decoding."""
    config = EngineConfig(target=str(qwen3_target_dir), drafter=str(drafter_dir))
    async with AsyncEngine(config, depth_policy=FixedDepthPolicy(3)) as engine:
        runner = engine._runner
        opened = {}
        engine.step_hooks.append(
            lambda r: opened.update(
                {
                    rid: (s.session is not None, s.lookup is not None)
                    for rid, s in runner.states.items()
                }  # fmt: skip
            )
        )
        prompts = {"off": [5, 6, 7, 5, 6, 7], "on": [5, 6, 8, 5, 6, 8]}
        results = await run_all(
            engine, [("off", prompts["off"], 12, 0, 0), ("on", prompts["on"], 12, None, 0)]
        )
    assert opened["off"] == (False, False) and opened["on"] == (True, True)
    model, _ = load_target_model(qwen3_target_dir)
    for name, (tokens, _) in zip(prompts, results):
        assert tokens == plain_greedy(model, prompts[name], 12)
    assert results[0][1].drafted_tokens == 0 and results[1][1].drafted_tokens > 0


async def test_depth_zero_runs_the_plain_path_without_drafter_forwards(
    qwen3_target_dir, drafter_dir
):
    config = EngineConfig(target=str(qwen3_target_dir), drafter=str(drafter_dir))
    async with AsyncEngine(config, depth_policy=FixedDepthPolicy(0)) as engine:
        drafter = engine._runner.drafter
        calls = []
        original = drafter.propose
        drafter.propose = lambda *a, **k: calls.append(1) or original(*a, **k)
        drafted_rows = []
        engine.step_hooks.append(lambda r: drafted_rows.append(r.drafted_rows))
        results = await run_all(engine, [(f"p{i}", [5, 6, 7 + i], 12, None, 0) for i in range(4)])
    assert calls == [] and set(drafted_rows) == {0}
    assert all(last.drafted_tokens == 0 for _, last in results)


class PlainPlainDraftPolicy:
    """Depths 0, 0, 3, 0, 0, 3, ... for everyone, always predicting a plain next step: the
    runner launches a lookahead after every plain step, uses it once and discards it once."""

    def __init__(self, lookahead: bool) -> None:
        self.steps = 0
        self.lookahead = lookahead

    def choose(self, requests, max_depth: int) -> dict[str, int]:
        self.steps += 1
        depth = 3 if self.steps % 3 == 0 else 0
        return {r.request_id: depth for r in requests}

    def observe(self, result) -> None:
        pass

    def expects_plain_next(self) -> bool:
        return self.lookahead


async def test_lookahead_used_and_discarded_keeps_outputs_exact(qwen3_target_dir, vocab_size):
    """A looked-ahead plain step that is used or rolled back (cache lengths, sampler draws)
    changes nothing: greedy output equals mlx-lm (also with staggered arrivals, so rows join
    while a lookahead is in use), seeded sampling equals the same run without lookahead, and
    the invariants hold after every step. Most lookaheads are built early, on the step's
    still lazy tokens (mlx-lm's pipelining), the others after a join."""
    requests = [(f"q{i}", [5 + i, 17, 99 - i], 10 + i, None, 0) for i in range(6)]
    staggered = [(f"s{i}", [9 + i, 3, 50 + i], 14, None, 0.02 * i) for i in range(6)]
    model, _ = load_target_model(qwen3_target_dir)
    references = [p + plain_greedy(model, p, m) for _, p, m, _, _ in requests + staggered]
    config = EngineConfig(target=str(qwen3_target_dir), max_num_seqs=8)

    async def run(lookahead: bool, strict: bool, batches) -> tuple[list, int, int]:
        policy = PlainPlainDraftPolicy(lookahead)
        engine = ScriptedEngine(config, references, vocab_size, [2, 0, 3], depth_policy=policy)
        async with engine:
            runner = engine._runner
            runner.drafter.strict = strict
            used, discarded, reported = [], [], []
            original_discard, original_execute = runner._discard, runner.execute
            runner._discard = lambda la: discarded.append(1) or original_discard(la)
            original_early = runner._launch_early

            def launch_early(plan, decode):
                lookahead = original_early(plan, decode)
                early.append(lookahead is not None)
                return lookahead

            runner._launch_early = launch_early

            def execute(plan):
                pending, before = runner._lookahead is not None, len(discarded)
                result = original_execute(plan)
                if pending and len(discarded) == before and result.batch_size:
                    used.append(1)
                # The step says what its cadence paid for nothing, and whether one follows.
                reported.append((len(discarded) > before) == (result.discarded_seconds > 0))
                reported.append(result.looked_ahead == (runner._lookahead is not None))
                return result

            runner.execute = execute
            failures = check_invariants(engine)
            outputs = []
            for batch, params in batches:
                outputs.append(await run_all(engine, batch, **params))
            await wait_idle(engine)
            assert engine.kv_bytes() == 0
        assert not failures, failures[:5]
        assert all(reported), reported
        return outputs, len(used), len(discarded)

    def assert_greedy_exact(batch, results) -> None:
        for (request_id, prompt, max_tokens, _, _), (tokens, _) in zip(batch, results):
            assert tokens == plain_greedy(model, prompt, max_tokens), request_id

    # Greedy, the scripted drafter strict about the committed order; arrivals at once and
    # staggered.
    early: list[bool] = []
    (at_once, spread), used, discarded = await run(True, True, [(requests, {}), (staggered, {})])
    assert_greedy_exact(requests, at_once)
    assert_greedy_exact(staggered, spread)
    assert used > 5 and discarded > 5, (used, discarded)
    assert sum(early) > 5, early
    # Seeded sampling: identical with and without lookahead.
    sampled = {}
    for lookahead in (True, False):
        (results,), used, discarded = await run(
            lookahead, False, [(requests, {"temperature": 1.0, "seed": 7})]
        )
        sampled[lookahead] = [tokens for tokens, _ in results]
        if lookahead:
            assert used > 3 and discarded > 3, (used, discarded)
        else:
            assert (used, discarded) == (0, 0)
    assert sampled[True] == sampled[False]


async def test_the_loop_handles_a_step_while_its_lookahead_computes(qwen3_target_dir):
    """A step's result reaches the loop before the MLX thread evaluates the step looked
    ahead after it: each lookahead's evaluation here waits until the loop has handled the
    step just executed (its step hook ran). Were the result held back until the lookahead
    was computed, that wait would time out. Output stays plain greedy decoding."""
    import threading

    model, _ = load_target_model(qwen3_target_dir)
    prompt = [5, 17, 99, 3]
    config = EngineConfig(target=str(qwen3_target_dir), num_speculative_tokens=0)
    async with AsyncEngine(config) as engine:
        runner, counts, waits = engine._runner, {"executed": 0, "handled": 0}, []
        changed = threading.Condition()
        original_execute, original_advance = runner.execute, runner.advance

        def execute(plan):  # on the MLX thread
            result = original_execute(plan)
            counts["executed"] += 1
            return result

        def advance() -> None:  # on the MLX thread, after `execute`
            if runner.lookahead_pending:
                with changed:
                    caught_up = lambda: counts["handled"] >= counts["executed"]  # noqa: E731
                    waits.append(changed.wait_for(caught_up, timeout=5))
            original_advance()

        def handled(result) -> None:  # on the loop
            with changed:
                counts["handled"] += 1
                changed.notify_all()

        runner.execute, runner.advance = execute, advance
        engine.step_hooks.append(handled)
        ((tokens, _),) = await run_all(engine, [("a", prompt, 16, None, 0)])
    assert tokens == plain_greedy(model, prompt, 16)
    assert len(waits) >= 8 and all(waits), waits


async def test_whole_prompts_prefilled_together_match_prefilling_alone(
    qwen3_target_dir, drafter_dir, vocab_size
):
    """Prompts of different lengths admitted in the same step are prefilled in one padded
    forward; greedy output equals mlx-lm and seeded sampling equals each request served
    alone."""
    lengths = [1, 4, 9, 17, 30]
    rng = random.Random(5)
    requests = [
        (f"w{n}", [rng.randrange(3, vocab_size) for _ in range(n)], 8, None, 0) for n in lengths
    ]
    # Drafting off: seeded speculative sampling is exact in distribution, not sample by sample.
    config = EngineConfig(
        target=str(qwen3_target_dir), drafter=str(drafter_dir), num_speculative_tokens=0
    )
    async with AsyncEngine(config) as engine:
        runner = engine._runner
        groups = []
        original = runner._prefill_together
        runner._prefill_together = lambda chunks, out: (
            groups.append(len(chunks)) or original(chunks, out)
        )
        failures = check_invariants(engine)
        greedy = await run_all(engine, requests)
        together = await run_all(engine, requests, temperature=1.0, seed=11)
        alone = [(await run_all(engine, [r], temperature=1.0, seed=11))[0] for r in requests]
        await wait_idle(engine)
    assert not failures, failures[:5]
    assert max(groups) == len(lengths)
    model, _ = load_target_model(qwen3_target_dir)
    for (request_id, prompt, max_tokens, _, _), (tokens, _) in zip(requests, greedy):
        assert tokens == plain_greedy(model, prompt, max_tokens), request_id
    assert [t for t, _ in together] == [t for t, _ in alone]


# chi-square critical values at alpha = 0.001 by degrees of freedom
_CHI2_CRITICAL = [10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88, 29.59, 31.26]


def _chi_square(a: list[int], b: list[int]) -> tuple[float, int]:
    stat = 0.0
    for c in set(a) | set(b):
        na, nb = a.count(c), b.count(c)
        e = (na + nb) / 2
        stat += (na - e) ** 2 / e + (nb - e) ** 2 / e
    return stat, len(set(a) | set(b)) - 1


async def test_batched_speculative_sampling_matches_plain_sampling(qwen3_target_dir, vocab_size):
    prompt = [5, 17, 99]
    model, _ = load_target_model(qwen3_target_dir)
    greedy = prompt + plain_greedy(model, prompt, 8)
    runs = 600
    params = dict(max_tokens=4, temperature=1.0, top_k=2, ignore_eos=True)
    config = EngineConfig(
        target=str(qwen3_target_dir), max_num_seqs=32, max_waiting_requests=runs,
        num_speculative_tokens=7,
    )  # fmt: skip

    async def sample_all(engine, seed_base, depth):
        async def one(i):
            sp = SamplingParams(seed=seed_base + i, num_speculative_tokens=depth, **params)
            tokens, last = [], None
            async for out in engine.generate(prompt, sp):
                tokens += out.token_ids
                last = out
            return tokens, last.accepted_tokens

        return await asyncio.gather(*[one(i) for i in range(runs)])

    async with ScriptedEngine(config, [greedy], vocab_size, [7]) as engine:
        plain = await sample_all(engine, 0, 0)
        speculative = await sample_all(engine, 100_000, None)
    assert sum(a for _, a in speculative) > runs // 4
    for position in (1, 2, 3):
        stat, dof = _chi_square(
            [t[position] for t, _ in plain], [t[position] for t, _ in speculative]
        )
        assert stat < _CHI2_CRITICAL[min(dof, 11) - 1], (position, stat, dof)


async def test_aborts_and_cancellation_leak_nothing(qwen3_target_dir, drafter_dir):
    config = EngineConfig(
        target=str(qwen3_target_dir),
        drafter=str(drafter_dir),
        max_num_seqs=4,
        prefill_chunk_tokens=8,
    )
    async with AsyncEngine(config) as engine:
        # before admission: queue more than max_num_seqs, abort a waiting one
        long_prompt = list(range(3, 60))
        ids = [
            engine.add_request(long_prompt, SamplingParams(max_tokens=30), f"a{i}")
            for i in range(6)
        ]
        engine.abort("a5")
        await asyncio.sleep(0)
        # mid-prefill (8 tokens per step for a 57-token prompt) and mid-decode
        for _ in range(3):
            await asyncio.sleep(0.005)
        engine.abort("a0")
        engine.abort("a1")
        outputs = {}
        for request_id, stream in ids:
            async with stream:
                outputs[request_id] = [o async for o in stream]
        assert outputs["a5"][-1].finish_reason == "abort"
        assert outputs["a0"][-1].finish_reason == "abort"
        assert outputs["a2"][-1].finish_reason == "length"

        # consumer cancellation mid-stream
        async def consume():
            async for _ in engine.generate(
                [5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True)
            ):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_idle(engine)
        assert engine.kv_bytes() == 0 and not engine._runner.states

        # still serving
        results = await run_all(engine, [("after", [9, 10, 11], 5, None, 0)])
        assert len(results[0][0]) == 5


async def test_stress_with_random_aborts(qwen3_target_dir, drafter_dir, vocab_size):
    rng = random.Random(7)
    config = EngineConfig(
        target=str(qwen3_target_dir), drafter=str(drafter_dir), max_num_seqs=16,
        prefill_chunk_tokens=32, max_waiting_requests=400,
    )  # fmt: skip
    async with AsyncEngine(config) as engine:
        failures = check_invariants(engine)

        async def one(i):
            prompt = [rng.randrange(3, vocab_size) for _ in range(rng.randint(1, 30))]
            params = SamplingParams(max_tokens=rng.randint(1, 16), ignore_eos=True,
                                    temperature=rng.choice([0.0, 1.0]), seed=i)  # fmt: skip
            abort_after = rng.choice([None, None, 0, 1, 3])
            count = 0
            agen = engine.generate(prompt, params)
            try:
                async for out in agen:
                    count += 1
                    if abort_after is not None and count > abort_after:
                        break
                    if out.finished:
                        return out.finish_reason
            finally:
                await agen.aclose()
            return "aborted"

        reasons = await asyncio.gather(*[one(i) for i in range(300)])
        await wait_idle(engine)
        assert engine.kv_bytes() == 0 and not engine._runner.states and not engine._runner.rows
        assert not engine.scheduler.requests
    assert not failures, failures[:5]
    assert reasons.count("length") > 100 and reasons.count("aborted") > 30


async def test_overload_and_invalid_requests_fail_fast(qwen3_target_dir):
    config = EngineConfig(
        target=str(qwen3_target_dir), max_num_seqs=1, max_waiting_requests=2, max_model_len=64
    )
    async with AsyncEngine(config) as engine:
        steps_before = engine.step_count
        with pytest.raises(InvalidRequest, match="maximum context length is 64"):
            engine.add_request(list(range(3, 63)), SamplingParams(max_tokens=10))
        with pytest.raises(InvalidRequest, match="temperature"):
            engine.add_request([5], SamplingParams(temperature=-1))
        with pytest.raises(InvalidRequest, match="token ids"):
            engine.add_request([10**6], SamplingParams())
        with pytest.raises(InvalidRequest, match="empty"):
            engine.add_request([], SamplingParams())
        assert engine.step_count == steps_before  # nothing reached the MLX thread
        streams = [  # fills the queue (2 waiting)
            engine.add_request([5, 6], SamplingParams(max_tokens=20), f"q{i}") for i in range(2)
        ]
        with pytest.raises(EngineOverloaded) as overloaded:
            engine.add_request([5, 6], SamplingParams(max_tokens=20))
        assert overloaded.value.retry_after >= 1
        for _, stream in streams:
            async with stream:
                assert [o async for o in stream][-1].finish_reason == "length"


async def test_shutdown_drains_then_closes(qwen3_target_dir):
    engine = AsyncEngine(EngineConfig(target=str(qwen3_target_dir)))
    await engine.start()
    _, stream = engine.add_request([5, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True))
    await engine.shutdown(drain_timeout=30)
    async with stream:
        outputs = [o async for o in stream]
    assert outputs[-1].finish_reason == "length" and outputs[-1].completion_tokens == 20
    with pytest.raises(EngineClosed):
        engine.add_request([5], SamplingParams())


async def test_stop_strings_stream_without_leaking_the_stop(qwen3_target_dir):
    async with AsyncEngine(EngineConfig(target=str(qwen3_target_dir))) as engine:
        full = ""
        async for out in engine.generate(
            "def f(x):", SamplingParams(max_tokens=30, ignore_eos=True)
        ):
            full += out.text
        stop = full[6:9]
        streamed = ""
        async for out in engine.generate(
            "def f(x):", SamplingParams(max_tokens=30, stop=[stop], ignore_eos=True)
        ):
            streamed += out.text
        assert out.finish_reason == "stop"
        assert streamed == full[: full.index(stop)]


def test_engine_config_defaults_are_sane(tmp_path: Path):
    config = EngineConfig(target=str(tmp_path))
    config.validate()
    with pytest.raises(ValueError):
        EngineConfig(target="x", max_num_seqs=0).validate()


async def test_adaptive_depth_parks_a_useless_drafter_and_stays_exact(
    qwen3_target_dir, drafter_dir
):
    """A random-weight drafter is never accepted: the controller falls to the plain path.

    DFlash is the only source here: on this random-weight pair's repetitive output lookup
    drafts are accepted, and a step widened by them may add DFlash rows on merit (their
    drafter forward priced cheap beside it), which said nothing about parking."""
    config = EngineConfig(target=str(qwen3_target_dir), drafter=str(drafter_dir), max_num_seqs=4,
                          draft_sources=["dflash"])  # fmt: skip
    requests = [(f"u{i}", [5 + i, 9, 11], 60, None, 0) for i in range(4)]
    async with AsyncEngine(config) as engine:
        drafted_rows = []
        engine.step_hooks.append(
            lambda r: drafted_rows.append(r.drafted_rows) if r.batch_size else None
        )
        results = await run_all(engine, requests)
        state = engine.depth_policy_state()
    model, _ = load_target_model(qwen3_target_dir)
    for (_, prompt, n, _, _), (tokens, _) in zip(requests, results):
        assert tokens == plain_greedy(model, prompt, n)
    late = drafted_rows[len(drafted_rows) // 2 :]
    assert sum(1 for d in late if d) <= len(late) // 5  # parked, with rare probes
    prior = state["prior"]["greedy"]
    if prior[0] != 0.6:  # whenever it drafted, the shared prior learned the rejections
        assert prior[0] < 0.6


async def test_adaptive_depth_drafts_when_drafts_are_accepted(qwen3_target_dir, vocab_size):
    requests = [(f"g{i}", [7 + i, 8, 9], 60, None, 0) for i in range(3)]
    model, _ = load_target_model(qwen3_target_dir)
    references = [p + plain_greedy(model, p, n) for _, p, n, _, _ in requests]
    config = EngineConfig(target=str(qwen3_target_dir), max_num_seqs=4)
    async with ScriptedEngine(config, references, vocab_size, [7]) as engine:
        results = await run_all(engine, requests)
    for reference, (_, prompt, _, _, _), (tokens, _) in zip(references, requests, results):
        assert tokens == reference[len(prompt) :]
    assert sum(last.accepted_tokens for _, last in results) > 30  # of 177 possible


async def test_each_step_after_the_first_carries_the_loops_cadence(qwen3_target_dir):
    """The loop stamps every step with the seconds since the previous step's result reached
    it (the cost the adaptive controller learns); a step after the loop sat idle has none."""
    config = EngineConfig(target=str(qwen3_target_dir), max_num_seqs=4)
    async with AsyncEngine(config) as engine:
        stamped: list[tuple[float, float, float]] = []
        engine.step_hooks.append(
            lambda r: stamped.append((time.perf_counter(), r.cadence_seconds, r.step_seconds))
        )
        await run_all(engine, [(f"c{i}", [5 + i, 9, 11], 12, None, 0) for i in range(3)])
        await asyncio.sleep(0.1)  # the loop idles
        resumed = time.perf_counter()
        await run_all(engine, [("late", [7, 9, 11], 6, None, 0)])
    after_idle = next(i for i, (at, _, _) in enumerate(stamped) if at > resumed)
    assert stamped[0][1] == 0.0 and stamped[after_idle][1] == 0.0
    later = [i for i in range(len(stamped)) if i not in (0, after_idle)]
    assert later and all(stamped[i][1] > 0 for i in later)
    # No cadence after the idle reaches back into it: each spans two results that both
    # arrived after `resumed` (exact, however long a host stall makes a step).
    for at, cadence, _ in stamped[after_idle + 1 :]:
        assert cadence <= at - resumed


async def test_a_fault_in_handling_a_step_fails_the_requests_in_flight_not_the_engine(
    qwen3_target_dir,
):
    """A bug in the loop's handling of a step's result (here the depth policy's observe)
    ends the requests in flight with an error instead of leaving their streams hanging, and
    the engine serves the next request."""

    class BrokenOnce(FixedDepthPolicy):
        calls = 0

        def observe(self, result) -> None:
            BrokenOnce.calls += 1
            if BrokenOnce.calls == 3:
                raise RuntimeError("a bug in the policy")

    config = EngineConfig(target=str(qwen3_target_dir), max_num_seqs=4)
    async with AsyncEngine(config, BrokenOnce(0)) as engine:
        failed = await asyncio.wait_for(
            run_all(engine, [(f"f{i}", [5 + i, 9, 11], 20, None, 0) for i in range(2)]), 60
        )
        assert all(last.finish_reason == "error" for _, last in failed)
        ((tokens, last),) = await asyncio.wait_for(
            run_all(engine, [("next", [7, 9, 11], 8, None, 0)]), 60
        )
        assert last.finish_reason == "length" and len(tokens) == 8
