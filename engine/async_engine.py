"""`AsyncEngine`: the embeddable async face of flashbatch.

    async with AsyncEngine(EngineConfig(target=..., drafter=...)) as engine:
        async for out in engine.generate("def quicksort(", SamplingParams(max_tokens=64)):
            print(out.text, end="")

One background task runs the scheduler loop; every step executes on a single dedicated MLX
thread (a one-worker executor), so all MLX arrays and streams live on that thread while the
asyncio loop stays free for I/O (`mx.eval` releases the GIL).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio
import msgspec

from drafters.lookup import LookupDrafter
from engine.backend import process_tuning
from engine.config import EngineConfig
from engine.errors import EngineClosed, EngineFailed, InvalidRequest
from engine.models.resolve import display_name
from engine.step.logprobs import TokenLogprob
from engine.step.prefix_cache import PrefixIndex
from engine.step.sampling import SamplingParams
from engine.step.stopping import StopChecker, eos_ids_of
from engine.step.structured import GrammarCompiler
from metrics import EngineMetrics
from scheduler.adaptive import AdaptiveDepthPolicy
from scheduler.depth import DepthPolicy, FixedDepthPolicy
from scheduler.guard import DraftingGuard
from scheduler.plan import StepResult
from scheduler.request import Request
from scheduler.scheduler import Scheduler, SchedulerLimits
from scheduler.sources import DFLASH, LOOKUP

log = logging.getLogger("flashbatch.engine")


class RequestOutput(msgspec.Struct, kw_only=True):
    """One streamed delta of a request; the last one has `finished=True`."""

    request_id: str
    text: str  # new text since the previous delta
    token_ids: list[int]  # new token ids since the previous delta
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache (not prefilled)
    completion_tokens: int = 0
    drafted_tokens: int = 0  # speculation stats so far
    accepted_tokens: int = 0
    verify_steps: int = 0
    drafted_by_source: dict[str, int] = msgspec.field(default_factory=dict)  # "dflash", "lookup"
    accepted_by_source: dict[str, int] = msgspec.field(default_factory=dict)
    # With SamplingParams.logprobs set: one entry per token of `token_ids` (the target's raw
    # log-probability and the top alternatives); None otherwise.
    logprobs: list[TokenLogprob] | None = None
    # With SamplingParams.prompt_logprobs set, on the first delta only: one entry per prompt
    # token (None for the first, which nothing predicts).
    prompt_logprobs: list[TokenLogprob | None] | None = None


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    """Complete a step's future on the loop (unless the loop gave up waiting on it)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class AsyncEngine:
    """Continuous-batching engine with a DFlash draft session per request."""

    def __init__(self, config: EngineConfig, depth_policy: DepthPolicy | None = None) -> None:
        config.validate()
        self.config = config
        self.model_name = config.model_name or display_name(config.target)
        self._policy = depth_policy
        self.metrics = EngineMetrics(self.model_name)
        self._executor: ThreadPoolExecutor | None = None
        # Hands a step's result to the loop when a lookahead follows (see _execute_then_advance).
        self._notifier: ThreadPoolExecutor | None = None
        self._runner: Any = None
        self.tokenizer: Any = None
        self.scheduler: Scheduler | None = None
        self._streams: dict[str, Any] = {}
        self._last_delta: dict[str, float | None] = {}  # request id -> time of its last delta
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._accepting = False
        self._stopped = False
        self.step_count = 0
        self._step_in_flight = False
        self._froze = False  # this engine froze the heap it loaded (`process_tuning`)
        self.last_result: StepResult | None = None
        # Called on the loop thread after every step (tests check invariants, metrics record).
        self.step_hooks: list[Callable[[StepResult], None]] = []
        # Distributed mode: what stopped the engine for good (a rank lost), and who to tell
        # (the server exits non-zero). The process must then end with `os._exit`: the MLX
        # thread may never leave its collective, and the interpreter's exit joins it.
        self.failure: BaseException | None = None
        self.failure_hooks: list[Callable[[BaseException], None]] = []

    # ----------------------------------------------------------------- lifecycle
    async def __aenter__(self) -> AsyncEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    async def start(self) -> None:
        """Load the models on the MLX thread and start the scheduler loop."""
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="flashbatch-mlx")
        self._notifier = ThreadPoolExecutor(1, thread_name_prefix="flashbatch-notify")
        loop = asyncio.get_running_loop()
        self._runner, self.tokenizer = await loop.run_in_executor(self._executor, self._load)
        self._runner.grammars = await loop.run_in_executor(self._executor, self._grammars)
        self.metrics.distributed_ranks.set(getattr(self._runner, "ranks", 1))
        if hasattr(self._runner, "watch_broadcasts"):  # distributed mode
            self._runner.watch_broadcasts(self.metrics.distributed_call_time.observe)
        target_args = getattr(self._runner.target.model, "args", None)
        max_len = self.config.max_model_len or getattr(target_args, "max_position_embeddings", None)
        limits = SchedulerLimits(
            max_num_seqs=self.config.max_num_seqs,
            max_waiting_requests=self.config.max_waiting_requests,
            max_waiting_prompt_tokens=self.config.max_waiting_prompt_tokens,
            prefill_chunk_tokens=self.config.prefill_chunk_tokens,
            kv_cache_bytes=self.config.kv_cache_bytes,
            bytes_per_token=self._runner.bytes_per_token(),
            bytes_per_row=self._runner.bytes_per_row(),
            max_model_len=int(max_len or 4096),
        )
        if self._policy is None:
            if self.config.num_speculative_tokens is not None:
                self._policy = FixedDepthPolicy(self.config.num_speculative_tokens)
            else:
                packed = self._runner.packed is not None  # its cost follows the verify's shape
                guard = DraftingGuard() if self.config.drafting_guard else None
                self._policy = AdaptiveDepthPolicy(
                    self._runner.max_depth, packed=packed, guard=guard
                )
                if self._runner.max_depth:
                    profile = await loop.run_in_executor(self._executor, self._runner.profile)
                    self._policy.seed(profile)
        self._runner.keep_features = self.config.keep_features
        prefix = None
        if self.config.prefix_cache_bytes:
            self._runner.prefix_caching = True
            per_token = self._runner.prefix_bytes_per_token()
            hybrid = self._runner.target.hybrid  # states: whole-prefix hits only
            prefix = PrefixIndex(self.config.prefix_cache_bytes, per_token,
                                 self._runner.bytes_per_row(), whole_only=hybrid)  # fmt: skip
        self.scheduler = Scheduler(
            limits, self._policy, self._runner.max_depth, self._runner.source_depths, prefix,
            prefill_rides=self._runner.packed is not None,
            share_in_flight=self.config.prefix_share_in_flight,
        )  # fmt: skip
        if self.config.process_tuning and process_tuning.wanted():
            process_tuning.freeze_loaded()  # after everything the engine keeps is loaded
            self._froze = True
        self._accepting = True
        self._loop_task = asyncio.create_task(self._run(), name="flashbatch-scheduler")

    def _load(self) -> tuple[Any, Any]:
        from engine.backend.platform import report_blas
        from engine.backend.process_tuning import tune_process_if_wanted
        from engine.backend.tuning import tune_for_backend
        from engine.models.loading import load_pair
        from engine.step.runner import ModelRunner

        if self.config.process_tuning:
            tune_process_if_wanted()
        report_blas(log)
        sources = self.config.served_sources()
        drafter = self.config.drafter if DFLASH in sources else None  # lookup only: no taps
        if self.config.parallel:  # rank 0 of a sharded target (`engine.distributed`)
            from engine.distributed.rank import load_leader

            runner, tokenizer = load_leader(self.config, drafter, sources)
            log.info("draft sources: %s", ", ".join(sources) or "none")
            return runner, tokenizer
        pair = load_pair(self.config.target, drafter)
        tune_for_backend(pair, self.config.cpu_kernels, self.config.row_padding)
        runner = ModelRunner(pair.target, pair.drafter, profile_phases=self.config.profile_phases,
                             lookup=self._lookup_drafter(sources),
                             packed_verify=self.config.packed_verify)  # fmt: skip
        log.info("draft sources: %s", ", ".join(sources) or "none")
        return runner, pair.tokenizer

    def _grammars(self) -> GrammarCompiler | None:
        """Structured output's compiler over the target's tokenizer (None where llguidance
        cannot read it: such requests get a 400)."""
        if self.tokenizer is None:
            return None
        try:
            return GrammarCompiler(
                self.tokenizer, self._runner.target.vocab_size, eos_ids_of(self.tokenizer)
            )
        except Exception as exc:  # a tokenizer llguidance cannot wrap (not a fast HF one)
            log.warning("structured output unavailable: %s", exc)
            return None

    def _lookup_drafter(self, sources: Sequence[str]) -> LookupDrafter | None:
        if LOOKUP not in sources:
            return None
        config = self.config
        return LookupDrafter(config.lookup_min_ngram, config.lookup_max_ngram,
                             config.lookup_max_depth,
                             config.lookup_depth_per_match or None)  # fmt: skip

    @property
    def draft_sources(self) -> tuple[str, ...]:
        """The draft sources this engine serves (after loading)."""
        return tuple(self._runner.source_depths) if self._runner is not None else ()

    @property
    def feature_taps(self) -> list[int]:
        """The target layers whose hidden states this engine taps for its drafter (what
        `keep_features` hands out, concatenated in this order); empty without DFlash."""
        if self._runner is None or self._runner.drafter is None:
            return []
        return list(self._runner.target.layer_ids)

    async def shutdown(self, drain_timeout: float | None = 0.0) -> None:
        """Stop accepting requests; let in-flight ones finish for up to `drain_timeout`
        seconds (None = wait for all), then abort the rest and stop."""
        self._accepting = False
        if self.scheduler is not None and drain_timeout != 0:
            with anyio.move_on_after(drain_timeout):
                while self.scheduler.num_unfinished:
                    await asyncio.sleep(0.01)
        if self.scheduler is not None:
            for request_id in list(self.scheduler.requests):
                self.abort(request_id)
        self._stopped = True
        self._wakeup.set()
        if self._loop_task is not None:
            await self._loop_task
            self._loop_task = None
        stop_followers = getattr(self._runner, "stop_followers", None)
        if stop_followers is not None and self._executor is not None and self.failure is None:
            await asyncio.get_running_loop().run_in_executor(self._executor, stop_followers)
        if self._executor is not None and self.failure is not None:
            # A failed distributed step may have left the MLX thread inside a collective
            # that no rank will finish: never wait for it (the process exits non-zero).
            self._executor.shutdown(wait=False)
            self._executor = None
        if self._executor is not None:
            # MLX keeps per-thread state (streams, the mx.compile cache holding Python
            # objects) that its own thread-exit cleanup frees too late: racing interpreter
            # finalization, it aborts the process ("terminate called without an active
            # exception"). MLX asks worker threads to clear it before they end.
            import mlx.core as mx  # here: engine/__init__ preloads BLAS before mlx loads

            clear = getattr(mx, "clear_streams", None)
            if clear is not None:
                self._executor.submit(clear).result()
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._notifier is not None:
            self._notifier.shutdown(wait=True)
            self._notifier = None
        if self._froze:
            process_tuning.thaw()
            self._froze = False

    @property
    def ready(self) -> bool:
        return self._accepting

    @property
    def idle(self) -> bool:
        """No request queued or in flight and no step running."""
        return not self._step_in_flight and not (self.scheduler and self.scheduler.has_work)

    # ----------------------------------------------------------------- requests
    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> tuple[str, Any]:
        """Validate and queue a request; return its id and the stream its outputs arrive on.

        Raises at once: InvalidRequest (bad parameters, prompt too long), EngineOverloaded
        (queue full), EngineClosed (shutting down). `generate` wraps this.
        """
        if self.failure is not None:
            raise EngineFailed(f"the engine stopped: {self.failure}")
        if not self._accepting or self.scheduler is None:
            raise EngineClosed("the engine is not accepting requests (starting or shutting down)")
        params = params or SamplingParams()
        params.validate(self._runner.target.vocab_size)
        missing = [s for s in params.draft_sources or [] if s not in self.draft_sources]
        if missing:
            raise InvalidRequest(
                f"draft_sources {missing} are not served here (this engine drafts from "
                f"{list(self.draft_sources)})"
            )
        if isinstance(prompt, str):
            prompt_ids = list(self.tokenizer.encode(prompt))
        else:
            prompt_ids = [int(t) for t in prompt]
            vocab = self._runner.target.vocab_size
            if any(not 0 <= t < vocab for t in prompt_ids):
                raise InvalidRequest(f"prompt token ids must lie in 0..{vocab - 1}")
        if params.stop and self.tokenizer is None:
            raise InvalidRequest("stop strings need a tokenizer")
        if params.structured is not None:
            if self._runner.grammars is None:
                raise InvalidRequest("structured output is not available for this model's "
                                     "tokenizer", param=params.structured.param)  # fmt: skip
            self._runner.grammars.check(params.structured)  # a bad schema is the caller's 400
        request_id = request_id or uuid.uuid4().hex
        stop = StopChecker(params, eos_ids_of(self.tokenizer), self.tokenizer)
        request = Request(request_id, prompt_ids, params, stop)
        self.scheduler.add(request)
        self._record_queue()
        send, receive = anyio.create_memory_object_stream(math.inf)
        self._streams[request_id] = send
        self._wakeup.set()
        return request_id, receive

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs. Cancelling or leaving the iteration aborts it."""
        request_id, stream = self.add_request(prompt, params, request_id)
        outputs = self.outputs(request_id, stream)
        try:
            async for output in outputs:
                yield output
        finally:
            await outputs.aclose()  # runs its abort-on-exit now, not at garbage collection

    async def outputs(self, request_id: str, stream: Any) -> AsyncIterator[RequestOutput]:
        """The outputs of a request queued with `add_request`; leaving early aborts it."""
        finished = False
        try:
            async with stream:
                async for output in stream:
                    finished = output.finished
                    yield output
                    if finished:
                        return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request; its slot is freed at the next step boundary."""
        if self.scheduler is None:
            return
        request = self.scheduler.abort(request_id)
        if request is not None:
            self._emit(request)
            self._record_queue()
        self._wakeup.set()

    def _record_queue(self) -> None:
        scheduler = self.scheduler
        running = len(scheduler.prefilling) + len(scheduler.running)
        self.metrics.on_queue(waiting=len(scheduler.waiting), running=running)

    # ----------------------------------------------------------------- the loop
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        scheduler = self.scheduler
        last_arrival: float | None = None  # the previous step's result (None: idle since)
        while True:
            if self.failure is not None:  # distributed: a rank lost; no step may run again
                return
            if not scheduler.has_work:
                if self._stopped:
                    return
                last_arrival = None
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            plan = scheduler.plan()
            if plan.empty:
                last_arrival = None
                await asyncio.sleep(0)
                continue
            if scheduler.prefix is not None and plan.admissions:
                self.metrics.on_prefix_lookups(
                    sum(len(a.prompt_ids) for a in plan.admissions),
                    sum(a.prefix_tokens for a in plan.admissions),
                )
            self.metrics.on_prefix_holds(scheduler.holds)
            self._step_in_flight = True
            done = loop.create_future()
            try:
                self._executor.submit(self._execute_then_advance, plan, done, loop)
                if self.config.parallel:  # a rank that stops answering must not hang us
                    result = await asyncio.wait_for(done, self.config.rank_timeout_s)
                else:
                    result = await done
            except Exception as exc:
                if self.config.parallel:  # ranks may now disagree: nothing can go on
                    self._fail_for_good(exc)
                    return
                log.exception("engine step failed; failing the requests in flight")
                self._fail_all()
                last_arrival = None
                continue
            finally:
                self._step_in_flight = False
            # What a step costs the loop's throughput: a plain step's forward overlaps the
            # loop's handling of the step before (the lookahead), a drafting step's does not.
            arrival = time.perf_counter()
            if last_arrival is not None:
                result.cadence_seconds = arrival - last_arrival
            last_arrival = arrival
            self.step_count += 1
            self.last_result = result
            try:
                for request in scheduler.apply(result):
                    self._emit(request)
                self.metrics.on_step(
                    result, scheduler.last_depths, scheduler.last_parked, self.config.kv_cache_bytes
                )
            except Exception:  # a bug in handling one step must not hang every stream
                log.exception("handling a step's result failed; failing the requests in flight")
                self._fail_all()
                last_arrival = None
                continue
            self._record_queue()
            for hook in self.step_hooks:
                hook(result)

    def _execute_then_advance(
        self, plan: Any, done: asyncio.Future, loop: asyncio.AbstractEventLoop
    ) -> None:
        """On the MLX thread: run the step, hand its result to the loop, then compute the
        looked-ahead next step (if any) while the loop handles that result.

        One call, not two queued ones: a second job submitted by the loop would wait for the
        GIL until the loop's own handling of the step (a few hundred microseconds to a few
        milliseconds of Python) was done, so the two ran one after the other. Nor does this
        thread wake the loop itself when a lookahead follows: the wake-up's write releases
        the GIL, the woken loop takes it, and this thread got it back only once the loop had
        handled the step (0.4 ms of a 7 ms bundled step at c=1, measured). The notifier
        thread wakes the loop instead, once `advance`'s `mx.async_eval` has released the GIL
        here, so the loop's handling overlaps the lookahead's compute."""
        try:
            result = self._runner.execute(plan)
        except BaseException as exc:  # noqa: BLE001 (handed to the loop, which logs it)
            loop.call_soon_threadsafe(_settle, done, None, exc)
            return
        if not self._runner.lookahead_pending:
            loop.call_soon_threadsafe(_settle, done, result, None)
            return
        self._notifier.submit(loop.call_soon_threadsafe, _settle, done, result, None)
        try:
            self._runner.advance()
        except Exception as exc:  # the next step's sync fails the same way and is handled there
            log.exception("lookahead forward failed")
            if self.config.parallel:  # but a lost rank may hang that sync: stop now
                loop.call_soon_threadsafe(self._fail_for_good, exc)

    def _fail_for_good(self, exc: BaseException) -> None:
        """Distributed mode: a step failed or timed out (a rank lost). Every request fails
        (HTTP 503), nothing new is accepted, and the failure hooks run (the server exits)."""
        if self.failure is not None:  # already stopped (a lookahead failed first)
            return
        if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
            exc = EngineFailed(f"a rank did not answer within {self.config.rank_timeout_s:.0f} s")
        log.error("distributed step failed; the engine stops: %s", exc)
        self.failure = exc
        self._accepting = False
        self._fail_all()
        for hook in self.failure_hooks:
            hook(exc)

    def _fail_all(self) -> None:
        for request_id in list(self.scheduler.requests):
            request = self.scheduler.abort(request_id)
            if request is not None:
                request.finish_reason = "error"
                self._emit(request)

    def _emit(self, request: Request) -> None:
        stream = self._streams.get(request.request_id)
        if stream is None:
            return
        tokens = request.stop.token_ids
        new_tokens = tokens[request.sent_tokens :]
        prompt_logprobs = None
        if request.prompt_logprobs is not None and request.sent_tokens == 0 and new_tokens:
            prompt_logprobs = request.prompt_logprobs
        new_logprobs = None
        if request.logprobs is not None:
            new_logprobs = request.logprobs[request.sent_tokens : len(tokens)]
        text = request.stop.text
        visible = len(text)
        if not request.finished and request.params.stop:
            visible -= request.stop.longest_stop - 1  # a stop string may still be forming
        new_text = text[request.sent_text : max(request.sent_text, visible)]
        request.sent_tokens = len(tokens)
        request.sent_text += len(new_text)
        now = request.last_token_time
        if new_tokens:
            since = (
                None
                if self._last_delta.get(request.request_id) is None
                else (now - self._last_delta[request.request_id])
            )
            self.metrics.on_delta(len(new_tokens), since)
            self._last_delta[request.request_id] = now
        if request.finished:
            self._last_delta.pop(request.request_id, None)
            self.metrics.on_finish(request)
        output = RequestOutput(
            request_id=request.request_id,
            text=new_text,
            token_ids=list(new_tokens),
            finished=request.finished,
            finish_reason=request.finish_reason,
            prompt_tokens=len(request.prompt_ids),
            cached_tokens=request.cached_tokens,
            completion_tokens=len(tokens),
            drafted_tokens=request.drafted,
            accepted_tokens=request.accepted,
            verify_steps=request.verify_steps,
            drafted_by_source=dict(request.drafted_by),
            accepted_by_source=dict(request.accepted_by),
            logprobs=new_logprobs,
            prompt_logprobs=prompt_logprobs,
        )
        try:
            stream.send_nowait(output)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # the consumer went away; the abort is on its way
        if request.finished:
            stream.close()
            del self._streams[request.request_id]

    # ----------------------------------------------------------------- introspection
    def depth_policy_state(self) -> dict:
        """The depth controller's inspectable state (empty for a fixed policy)."""
        state = getattr(self._policy, "state", None)
        return state() if callable(state) else {}

    def kv_bytes(self) -> int:
        """KV cache bytes held by the runner (read between steps)."""
        return self._runner.kv_bytes if self._runner is not None else 0

    def prefix_cache_bytes(self) -> int:
        """Bytes held by the prefix cache's entries (read between steps)."""
        return self._runner.prefix_cache_bytes if self._runner is not None else 0
