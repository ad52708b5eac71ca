"""`flashbatch bench run` / `bench serve` on the tiny test models: outputs, numbers computed from
recorded timestamps, failing engines reported, the HTTP load client against real servers."""

from __future__ import annotations

import asyncio
import inspect
import json
import shutil
import statistics
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from bench.engines import BenchEngine
from bench.paired import paired_ratio
from bench.serve_load import (
    LoadConfig,
    ServerProcess,
    arrival_times,
    check_loopback,
    flashbatch_command,
    free_port,
    mlx_lm_model_dir,
    run_load,
    stored_dtypes,
    summarize_load,
)
from bench.stats import RequestRecord, RunResult, percentile
from bench.suite import QUICK, SuiteConfig, run_suite
from engine import cli

CLOCK_STEP = 0.5


def counting_clock(step: float = CLOCK_STEP, start: float = 1000.0):
    """A fake clock: every call advances by `step` seconds."""
    now = [start]

    def clock() -> float:
        now[0] += step
        return now[0]

    return clock


def _multiple(value: float, step: float = CLOCK_STEP) -> bool:
    return abs(value / step - round(value / step)) < 1e-6


class RaisingEngine(BenchEngine):
    name = "raiser"
    family = "other"
    description = "raises on purpose"

    async def run(self, prompts, concurrency, params, clock):
        if params.max_tokens > 4:  # the warm-up (4 tokens) passes; measured runs fail
            raise RuntimeError("boom")
        return RunResult(clock(), clock(), [])


