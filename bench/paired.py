"""Paired round ratios: is one engine at least X times another, beyond this host's noise?

A cell's medians are taken minutes apart from other cells', and this 2-core host changes speed
by tens of percent within minutes, so a ratio of two medians moves by up to 0.15 between runs
of the same code. Within a round, though, the engines of a cell run back to back (the order
rotates every round), so the ratio of two engines' throughputs *in the same round* carries
little of the host's drift. This module pairs them round by round and reports the geometric
mean of the paired ratios with a Student-t interval on their logarithms (the usual treatment
of a ratio of positive rates), and a verdict against a threshold:

- "at or above": the whole interval is at or above the threshold;
- "below": the whole interval is below it;
- "undecided": the interval straddles it (too few rounds, or too much noise, to tell).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

CONFIDENCE = 0.90  # two-sided
# Student-t quantile t(0.95, df) for the 90% two-sided interval, df = 1..30; above, normal's.
_T95 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812,
        1.796, 1.782, 1.771, 1.761, 1.753, 1.746, 1.740, 1.734, 1.729, 1.725,
        1.721, 1.717, 1.714, 1.711, 1.708, 1.706, 1.703, 1.701, 1.699, 1.697)  # fmt: skip
_Z95 = 1.645

ABOVE, BELOW, UNDECIDED = "at or above", "below", "undecided"


def t_quantile(df: int) -> float:
    """t(0.95, df): the half-width multiplier of a 90% two-sided interval."""
    if df < 1:
        raise ValueError("df must be >= 1")
    return _T95[df - 1] if df <= len(_T95) else _Z95


@dataclass(frozen=True)
class PairedRatio:
    """Numerator / denominator over rounds run side by side."""

    per_round: tuple[float, ...]  # each round's ratio, in round order
    geomean: float
    low: float  # the 90% interval (nan with one round)
    high: float

    @property
    def rounds(self) -> int:
        return len(self.per_round)

    def verdict(self, threshold: float) -> str:
        if math.isnan(self.low) or math.isnan(self.high):
            return UNDECIDED
        if self.low >= threshold:
            return ABOVE
        if self.high < threshold:
            return BELOW
        return UNDECIDED

    def text(self) -> str:
        """`0.98 [0.93, 1.03]`, or `0.98 (1 round)` when there is no interval."""
        if math.isnan(self.low):
            return f"{self.geomean:.2f} ({self.rounds} round)"
        return f"{self.geomean:.2f} [{self.low:.2f}, {self.high:.2f}]"


def paired_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> PairedRatio | None:
    """Pair the i-th rounds' rates; rounds where either is missing or not positive are
    dropped. None when no round pairs."""
    ratios = [
        a / b
        for a, b in zip(numerator, denominator)
        if a is not None and b is not None and a > 0 and b > 0
        and math.isfinite(a) and math.isfinite(b)
    ]  # fmt: skip
    if not ratios:
        return None
    logs = [math.log(r) for r in ratios]
    centre = statistics.fmean(logs)
    if len(logs) < 2:
        return PairedRatio(tuple(ratios), math.exp(centre), math.nan, math.nan)
    half = t_quantile(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return PairedRatio(tuple(ratios), math.exp(centre), math.exp(centre - half),
                       math.exp(centre + half))  # fmt: skip


def _round_rates(row: dict) -> list[float]:
    return [r.get("tok_s") for r in row.get("rounds") or []]


def _cells(rows: list[dict]) -> dict[tuple, dict[str, dict]]:
    cells: dict[tuple, dict[str, dict]] = {}
    for row in rows:
        key = (row["workload"], row["temperature"], row["concurrency"])
        cells.setdefault(key, {})[row["engine"]] = row
    return cells


def best_mlx_lm_here(cell: dict[str, dict]) -> dict | None:
    """The fastest mlx-lm engine measured in this very cell (`generate_step` at concurrency 1,
    `BatchGenerator` above): only those rounds ran beside flashbatch's."""
    ok = [
        r for r in cell.values()
        if r["family"] == "mlx-lm" and r["status"] == "ok" and r.get("tok_s")
    ]  # fmt: skip
    return max(ok, key=lambda r: r["tok_s"], default=None)


