"""Prometheus metric definitions and recording (the only place that imports prometheus_client).

Arrives with the serve-and-observe issue; nothing here yet.
"""
