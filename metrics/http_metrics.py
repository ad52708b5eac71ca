"""Metrics of the HTTP edge: what clients did to connections, as counts instead of log lines.

A client that hangs up, stalls or opens too many connections is a normal event at an internet
edge; logging each one would let any client flood the log, so they are counted here.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from metrics.engine_metrics import PREFIX

# Where a client can leave: while sending its body, while waiting for a non-streamed answer,
# or while an answer streams to it.
DISCONNECT_PHASES = ("upload", "wait", "stream")
# Why the server closed a connection itself.
CLOSE_REASONS = ("read_timeout", "connection_limit", "malformed_request")


class HTTPMetrics:
    """Counters of the HTTP edge, registered next to an engine's metrics."""

    def __init__(self, model_name: str, registry: CollectorRegistry) -> None:
        self.model_name = model_name
        labels = ["model_name"]
        # vLLM's name for the same count (`http_requests_client_disconnected_total`).
        self._disconnects = Counter(
            PREFIX + "http_requests_client_disconnected",
            "Requests whose client went away before the response ended, by phase.",
            labels + ["phase"],
            registry=registry,
        )
        self._closed = Counter(
            PREFIX + "http_connections_closed_by_server",
            "Connections the server closed on a slow, surplus or malformed client, by reason.",
            labels + ["reason"],
            registry=registry,
        )
        for phase in DISCONNECT_PHASES:  # export zeros from the start, so rate() works
            self._disconnects.labels(model_name, phase)
        for reason in CLOSE_REASONS:
            self._closed.labels(model_name, reason)

    def on_disconnect(self, phase: str) -> None:
        self._disconnects.labels(self.model_name, phase).inc()

    def on_server_close(self, reason: str) -> None:
        self._closed.labels(self.model_name, reason).inc()
