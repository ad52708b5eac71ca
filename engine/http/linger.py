"""Lingering close: answer early, then read and drop the rest of the request before closing.

When the server answers before it has read a request's body (a 413 for a body over the limit, a
401, a 400 for ambiguous framing) and then closes, the client's unread bytes still sit in the
kernel: closing a socket with unread input sends a TCP reset, and a reset discards the answer
the client has not read yet. Clients that finish writing before they read (httpx.AsyncClient,
AsyncOpenAI) then see a connection error instead of the 413, and retry a request that can never
succeed. nginx's remedy ("lingering close", `lingering_time` / `lingering_timeout`) is done
here: half-close the write side after the answer (the client sees the answer, then EOF), keep
reading and discarding what the client still sends, and close when the client is done, or when
a bound in bytes, in total seconds or in idle seconds is reached.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

LINGER_BYTES = 128 << 20  # discarded at most per connection; then the connection is reset
LINGER_SECONDS = 30.0  # total time a closing connection lingers (nginx: lingering_time 30 s)
LINGER_IDLE_SECONDS = 5.0  # ... and without input (nginx: lingering_timeout 5 s)


class LingeringTransport:
    """The transport as uvicorn's protocol sees it. `close()` lingers while `wants_linger()`
    (the client is still sending a body); everything else goes to the real transport."""

    def __init__(
        self,
        transport: asyncio.Transport,
        loop: asyncio.AbstractEventLoop,
        wants_linger: Callable[[], bool],
        max_bytes: int = LINGER_BYTES,
        max_seconds: float = LINGER_SECONDS,
        idle_seconds: float = LINGER_IDLE_SECONDS,
    ) -> None:
        self._transport = transport
        self._loop = loop
        self._wants_linger = wants_linger
        self._max_bytes, self._max_seconds, self._idle = max_bytes, max_seconds, idle_seconds
        self.lingering = False
        self.discarded = 0
        self._deadline: asyncio.TimerHandle | None = None
        self._idle_timer: asyncio.TimerHandle | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def close(self) -> None:
        if self.lingering:
            return
        if self._transport.is_closing() or not self._wants_linger():
            self._transport.close()
            return
        self.lingering = True
        if self._transport.can_write_eof():
            self._transport.write_eof()  # after the buffered answer: the client reads it, then EOF
        self._transport.resume_reading()  # uvicorn's flow control may have paused it
        self._deadline = self._loop.call_later(self._max_seconds, self.close_now)
        self._arm_idle()

    def close_now(self) -> None:
        """Stop lingering (a bound was reached, the client finished, or the server stops)."""
        for timer in (self._deadline, self._idle_timer):
            if timer is not None:
                timer.cancel()
        self._deadline = self._idle_timer = None
        self.lingering = False
        self._transport.close()

    def discard(self, data: bytes) -> None:
        """Input that arrives while lingering: counted and dropped."""
        self.discarded += len(data)
        if self.discarded > self._max_bytes:
            self.close_now()
        else:
            self._arm_idle()

    def _arm_idle(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        self._idle_timer = self._loop.call_later(self._idle, self.close_now)
