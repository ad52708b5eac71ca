"""Engine configuration: one place for every default."""

from __future__ import annotations

import msgspec


class EngineConfig(msgspec.Struct, kw_only=True):
    """How an `AsyncEngine` is built and how it schedules."""

    target: str  # mlx-lm model directory, .gguf file or registry name (engine.models.registry)
    drafter: str | None = None  # DFlash drafter directory (z-lab layout); None = no drafting
    model_name: str | None = None  # name reported to clients; default: the target's folder name
    max_num_seqs: int = 32  # requests prefilling or decoding at once
    max_waiting_requests: int = 256  # queue bound (count); over it -> EngineOverloaded
    max_waiting_prompt_tokens: int = 1 << 18  # queue bound (prompt tokens)
    max_model_len: int | None = None  # context limit; default: the target's max positions
    # Prompt tokens per step across all prefilling requests, so prefills do not stall decoders
    # for long. 1024 (not 256): at 32 clients fewer steps carry a prefill chunk, so the median
    # inter-token latency is a decode step's (bench/results/2026-12-01/serve-*-chunk1024).
    prefill_chunk_tokens: int = 1024
    kv_cache_bytes: int = 4 << 30  # target KV cache budget for admitted requests
    # Automatic prefix caching: finished requests' KV (and drafter features) kept in an LRU
    # of this many bytes, reused by prompts that start the same way; 0 = off.
    prefix_cache_bytes: int = 512 << 20
    # In-flight sharing: a prompt becomes an entry as soon as its prefill completes, and a
    # waiting request sharing a long prefix with one still prefilling is held back until then
    # (`scheduler.scheduler.Scheduler._held`). False: only finished and aborted requests leave
    # entries, and nobody is held.
    prefix_share_in_flight: bool = True
    # Hand every leaving request's tapped target features out in its step's result
    # (`StepResult.released_features`, read by a step hook): drafter training data made as it
    # is generated (`build --stages data --keep-features`). Needs DFlash served (the
    # drafter sets the taps); one process only.
    keep_features: bool = False
    # None: the adaptive depth controller; a number: that fixed depth for everyone (0 = off)
    num_speculative_tokens: int | None = None
    # Adaptive only: per batch size, hold drafting off where whole steps, event loop included,
    # measured slower with it than without (`scheduler.guard`); False: the controller alone.
    drafting_guard: bool = True
    # Verify rows packed (each row pays for its own 1 + depth positions) where the target's
    # architecture allows (mlx-lm llama, qwen2, qwen3); False: the padded verify everywhere.
    packed_verify: bool = True
    # On the CPU backend, attention and SwiGLU on a vectorised exp (engine.backend.cpu_kernels);
    # ignored on Metal and CUDA, whose fused kernels are fast.
    cpu_kernels: bool = True
    # On the CPU backend, compute a matmul of M rows as M' > M rows where the BLAS measured
    # clearly faster at M' (engine.step.row_padding: OpenBLAS took 22 ms for 12 rows through
    # SmolLM2's head and 12 ms for 16); outputs are unchanged. Ignored on Metal and CUDA.
    row_padding: bool = True
    # Process-wide (engine.backend.process_tuning): glibc malloc keeps freed activations instead of
    # faulting fresh pages every step, and the GIL changes hands within 0.5 ms. Applied once
    # per process at start; False (or FLASHBATCH_PROCESS_TUNING=0) leaves the process alone.
    process_tuning: bool = True
    profile_phases: bool = False  # time draft and verify apart (costs one extra sync per step)
    # Draft sources served: "dflash" (needs `drafter`) and/or "lookup" (n-gram lookup over each
    # request's prompt and output, no forward). None: both where a drafter is given, lookup
    # otherwise; []: no drafting.
    draft_sources: list[str] | None = None
    lookup_min_ngram: int = 2  # shortest suffix a lookup match may use
    lookup_max_ngram: int = 8  # longest suffix tried first
    lookup_max_depth: int = 15  # most draft tokens one lookup proposal holds
    # and at most this many per matched suffix token (a 2-token match drafts 2, a 6-token one
    # 12): long matches copy on, short ones are often coincidences; 0: no cap
    lookup_depth_per_match: int = 2
    # Distributed mode (`engine.distributed`, ranks started by mlx.launch): None = one process;
    # "tensor" (heads split, mlx-lm's shard()) or "pipeline" (layers split).
    parallel: str | None = None
    # Distributed mode: a step that has not finished after this many seconds means a rank
    # stopped answering; the engine then fails every request and the server exits non-zero.
    rank_timeout_s: float = 20.0

    def validate(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.prefill_chunk_tokens < 1:
            raise ValueError("prefill_chunk_tokens must be >= 1")
        if self.prefix_cache_bytes < 0:
            raise ValueError("prefix_cache_bytes must be >= 0 (0 turns the prefix cache off)")
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must be >= 0")
        if not 1 <= self.lookup_min_ngram <= self.lookup_max_ngram:
            raise ValueError("need 1 <= lookup_min_ngram <= lookup_max_ngram")
        if self.lookup_max_depth < 1:
            raise ValueError("lookup_max_depth must be >= 1")
        if self.lookup_depth_per_match < 0:
            raise ValueError("lookup_depth_per_match must be >= 0 (0: no cap)")
        if self.parallel not in (None, "tensor", "pipeline"):
            raise ValueError(f"parallel {self.parallel!r}: one of tensor, pipeline (or unset)")
        if self.rank_timeout_s <= 0:
            raise ValueError("rank_timeout_s must be > 0")
        sources = self.served_sources()  # unknown names, or dflash without a drafter, fail here
        if self.keep_features and ("dflash" not in sources or self.parallel):
            raise ValueError("keep_features needs DFlash served (its drafter sets the taps), "
                             "in one process")  # fmt: skip

    def served_sources(self) -> tuple[str, ...]:
        """The draft sources this configuration serves (see `draft_sources`). None (empty) when
        drafting is off engine-wide (`num_speculative_tokens=0`): no request could draft, so
        neither the drafter nor the lookup index is loaded, and plain steps keep no draft
        sessions up to date."""
        from scheduler.sources import engine_sources, parse_sources

        sources = engine_sources(parse_sources(self.draft_sources), self.drafter is not None)
        return () if self.num_speculative_tokens == 0 else sources
