"""Draft sources: which proposer a decoding row may take its drafts from on a step.

A request may draft from its DFlash session, from a prompt lookup over its own tokens, or
from neither. The engine serves some sources (its config; DFlash only with a drafter), a
request may narrow them (`SamplingParams.draft_sources`), and lookup is usable on a step only
when the row's suffix matches earlier text. The depth policy then picks one source per row.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

DFLASH = "dflash"
LOOKUP = "lookup"
ALL_SOURCES = (DFLASH, LOOKUP)
NO_SOURCE = "none"  # metric label of rows that verify without drafts


def parse_sources(value: str | Iterable[str] | None) -> list[str] | None:
    """`"dflash,lookup"`, a list, `"none"`/`""` (no drafting) or None (the default); unknown
    names raise ValueError."""
    if value is None:
        return None
    names = value.split(",") if isinstance(value, str) else list(value)
    names = [n.strip().lower() for n in names if n.strip()]
    if names == [NO_SOURCE]:
        return []
    unknown = [n for n in names if n not in ALL_SOURCES]
    if unknown:
        raise ValueError(f"unknown draft sources {unknown}: choose from {list(ALL_SOURCES)}")
    return [s for s in ALL_SOURCES if s in names]  # canonical order, no duplicates


def engine_sources(configured: Sequence[str] | None, has_dflash: bool) -> tuple[str, ...]:
    """The sources an engine serves: the configured ones (DFlash needs a drafter), by default
    both where a DFlash drafter exists and lookup otherwise."""
    if configured is None:
        return (DFLASH, LOOKUP) if has_dflash else (LOOKUP,)
    if DFLASH in configured and not has_dflash:
        raise ValueError("draft source 'dflash' needs a DFlash drafter (none is loaded)")
    return tuple(s for s in ALL_SOURCES if s in configured)


@dataclass(frozen=True)
class DraftOptions:
    """What one decoding row may draft from on the coming step."""

    sources: tuple[str, ...]  # usable now (lookup only when it has a match)
    lookup_match: int = 0  # length of the row's longest earlier suffix match (0 = none)
    max_depth: dict[str, int] | None = None  # per source, the most one proposal holds

    def depth_limit(self, source: str) -> int:
        return (self.max_depth or {}).get(source, 0)


def row_options(
    allowed: Sequence[str], lookup_match: int, max_depth: dict[str, int]
) -> DraftOptions:
    """A row's options: its allowed sources, lookup dropped while nothing matches."""
    usable = tuple(s for s in allowed if s != LOOKUP or lookup_match > 0)
    return DraftOptions(usable, lookup_match, max_depth)


def allowed_sources(requested: Sequence[str] | None, served: Sequence[str]) -> tuple[str, ...]:
    """The sources a request may use: those it asked for (None = all served) that are served."""
    if requested is None:
        return tuple(served)
    return tuple(s for s in served if s in requested)


class DraftLimits(Protocol):
    """What a request says about its drafting (`engine.step.sampling.SamplingParams`)."""

    @property
    def draft_sources(self) -> Sequence[str] | None: ...

    @property
    def num_speculative_tokens(self) -> int | None: ...


def may_draft(params: DraftLimits, source: str, served: Sequence[str] = ALL_SOURCES) -> bool:
    """Whether a request may ever draft from `source`: the engine serves it (`served`), the
    request's `draft_sources` allows it and its `num_speculative_tokens` is not 0. The one
    rule the runner (which sessions it opens), the scheduler (which rows it watches for a
    lookup match) and the depth policy (who may end a hold) share."""
    if params.num_speculative_tokens == 0:
        return False
    return source in allowed_sources(params.draft_sources, served)


def fallback_source(options: DraftOptions) -> str | None:
    """For policies that choose depths only: lookup when it matches (its drafts cost no
    forward), else DFlash, else nothing."""
    for source in (LOOKUP, DFLASH):
        if source in options.sources:
            return source
    return None
