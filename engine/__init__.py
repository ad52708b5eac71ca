"""flashbatch's public API.

Importing this package first preloads an optimized BLAS on Linux (see `engine.backend.platform`), so
import `engine` (or `drafters`) before `mlx`. The names below load lazily:

- `AsyncEngine(EngineConfig(...))` — the continuous-batching engine: `async with` it, then
  `generate(prompt, params)` streams `RequestOutput` deltas; `abort(id)`; `shutdown(drain)`.
- `SamplingParams` — how one request is decoded (temperature, top-p/k, min-p, seed, stops, ...).
- `load_pair(target_path, drafter_path=None)` → `ModelPair` — an mlx-lm target, tapped for its
  DFlash drafter, the drafter and the tokenizer; a bad pairing fails here with a clear message.
- `generate(target, prompt_ids, params, drafter=..., tokenizer=...)` → `GenerationResult` — one
  request, speculatively decoded (the single-request reference loop).
- `TargetAdapter` — any mlx-lm model whose forward also returns tapped layer features.
- `RaggedKVCache` — the batched KV cache with per-row lengths.
- Errors: `FlashbatchError`, `InvalidRequest`, `EngineOverloaded`, `EngineClosed`,
  `EngineFailed`.
- `blas_status()` / `report_blas()` — which BLAS CPU matmuls use.
- Distributed mode (`EngineConfig(parallel="tensor" | "pipeline")`, every rank started by
  `mlx.launch`): rank 0 runs the `AsyncEngine`; every other rank calls `serve_follower()` and
  exits with its status. `is_leader()` says which this process is; `DistributedError`.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from engine.backend import platform as _platform  # noqa: F401  (must run before mlx is imported)

_EXPORTS = {
    "AsyncEngine": "engine.async_engine",
    "RequestOutput": "engine.async_engine",
    "EngineConfig": "engine.config",
    "SamplingParams": "engine.step.sampling",
    "StructuredOutput": "engine.step.structured",
    "load_pair": "engine.models.loading",
    "ModelPair": "engine.models.loading",
    "generate": "engine.step.speculative",
    "GenerationResult": "engine.step.speculative",
    "StepStats": "engine.step.speculative",
    "TargetAdapter": "engine.step.target",
    "UnsupportedTargetError": "engine.step.target",
    "RaggedKVCache": "engine.step.kv_cache",
    "FlashbatchError": "engine.errors",
    "InvalidRequest": "engine.errors",
    "EngineOverloaded": "engine.errors",
    "EngineClosed": "engine.errors",
    "EngineFailed": "engine.errors",
    "serve_follower": "engine.distributed.rank",
    "is_leader": "engine.distributed.rank",
    "DistributedError": "engine.distributed.group",
    "blas_status": "engine.backend.platform",
    "report_blas": "engine.backend.platform",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(import_module(module), name)
