"""Typed errors the engine raises to its callers (the HTTP layer maps them to status codes)."""

from __future__ import annotations


class FlashbatchError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequest(FlashbatchError, ValueError):
    """The request cannot be served as given (bad parameter, prompt too long, ...).

    `param` names the offending field where one is to blame; `code` is a machine-readable
    reason where one applies (OpenAI's `context_length_exceeded`), else None."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


class EngineOverloaded(FlashbatchError):
    """The waiting queue is full; retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineClosed(FlashbatchError):
    """The engine is shutting down or closed and accepts no new requests."""


class EngineFailed(EngineClosed):
    """The engine stopped for good while the request was in flight (in distributed mode: a
    rank died or could not be reached). Its partial answer is not an answer: HTTP 503."""