def paired_cells(
    results: dict[str, Any], numerator: str, denominator: str | None
) -> list[tuple[tuple, PairedRatio | None, str | None]]:
    """Each cell's paired ratio of engine `numerator` to `denominator` (None: the cell's best
    mlx-lm engine), with the denominator's name; cells without the numerator are left out."""
    out = []
    for key, cell in _cells(results["rows"]).items():
        top = cell.get(numerator)
        if top is None:
            continue
        bottom = cell.get(denominator) if denominator else best_mlx_lm_here(cell)
        if top["status"] != "ok" or bottom is None or bottom["status"] != "ok":
            out.append((key, None, None if bottom is None else bottom["engine"]))
            continue
        out.append((key, paired_ratio(_round_rates(top), _round_rates(bottom)), bottom["engine"]))
    return out


def pair_rows(
    results: dict[str, Any], pairs: Sequence[tuple[str, str]], threshold: float = 0.97
) -> list[str]:
    """Markdown rows ``| numerator / denominator | workload | T | c | ratio [interval] |
    verdict |``, one per cell of each (numerator, denominator) pair of engine names: the
    pairs the bench's own table leaves out (say the hybrid against lookup alone)."""
    lines = []
    for numerator, denominator in pairs:
        for (workload, temperature, c), pair, _ in sorted(
            paired_cells(results, numerator, denominator)
        ):
            text = pair.text() if pair else "-"
            verdict = pair.verdict(threshold) if pair else "-"
            name = f"{numerator} / {denominator}"
            lines.append(f"| {name} | {workload} | {temperature:g} | {c} | {text} | {verdict} |")
    return lines


def aims_table(results: dict[str, Any], threshold: float = 0.97) -> list[str]:
    """Markdown: flashbatch adaptive / drafting off and drafting off / best mlx-lm per cell,
    paired by round, with 90% intervals and verdicts against `threshold`, and a tally."""
    comparisons = [
        ("adaptive / off", "flashbatch adaptive", "flashbatch off"),
        ("off / best mlx-lm", "flashbatch off", None),
    ]
    columns = [
        (label, {key: (pair, base) for key, pair, base in paired_cells(results, top, bottom)})
        for label, top, bottom in comparisons
    ]
    columns = [(label, cells) for label, cells in columns if any(p for p, _ in cells.values())]
    if not columns:
        return []
    keys = list(dict.fromkeys(key for _, cells in columns for key in cells))
    lines = [
        f"## Paired by round: ratios with {CONFIDENCE:.0%} intervals, against {threshold:g}",
        "",
        "Each round's ratio of two engines run back to back in that round; geometric mean and "
        "a Student-t interval on the logs. at or above / below: the whole interval is; "
        "undecided: it straddles the threshold.",
        "",
        "| workload | T | c | " + " | ".join(f"{label} | verdict" for label, _ in columns) + " |",
        "|---|---:|---:|" + "---|---|" * len(columns),
    ]
    tallies = {label: {ABOVE: 0, UNDECIDED: 0, BELOW: 0} for label, _ in columns}
    for key in keys:
        parts = []
        for label, cells in columns:
            pair, base = cells.get(key, (None, None))
            if pair is None:
                parts.append("- | -")
                continue
            verdict = pair.verdict(threshold)
            tallies[label][verdict] += 1
            against = "" if label.startswith("adaptive") else f" ({base})"
            parts.append(f"{pair.text()}{against} | {verdict}")
        workload, temperature, concurrency = key
        head = f"| {workload} | {temperature:g} | {concurrency} | "
        lines.append(head + " | ".join(parts) + " |")
    lines.append("")
    for label, counts in tallies.items():
        lines.append(
            f"- {label}: {counts[ABOVE]} at or above {threshold:g}, {counts[UNDECIDED]} "
            f"undecided, {counts[BELOW]} below."
        )
    return lines
