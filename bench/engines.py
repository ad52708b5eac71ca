"""The engines `flashbatch bench run` compares, behind one small interface.

Each engine serves a list of prompt token ids at a concurrency (closed loop: at most that many
requests in flight, the next one submitted when one finishes) and returns a `RunResult` of
timestamps taken with the harness's clock. Every engine ignores EOS, so all of them produce
`max_tokens` tokens per request on the same prompts; with `RunParams.stop_at_eos` every engine
stops a request at the target's EOS instead (what a user gets; greedy, all engines then still
produce the same tokens).

- `MlxStreamEngine`: mlx-lm `stream_generate`, one request at a time; with `draft_model` it is
  mlx-lm's speculative decoding with an autoregressive draft (`num_draft_tokens` per step).
- `MlxBatchEngine`: mlx-lm `BatchGenerator` (continuous batching) at the concurrency.
- `FlashbatchEngine`: an `AsyncEngine`; its `EngineConfig.num_speculative_tokens` picks drafting
  off (0), a fixed depth, or the adaptive controller (None).
- The mlx-lm engines run with OpenBLAS's own thread count, as their users get it; flashbatch
  sets it per forward (`engine/backend/blas_threads.py`).
- `UnavailableEngine`: stands in for an engine that cannot run (say, no AR draft model) so the
  report shows it as not available, with the reason.
"""

from __future__ import annotations

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import asyncio
import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from bench.stats import RequestRecord, RunResult
from engine.backend.blas_threads import restore_default_threads

Clock = Callable[[], float]


class EngineUnavailable(RuntimeError):
    """The engine cannot run here (a missing model, say); the message says what to do."""


@dataclass
class RunParams:
    max_tokens: int
    temperature: float
    stop_at_eos: bool = False  # True: a request ends at EOS (or max_tokens), in every engine


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _memory_at_start() -> int:
    mx.synchronize()
    mx.reset_peak_memory()
    return mx.get_active_memory()


class BenchEngine:
    """An engine under test. `single_stream` engines serve one request at a time."""

    name: str = "engine"
    family: str = "other"  # "mlx-lm" engines are the baselines of the ratios
    single_stream: bool = False
    description: str = ""

    async def start(self) -> None:
        """Load models; raise (EngineUnavailable or anything) if the engine cannot run."""

    async def run(
        self, prompts: list[list[int]], concurrency: int, params: RunParams, clock: Clock
    ) -> RunResult:
        raise NotImplementedError

    async def close(self) -> None:
        pass


class UnavailableEngine(BenchEngine):
    def __init__(self, name: str, family: str, reason: str, single_stream: bool = False,
                 description: str = "") -> None:  # fmt: skip
        self.name, self.family, self.reason = name, family, reason
        self.single_stream = single_stream
        self.description = description

    async def start(self) -> None:
        raise EngineUnavailable(self.reason)


