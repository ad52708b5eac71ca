"""What a benchmark run can choose from: workloads, engines and the shipped draft model.

A leaf module, so `bench.cli` (arguments) and `bench.suite` (the run) both read it without
importing each other.
"""

from __future__ import annotations

from pathlib import Path

WORKLOADS = ("completion", "editing", "prose", "chat", "mixed")
ENGINE_KINDS = ("mlx-lm", "batch-generator", "mlx-lm-spec", "flashbatch")
DEFAULT_AR_DRAFT = str(Path(__file__).with_name("ar_draft"))  # shipped; bench/train_ar_draft.py
