"""Rank 0's model runner in distributed mode: every call that may run a forward goes to the
followers first, so every rank's runner makes the same calls in the same order.

A step's plan crosses as the pickled call `("call", "execute", (plan,), {})`: one small byte
array summed over the group before the forward (`Group.broadcast_object`). Reads of facts
(`kv_bytes`, `rows`, ...) stay local. Setting `prefix_caching` is mirrored too (it changes
what a step does); `grammars` is not (each rank compiles its own from its own tokenizer).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from engine.distributed.follower import CALL, SET, STOP
from engine.distributed.group import Group

# The runner's methods that run a forward (or decide a later one's shape). `advance` is not
# among them: the engine calls it right after `execute` exactly when the runner has a
# lookahead pending, which every rank knows alike, so a follower advances on its own.
MIRRORED_CALLS = frozenset(
    {"execute", "profile", "bytes_per_token", "bytes_per_row", "prefix_bytes_per_token"}
)
MIRRORED_SETS = frozenset({"prefix_caching"})


class MirroredRunner:
    """Wraps rank 0's `ModelRunner`; see the module docstring."""

    def __init__(self, runner: Any, group: Group) -> None:
        object.__setattr__(self, "_runner", runner)
        object.__setattr__(self, "_group", group)
        object.__setattr__(self, "_stopped", False)
        object.__setattr__(self, "_observe", None)

    @property
    def ranks(self) -> int:
        return self._group.size

    def watch_broadcasts(self, observe: Callable[[float], None]) -> None:
        """Call `observe(seconds)` with the time of every call's broadcast (the metrics)."""
        object.__setattr__(self, "_observe", observe)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._runner, name)
        if name not in MIRRORED_CALLS:
            return value
        group = self._group

        def mirrored(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            group.broadcast_object((CALL, name, args, kwargs))
            if self._observe is not None:
                self._observe(time.perf_counter() - started)
            return value(*args, **kwargs)

        return mirrored

    def __setattr__(self, name: str, value: Any) -> None:
        if name in MIRRORED_SETS:
            self._group.broadcast_object((SET, name, value))
        setattr(self._runner, name, value)

    def stop_followers(self) -> None:
        """Tell every follower to leave its loop (once; a lost group is not an error here)."""
        if self._stopped:
            return
        object.__setattr__(self, "_stopped", True)
        try:
            self._group.broadcast_object((STOP,))
        except Exception:  # noqa: BLE001 (a follower already gone: nothing left to stop)
            pass
