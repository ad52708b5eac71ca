"""Process tuning (engine.backend.process_tuning): freed activations stay in the process, the GIL
switch interval is short, the collector leaves a loaded engine alone, and the engine applies
all of it only when allowed."""

from __future__ import annotations

import gc
import os
import platform
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import pytest

from engine.async_engine import AsyncEngine
from engine.backend import process_tuning
from engine.bundled.pair import bundled_paths
from engine.config import EngineConfig

ROOT = Path(__file__).resolve().parent.parent

# The pattern that faulted in the engine: the row-padding measurement (which frees a 2.4 MB
# weight, moving glibc's dynamic thresholds), then a prefill-sized SwiGLU, ten times.
_FAULTS_SCRIPT = textwrap.dedent(
    """
    import resource, sys
    import engine  # noqa: F401  (the BLAS preload comes before mlx)
    import mlx.core as mx
    from engine.backend import cpu_kernels
    from engine.backend import process_tuning
    from engine.step import row_padding
    if sys.argv[1] == "tuned":
        process_tuning.tune_process()
    row_padding.measure(384)
    gate, x = mx.random.normal((400, 1024)), mx.random.normal((400, 1024))
    mx.eval(gate, x, cpu_kernels.swiglu(gate, x))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        mx.eval(cpu_kernels.swiglu(gate, x))
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)


def _page_faults(mode: str) -> int:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", _FAULTS_SCRIPT, mode], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=True)  # fmt: skip
    return int(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="the allocator part is for glibc only",
)
def test_tuned_allocator_reuses_freed_activations_instead_of_faulting_pages():
    untuned = _page_faults("untuned")
    tuned = _page_faults("tuned")
    # Ten SwiGLUs over [400, 1024] write about 80 MB of intermediates; kept blocks fault none.
    assert tuned < 100, tuned
    if untuned < 1000:
        pytest.skip(f"this glibc did not fault without the tuning ({untuned} faults)")
    assert tuned < untuned / 10


def test_tune_process_shortens_the_switch_interval_once_and_reports_it():
    first = process_tuning.tune_process()
    assert sys.getswitchinterval() <= process_tuning.SWITCH_INTERVAL_SECONDS
    assert "switch interval" in first.switch_interval
    assert process_tuning.tune_process() is first  # once per process
    if platform.libc_ver()[0] == "glibc":
        assert first.allocator.startswith("glibc malloc")


def test_environment_turns_it_off(monkeypatch):
    monkeypatch.setenv(process_tuning.ENV_VAR, "0")
    assert not process_tuning.wanted()
    monkeypatch.setenv(process_tuning.ENV_VAR, "1")
    assert process_tuning.wanted()


async def test_engine_leaves_the_process_alone_when_told(monkeypatch):
    calls = []
    monkeypatch.setattr(process_tuning, "tune_process", lambda: calls.append(1))
    target, _ = bundled_paths()
    frozen = []
    for allowed in (False, True):
        config = EngineConfig(target=str(target), draft_sources=[], process_tuning=allowed,
                              prefix_cache_bytes=0)  # fmt: skip
        engine = AsyncEngine(config)
        await engine.start()
        frozen.append(gc.get_freeze_count())
        await engine.shutdown()
    assert calls == [1]
    assert frozen[0] == 0 and frozen[1] > 1000  # the loaded model's objects, when allowed


async def test_a_started_engine_freezes_what_it_loaded_and_thaws_it_at_shutdown():
    """While engines run, the collector's full walks skip the loaded models; once the last
    one shuts down nothing stays frozen, so a model it dropped can be collected."""
    assert gc.get_freeze_count() == 0
    target, drafter = bundled_paths()
    config = EngineConfig(target=str(target), drafter=str(drafter), prefix_cache_bytes=0)
    first, second = AsyncEngine(config), AsyncEngine(config)
    await first.start()
    model = weakref.ref(first._runner.target.model)
    after_first = gc.get_freeze_count()
    assert after_first > 1000
    await second.start()
    assert gc.get_freeze_count() > after_first
    await first.shutdown()
    assert gc.get_freeze_count() > 0  # the second engine still runs: its objects stay out
    await second.shutdown()
    assert gc.get_freeze_count() == 0
    del first
    gc.collect()
    assert model() is None  # nothing of the first engine was kept alive by the freeze


def test_bench_script_compares_tuned_and_untuned_processes_end_to_end():
    """`bench/process_tuning.py` runs one tuned and one untuned engine process on the bundled
    pair and reports both sides and their paired ratio."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "bench/process_tuning.py", "--requests", "1", "--max-tokens", "4",
         "--pairs", "1", "--runs", "1", "--policy", "adaptive"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    lines = done.stdout.splitlines()
    assert any(line.startswith("pair 0 tuned: ") for line in lines), done.stdout
    assert any(line.startswith("pair 0 untuned: ") for line in lines), done.stdout
    assert any(line.startswith("| tuned | ") for line in lines), done.stdout
    assert any(line.startswith("tuned / untuned throughput, paired by pair: ") for line in lines)
