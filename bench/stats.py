"""Measured records and the statistics computed from them.

Engines only record timestamps (from the harness's clock) and token counts; every rate and
latency in the results is computed here from those timestamps:

- aggregate output tokens/s = output tokens of the run / (run end - run start);
- per-request tokens/s = a request's output tokens / (its finish - its submission);
- TTFT = first token's arrival - submission;
- inter-token latency (ITL): the gap before each streamed chunk after the first, split evenly
  over the chunk's tokens (a speculative step that commits k tokens at once after a gap g
  counts as k latencies of g/k, so engines that stream one token at a time and engines that
  stream several are measured on the same per-token footing);
- TPOT = (finish - first token) / (output tokens - 1), per request;
- tau = tokens committed by verify steps / verify steps (1.0 for plain decoding).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation (numpy's default); NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(values: Sequence[float]) -> float:
    finite = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(finite) if finite else math.nan


class Timeline:
    """TTFT and end-to-end latency from a record's `submitted`, `chunk_times` and `finished`
    (shared by the in-process and the HTTP load records)."""

    submitted: float
    chunk_times: list[float]
    finished: float | None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.submitted if self.chunk_times else None

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.submitted


@dataclass
class RequestRecord(Timeline):
    """One request as the harness saw it: when it was submitted, when each chunk of tokens
    arrived (and how many tokens each carried), when it finished."""

    submitted: float
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    finished: float | None = None
    prompt_tokens: int = 0
    # Speculation, as reported by the engine (tokens committed by verify steps, and those steps).
    drafted: int = 0
    accepted: int = 0
    committed: int = 0
    verify_steps: int = 0
    error: str | None = None

    def add_chunk(self, when: float, tokens: int) -> None:
        if tokens > 0:
            self.chunk_times.append(when)
            self.chunk_tokens.append(tokens)

    @property
    def tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def tokens_per_s(self) -> float | None:
        e2e = self.e2e
        return self.tokens / e2e if e2e and self.tokens else None

    @property
    def tpot(self) -> float | None:
        if self.finished is None or self.tokens < 2:
            return None
        return (self.finished - self.chunk_times[0]) / (self.tokens - 1)

    def itls(self) -> list[float]:
        """Per-token inter-token latencies: each chunk's gap split over its tokens."""
        out: list[float] = []
        for i in range(1, len(self.chunk_times)):
            gap = self.chunk_times[i] - self.chunk_times[i - 1]
            n = self.chunk_tokens[i]
            out.extend([gap / n] * n)
        return out

    def to_json(self, origin: float) -> dict[str, Any]:
        """A compact summary, times relative to `origin` (the run's start)."""
        return {
            "submitted": self.submitted - origin,
            "first_token": None if not self.chunk_times else self.chunk_times[0] - origin,
            "finished": None if self.finished is None else self.finished - origin,
            "tokens": self.tokens,
            "chunks": len(self.chunk_times),
            "prompt_tokens": self.prompt_tokens,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "committed": self.committed,
            "verify_steps": self.verify_steps,
            "error": self.error,
        }


@dataclass
class RunResult:
    """One measured run of one engine on one set of prompts."""

    started: float
    ended: float
    records: list[RequestRecord]
    depth_counts: dict[int, int] | None = None  # chosen draft depth per request-step
    peak_memory: int | None = None  # mx.get_peak_memory() after a reset at the run's start
    active_memory: int | None = None  # mx.get_active_memory() at the run's start

    @property
    def output_tokens(self) -> int:
        return sum(r.tokens for r in self.records)

    @property
    def duration(self) -> float:
        return self.ended - self.started

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.duration if self.duration > 0 else math.nan


def _spread(prefix: str, values: list[float], scale: float = 1.0) -> dict[str, float]:
    return {f"{prefix}_p{q}": percentile(values, q) * scale for q in PERCENTILES}


def summarize_run(run: RunResult) -> dict[str, Any]:
    """The per-run numbers (a round), all from recorded timestamps."""
    ok = [r for r in run.records if r.error is None]
    rates = [r.tokens_per_s for r in ok if r.tokens_per_s is not None]
    steps = sum(r.verify_steps for r in ok)
    drafted = sum(r.drafted for r in ok)
    return {
        "started": run.started,
        "ended": run.ended,
        "duration_s": run.duration,
        "requests": len(run.records),
        "failed_requests": len(run.records) - len(ok),
        "output_tokens": run.output_tokens,
        "tok_s": run.tokens_per_s,
        "req_tok_s_mean": statistics.fmean(rates) if rates else math.nan,
        "req_tok_s_p50": percentile(rates, 50),
        "tau": sum(r.committed for r in ok) / steps if steps else math.nan,
        "acceptance": sum(r.accepted for r in ok) / drafted if drafted else math.nan,
        "depth_counts": dict(sorted(run.depth_counts.items())) if run.depth_counts else None,
        "peak_memory_bytes": run.peak_memory,
        "peak_above_start_bytes": (
            run.peak_memory - run.active_memory
            if run.peak_memory is not None and run.active_memory is not None
            else None
        ),
    }


def summarize_rounds(runs: list[RunResult]) -> dict[str, Any]:
    """Medians over rounds for throughput; latency percentiles over all rounds' requests;
    tau, acceptance and the depth distribution over all rounds' steps."""
    per_round = [summarize_run(run) for run in runs]
    records = [r for run in runs for r in run.records if r.error is None]
    ttfts = [r.ttft for r in records if r.ttft is not None]
    itls = [x for r in records for x in r.itls()]
    tpots = [r.tpot for r in records if r.tpot is not None]
    e2es = [r.e2e for r in records if r.e2e is not None]
    steps = sum(r.verify_steps for r in records)
    drafted = sum(r.drafted for r in records)
    depths: dict[int, int] = {}
    for run in runs:
        for depth, count in (run.depth_counts or {}).items():
            depths[depth] = depths.get(depth, 0) + count
    peaks = [s["peak_memory_bytes"] for s in per_round if s["peak_memory_bytes"] is not None]
    above = [s["peak_above_start_bytes"] for s in per_round if s["peak_above_start_bytes"]]
    out: dict[str, Any] = {
        "tok_s": median([s["tok_s"] for s in per_round]),
        "req_tok_s_p50": median([s["req_tok_s_p50"] for s in per_round]),
        "output_tokens": sum(s["output_tokens"] for s in per_round),
        "requests": sum(s["requests"] for s in per_round),
        "failed_requests": sum(s["failed_requests"] for s in per_round),
        **_spread("ttft_ms", ttfts, 1e3),
        **_spread("itl_ms", itls, 1e3),
        **_spread("tpot_ms", tpots, 1e3),
        **_spread("e2e_ms", e2es, 1e3),
        "tau": sum(r.committed for r in records) / steps if steps else math.nan,
        "acceptance": sum(r.accepted for r in records) / drafted if drafted else math.nan,
        "mean_depth": (
            sum(d * c for d, c in depths.items()) / sum(depths.values()) if depths else math.nan
        ),
        "depth_counts": dict(sorted(depths.items())) if depths else None,
        "peak_memory_bytes": max(peaks) if peaks else None,
        "peak_above_start_bytes": max(above) if above else None,
    }
    return out
