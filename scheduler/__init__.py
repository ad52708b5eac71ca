"""Continuous batching: request lifecycle, admission, step planning, depth policies and the
choice of draft source per row (`scheduler.sources`)."""