def test_percentile_and_records():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 50):
        values = list(rng.random(n))
        for q in (0, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    record = RequestRecord(submitted=1.0)
    for when, tokens in ((1.5, 1), (2.0, 1), (3.0, 4), (3.0, 0)):  # an empty delta is ignored
        record.add_chunk(when, tokens)
    record.finished = 3.5
    assert record.tokens == 6 and record.ttft == 0.5 and record.e2e == 2.5
    assert record.itls() == [0.5, 0.25, 0.25, 0.25, 0.25]  # a 4-token chunk: the gap split
    assert record.tpot == pytest.approx((3.5 - 1.5) / 5)
    assert record.tokens_per_s == pytest.approx(6 / 2.5)


def _rows(results):
    return {(r["engine"], r["concurrency"]): r for r in results["rows"]}


def test_quick_suite_outputs_and_measured_numbers(tmp_path, qwen3_target_dir, drafter_dir):
    cfg = SuiteConfig(target=str(qwen3_target_dir), drafter=str(drafter_dir),
                      ar_draft=str(tmp_path / "no-ar-draft"), out_dir=str(tmp_path / "out"),
                      quick=True)  # fmt: skip
    for key, value in QUICK.items():
        setattr(cfg, key, value)
    cfg.max_tokens = 8
    results = asyncio.run(
        run_suite(cfg, extra_engines=[RaisingEngine()], clock=counting_clock(), progress=False)
    )
    out = tmp_path / "out"
    assert json.loads((out / "results.json").read_text()) == json.loads(json.dumps(results))
    plots = sorted(p.name for p in (out / "plots").glob("*.png"))
    assert plots == ["latency_completion_t0.png", "throughput_completion_t0.png"]
    for name in plots:
        assert (out / "plots" / name).read_bytes()[:4] == b"\x89PNG"
    markdown = (out / "results.md").read_text()
    assert "## completion, temperature 0" in markdown
    # The summary line of each concurrency: best baseline and every flashbatch engine's ratio.
    best = max((r for r in results["rows"] if r["family"] == "mlx-lm" and r["status"] == "ok"
                and r["concurrency"] == (1 if r["single_stream"] else 2)),
               key=lambda r: r["tok_s"])  # fmt: skip
    adaptive = _rows(results)[("flashbatch adaptive", 2)]
    assert adaptive["baseline"] == best["engine"]
    assert f"| completion | 0 | 2 | {best['engine']} | {best['tok_s']:.1f} |" in markdown
    assert (
        "| 2 | flashbatch adaptive |" in markdown
        and "plots/throughput_completion_t0.png" in markdown
    )
    # Adaptive against drafting off, paired round by round (bench/paired.py).
    off = _rows(results)[("flashbatch off", 2)]
    pair = paired_ratio([r["tok_s"] for r in adaptive["rounds"]],
                        [r["tok_s"] for r in off["rounds"]])  # fmt: skip
    assert pair.rounds == cfg.rounds and f"| completion | 0 | 2 | {pair.text()} |" in markdown

    rows = _rows(results)
    # Failing engines are rows with their error, at every concurrency they would have run at.
    spec = rows[("mlx-lm spec k=3", 1)]
    assert spec["status"] == "failed" and "train_ar_draft.py" in spec["error"]
    assert ("mlx-lm spec k=3", 2) not in rows  # single stream: concurrency 1 only
    for c in (1, 2):
        assert rows[("raiser", c)]["status"] == "failed"
        assert rows[("raiser", c)]["error"] == "RuntimeError: boom"
        assert rows[("raiser", c)]["tok_s"] is None and rows[("raiser", c)]["ratio"] is None
    assert "**FAILED**: RuntimeError: boom" in markdown and "train_ar_draft.py" in markdown
    statuses = {e["name"]: e["status"] for e in results["engines"]}
    assert statuses["mlx-lm spec k=3"] == "failed" and statuses["flashbatch adaptive"] == "ok"

    ok = {key: row for key, row in rows.items() if row["status"] == "ok"}
    assert set(ok) == {("mlx-lm", 1), ("mlx-lm batch", 1), ("mlx-lm batch", 2)} | {
        (f"flashbatch {p}", c) for p in ("off", "d=3", "adaptive") for c in (1, 2)
    }
    for (name, concurrency), row in ok.items():
        assert len(row["rounds"]) == cfg.rounds
        ttfts, rates = [], []
        for rnd in row["rounds"]:
            records = rnd["records"]
            assert len(records) == cfg.requests_at(concurrency)
            assert all(r["tokens"] == cfg.max_tokens for r in records)  # EOS ignored everywhere
            duration = rnd["ended"] - rnd["started"]
            # Times come from the harness's (here fake) clock, and rates from those times.
            assert _multiple(duration) and duration == pytest.approx(rnd["duration_s"])
            for r in records:
                assert all(_multiple(r[k]) for k in ("submitted", "first_token", "finished"))
                assert 0 < r["submitted"] < r["first_token"] <= r["finished"] <= duration
            assert rnd["output_tokens"] == sum(r["tokens"] for r in records)
            assert rnd["tok_s"] == pytest.approx(rnd["output_tokens"] / duration)
            per_request = [r["tokens"] / (r["finished"] - r["submitted"]) for r in records]
            assert rnd["req_tok_s_p50"] == pytest.approx(np.percentile(per_request, 50))
            ttfts += [(r["first_token"] - r["submitted"]) * 1e3 for r in records]
            rates.append(rnd["tok_s"])
        assert row["tok_s"] == pytest.approx(statistics.median(rates))
        for q in (50, 90, 99):
            assert row[f"ttft_ms_p{q}"] == pytest.approx(np.percentile(ttfts, q))
        records = [r for rnd in row["rounds"] for r in rnd["records"]]
        steps = sum(r["verify_steps"] for r in records)
        assert row["tau"] == pytest.approx(sum(r["committed"] for r in records) / steps)
        # The ratio is against the best mlx-lm engine here (single-stream ones count everywhere).
        baselines = [rows[("mlx-lm", 1)]["tok_s"], rows[("mlx-lm batch", concurrency)]["tok_s"]]
        assert row["baseline_tok_s"] == max(baselines)
        assert row["ratio"] == pytest.approx(row["tok_s"] / max(baselines))
        if name.startswith("flashbatch"):
            depths = {int(d): n for d, n in row["depth_counts"].items()}
            assert sum(depths.values()) == steps  # one chosen depth per request-step
            if name == "flashbatch off":
                assert set(depths) == {0} and row["tau"] == 1.0
            if name == "flashbatch d=3":
                assert max(depths) == 3
        assert row["peak_memory_bytes"] > 0


def test_cli_quick_with_trained_ar_draft(tmp_path, qwen3_target_dir, drafter_dir,
                                         tokenizer_dir, capsys):  # fmt: skip
    import importlib

    from bench.train_ar_draft import main as train_ar_draft

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for module in ("json", "inspect", "importlib"):
        shutil.copy(inspect.getsourcefile(importlib.import_module(module)), corpus / f"{module}.py")
    ar = tmp_path / "ar-draft"
    small = ["--hidden", "32", "--layers", "1", "--head-dim", "16", "--batch-size", "2",
             "--seq-len", "32", "--corpus-root", str(corpus), "--tokenizer", str(tokenizer_dir),
             "--out", str(ar), "--work-dir", str(tmp_path / "ar-work")]  # fmt: skip
    assert train_ar_draft([*small, "--steps", "2"]) == 0
    assert train_ar_draft([*small, "--steps", "3"]) == 0  # resumes from step 2
    assert "resuming target pretraining at step 2/3" in capsys.readouterr().out
    assert json.loads((ar / "ar_draft.json").read_text())["steps"] == 3

    out = tmp_path / "out"
    code = cli.main(["bench", "run", "--quick", "--target", str(qwen3_target_dir),
                     "--drafter", str(drafter_dir), "--ar-draft", str(ar),
                     "--engines", "mlx-lm,mlx-lm-spec,flashbatch", "--policies", "adaptive",
                     "--rounds", "1", "--max-tokens", "8", "--out", str(out),
                     "--no-progress"])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "| 1 | mlx-lm spec k=3 |" in printed and f"results: {out}/" in printed
    results = json.loads((out / "results.json").read_text())
    spec = _rows(results)[("mlx-lm spec k=3", 1)]
    assert spec["status"] == "ok", spec["error"]
    records = [r for rnd in spec["rounds"] for r in rnd["records"]]
    assert all(r["tokens"] == 8 and r["accepted"] <= r["drafted"] for r in records)
    assert spec["tau"] == pytest.approx(sum(r["tokens"] for r in records)
                                        / sum(r["verify_steps"] for r in records))  # fmt: skip
    assert set(int(d) for d in spec["depth_counts"]) <= {1, 2, 3}
    assert {r["engine"] for r in results["rows"]} == {
        "mlx-lm", "mlx-lm spec k=3", "flashbatch adaptive"
    }  # fmt: skip
    assert (out / "results.md").is_file() and len(list((out / "plots").glob("*.png"))) == 2


# ----------------------------------------------------------------------------- bench serve
@pytest.fixture(scope="module")
def fb_server(qwen3_target_dir, drafter_dir):
    port = free_port()
    server = ServerProcess("flashbatch", flashbatch_command(qwen3_target_dir, drafter_dir, port),
                           port, startup_timeout=120)  # fmt: skip
    server.start()
    yield server
    server.stop()


def test_loopback_only():
    for url in (
        "http://127.0.0.1:8000",
        "http://localhost:1/",
        "http://127.3.2.1:9",
        "http://[::1]:8",
    ):
        assert check_loopback(url) == url.rstrip("/")
    for url in ("http://192.0.2.1:8000", "http://example.com", "ftp://127.0.0.1", "10.0.0.1"):
        with pytest.raises(ValueError):
            check_loopback(url)
    code = cli.main(["bench", "serve", "--url", "http://192.0.2.1:8000", "--num-requests", "1"])
    assert code == 2  # refused before any traffic


def test_serve_load_percentiles_match_records(fb_server):
    cfg = LoadConfig(url=fb_server.url, num_requests=6, concurrency=2, max_tokens=8)
    result = asyncio.run(run_load(cfg, ["def f(x):", "import os\n", "class A:"]))
    summary = summarize_load(result)
    assert summary["completed"] == 6 and summary["failed"] == 0
    assert summary["total_output_tokens"] == 6 * 8  # ignore_eos, counted from usage
    records = result.records
    for r in records:
        assert r.tokens_from == "usage" and r.output_tokens == 8
        assert r.submitted <= r.chunk_times[0] <= r.finished
        assert r.chunk_times == sorted(r.chunk_times)
        assert r.speculation is not None  # flashbatch's drafted/accepted/verify steps
    for t in [r.submitted for r in records]:  # closed loop: never more than 2 in flight
        assert sum(r.submitted <= t < r.finished for r in records) <= 2
    duration = result.ended - result.started
    assert summary["duration_s"] == duration
    assert summary["output_throughput"] == pytest.approx(48 / duration)
    assert summary["request_throughput"] == pytest.approx(6 / duration)
    series = {
        "ttft": [(r.chunk_times[0] - r.submitted) * 1e3 for r in records],
        "tpot": [(r.finished - r.chunk_times[0]) / 7 * 1e3 for r in records],
        "itl": [(b - a) * 1e3 for r in records for a, b in zip(r.chunk_times, r.chunk_times[1:])],
        "e2el": [(r.finished - r.submitted) * 1e3 for r in records],
    }
    for name, values in series.items():
        assert summary[f"mean_{name}_ms"] == pytest.approx(np.mean(values))
        assert summary[f"median_{name}_ms"] == pytest.approx(np.percentile(values, 50))
        assert summary[f"p90_{name}_ms"] == pytest.approx(np.percentile(values, 90))
        assert summary[f"p99_{name}_ms"] == pytest.approx(np.percentile(values, 99))


def test_serve_load_poisson_and_cli(fb_server, tmp_path, capsys):
    cfg = LoadConfig(url=fb_server.url, num_requests=4, concurrency=None, request_rate=40.0,
                     max_tokens=4, seed=3)  # fmt: skip
    result = asyncio.run(run_load(cfg, ["x = 1\n"]))
    offsets = arrival_times(4, 40.0, 3)
    assert offsets[0] == 0 and offsets == sorted(offsets) and len(set(offsets)) == 4
    for record, offset in zip(result.records, offsets):
        assert record.scheduled == pytest.approx(result.started + offset)
        assert record.submitted >= record.scheduled - 1e-3 and record.ok

    out = tmp_path / "serve"
    code = cli.main(["bench", "serve", "--url", fb_server.url, "--num-requests", "3",
                     "--concurrency", "3", "--max-tokens", "4", "--out", str(out)])  # fmt: skip
    assert code == 0
    assert "Successful requests:                               3" in capsys.readouterr().out
    saved = json.loads((out / "serve.json").read_text())
    assert saved["summary"]["completed"] == 3 and len(saved["requests"]) == 3


def test_mlx_lm_gets_a_float32_copy(tmp_path, qwen3_target_dir):
    import mlx.core as mx
    from mlx_lm.utils import save_model

    from engine.models.loading import load_target_model

    assert mlx_lm_model_dir(str(qwen3_target_dir), tmp_path / "unused")[0] == str(qwen3_target_dir)
    bf16 = tmp_path / "bf16"
    model, _ = load_target_model(qwen3_target_dir)
    model.set_dtype(mx.bfloat16)
    save_model(bf16, model)
    for item in qwen3_target_dir.iterdir():
        if not item.name.startswith("model"):
            shutil.copy(item, bf16 / item.name)
    assert stored_dtypes(bf16) == {"BF16"}
    copy, note = mlx_lm_model_dir(str(bf16), tmp_path / "f32")
    assert copy == str(tmp_path / "f32") and "float32" in note
    assert stored_dtypes(Path(copy)) == {"F32"} and (Path(copy) / "tokenizer.json").is_file()


def test_serve_compare_flashbatch_and_mlx_lm(tmp_path, qwen3_target_dir, drafter_dir, capsys):
    out = tmp_path / "compare"
    code = cli.main(["bench", "serve", "--compare", "--target", str(qwen3_target_dir),
                     "--drafter", str(drafter_dir), "--num-requests", "3", "--concurrency", "3",
                     "--max-tokens", "4", "--out", str(out), "--no-warmup"])  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0, printed
    saved = json.loads((out / "serve-compare.json").read_text())
    for name in ("flashbatch", "mlx_lm.server"):
        assert saved["servers"][name]["summary"]["completed"] == 3
        assert saved["servers"][name]["summary"]["total_output_tokens"] == 12
    assert "| output tok/s |" in printed and "flashbatch / mlx-lm" in printed


def test_shipped_ar_draft_pairs_with_the_bundled_target():
    """The AR draft `bench run` uses by default loads with mlx-lm, has the bundled target's
    tokenizer and vocabulary, and is an order of magnitude smaller."""
    from bench.cli import DEFAULT_AR_DRAFT
    from engine.bundled.pair import bundled_paths
    from engine.models.loading import load_target_model

    draft_dir, (target_dir, _) = Path(DEFAULT_AR_DRAFT), bundled_paths()
    assert (draft_dir / "tokenizer.json").read_bytes() == (
        target_dir / "tokenizer.json"
    ).read_bytes()
    draft, _ = load_target_model(draft_dir)
    target, _ = load_target_model(target_dir)

    def params(model) -> int:
        return sum(v.size for _, v in tree_flatten(model.parameters()))

    assert draft.args.vocab_size == target.args.vocab_size
    assert params(draft) * 10 < params(target)
    out = draft(mx.array([[1, 2, 3]]))
    assert out.shape == (1, 3, target.args.vocab_size)


def test_mix_workloads_wrap_chat_kinds_in_the_chat_template(tmp_path):
    from mlx_lm.utils import load_tokenizer

    from bench.suite import cell_prompts, config_from_args
    from engine.bundled.pair import bundled_paths

    target, _ = bundled_paths()
    tokenizer = load_tokenizer(target)
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    editing = cell_prompts(tokenizer, "editing", 3, None, workload_set="mix")
    completion = cell_prompts(tokenizer, "completion", 3, None, workload_set="mix")
    assert len(editing) == 3 and all(p[0] == im_start for p in editing)
    assert all(im_start not in p for p in completion)  # raw code, no template
    # The default set follows the target: the bundled pair keeps its own workloads, any other
    # model (here the bundled target under another path) gets the chat mix.
    args = cli.build_parser().parse_args(["bench", "run", "--quick"])
    assert config_from_args(args).workload_set == "bundled"
    args = cli.build_parser().parse_args(["bench", "run", "--target", "bundled"])
    assert config_from_args(args).workload_set == "bundled"
    shutil.copytree(target, tmp_path / "target")
    args = cli.build_parser().parse_args(["bench", "run", "--target", str(tmp_path / "target")])
    assert config_from_args(args).workload_set == "mix"


def test_policies_choose_draft_sources(qwen3_target_dir):
    from bench.suite import build_engines, policy_depth

    policies = ["adaptive@lookup", "3@dflash", "7@dflash+lookup", "adaptive"]
    cfg = SuiteConfig(target=str(qwen3_target_dir), drafter=None, engines=["flashbatch"],
                      policies=policies)  # fmt: skip
    _, engines = build_engines(cfg)
    by_name = {e.name: e for e in engines}
    assert by_name["flashbatch adaptive lookup"].config.draft_sources == ["lookup"]
    assert "lookup" in by_name["flashbatch adaptive lookup"].description
    for name in ("flashbatch d=3 dflash", "flashbatch d=7 dflash+lookup"):
        assert "no DFlash drafter" in by_name[name].reason  # reported as a failed row
    # Without a drafter the default sources are lookup alone: the engine still drafts.
    assert by_name["flashbatch adaptive"].config.served_sources() == ("lookup",)
    # Prompts repeat across rounds and cells: prefix cache hits would measure the cache.
    assert all(e.config.prefix_cache_bytes == 0 for e in engines if hasattr(e, "config"))
    with pytest.raises(ValueError, match="unknown draft sources"):
        policy_depth("3@eagle")


def test_stop_at_eos_ends_each_request_at_the_same_token_in_every_engine(tmp_path):
    """`--stop-at-eos`: mlx-lm, BatchGenerator and flashbatch all end a request at the target's
    EOS (greedy: the same tokens), where by default every request runs to max_tokens."""
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from bench.suite import cell_prompts
    from engine.bundled.pair import bundled_paths
    from engine.models.loading import load_target_model

    source, _ = bundled_paths()  # a trained target: its greedy text varies
    model, tokenizer = load_target_model(source)
    prompt = cell_prompts(tokenizer, "completion", 1, None)[0]
    tokenizer.eos_token_ids = set()
    greedy = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=16,
                                               sampler=make_sampler(temp=0.0))]  # fmt: skip
    # The first token not seen before, from the 4th on, becomes the target's EOS.
    stop_at = next(i for i in range(3, 16) if greedy[i] not in greedy[:i])
    target = tmp_path / "target"
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config["eos_token_id"] = int(greedy[stop_at])
    (target / "config.json").write_text(json.dumps(config))

    def tokens_per_request(stop_at_eos: bool) -> dict[str, list[int]]:
        cfg = SuiteConfig(target=str(target), drafter=None, workloads=["completion"],
                          temperatures=[0.0], concurrency=[1], requests=2, max_tokens=16,
                          rounds=1, engines=["mlx-lm", "batch-generator", "flashbatch"],
                          policies=["off", "adaptive@lookup"], warmup=False,
                          stop_at_eos=stop_at_eos, out_dir=str(tmp_path / f"out{stop_at_eos}"),
                          workload_set="bundled")  # fmt: skip
        results = asyncio.run(run_suite(cfg, clock=counting_clock(), progress=False))
        rows = [r for r in results["rows"] if r["status"] == "ok"]
        assert len(rows) == 4
        return {r["engine"]: [rec["tokens"] for rec in r["rounds"][0]["records"]] for r in rows}

    stopped = tokens_per_request(True)
    first = stopped["mlx-lm"][0]
    assert first == stop_at + 1  # the tokens before EOS, and EOS itself
    assert all(counts == stopped["mlx-lm"] for counts in stopped.values()), stopped
    ignored = tokens_per_request(False)
    assert all(counts == [16, 16] for counts in ignored.values()), ignored
