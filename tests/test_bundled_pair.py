"""The bundled model pair: it loads, its speculative output is exactly the target's greedy
output on held-out prompts, the engine serves it by default, and its drafter is really trained
(drafts get accepted)."""

from __future__ import annotations

import asyncio

import httpx
import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from engine import AsyncEngine, EngineConfig, SamplingParams, generate, load_pair
from engine.bundled.pair import bundled_paths
from engine.bundled.workloads import WORKLOADS, load_workloads

TARGET, DRAFTER = bundled_paths()
pytestmark = pytest.mark.skipif(
    not (TARGET / "config.json").is_file() or not (DRAFTER / "config.json").is_file(),
    reason="the bundled pair is not built in this checkout (python -m engine.bundled.build)",
)


@pytest.fixture(scope="module")
def pair():
    return load_pair(TARGET, DRAFTER)


def plain_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    steps = generate_step(
        mx.array(prompt_ids), model, max_tokens=n, sampler=lambda x: mx.argmax(x, -1)
    )
    return [int(t) for t, _ in steps]


@pytest.mark.parametrize("workload", WORKLOADS)
def test_speculative_greedy_equals_plain_greedy_on_held_out_prompts(pair, workload):
    accepted = 0
    for text in load_workloads()[workload][:2]:
        ids = list(pair.tokenizer.encode(text))
        result = generate(pair.target, ids, SamplingParams(max_tokens=48, ignore_eos=True),
                          drafter=pair.drafter)  # fmt: skip
        assert result.token_ids == plain_greedy(pair.target.model, ids, 48), text[-80:]
        accepted += result.accepted
    assert accepted > 0  # a trained drafter: some drafts are accepted


def test_engine_serves_the_bundled_pair_by_default_and_stays_exact(pair):
    prompts = [list(pair.tokenizer.encode(t)) for t in load_workloads()["completion"][:6]]

    async def run():
        config = EngineConfig(target=str(TARGET), drafter=str(DRAFTER), max_num_seqs=6)
        async with AsyncEngine(config) as engine:

            async def one(ids):
                tokens = []
                params = SamplingParams(max_tokens=32, ignore_eos=True)
                async for out in engine.generate(ids, params):
                    tokens += out.token_ids
                return tokens

            return await asyncio.gather(*[one(ids) for ids in prompts])

    for ids, tokens in zip(prompts, asyncio.run(run())):
        assert tokens == plain_greedy(pair.target.model, ids, 32)


def test_flashbatch_serve_target_bundled_answers(tmp_path):
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "serve", "--target", "bundled", "--port", str(port),
         "--log-level", "error"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                if httpx.get(url + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        body = {"prompt": "def main():", "max_tokens": 16, "temperature": 0}
        response = httpx.post(url + "/v1/completions", timeout=60, json=body)
        assert response.status_code == 200
        body = response.json()
        assert body["choices"][0]["text"] and body["usage"]["completion_tokens"] >= 1
        assert body["model"] == "bundled"
    finally:
        process.kill()
        process.wait()


def test_truncated_block_drafts_what_the_full_block_drafts(pair, monkeypatch):
    """A depth-d proposal runs d+1 block rows; on the bundled pair it drafts the same tokens
    as the trained 16-row block (the dropped rows are MASKs that only carry a position)."""
    drafter = pair.drafter
    rows_seen = []
    model_call = type(drafter.model).__call__

    def spy(self, block_embeddings, *args, **kwargs):
        rows_seen.append(block_embeddings.shape[1])
        return model_call(self, block_embeddings, *args, **kwargs)

    monkeypatch.setattr(type(drafter.model), "__call__", spy)
    agree = total = 0
    for text in load_workloads()["completion"][:4]:
        ids = list(pair.tokenizer.encode(text))
        _, features = pair.target(mx.array(ids)[None], pair.target.make_cache())
        drafts = {}
        for truncate in (True, False):
            drafter.truncate_block = truncate
            session = drafter.open(ids)
            drafter.commit(session, features[0, :-1])
            try:
                drafts[truncate] = drafter.propose([session], [ids[-1]], [3]).tokens[0].tolist()
            finally:
                drafter.truncate_block = True
                drafter.close(session)
        agree += sum(a == b for a, b in zip(drafts[True], drafts[False]))
        total += 3
    assert rows_seen == [4, 16] * 4
    assert agree >= total - 1  # at most one argmax tie flips


def test_evaluate_pair_reports_block_and_short_depth_rates():
    from engine.bundled.pair import evaluate_pair

    workloads = {"prose": load_workloads()["prose"][:1]}
    result = evaluate_pair(TARGET, DRAFTER, workloads, prompts=1, max_tokens=12, log=lambda _: 0)
    prose = result["prose"]
    assert 1.0 <= prose["tau"] <= 12 and 1.0 <= prose["short_tau"] <= 4.0  # depth 3 + bonus
    assert prose["short_depth"] == 3
    for rate in ("spec_tok_s", "short_tok_s", "mlx_lm_tok_s"):
        assert prose[rate] > 0
    assert prose["speedup"] == pytest.approx(prose["spec_tok_s"] / prose["mlx_lm_tok_s"])
