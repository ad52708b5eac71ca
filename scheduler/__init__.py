"""Continuous batching: request lifecycle, admission, step planning, depth policy.

Arrives with the engine-core issue; nothing here yet.
"""
