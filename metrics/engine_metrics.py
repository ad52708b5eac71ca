"""The engine's Prometheus metrics and the code that records them.

`EngineMetrics` is fed by the engine loop: `on_step` after every step, `on_output` for every
streamed delta, `on_finish` once per request. Buckets follow vLLM's.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

from scheduler.sources import DFLASH, NO_SOURCE

PREFIX = "flashbatch_"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
# A distributed call's broadcast: a few hundred microseconds on loopback.
CALL_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.5, 0.75, 1.0, 2.0, 5.0)  # fmt: skip
DEPTH_BUCKETS = tuple(range(0, 17))
BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128)


class EngineMetrics:
    """All metrics of one engine, in their own registry (several engines may share a process)."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.model_name = model_name
        self.registry = registry or CollectorRegistry()
        r, labels = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str, extra: list[str] | None = None) -> Counter:
            metric = Counter(PREFIX + name, doc, labels + (extra or []), registry=r)
            return metric if extra else metric.labels(model_name)

        def histogram(name: str, doc: str, buckets, extra: list[str] | None = None):
            metric = Histogram(
                PREFIX + name, doc, labels + (extra or []), buckets=buckets, registry=r
            )
            return metric if extra else metric.labels(model_name)

        # --- vLLM-compatible
        self.num_requests_running = gauge(
            "num_requests_running", "Requests prefilling or decoding."
        )
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting for admission.")
        self.kv_cache_usage_perc = gauge(
            "kv_cache_usage_perc", "KV cache bytes in use as a fraction of the budget (0-1)."
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self._request_success = counter(
            "request_success", "Finished requests by reason.", ["finished_reason"]
        )
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram(
            "inter_token_latency_seconds", "Time between streamed deltas of a request.", ITL_BUCKETS
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Arrival to finish.", REQUEST_LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "request_queue_time_seconds", "Arrival to admission.", REQUEST_LATENCY_BUCKETS
        )
        self.prefill_time = histogram(
            "request_prefill_time_seconds", "Admission to first token.", REQUEST_LATENCY_BUCKETS
        )
        self.decode_time = histogram(
            "request_decode_time_seconds", "First token to finish.", REQUEST_LATENCY_BUCKETS
        )
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt length per request.", TOKEN_COUNT_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per request.", TOKEN_COUNT_BUCKETS
        )
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache (not prefilled)."
        )
        self._holds_counted = 0
        self.prefix_cache_holds = counter(
            "prefix_cache_holds",
            "Requests held back to reuse a prefix another request was prefilling.",
        )
        # `source`: the drafter that proposed ("dflash", "lookup"); sum over it for totals.
        self._spec_num_drafts = counter(
            "spec_decode_num_drafts", "Verify steps with drafts, by draft source.", ["source"]
        )
        self._spec_num_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Draft tokens, by draft source.", ["source"]
        )
        self._spec_num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted, by draft source.", ["source"]
        )
        self._spec_accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by position in the block (1 = first draft).",
            ["position"],
        )
        # --- beyond vLLM
        self._draft_depth = histogram(
            "spec_decode_draft_depth",
            "Chosen verify depth per request-step, by draft source (none: depth 0).",
            DEPTH_BUCKETS,
            ["source"],
        )
        self._parked_steps = counter(
            "spec_decode_parked_steps",
            "Request-steps decoded without drafting, by reason.",
            ["reason"],
        )
        self._step_time = histogram(
            "step_duration_seconds", "Engine step time by phase.", STEP_BUCKETS, ["phase"]
        )
        self.batch_size = gauge("batch_size", "Decoding rows in the latest step.")
        self.batch_size_hist = histogram(
            "step_batch_size", "Decoding rows per step.", BATCH_BUCKETS
        )
        self.mlx_active_memory = gauge("mlx_active_memory_bytes", "MLX memory in use.")
        self.mlx_peak_memory = gauge("mlx_peak_memory_bytes", "MLX peak memory since start.")
        self.kv_cache_bytes = gauge("kv_cache_bytes", "KV cache bytes held (target and drafter).")
        # --- distributed mode (`engine.distributed`): rank 0 exports these; followers nothing
        self.distributed_ranks = gauge(
            "distributed_ranks", "Ranks the target is sharded over (1: one process)."
        )
        self.distributed_ranks.set(1)
        self.distributed_call_time = histogram(
            "distributed_call_broadcast_seconds",
            "Rank 0's time to send one runner call (a step's plan) to every other rank.",
            CALL_BUCKETS,
        )

    # ----------------------------------------------------------------- recording
    def on_step(
        self, result, depths: dict[str, int], parked: dict[str, str], kv_budget: int
    ) -> None:
        for phase, seconds in result.phase_seconds.items():
            self._step_time.labels(self.model_name, phase).observe(seconds)
        self._step_time.labels(self.model_name, "total").observe(result.step_seconds)
        if result.batch_size:
            self.batch_size.set(result.batch_size)
            self.batch_size_hist.observe(result.batch_size)
        self.prompt_tokens.inc(result.prefill_tokens)
        for outcome in result.outcomes.values():
            source = (outcome.source or DFLASH) if outcome.drafted else NO_SOURCE
            self._draft_depth.labels(self.model_name, source).observe(outcome.drafted)
            if outcome.drafted:
                self._spec_num_drafts.labels(self.model_name, source).inc()
                self._spec_num_draft_tokens.labels(self.model_name, source).inc(outcome.drafted)
                self._spec_num_accepted_tokens.labels(self.model_name, source).inc(outcome.accepted)
                for position in range(1, outcome.accepted + 1):
                    self._spec_accepted_per_pos.labels(self.model_name, str(position)).inc()
        for reason in parked.values():
            self._parked_steps.labels(self.model_name, reason).inc()
        self.kv_cache_bytes.set(result.kv_bytes)
        self.kv_cache_usage_perc.set(min(1.0, result.kv_bytes / kv_budget) if kv_budget else 0.0)
        if result.memory_active is not None:
            self.mlx_active_memory.set(result.memory_active)
            self.mlx_peak_memory.set(result.memory_peak)

    def on_prefix_lookups(self, queried_tokens: int, hit_tokens: int) -> None:
        """Admissions' prefix cache lookups, in tokens (vLLM's meaning)."""
        self.prefix_cache_queries.inc(queried_tokens)
        self.prefix_cache_hits.inc(hit_tokens)

    def on_prefix_holds(self, total: int) -> None:
        """The scheduler's running count of held-back requests (the counter follows it)."""
        if total > self._holds_counted:
            self.prefix_cache_holds.inc(total - self._holds_counted)
            self._holds_counted = total

    def on_queue(self, waiting: int, running: int) -> None:
        self.num_requests_waiting.set(waiting)
        self.num_requests_running.set(running)

    def on_delta(self, new_tokens: int, since_previous: float | None) -> None:
        self.generation_tokens.inc(new_tokens)
        if since_previous is not None:
            self.itl.observe(since_previous)

    def on_finish(self, request) -> None:
        reason = request.finish_reason or "unknown"
        self._request_success.labels(self.model_name, reason).inc()
        end = request.finished_time
        self.e2e.observe(end - request.arrival_time)
        if request.admitted_time is not None:
            self.queue_time.observe(request.admitted_time - request.arrival_time)
            if request.first_token_time is not None:
                self.prefill_time.observe(request.first_token_time - request.admitted_time)
                self.decode_time.observe(end - request.first_token_time)
        if request.first_token_time is not None:
            self.ttft.observe(request.first_token_time - request.arrival_time)
        self.request_prompt_tokens.observe(len(request.prompt_ids))
        self.request_generation_tokens.observe(request.generated)

    def exposition(self) -> bytes:
        return generate_latest(_WithoutCreated(self.registry))


class _WithoutCreated:
    """A registry view without the `_created` series prometheus_client adds to every counter
    and histogram: noise to a scraper here. Filtering this view (not calling the process-wide
    `disable_created_metrics()`) leaves an embedding application's own metrics as they are."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self):
        for family in self.registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family
