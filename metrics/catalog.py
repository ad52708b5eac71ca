"""The catalogue of metric families the engine and its HTTP edge export.

Kept apart from both definitions so neither imports the other: `http_metrics` takes the
prefix from `engine_metrics`, and this module reads both.
"""

from __future__ import annotations

from metrics.engine_metrics import EngineMetrics
from metrics.http_metrics import HTTPMetrics


def metric_names() -> list[str]:
    """Every family name the engine and its HTTP server export (as Prometheus sees them,
    suffixes included)."""
    metrics = EngineMetrics("probe")
    HTTPMetrics("probe", metrics.registry)
    names = []
    for family in metrics.registry.collect():
        kind = family.type
        if kind == "counter":
            names.append(family.name + "_total")
        elif kind == "histogram":
            names += [family.name + s for s in ("_bucket", "_sum", "_count")]
        else:
            names.append(family.name)
    return sorted(names)


METRIC_NAMES = metric_names()
