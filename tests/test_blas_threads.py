"""OpenBLAS's thread count for small forwards (an operator's setting): the set count below
SMALL_FORWARD positions, the library's own above, nothing changed without the setting, the
library's count back for baselines, and the engine setting it per step."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine.backend import blas_threads as bt
from engine.backend.blas_threads import SMALL_FORWARD, BlasThreads


class RecordingSetter:
    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, threads: int) -> None:
        self.calls.append(threads)


def test_small_forwards_get_the_small_count_and_large_ones_all_threads():
    setter = RecordingSetter()
    control = BlasThreads(setter, default=2, small=1)
    assert setter.calls == [2]  # starts at the library's own count
    assert control.fit(8) == 1 and control.fit(SMALL_FORWARD - 1) == 1
    assert control.fit(SMALL_FORWARD) == 2 and control.fit(4096) == 2
    assert setter.calls == [2, 1, 2]  # the library is called only on a change
    control.fit(1)
    control.restore()
    assert setter.calls[-2:] == [1, 2]


def test_the_setting_is_read_as_a_count_or_default(monkeypatch):
    for value, expected in (("", None), ("default", None), ("1", 1), ("3", 3), ("0", 1),
                            ("many", None)):  # fmt: skip
        monkeypatch.setenv(bt.THREADS_ENV_VAR, value)
        assert bt.small_forward_threads() == expected
    monkeypatch.delenv(bt.THREADS_ENV_VAR)
    assert bt.small_forward_threads() is None  # by default the library's count stays


def _in_fresh_process(code: str, env: dict[str, str]) -> str:
    run_env = {**os.environ, **env}
    script = "import engine\nfrom engine.backend.blas_threads import blas_threads\n" + code
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=run_env, check=True)  # fmt: skip
    return out.stdout.strip()


OPENBLAS = os.path.exists("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0")


@pytest.mark.skipif(not OPENBLAS, reason="needs Debian's libopenblas0-pthread")
def test_the_library_count_follows_the_forward_size():
    code = (
        "import ctypes\nget = ctypes.CDLL(None).openblas_get_num_threads\n"
        "c = blas_threads()\nc.fit(4); small = get()\nc.fit(512); large = get()\n"
        "print(c.small, c.default, small, large)"
    )
    env = {"OPENBLAS_NUM_THREADS": "2", bt.THREADS_ENV_VAR: "1"}
    assert _in_fresh_process(code, env).split() == ["1", "2", "1", "2"]
    unset = {"OPENBLAS_NUM_THREADS": "2", bt.THREADS_ENV_VAR: "default"}
    assert _in_fresh_process("print(blas_threads())", unset) == "None"


def test_the_runner_sets_the_count_for_each_step():
    """Every step's forwards run at the count for its positions: prefill tokens, one per
    decoding row, plus the drafted ones; the lookahead by its rows."""
    from engine import AsyncEngine, EngineConfig, SamplingParams
    from engine.bundled.pair import bundled_paths

    target, drafter = bundled_paths()
    sizes: list[int] = []
    steps: list[int] = []

    class Recording(BlasThreads):
        def fit(self, positions: int) -> int:
            sizes.append(positions)
            return super().fit(positions)

    import asyncio

    async def main() -> list[list[int]]:
        config = EngineConfig(target=str(target), drafter=str(drafter), max_num_seqs=4)
        async with AsyncEngine(config) as eng:
            eng._runner.blas = Recording(RecordingSetter(), default=2, small=1)
            eng.step_hooks.append(lambda r: steps.append(r.prefill_tokens + r.verify_tokens))
            params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

            async def one(prompt: str) -> list[int]:
                ids: list[int] = []
                async for out in eng.generate(prompt, params):
                    ids += out.token_ids
                return ids

            return await asyncio.gather(*[one(p) for p in ("def add(a, b):", "import os\n")])

    outputs = asyncio.run(main())
    assert all(len(ids) == 12 for ids in outputs)
    # Each step's positions were set before it ran (a step computed ahead: its rows, when it
    # was launched). A plan's depth is an upper bound: a row whose proposal held fewer drafts
    # verifies fewer positions than were counted.
    missing = [n for n in steps if not any(n <= f <= n + 7 for f in sizes)]
    assert steps and not missing, f"steps {steps} fits {sizes}"
    assert max(steps) > 2  # the prompts' prefill, drafts or both
