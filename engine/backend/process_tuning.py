"""Process-wide settings for a process that serves: the C allocator, the GIL's switch interval
and the garbage collector.

All three are measured on the 2-core Linux machine (bundled pair; README "Process tuning"):

- **glibc malloc keeps what MLX frees.** MLX's CPU allocator calls `malloc`/`free` directly
  (it has no buffer cache there, unlike Metal's). glibc serves a block over its mmap threshold
  (128 KB at first, then whatever size was freed last) with a fresh `mmap`, and trims a heap
  whose free top passes its trim threshold. A step's activations are exactly such blocks, so
  every step faulted fresh zeroed pages in again: a 400-row SwiGLU ran 4x slower (41 ms vs
  9.7 ms for ten) once the row-padding measurement had moved the dynamic threshold, and one
  adaptive request of 48 tokens faulted about 13,000 pages. Fixed thresholds (`mallopt`) keep
  blocks up to 32 MB in the heap and up to 256 MB of free heap in the process; a top pad of
  64 MB keeps glibc from unmapping a thread arena's heap (64 MB at most) whenever it empties,
  which at 32 SmolLM2 rows faulted ~170 pages a token even with the thresholds fixed. MLX's
  Metal allocator keeps freed buffers in the same way (its buffer cache).
- **The GIL changes hands sooner.** Each step hops from the event loop to the MLX thread and
  back; a thread that wants the GIL waits up to `sys.getswitchinterval()` (5 ms by default)
  while the other runs Python. 0.5 ms is shorter than a decode step on any backend.
- **The garbage collector leaves the loaded models alone.** A loaded engine holds some 80,000
  Python objects (modules, parameters, the tokenizer's tables) that live as long as it does.
  Python's full collection walks every one of them: at 32 clients on the bundled pair one ran
  every 5-15 seconds and stopped the event loop for 42-75 ms, two steps' worth of time for
  every stream at once. Once an engine has loaded, `freeze_loaded` collects what garbage there
  is and
  moves every object alive into the collector's permanent generation (`gc.freeze`, as SGLang
  and vLLM do after start-up), so later collections walk only what serving creates. When the
  last engine that froze shuts down the objects are handed back (`gc.unfreeze`), so a model
  dropped in a reference cycle can still be collected.

All are process-wide, so they are applied once, logged, and can be turned off:
``EngineConfig(process_tuning=False)`` or ``FLASHBATCH_PROCESS_TUNING=0``. Where libc is not
glibc (macOS, musl) the allocator part is skipped.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import platform
import sys
from dataclasses import dataclass

log = logging.getLogger("flashbatch.engine")

ENV_VAR = "FLASHBATCH_PROCESS_TUNING"
# glibc's mallopt parameters (malloc.h) and the largest mmap threshold it accepts on 64-bit.
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
TRIM_THRESHOLD_BYTES = 256 * 1024 * 1024
TOP_PAD_BYTES = 64 * 1024 * 1024  # a thread arena's whole heap (64 MB) is then never unmapped
SWITCH_INTERVAL_SECONDS = 0.0005


@dataclass(frozen=True)
class ProcessTuning:
    """What `tune_process` did: each field is a short description, or why it was skipped."""

    allocator: str
    switch_interval: str


_applied: ProcessTuning | None = None


def wanted() -> bool:
    """Unless turned off with ``FLASHBATCH_PROCESS_TUNING=0``."""
    return os.environ.get(ENV_VAR, "1") != "0"


def _tune_allocator() -> str:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "skipped (libc is not glibc)"
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return "skipped (no mallopt)"
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    settings = {_M_MMAP_THRESHOLD: MMAP_THRESHOLD_BYTES, _M_TRIM_THRESHOLD: TRIM_THRESHOLD_BYTES,
                _M_TOP_PAD: TOP_PAD_BYTES}  # fmt: skip
    if not all(mallopt(param, value) for param, value in settings.items()):
        return "skipped (mallopt refused)"
    mb = [value >> 20 for value in settings.values()]
    return f"glibc malloc: mmap threshold {mb[0]} MB, trim threshold {mb[1]} MB, top pad {mb[2]} MB"


def _tune_switch_interval() -> str:
    if sys.getswitchinterval() > SWITCH_INTERVAL_SECONDS:
        sys.setswitchinterval(SWITCH_INTERVAL_SECONDS)
    return f"GIL switch interval {sys.getswitchinterval() * 1e3:g} ms"


def applied() -> ProcessTuning | None:
    """What `tune_process` did in this process, or None if it has not run."""
    return _applied


def tune_process_if_wanted() -> ProcessTuning | None:
    """`tune_process` unless ``FLASHBATCH_PROCESS_TUNING=0``: what every caller (the engine,
    the benches) applies, so they all run under the same settings."""
    return tune_process() if wanted() else None


def tune_process() -> ProcessTuning:
    """Apply both settings once per process (later calls return the first result)."""
    global _applied
    if _applied is None:
        _applied = ProcessTuning(_tune_allocator(), _tune_switch_interval())
        log.info("process tuning: %s; %s", _applied.allocator, _applied.switch_interval)
    return _applied


_freezers = 0  # engines started with a frozen heap and not yet shut down


def freeze_loaded() -> int:
    """After an engine has loaded: collect, then move every object alive out of the cyclic
    collector's walks (see the module docstring); returns how many objects are frozen.
    Pair each call with one `thaw`."""
    global _freezers
    gc.collect()
    gc.freeze()
    _freezers += 1
    count = gc.get_freeze_count()
    log.info("process tuning: %d objects alive after loading left out of garbage collection", count)
    return count


def thaw() -> None:
    """An engine that froze shuts down: the last one hands every frozen object back."""
    global _freezers
    if _freezers == 0:
        return
    _freezers -= 1
    if _freezers == 0:
        gc.unfreeze()
