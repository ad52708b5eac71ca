"""What the engine does to a freshly loaded pair for the backend it runs on, in one place.

On the CPU backend the engine runs attention and SwiGLU on `engine.backend.cpu_kernels` (MLX's own
evaluate `exp` through libm) and pads matmul rows where OpenBLAS is faster with more
(`engine.step.row_padding`). The step benchmarks call this too, so they time what the engine runs:
a benchmark without the kernels once timed a bundled 32-row plain step at 51 ms, 36 of them in
stock attention, and every ratio to that step was off.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("flashbatch.engine")


def tune_for_backend(pair: Any, cpu_kernels: bool = True, row_padding: bool = True) -> None:
    """Install the CPU kernels and the row padding on `pair` (a `LoadedPair`) where the
    backend wants them (each is a no-op on Metal and CUDA) and the flags allow."""
    from engine.backend import cpu_kernels as kernels
    from engine.step import row_padding as padding

    if cpu_kernels and kernels.wanted():
        reason = pair.target.use_cpu_kernels()
        log.info("CPU kernels (attention, SwiGLU): %s", reason or "on")
        if hasattr(getattr(pair.drafter, "model", None), "use_cpu_kernels"):
            pair.drafter.model.use_cpu_kernels()
    if row_padding and padding.wanted():
        table = padding.pad_pair(pair.target, pair.drafter)
        padded = ", ".join(f"{a}->{b}" for a, b in table.padded.items())
        log.info("matmul row padding: %s", padded or "no row count gains")
