"""flashbatch's benchmarks against its peers.

- `flashbatch bench run` (`bench.suite`): engines side by side in one process on the same target,
  prompts and dtype — mlx-lm `stream_generate` (single stream), mlx-lm `BatchGenerator`, mlx-lm
  speculative decoding with an autoregressive draft model (`bench/train_ar_draft.py`), and
  flashbatch with drafting off, fixed depths and the adaptive controller — over workloads,
  temperatures and a concurrency sweep, in interleaved rounds; writes results.json, results.md
  and PNG plots.
- `flashbatch bench serve` (`bench.serve_load`): an HTTP streaming load client (fixed concurrency
  or Poisson arrivals) against an OpenAI-compatible server on loopback, vLLM-bench style; with
  `--compare` it starts flashbatch's server and `mlx_lm.server` on the same model and reports
  the ratio.
- `bench/engine_core.py`: the older flashbatch-policies-vs-BatchGenerator table (a script).

Every number is computed from timestamps the harness records itself (`bench.stats`).
"""
