"""How many threads OpenBLAS may use for small forwards (an operator's setting, CPU backend).

On the CPU backend every matmul is a `cblas_sgemm` call from MLX's worker thread. A decode
step makes ~200 of them (7 a layer, plus the head), each on a few to a few dozen rows, and
with more than one thread each call hands work to OpenBLAS's workers and waits for them. On
the 2-core machine whether that pays changed from hour to hour (SmolLM2, float32, engine
steps of ~8 decoding rows, each setting run in turn; `bench/step_trace.py`):

- 2026-12-02 08:10 UTC: one thread 195-205 ms a step, two 290-645 ms (a whole serving run:
  output 1.34x faster on one thread, `BatchGenerator` 1.42x);
- 08:45 UTC: one thread 183 ms, two 135 ms (three runs each, one after the other in turn).

What differs is the machine's load from outside (a shared host), which no setting here can
see. So by default the engine leaves OpenBLAS's count alone, and ``FLASHBATCH_BLAS_THREADS=N``
lets an operator who measured their machine run forwards below `SMALL_FORWARD` positions
(decode and verify steps) on N threads; larger ones (prefill chunks, where two threads are
~2x faster) keep the library's count. Where the process has no OpenBLAS (macOS Accelerate, a
GPU, another BLAS) the setting is ignored.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

log = logging.getLogger("flashbatch.platform")

THREADS_ENV_VAR = "FLASHBATCH_BLAS_THREADS"
# Positions of a forward (tokens through the target) from which every thread helps: a prefill
# chunk. Below it, matmuls have a few dozen rows (measured crossover on 2 cores: 64-128).
SMALL_FORWARD = 128


class BlasThreads:
    """Sets OpenBLAS's thread count per forward (see the module docstring)."""

    def __init__(self, set_threads: ctypes._CFuncPtr, default: int, small: int) -> None:
        self._set = set_threads
        self.default = default  # OpenBLAS's own count (OPENBLAS_NUM_THREADS or the cores)
        self.small = small  # for forwards below SMALL_FORWARD positions
        self.current: int | None = None
        self.use(default)

    def fit(self, positions: int) -> int:
        """Set the count for a forward of this many positions; return it."""
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


def small_forward_threads() -> int | None:
    """The operator's count for small forwards, or None (unset, `default`, or not a count)."""
    setting = os.environ.get(THREADS_ENV_VAR, "default").strip().lower()
    if setting in ("", "default"):
        return None
    try:
        return max(1, int(setting))
    except ValueError:
        log.warning("%s=%r is neither a thread count nor 'default': ignored",
                    THREADS_ENV_VAR, setting)  # fmt: skip
        return None


@functools.cache
def blas_threads() -> BlasThreads | None:
    """The process's control (made once), or None where there is nothing to do: no setting,
    no OpenBLAS in the process, or a GPU backend."""
    small = small_forward_threads()
    if small is None:
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
    return BlasThreads(set_threads, max(1, int(get_threads())), small)


def restore_default_threads() -> None:
    """OpenBLAS's own thread count, if the engine changed it (baselines run with it)."""
    control = blas_threads()
    if control is not None:
        control.restore()
