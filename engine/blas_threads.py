"""How many threads OpenBLAS may use for one forward, chosen by the forward's size.

On the CPU backend every matmul is a `cblas_sgemm` call from MLX's worker thread. A decode
step makes ~200 of them (7 a layer, plus the head), each on a few to a few dozen rows. With
OpenBLAS's default of one thread per core, each such call wakes the library's worker threads
and waits for them; on a 2-core machine, where those workers compete with MLX's thread and the
event loop, a call then often waits a whole scheduler tick (4 ms) for its partner. Measured on
the 2-core machine (SmolLM2, float32, `python bench/blas_threads.py`): a [8 x 576] x
[576 x 1536] matmul took 0.5 ms on one thread and 4.0 ms on two; a whole decode step of 8
rows 195-205 ms on one thread and 290-325 ms on two. Large matmuls (a prefill chunk, 512 rows)
still run ~2x faster on two.

So each forward sets the thread count first (`BlasThreads.fit`): below `SMALL_FORWARD`
positions it leaves one core to the rest of the process (one thread on two cores), at or
above it OpenBLAS gets all its threads. ``FLASHBATCH_BLAS_THREADS=N`` fixes the count
instead; ``FLASHBATCH_BLAS_THREADS=default`` leaves OpenBLAS alone. Where the process has no
OpenBLAS (macOS Accelerate, a GPU, another BLAS) nothing is changed.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger("flashbatch.platform")

THREADS_ENV_VAR = "FLASHBATCH_BLAS_THREADS"
# Positions of a forward (tokens through the target) from which every core helps: below it,
# the per-call hand-off costs more than a second core saves (measured crossover: 64-128).
SMALL_FORWARD = 128


class BlasThreads:
    """Sets OpenBLAS's thread count per forward (see the module docstring)."""

    def __init__(self, set_threads: ctypes._CFuncPtr, default: int, small: int,
                 fixed: int | None = None) -> None:  # fmt: skip
        self._set = set_threads
        self.default = default  # OpenBLAS's own count (OPENBLAS_NUM_THREADS or the cores)
        self.small = small  # for forwards below SMALL_FORWARD positions
        self.fixed = fixed
        self.current: int | None = None
        self.use(fixed if fixed is not None else default)

    def fit(self, positions: int) -> int:
        """Set the count for a forward of this many positions; return it."""
        if self.fixed is not None:
            threads = self.fixed
        else:
            threads = self.small if positions < SMALL_FORWARD else self.default
        self.use(threads)
        return threads

    def use(self, threads: int) -> None:
        if threads != self.current:
            self._set(int(threads))
            self.current = threads

    def restore(self) -> None:
        """OpenBLAS's own count again (for code that is not the engine's, e.g. a baseline)."""
        self.use(self.default)


def _symbols() -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr] | None:
    try:
        process = ctypes.CDLL(None)
        return process.openblas_set_num_threads, process.openblas_get_num_threads
    except (AttributeError, OSError):
        return None


_control: BlasThreads | None = None
_decided = False


def blas_threads() -> BlasThreads | None:
    """The process's control (made once), or None where there is nothing to control: no
    OpenBLAS in the process, a GPU backend, or ``FLASHBATCH_BLAS_THREADS=default``."""
    global _control, _decided
    if _decided:
        return _control
    _decided = True
    setting = os.environ.get(THREADS_ENV_VAR, "auto").strip().lower()
    if setting == "default":
        return None
    import mlx.core as mx

    if mx.default_device().type != mx.DeviceType.cpu:
        return None
    symbols = _symbols()
    if symbols is None:
        return None
    set_threads, get_threads = symbols
    set_threads.argtypes, set_threads.restype = [ctypes.c_int], None
    get_threads.restype = ctypes.c_int
    default = max(1, int(get_threads()))
    fixed = None
    if setting != "auto":
        try:
            fixed = max(1, int(setting))
        except ValueError:
            log.warning("%s=%r is not auto, default or a count: using auto",
                        THREADS_ENV_VAR, setting)  # fmt: skip
    # One core for MLX's own thread and the event loop, the rest for small matmuls.
    small = max(1, min(default, (os.cpu_count() or 1) - 1))
    _control = BlasThreads(set_threads, default, small, fixed)
    return _control


def restore_default_threads() -> None:
    """OpenBLAS's own thread count, if the engine changed it (baselines run with it)."""
    if _control is not None:
        _control.restore()
