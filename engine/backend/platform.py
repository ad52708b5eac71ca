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


# Substrings of the file names of optimized BLAS libraries (the reference one is `libblas`).
_OPTIMIZED_BLAS_NAMES = ("openblas", "mkl", "blis", "armpl")


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]  # fmt: skip


def _library_of(address: int) -> str | None:
    """The file of the loaded library that holds `address` (dladdr)."""
    try:
        dladdr = ctypes.CDLL(None).dladdr  # glibc >= 2.34 has it in libc itself
    except AttributeError:
        dladdr = ctypes.CDLL(ctypes.util.find_library("dl")).dladdr
    info = _DlInfo()
    if not dladdr(ctypes.c_void_p(address), ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.path.realpath(os.fsdecode(info.dli_fname))


def loaded_global_blas() -> str | None:
    """The optimized BLAS whose `cblas_sgemm` the process's global symbol scope holds, if any.

    MLX's own lookup of `cblas_sgemm` starts in that scope, so an OpenBLAS an embedding
    application loaded there itself (RTLD_GLOBAL) serves MLX's matmuls as well as ours would.
    A copy loaded privately (numpy's bundled one, say) is not in that scope and does not count.
    """
    try:
        sgemm = ctypes.CDLL(None).cblas_sgemm
    except (AttributeError, OSError):
        return None
    path = _library_of(ctypes.cast(sgemm, ctypes.c_void_p).value)
    if path is None or not any(n in os.path.basename(path).lower() for n in _OPTIMIZED_BLAS_NAMES):
        return None
    return path


def preload_fast_blas() -> BlasStatus:
    """Load an optimized BLAS before `mlx` is imported (Linux only). Idempotent."""
    global _status
    if _status is not None:
        return _status
    _status = _preload()
    if not _status.fast and sys.platform.startswith("linux"):
        # Whatever our preload could or could not do, the process may hold one already.
        loaded = loaded_global_blas()
        if loaded is not None:
            name = "openblas" if "openblas" in loaded.lower() else "optimized"
            _status = BlasStatus(name, loaded, True, f"{loaded} was already loaded globally")
    return _status


def _preload() -> BlasStatus:
    """Our own preload's outcome (the process may have an optimized BLAS regardless)."""
    setting = os.environ.get(BLAS_ENV_VAR, "auto").strip()
    if not sys.platform.startswith("linux"):
        return BlasStatus(
            "accelerate" if sys.platform == "darwin" else "not-applicable",
            None,
            True,
            "MLX uses the platform's own BLAS here",
        )
    if setting.lower() in ("off", "0", "false", "no"):
        return BlasStatus("reference", None, False, f"preload disabled by {BLAS_ENV_VAR}=off")
    if "mlx.core" in sys.modules:
        return BlasStatus(
            "reference",
            None,
            False,
            "mlx was imported before flashbatch could preload OpenBLAS; "
            "import engine (or drafters) before mlx",
        )
    path = setting if setting.lower() != "auto" else _find_openblas()
    if not path:
        return BlasStatus(
            "reference",
            None,
            False,
            "no OpenBLAS found (Debian/Ubuntu: apt-get install libopenblas0-pthread)",
        )
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        return BlasStatus("reference", path, False, f"could not load {path}: {exc}")
    return BlasStatus("openblas", path, True, f"preloaded {path}")


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
    if status.name == "openblas" and not uses_gpu():
        from engine.backend.blas_threads import blas_threads

        control = blas_threads()
        if control is not None:
            logger.info("BLAS threads: %d for decode and verify forwards, %d for prefill",
                        control.small, control.default)  # fmt: skip
    return status


preload_fast_blas()
