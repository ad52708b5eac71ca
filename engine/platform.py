"""Backend-specific start-up choices, kept in one small module.

On Linux the `mlx[cpu]` wheel links a bundled *reference* (netlib) BLAS: float32 matmuls run at
about 1 GFLOP/s. Loading an optimized OpenBLAS into the process with global symbol visibility
*before* `mlx` is imported makes MLX's `cblas_sgemm` calls resolve to it (20-120 GFLOP/s).
This module does that by itself when such a library is present. It must therefore be imported
before anything imports `mlx`; `engine/__init__.py` and `drafters/__init__.py` import it first.

Setting ``FLASHBATCH_BLAS=off`` disables the preload; ``FLASHBATCH_BLAS=/path/to/libopenblas.so``
names the library explicitly. On macOS (Accelerate) and with a GPU backend nothing is needed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from dataclasses import dataclass

log = logging.getLogger("flashbatch.platform")

BLAS_ENV_VAR = "FLASHBATCH_BLAS"

# Debian/Ubuntu and Fedora locations of a multi-threaded OpenBLAS.
_OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",
)


@dataclass(frozen=True)
class BlasStatus:
    """Which BLAS float32 matmuls on the CPU backend go through."""

    name: str  # "openblas", "reference", "accelerate", "not-applicable"
    path: str | None
    fast: bool
    detail: str


_status: BlasStatus | None = None


def _find_openblas() -> str | None:
    for path in _OPENBLAS_CANDIDATES:
        if os.path.exists(path):
            return path
    found = ctypes.util.find_library("openblas")
    return found


def preload_fast_blas() -> BlasStatus:
    """Load an optimized BLAS before `mlx` is imported (Linux only). Idempotent."""
    global _status
    if _status is not None:
        return _status
    setting = os.environ.get(BLAS_ENV_VAR, "auto").strip()
    if not sys.platform.startswith("linux"):
        _status = BlasStatus(
            "accelerate" if sys.platform == "darwin" else "not-applicable",
            None,
            True,
            "MLX uses the platform's own BLAS here",
        )
        return _status
    if setting.lower() in ("off", "0", "false", "no"):
        _status = BlasStatus("reference", None, False, f"preload disabled by {BLAS_ENV_VAR}=off")
        return _status
    if "mlx.core" in sys.modules:
        _status = BlasStatus(
            "reference",
            None,
            False,
            "mlx was imported before flashbatch could preload OpenBLAS; "
            "import engine (or drafters) before mlx",
        )
        return _status
    path = setting if setting.lower() != "auto" else _find_openblas()
    if not path:
        _status = BlasStatus(
            "reference",
            None,
            False,
            "no OpenBLAS found (Debian/Ubuntu: apt-get install libopenblas0-pthread)",
        )
        return _status
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        _status = BlasStatus("reference", path, False, f"could not load {path}: {exc}")
        return _status
    _status = BlasStatus("openblas", path, True, f"preloaded {path}")
    return _status


def blas_status() -> BlasStatus:
    """The BLAS decision made at import time."""
    return preload_fast_blas()


def uses_gpu() -> bool:
    """True when MLX's default device is a GPU (Metal or CUDA)."""
    import mlx.core as mx

    return mx.default_device().type == mx.DeviceType.gpu


def compute_dtype():
    """The dtype models compute in: float32 on the CPU backend (only float32 reaches BLAS there;
    bf16/fp16 matmuls are 2-8x slower), None (keep the checkpoint's dtype) on a GPU."""
    import mlx.core as mx

    return None if uses_gpu() else mx.float32


def report_blas(logger: logging.Logger | None = None) -> BlasStatus:
    """Log which BLAS is active; warn when CPU matmuls go through the slow reference BLAS."""
    logger = logger or log
    status = blas_status()
    if uses_gpu() or status.fast:
        logger.info("BLAS: %s (%s)", status.name, status.detail)
    else:
        logger.warning(
            "BLAS: slow reference BLAS in use (%s); CPU matmuls will be 20-100x slower",
            status.detail,
        )
    return status


preload_fast_blas()
