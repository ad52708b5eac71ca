"""Prompt-lookup drafting: an incremental n-gram index per request, no forward."""

from drafters.lookup.drafter import LookupDrafter, LookupSession
from drafters.lookup.index import NGramIndex

__all__ = ["LookupDrafter", "LookupSession", "NGramIndex"]
