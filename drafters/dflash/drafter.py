"""DFlash as a `Drafter`: a model-lifetime object with one context-cache row per session.

Session rules (after Ollama's DFlash draft session):
- committed target positions are *buffered* as pending feature rows; the next proposal writes
  them into the context cache in the same forward as its block (lazy append), so rejected
  drafts never reach the cache and there is nothing to roll back on the drafter side;
- a session that does not draft pays nothing: its pending rows (the prompt's, then every
  step's) wait for its next proposal, which writes them all in its one forward. A request
  the controller never drafts for with DFlash never runs the drafter at all. Measured on the
  bundled pair, 32 clients, 350-token prompts, drafting parked: writing every prompt at its
  join (the old rule, a flush at 256 pending rows) cost the adaptive engine 23% more CPU
  than drafting off and 16% of its throughput; waiting costs neither;
- a step's rows arrive together (`commit_step`): the step's feature array is journalled
  once for all sessions (`engine.step.feature_journal.FeatureJournal`), and every
  `MERGE_EVERY` steps, or
  when a session's rows are needed, each session's journalled rows are gathered into one
  array of its own (a memory copy, no forward; one op per session per 64 steps, not one per
  step). Only past `flush_cap` rows (a long request that never drafts) are they written by
  a context-only forward, to bound the memory a parked session holds;
- invariant: ``context_rows + pending_rows == target cache length`` after every step;
- opening and closing sessions only mark membership: the cache's rows follow at its next use,
  in one filter and one append however many sessions came and went (a step's joins and
  leaves would otherwise copy the whole drafter cache once each).

Block truncation: a proposal runs ``max(depths) + 1`` block rows, not the trained block size.
The rows past the deepest draft are MASK tokens that only carry a position; dropping them
barely moves the drafts (bundled pair: the same tau on all three workloads at depths 3 and 7,
draft probabilities within 1e-3), while the drafter's cost grows with its rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from drafters.base import Candidates
from drafters.dflash.config import validate_pairing
from drafters.dflash.model import DFlashDraftModel
from drafters.dflash.vocab import DraftHead
from engine.step.feature_journal import FeatureJournal
from engine.step.kv_cache import RaggedKVCache

if TYPE_CHECKING:
    from engine.step.target import TargetAdapter

# Pending rows a session may hold before a context-only forward writes them: feature rows
# cost about as much memory as the drafter's context K/V they become (2.3x on the bundled
# pair), so this bounds a parked session's memory at about that of 4k drafter positions.
FLUSH_CAP = 4096
# What one more (context-only) drafter forward costs, in padded context positions (see
# `backlogs_to_write_first`). Bundled pair: a context row ~9 us, the forward's fixed part
# ~1.3 ms; eight rows, one of them 256 pending, went from 35 ms padded to 9.6 ms split.
SPLIT_FORWARD_ROWS = 128


class DFlashSession:
    """One request's draft state: its cache row and the feature rows not yet written."""

    def __init__(self, drafter: DFlashDrafter) -> None:
        self._drafter = drafter
        self.pending: list[mx.array] = []  # gathered rows (the journal may hold more)
        self.pending_rows = 0  # all rows not yet written: in `pending` and in the journal

    @property
    def context_rows(self) -> int:
        return self._drafter.cache[0].lengths[self._drafter.row_of(self)]