class MlxStreamEngine(BenchEngine):
    """mlx-lm `stream_generate`, one request at a time (optionally speculative)."""

    family = "mlx-lm"
    single_stream = True

    def __init__(
        self,
        name: str,
        model: Any,
        tokenizer: Any,
        draft_model: Any = None,
        num_draft_tokens: int = 3,
    ) -> None:
        from mlx_lm.tokenizer_utils import TokenizerWrapper

        self.name = name
        self.model = model
        self.draft_model = draft_model
        self.num_draft_tokens = num_draft_tokens
        wrapper = tokenizer if isinstance(tokenizer, TokenizerWrapper) else None
        self.tokenizer_with_eos = wrapper if wrapper else TokenizerWrapper(tokenizer)
        self.tokenizer = copy.copy(self.tokenizer_with_eos)
        self.tokenizer.eos_token_ids = set()  # ignore EOS, like every engine in the suite
        self.description = (
            "mlx_lm.stream_generate, one request at a time"
            if draft_model is None
            else f"mlx_lm.stream_generate with an AR draft model, {num_draft_tokens} draft "
            "tokens per step, one request at a time"
        )

    async def run(self, prompts, concurrency, params, clock) -> RunResult:
        from mlx_lm import stream_generate
        from mlx_lm.sample_utils import make_sampler

        restore_default_threads()  # as its users run it, not with the engine's choice
        sampler = make_sampler(temp=params.temperature)
        kwargs: dict[str, Any] = {}
        if self.draft_model is not None:
            kwargs = {"draft_model": self.draft_model, "num_draft_tokens": self.num_draft_tokens}
        active = _memory_at_start()
        records = []
        depths: dict[int, int] = {}
        tokenizer = self.tokenizer_with_eos if params.stop_at_eos else self.tokenizer
        started = clock()
        for prompt in prompts:
            record = RequestRecord(submitted=clock(), prompt_tokens=len(prompt))
            records.append(record)
            produced = 0
            in_step = False
            for response in stream_generate(
                self.model, tokenizer, prompt, max_tokens=params.max_tokens,
                sampler=sampler, **kwargs,
            ):  # fmt: skip
                record.add_chunk(clock(), 1)
                if self.draft_model is not None:
                    # One verify step yields its accepted drafts, then the target's own token.
                    if not in_step:
                        depth = min(params.max_tokens - produced, self.num_draft_tokens)
                        record.verify_steps += 1
                        record.drafted += depth
                        depths[depth] = depths.get(depth, 0) + 1
                        in_step = True
                    record.accepted += int(response.from_draft)
                    in_step = response.from_draft
                produced += 1
            record.finished = clock()
            if self.draft_model is not None:
                record.committed = produced  # every token comes from a verify step
            else:
                record.committed = record.verify_steps = max(0, produced - 1)
            await asyncio.sleep(0)
        ended = clock()
        return RunResult(started, ended, records, depth_counts=depths or None,
                         peak_memory=mx.get_peak_memory(), active_memory=active)  # fmt: skip


class MlxBatchEngine(BenchEngine):
    """mlx-lm `BatchGenerator`, closed loop at the concurrency (its completion batch size)."""

    family = "mlx-lm"
    description = "mlx_lm BatchGenerator (continuous batching), completion batch = concurrency"

    def __init__(self, name: str, model: Any, prefill_step_size: int = 256,
                 eos_token_ids: set[int] | None = None) -> None:  # fmt: skip
        self.name = name
        self.model = model
        self.prefill_step_size = prefill_step_size
        self.eos_token_ids = sorted(eos_token_ids or ())  # used with `stop_at_eos`

    async def run(self, prompts, concurrency, params, clock) -> RunResult:
        from mlx_lm.generate import BatchGenerator
        from mlx_lm.sample_utils import make_sampler

        restore_default_threads()  # as its users run it, not with the engine's choice
        generator = BatchGenerator(
            self.model, max_tokens=params.max_tokens, completion_batch_size=concurrency,
            prefill_batch_size=min(concurrency, 8), prefill_step_size=self.prefill_step_size,
            sampler=make_sampler(temp=params.temperature),
            stop_tokens=[[t] for t in self.eos_token_ids] if params.stop_at_eos else None,
        )  # fmt: skip
        active = _memory_at_start()
        queue = list(prompts)
        records: dict[int, RequestRecord] = {}
        ordered: list[RequestRecord] = []
        in_flight = 0
        started = clock()
        try:
            while queue or in_flight:
                while queue and in_flight < concurrency:
                    prompt = queue.pop(0)
                    record = RequestRecord(submitted=clock(), prompt_tokens=len(prompt))
                    (uid,) = generator.insert([prompt], max_tokens=[params.max_tokens])
                    records[uid] = record
                    ordered.append(record)
                    in_flight += 1
                responses = generator.next_generated()
                now = clock()
                for response in responses:
                    record = records[response.uid]
                    record.add_chunk(now, 1)
                    if response.finish_reason is not None:
                        record.finished = now
                        record.committed = record.verify_steps = max(0, record.tokens - 1)
                        in_flight -= 1
        finally:
            generator.close()
        ended = clock()
        return RunResult(started, ended, ordered, peak_memory=mx.get_peak_memory(),
                         active_memory=active)  # fmt: skip


