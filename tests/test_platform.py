"""The BLAS preload: on by itself on Linux when OpenBLAS is present, off by setting, and honest
about which BLAS is active."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine.backend.platform import blas_status

OPENBLAS_PATHS = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
)
OPENBLAS_PRESENT = any(os.path.exists(p) for p in OPENBLAS_PATHS)


def _status_in_fresh_process(code_before: str = "", env: dict | None = None) -> str:
    script = (
        f"{code_before}\nimport logging, engine\nlogging.basicConfig(level=logging.INFO)\n"
        "s = engine.report_blas()\nprint('STATUS', s.name, s.fast)"
    )
    run_env = dict(os.environ)
    run_env.update(env or {})
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=run_env, check=True
    )
    return out.stdout + out.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the preload is Linux-only")
@pytest.mark.skipif(not OPENBLAS_PRESENT, reason="OpenBLAS is not installed here")
def test_openblas_is_preloaded_and_reported():
    assert blas_status().name == "openblas" and blas_status().fast
    with open("/proc/self/maps") as maps:
        assert "libopenblas" in maps.read()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the preload is Linux-only")
def test_setting_turns_the_preload_off_and_the_slow_blas_is_warned_about():
    output = _status_in_fresh_process(env={"FLASHBATCH_BLAS": "off"})
    assert "STATUS reference False" in output
    assert "WARNING" in output and "slow reference BLAS" in output


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the preload is Linux-only")
def test_importing_mlx_first_is_detected():
    output = _status_in_fresh_process(code_before="import mlx.core")
    assert "STATUS reference False" in output
    assert "imported before" in output


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the preload is Linux-only")
@pytest.mark.skipif(not OPENBLAS_PRESENT, reason="OpenBLAS is not installed here")
def test_openblas_the_application_loaded_before_mlx_is_recognised():
    """An embedding application that loads OpenBLAS globally itself, then mlx, then engine:
    MLX's matmuls use that OpenBLAS, so no slow-BLAS warning (it used to assume the worst)."""
    path = next(p for p in OPENBLAS_PATHS if os.path.exists(p))
    loader = f"import ctypes; ctypes.CDLL({path!r}, mode=ctypes.RTLD_GLOBAL); import mlx.core"
    output = _status_in_fresh_process(code_before=loader)
    assert "STATUS openblas True" in output
    assert "WARNING" not in output and "already loaded" in output


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the preload is Linux-only")
@pytest.mark.skipif(not OPENBLAS_PRESENT, reason="OpenBLAS is not installed here")
def test_openblas_loaded_privately_does_not_count():
    """A copy loaded without global visibility is not where MLX looks: still the warning."""
    path = next(p for p in OPENBLAS_PATHS if os.path.exists(p))
    loader = f"import ctypes; ctypes.CDLL({path!r}, mode=ctypes.RTLD_LOCAL); import mlx.core"
    output = _status_in_fresh_process(code_before=loader)
    assert "STATUS reference False" in output and "WARNING" in output