class DFlashDrafter:
    """Batched DFlash drafting for many sessions; see the module docstring."""

    def __init__(
        self,
        model: DFlashDraftModel,
        target: TargetAdapter,
        flush_cap: int = FLUSH_CAP,
        truncate_block: bool = True,
        draft_vocab: np.ndarray | None = None,
    ) -> None:
        config = model.config
        validate_pairing(config, target.shape, model.fc.weight.shape[1])
        if target.layer_ids != config.target_layer_ids:
            raise ValueError(
                f"target is tapped at {target.layer_ids}, drafter needs {config.target_layer_ids}"
            )
        self.model = model
        self.target = target
        self.config = config
        self.block_size = config.block_size
        self.mask_token_id = config.mask_token_id
        self.flush_cap = flush_cap
        self.truncate_block = truncate_block
        # The LM head restricted to the draft vocabulary (`vocab.py`); None: the full head.
        self.head = DraftHead(target, draft_vocab) if draft_vocab is not None else None
        self._cache: list[RaggedKVCache] = model.make_cache(0)
        self._sessions: list[DFlashSession] = []  # open sessions; cache-row order once synced
        self._cache_rows: list[DFlashSession] = []  # whose row each cache row is
        self._journal: FeatureJournal[DFlashSession] = FeatureJournal()
        self._unevaluated: list[mx.array] = []  # gathered pending rows, for the caller's sync
        model.fuse_context_projections()

    @property
    def max_depth(self) -> int:
        return self.block_size - 1

    @property
    def cache(self) -> list[RaggedKVCache]:
        """The per-layer context cache, one row per open session (in opening order)."""
        if self._cache_rows != self._sessions:
            self._sync_rows()
        return self._cache

    def row_of(self, session: DFlashSession) -> int:
        return self._sessions.index(session)

    # ----------------------------------------------------------------- lifecycle
    def open(self, prompt_ids: Sequence[int] = ()) -> DFlashSession:
        session = DFlashSession(self)
        self._sessions.append(session)
        return session

    def close(self, session: DFlashSession) -> None:
        self._sessions.remove(session)
        session.pending.clear()  # its journalled rows are skipped at the next gather
        session.pending_rows = 0

    def _sync_rows(self) -> None:
        """Drop closed sessions' rows (one filter), append opened ones (one extend). Sessions
        only ever join at the end, so survivors keep their order and newcomers follow."""
        still_open = set(self._sessions)
        keep = [i for i, s in enumerate(self._cache_rows) if s in still_open]
        if len(keep) < len(self._cache_rows):
            for layer_cache in self._cache:
                layer_cache.filter(keep)
        joined = len(self._sessions) - len(keep)
        if joined:
            for layer_cache in self._cache:
                layer_cache.extend(RaggedKVCache(joined))
        self._cache_rows = list(self._sessions)

    def commit(
        self, session: DFlashSession, features: mx.array, tokens: Sequence[int] = ()
    ) -> None:
        """Buffer feature rows [n, F] of newly committed target positions (DFlash conditions
        on features only; the tokens are not needed). A decode step's rows come through
        `commit_step` instead."""
        if features.shape[0] == 0:
            return
        if session in self._journal.rows:  # its journalled rows come first
            self._gather()
        session.pending.append(features)
        session.pending_rows += features.shape[0]
        if session.pending_rows >= self.flush_cap:
            self.flush([session])

    def commit_step(
        self, features: mx.array, blocks: list[tuple[DFlashSession, int, Sequence[int]]]
    ) -> None:
        """One decode step's committed positions for many sessions: `features` [N, F] is the
        step's whole feature array, and each block (session, start, tokens) says the session's
        positions are rows start..start+len(tokens)-1 of it. Journalled, not sliced (see the
        module docstring)."""
        rows, over = [], []
        for session, start, tokens in blocks:
            count = len(tokens)
            rows.append((session, start, count))
            session.pending_rows += count
            if session.pending_rows >= self.flush_cap:
                over.append(session)
        if self._journal.record(features, rows) or over:
            # Computed by the caller's next sync (`take_unevaluated`) or the proposal that
            # reads them; an `async_eval` here would hold the host behind the forward in flight.
            self._gather()
        if over:  # written now, computed with the caller's next sync too
            self._write(over)
            self._unevaluated += [a for c in self.cache for a in c.state]

    def _gather(self) -> None:
        """Move every open session's journalled rows into its pending list."""
        open_sessions = set(self._sessions)
        for session, rows in self._journal.gather(open_sessions.__contains__).items():
            session.pending.append(rows)
            self._unevaluated.append(rows)

    def take_unevaluated(self) -> list[mx.array]:
        """Pending rows gathered lazily since the last call, for the caller to compute with
        its next evaluation (which then releases the step arrays they were taken from).
        A caller that never takes them only loses that early release: each flush and
        proposal drops the list, so it cannot grow without bound."""
        arrays, self._unevaluated = self._unevaluated, []
        return arrays

    def flush(self, sessions: list[DFlashSession], release: bool = True) -> None:
        """Write the sessions' pending rows with a context-only forward (no block); `release`:
        evaluate it now (a proposal that follows at once evaluates it with its own)."""
        self._unevaluated = []  # see `take_unevaluated`
        if len(self._journal):
            self._gather()
        if self._write(sessions) and release:
            # so the buffered features are released even if the session never drafts
            mx.async_eval([a for c in self.cache for a in c.state])

    def _write(self, sessions: list[DFlashSession]) -> bool:
        """The context-only forward of `flush` (the journal gathered before); False when
        none of the sessions had rows to write."""
        sessions = [s for s in sessions if s.pending_rows]
        if not sessions:
            return False
        rows = [self.row_of(s) for s in sessions]
        cache = self._rows_view(rows)
        features, counts = _take_pending(sessions)
        self.model.append_context(features, counts, cache)
        self._write_back(rows, cache)
        return True

    # ----------------------------------------------------------------- drafting
    def propose(
        self, sessions: list[DFlashSession], anchors: list[int], depths: list[int]
    ) -> Candidates:
        """Draft for `sessions`: block ``[anchor, MASK...]``, one forward; the block has
        ``max(depths) + 1`` rows (see block truncation above), or the trained size."""
        if not sessions:
            raise ValueError("propose needs at least one session")
        if any(not 0 < d <= self.max_depth for d in depths):
            raise ValueError(f"depths {depths} must lie in [1, {self.max_depth}]")
        first = backlogs_to_write_first([s.pending_rows for s in sessions], sessions)
        self.flush(first, release=False)  # gathers the journal too
        rows = [self.row_of(s) for s in sessions]
        cache = self._rows_view(rows)
        features, counts = _take_pending(sessions)
        depth = max(depths)
        masks = depth if self.truncate_block else self.block_size - 1
        block = [[anchor] + [self.mask_token_id] * masks for anchor in anchors]
        hidden = self.model(self.target.embed(mx.array(block)), cache, features, counts)
        self._write_back(rows, cache)
        # Only the rows that will be verified go through the (large) LM head.
        verified = hidden[:, 1 : 1 + depth]
        if self.head is None:
            logits = self.target.unembed(verified).astype(mx.float32)
            tokens = mx.argmax(logits, axis=-1).astype(mx.int32)
        else:
            logits = self.head(verified).astype(mx.float32)
            tokens = self.head.to_target(mx.argmax(logits, axis=-1))
        # The drafter's confidence, normalised over the draft vocabulary when it has one.
        probs = mx.exp(logits.max(axis=-1) - mx.logsumexp(logits, axis=-1))
        return Candidates(tokens=tokens, probs=probs, depths=list(depths))

    # ----------------------------------------------------------------- row subsets
    def _rows_view(self, rows: list[int]) -> list[RaggedKVCache]:
        """The cache itself when all rows take part, else a copy of those rows."""
        if rows == list(range(len(self._sessions))):
            return self.cache
        return [layer_cache.take_rows(rows) for layer_cache in self.cache]

    def _write_back(self, rows: list[int], view: list[RaggedKVCache]) -> None:
        if view is not self.cache:
            for layer_cache, taken in zip(self.cache, view):
                layer_cache.put_rows(rows, taken)


