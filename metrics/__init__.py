"""Prometheus metrics: definitions and recording (the only place that imports prometheus_client).

Names mirror vLLM's (prefix `flashbatch_` instead of `vllm:`) so existing dashboards and
autoscalers carry over; beyond vLLM: chosen draft depth per request-step, steps with drafting
parked by reason, step time by phase, batch size and MLX memory, and at the HTTP edge client
disconnects and connections the server closed. Every metric has the label `model_name`.
Recording happens on the asyncio loop, never on the MLX thread.
"""

from metrics.catalog import METRIC_NAMES
from metrics.engine_metrics import EngineMetrics
from metrics.http_metrics import HTTPMetrics

__all__ = ["EngineMetrics", "HTTPMetrics", "METRIC_NAMES"]
