"""Paired round ratios (bench/paired.py): the statistic, its verdicts and the report."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from bench.paired import (
    ABOVE,
    BELOW,
    UNDECIDED,
    aims_table,
    pair_rows,
    paired_ratio,
    t_quantile,
)
from bench.report import markdown_report
from engine import cli


def test_the_paired_ratio_is_the_geometric_mean_with_a_t_interval_on_the_logs():
    off = [100.0, 50.0, 80.0, 120.0]  # the host's speed swings by 2x between rounds
    adaptive = [99.0, 49.0, 79.5, 118.0]  # but adaptive is always ~1% behind its neighbour
    pair = paired_ratio(adaptive, off)
    logs = [math.log(a / b) for a, b in zip(adaptive, off)]
    half = 2.353 * statistics.stdev(logs) / math.sqrt(4)  # t(0.95, 3)
    assert pair.geomean == pytest.approx(math.exp(statistics.fmean(logs)))
    assert (pair.low, pair.high) == pytest.approx(
        (math.exp(statistics.fmean(logs) - half), math.exp(statistics.fmean(logs) + half))
    )
    # Paired, the 2x drift cancels: the verdict is clear both ways.
    assert pair.verdict(0.97) == ABOVE and pair.verdict(1.0) == BELOW
    # Unpaired, the rounds' rates spread over 2x; paired, the interval is 1.5% wide.
    assert pair.high - pair.low < 0.02


def test_verdicts_undecided_when_the_interval_straddles_or_one_round():
    noisy = paired_ratio([90.0, 110.0, 95.0], [100.0, 100.0, 100.0])
    assert noisy.low < 0.97 < noisy.high and noisy.verdict(0.97) == UNDECIDED
    single = paired_ratio([50.0], [100.0])
    assert math.isnan(single.low) and single.verdict(0.97) == UNDECIDED
    assert single.text() == "0.50 (1 round)"
    assert paired_ratio([None, 0.0], [1.0, 2.0]) is None  # nothing pairs
    # Unpaired rounds (a failed round, a missing one) are dropped, not misaligned.
    assert paired_ratio([10.0, None, 30.0], [10.0, 20.0, 30.0, 40.0]).per_round == (1.0, 1.0)
    assert t_quantile(1) == pytest.approx(6.314) and t_quantile(100) == pytest.approx(1.645)
    with pytest.raises(ValueError):
        t_quantile(0)


def _row(engine: str, family: str, concurrency: int, rates: list[float]) -> dict:
    return {"workload": "prose", "temperature": 0.0, "concurrency": concurrency,
            "engine": engine, "family": family, "status": "ok",
            "tok_s": statistics.median(rates), "rounds": [{"tok_s": r} for r in rates]}  # fmt: skip


def _results() -> dict:
    return {
        "meta": {"config": {"target": "t", "max_tokens": 8, "rounds": 3}},
        "engines": [],
        "rows": [
            # c=1: generate_step is the best mlx-lm engine here, not BatchGenerator
            _row("mlx-lm", "mlx-lm", 1, [50.0, 40.0, 60.0]),
            _row("mlx-lm batch", "mlx-lm", 1, [30.0, 25.0, 35.0]),
            _row("flashbatch off", "flashbatch", 1, [55.0, 44.0, 66.0]),
            _row("flashbatch adaptive", "flashbatch", 1, [66.0, 52.8, 79.2]),
            # c=8: adaptive loses 10% every round; off beats BatchGenerator by ~2x
            _row("mlx-lm batch", "mlx-lm", 8, [100.0, 80.0, 120.0]),
            _row("flashbatch off", "flashbatch", 8, [200.0, 150.0, 250.0]),
            _row("flashbatch adaptive", "flashbatch", 8, [180.0, 135.0, 225.0]),
        ],
    }


def test_the_report_pairs_adaptive_with_off_and_off_with_the_cells_best_mlx_lm(tmp_path):
    lines = aims_table(_results())
    assert (
        "| prose | 0 | 1 | 1.20 [1.20, 1.20] | at or above | 1.10 [1.10, 1.10] (mlx-lm)"
        " | at or above |" in lines
    )
    assert "| prose | 0 | 8 | 0.90 [0.90, 0.90] | below |" in "\n".join(lines)
    assert "(mlx-lm batch) | at or above |" in lines[-4]
    assert "- adaptive / off: 1 at or above 0.97, 0 undecided, 1 below." in lines
    assert "- off / best mlx-lm: 2 at or above 0.97, 0 undecided, 0 below." in lines

    # `flashbatch bench report DIR` rewrites results.md from results.json.
    (tmp_path / "results.json").write_text(json.dumps(_results()))
    assert cli.main(["bench", "report", str(tmp_path)]) == 0
    written = (tmp_path / "results.md").read_text()
    assert written == markdown_report(_results()) + "\n"
    assert "## Paired by round" in written and "0.90 [0.90, 0.90] | below" in written
    assert cli.main(["bench", "report", str(tmp_path / "nowhere")]) == 2


def test_without_both_engines_there_is_no_paired_section():
    results = _results()
    results["rows"] = [r for r in results["rows"] if r["engine"] == "flashbatch adaptive"]
    assert aims_table(results) == []


def test_pair_rows_name_each_pair_cell_by_cell_and_dash_a_missing_partner():
    results = _results()
    pair = [("flashbatch adaptive", "flashbatch off")]
    name = "| flashbatch adaptive / flashbatch off | prose | 0 "
    assert pair_rows(results, pair) == [
        name + "| 1 | 1.20 [1.20, 1.20] | at or above |",
        name + "| 8 | 0.90 [0.90, 0.90] | below |",
    ]
    results["rows"] = [r for r in results["rows"] if r["engine"] != "flashbatch off"]
    assert pair_rows(results, pair) == [name + "| 1 | - | - |", name + "| 8 | - | - |"]