def backlogs_to_write_first(counts: list[int], sessions: list[DFlashSession]) -> list:
    """The sessions whose pending rows a context-only forward should write before a proposal.

    A proposal pads every session's pending rows to the longest (one [B, S_max, F] array), so
    one catch-up (a request's prompt at its first proposal, or the rows it sat out) made every
    row beside it run that many context positions: two probed rows, one with a 300-token
    prompt, ran 600. Writing the longest backlogs first, padded among themselves, leaves the
    proposal padded to the rest. Chosen to minimise padded positions, each extra forward
    counted as SPLIT_FORWARD_ROWS positions."""
    order = sorted(range(len(counts)), key=counts.__getitem__)
    ranked = [counts[i] for i in order]
    n = len(ranked)
    best_cut, best_cost = n, n * ranked[-1] if ranked else 0
    for cut in range(1, n):  # the `cut` shortest stay in the proposal
        cost = n * ranked[cut - 1] + (n - cut) * ranked[-1] + SPLIT_FORWARD_ROWS
        if cost < best_cost:
            best_cut, best_cost = cut, cost
    return [sessions[i] for i in order[best_cut:]]


def _take_pending(sessions: list[DFlashSession]) -> tuple[mx.array | None, list[int]]:
    """Pending rows of each session, right-padded with zeros to one [B, S_max, F] array."""
    counts = [s.pending_rows for s in sessions]
    longest = max(counts)
    if longest == 0:
        return None, counts
    sample = next(x for s in sessions for x in s.pending)
    rows = []
    for session in sessions:
        parts = list(session.pending)
        if session.pending_rows < longest:
            parts.append(mx.zeros((longest - session.pending_rows, sample.shape[-1]), sample.dtype))
        rows.append(mx.concatenate(parts, axis=0))
        session.pending = []
        session.pending_rows = 0
    return mx.stack(rows), counts