DEPTH_METRIC = "flashbatch_spec_decode_draft_depth"


def depth_histogram(metrics: Any) -> dict[int, int]:
    """Request-steps per chosen draft depth, from the engine's `spec_decode_draft_depth`
    histogram (integer buckets 0..16, so bucket differences are exact counts)."""
    by_bound: dict[float, float] = {}  # summed over the `source` label
    for family in metrics.registry.collect():
        if family.name != DEPTH_METRIC:
            continue
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                le = float(sample.labels["le"])
                by_bound[le] = by_bound.get(le, 0.0) + sample.value
    cumulative = sorted(by_bound.items())
    counts: dict[int, int] = {}
    previous = 0.0
    for i, (le, value) in enumerate(cumulative):
        # the +Inf bucket (deeper than the last bound) is counted one past that bound
        depth = int(le) if math.isfinite(le) else (int(cumulative[i - 1][0]) + 1 if i else 0)
        if value - previous:
            counts[depth] = int(value - previous)
        previous = value
    return counts


class FlashbatchEngine(BenchEngine):
    """An `AsyncEngine` with one depth policy (0 = drafting off, k = fixed, None = adaptive)."""

    family = "flashbatch"

    def __init__(self, name: str, config: Any) -> None:
        self.name = name
        self.config = config
        self.engine: Any = None
        depth = config.num_speculative_tokens
        sources = config.served_sources()
        self.description = (
            "AsyncEngine, drafting off"
            if depth == 0 or not sources
            else "AsyncEngine, adaptive draft depth"
            if depth is None
            else f"AsyncEngine, fixed draft depth {depth}"
        ) + (f", drafts from {' and '.join(sources)}" if depth != 0 and sources else "")

    async def start(self) -> None:
        from engine.async_engine import AsyncEngine

        self.engine = AsyncEngine(self.config)
        await self.engine.start()

    async def run(self, prompts, concurrency, params, clock) -> RunResult:
        from engine.step.sampling import SamplingParams

        sampling = SamplingParams(
            max_tokens=params.max_tokens,
            ignore_eos=not params.stop_at_eos,
            temperature=params.temperature,
        )
        gate = asyncio.Semaphore(concurrency)
        records = [RequestRecord(submitted=math.nan, prompt_tokens=len(p)) for p in prompts]

        async def one(prompt: list[int], record: RequestRecord) -> None:
            async with gate:
                record.submitted = clock()
                last = None
                try:
                    async for out in self.engine.generate(prompt, sampling):
                        record.add_chunk(clock(), len(out.token_ids))
                        last = out
                except Exception as exc:  # noqa: BLE001  (reported in the results)
                    record.error = _error(exc)
                record.finished = clock()
                if last is not None:
                    if last.finish_reason in ("error", "abort"):
                        record.error = record.error or f"request finished with {last.finish_reason}"
                    record.drafted = last.drafted_tokens
                    record.accepted = last.accepted_tokens
                    record.verify_steps = last.verify_steps
                    record.committed = max(0, last.completion_tokens - 1)  # 1st: from prefill
                elif record.error is None:
                    record.error = "no output"

        before = depth_histogram(self.engine.metrics)
        active = _memory_at_start()
        started = clock()
        await asyncio.gather(*[one(p, r) for p, r in zip(prompts, records)])
        ended = clock()
        peak = mx.get_peak_memory()
        after = depth_histogram(self.engine.metrics)
        depths = {d: after[d] - before.get(d, 0) for d in after if after[d] - before.get(d, 0)}
        return RunResult(started, ended, records, depth_counts=depths, peak_memory=peak,
                         active_memory=active)  # fmt: skip

    async def close(self) -> None:
        if self.engine is not None:
            await self.engine.shutdown()
            self.engine = None
