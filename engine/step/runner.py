"""The model runner: executes one step plan on the MLX thread.

Everything MLX lives here and is touched only from the engine's single MLX thread. One step:

1. rows of finished/aborted requests leave the batch (`remove_rows`: the last rows move into
   their places, one row copied per hole);
2. prefill chunks of new requests run, each request in its own small cache: inside the
   decoding rows' packed forward of step 3 where they can (`engine.step.packed.PrefillSegment`),
   else in forwards of their own first;
3. decode: one batched drafter forward for the rows with depth > 0, one batched target forward
   over ``[anchor, drafts...]`` of every row (packed: each row only its own ``1 + depth``
   positions, see `engine.step.packed`; padded to the widest for other architectures),
   every row sampled with its own sampler, the longest prefix where draft == sample accepted;
4. **one** host sync; then per-row rollback of the rejected positions (O(1), lengths only;
   a hybrid target's recurrent-state layers replay their kept positions instead, built here
   and computed with the next forward: `engine.step.recurrent`), committed features to the
   drafter sessions, and finished prefills join the batch;
5. lookahead: when the plan says the next step will be plain decoding too, that step's
   forward is built now and computed by `advance` (queued on the MLX thread right after this
   step returns) while the asyncio loop streams this step's tokens and plans the next one.
   The next `execute` uses it if its plan is indeed plain for every row, else rolls it back
   (lengths only) and computes anew.

With every depth 0 the step is plain batched decoding: no drafter forward at all.

Draft sources: each drafting row takes its drafts from its DFlash session or from prompt
lookup (the plan says which). Only DFlash rows enter the drafter forward; lookup drafts are
copied from the row's own tokens on the host; all rows share the one verify forward. Every
committed position reaches both of a row's sessions whichever source proposed it, so a row
can switch sources at any step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from drafters.base import Drafter, DraftSession
from drafters.lookup import LookupDrafter, LookupSession
from engine.backend.blas_threads import blas_threads
from engine.distributed.group import Decisions
from engine.step import logprobs as token_logprobs
from engine.step.feature_journal import FeatureJournal
from engine.step.kv_cache import RaggedKVCache
from engine.step.packed import PackedLayout, PrefillSegment
from engine.step.penalties import TokenHistory
from engine.step.prefix_cache import PrefixEntry, PrefixSave
from engine.step.recurrent import replay
from engine.step.sampling import RandomStream, SamplingParams, request_stream, sample, sample_rows
from engine.step.state_cache import RaggedStateCache
from engine.step.structured import GrammarCompiler, RowGrammar
from engine.step.target import TargetAdapter
from scheduler.plan import Admission, PrefillChunk, RowOutcome, StepPlan, StepResult
from scheduler.sources import DFLASH, LOOKUP, may_draft


@dataclass(eq=False)  # compared and hashed by identity (a feature journal's owner)
class _RowState:
    """A request's MLX-side state."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    random: RandomStream | None  # None when greedy
    # Logit bias / penalties (`engine.step.penalties`): the generated tokens' counts, anchor
    # included; None when the request has none. Such a row (and a grammar row) needs its
    # committed tokens on the host before its next forward: no step is built on lazy tokens.
    history: TokenHistory | None = None
    # Structured output: the row's matcher, holding its committed tokens (`engine.step.structured`).
    grammar: RowGrammar | None = None
    anchor: int = -1  # last committed token, not yet in the target cache
    session: DraftSession | None = None
    lookup: LookupSession | None = None
    lookup_match: int = 0  # longest earlier match of the suffix ending at the anchor
    prefill_cache: list[RaggedKVCache] | None = None
    prefill_features: list[mx.array] = field(default_factory=list)
    # With prefix caching (or `keep_features`) and a drafter: the target features of the row's
    # cache positions (with its KV, what a finished row leaves in the prefix cache for the
    # drafter; what `keep_features` hands out when the row leaves).
    # (Decode steps' rows are journalled first: `ModelRunner._feature_journal`.)
    feature_log: list[mx.array] = field(default_factory=list)

    @property
    def draws(self) -> int:
        """How many uniforms the row's sampler has drawn (its whole state)."""
        return 0 if self.random is None else self.random.drawn

    def give_back(self, draws: int) -> None:
        """Rewind the sampler to `draws` (a step that never ran gives its draws back)."""
        if self.random is not None:
            self.random.drawn = draws


@dataclass
class _Decode:
    """The lazy outputs of a decode forward, resolved by the step's single sync."""

    depths: list[int]
    width: int
    targets: mx.array  # [B, width + 1]
    accepted: mx.array  # [B]
    features: mx.array | None  # [B, width + 1, F] padded, or [N, F] packed
    drafted_rows: int  # rows in the drafter forward
    # Context rows that forward wrote into the drafter (its sessions' pending rows).
    draft_context_rows: int = 0
    sources: list[str | None] = field(default_factory=list)  # per row (None: no drafts)
    lookup_rows: int = 0
    logprobs: token_logprobs.LazyLogprobs | None = None  # rows that asked for them

    # Packed verify: where row b's verify position i lies in the packed logits/features
    # (`layout.index(b, i)`); None when the forward was padded to `width + 1` per row.
    layout: PackedLayout | None = None
    # A padded forward whose LM head ran on each row's own `1 + depth` positions only: how
    # many positions each row sampled (None: `width + 1` each, or see `layout`).
    sampled: list[int] | None = None

    def flat_features(self) -> mx.array:
        """The features as [positions, F]: row b's verify positions from `row_start(b)` on."""
        if self.layout is None:
            return self.features.reshape(-1, self.features.shape[-1])
        return self.features

    def row_start(self, row: int) -> int:
        """Where `row`'s first verify position lies in `flat_features()`."""
        return row * (self.width + 1) if self.layout is None else self.layout.starts[row]

    def trims(self, accepted: list[int]) -> list[int]:
        """Cache positions to roll back per row: all it wrote past its accepted drafts."""
        if self.layout is None:
            return [self.width - a for a in accepted]
        return [w - 1 - a for w, a in zip(self.layout.widths, accepted)]

    def unused_draws(self, accepted: list[int]) -> list[int]:
        """Sampler draws per row past its bonus token, to give back: a row's k-th generated
        token always takes its k-th uniform, whatever the step's depths."""
        if self.sampled is None:
            return self.trims(accepted)
        return [w - 1 - a for w, a in zip(self.sampled, accepted)]

    @property
    def verify_tokens(self) -> int:
        """Positions that went through the target."""
        if self.layout is None:
            return len(self.depths) * (self.width + 1)
        return self.layout.total

    def arrays(self) -> list[mx.array]:
        """What the step's sync must resolve."""
        extra = self.logprobs.arrays() if self.logprobs is not None else []
        return [self.targets, self.accepted, *extra]


@dataclass
class _Segment:
    """A prefill chunk riding in the step's packed forward; its outputs (lazy) once it ran."""

    chunk: PrefillChunk
    state: _RowState
    logits: mx.array | None = None  # [1, V] at the chunk's last position
    features: mx.array | None = None  # [chunk tokens, F]
    # [chunk tokens, V] at every position, where the request asked for prompt logprobs
    all_logits: mx.array | None = None

    @property
    def full(self) -> bool:
        return self.state.params.prompt_logprobs is not None

    def packed(self) -> PrefillSegment:
        ids = self.state.prompt_ids[self.chunk.start : self.chunk.end]
        return PrefillSegment(ids, self.state.prefill_cache, full=self.full)


@dataclass
class _Lookahead:
    """A plain decode step launched before its plan arrived (see the module docstring)."""

    decode: _Decode
    rows: list[str]  # batch rows it was launched for, in order
    draws: dict[str, int]  # the rows' sampler draws before it, restored if it is discarded
    build_seconds: float  # building its graph (at the end of the previous step)
    eval_seconds: float = 0.0  # computing it (in `advance`)
    # Built early (before the step's sync): the target cache before it, until it is kept.
    cache_before: list[tuple] | None = None
    # Hybrid targets: each state layer's state before it (a state cannot be trimmed), to
    # discard it or to save a prefix entry at the row's committed end.
    state_before: list[list[mx.array | None]] = field(default_factory=list)

    def select(self, rows: list[str]) -> None:
        """Keep only `rows` (requests left the batch): their outputs, in that order."""
        if rows == self.rows:
            return
        position = {r: i for i, r in enumerate(self.rows)}
        index = mx.array([position[r] for r in rows], dtype=mx.int32)
        d = self.decode
        d.targets, d.accepted = d.targets[index], d.accepted[index]
        d.features = None if d.features is None else d.features[index]
        d.depths = [0] * len(rows)
        d.sources = [None] * len(rows)
        self.state_before = [
            [None if a is None else a[index] for a in before] for before in self.state_before
        ]
        self.rows = list(rows)


class ModelRunner:
    """Owns the batched target cache (one row per decoding request) and the drafter."""

    def __init__(
        self,
        target: TargetAdapter,
        drafter: Drafter | None = None,
        profile_phases: bool = False,
        lookup: LookupDrafter | None = None,
        packed_verify: bool = True,
    ) -> None:
        self.target = target
        self.drafter = drafter
        self.lookup = lookup
        # Drafting steps verify packed (each row its own 1 + depth positions) where the target
        # allows, and so does a step that carries prefill chunks beside its decoding rows;
        # other plain steps keep the stock forward (depth 0 is the plain path).
        self.packed = target.packed_verifier() if packed_verify else None
        # Profiling adds a host sync after the draft forward to time it apart from the verify.
        self.profile_phases = profile_phases
        self._draft_seconds = 0.0
        # One cache per layer: a ragged KV cache, or for a hybrid target's recurrent layers a
        # batched state (`engine.step.state_cache`), rolled back by replay
        # (`engine.step.recurrent`).
        self.cache: list[RaggedKVCache | RaggedStateCache] = target.new_cache(0)
        self._kv = [c for c in self.cache if isinstance(c, RaggedKVCache)]
        self._states = [c for c in self.cache if isinstance(c, RaggedStateCache)]
        self.rows: list[str] = []  # request ids in batch-row order
        self.states: dict[str, _RowState] = {}
        self._lookahead: _Lookahead | None = None
        self._first_logprobs: list[token_logprobs.LazyLogprobs] = []  # this step's
        # Prefix cache entries by id (the scheduler's PrefixIndex decides what is kept).
        self.prefix_entries: dict[int, PrefixEntry] = {}
        self.prefix_caching = False  # the engine turns it on with a budget
        # Hand each leaving row's tapped features out (`StepResult.released_features`): a
        # drafter's training data is then made as it is generated, with no feature pass of
        # its own (`drafters.dflash.datagen`). The engine turns it on (`keep_features`).
        self.keep_features = False
        self._released: dict[str, mx.array] = {}  # this step's, computed with its sync
        self._to_eval: list[mx.array] = []  # new entries and gathered logs, for the sync
        # Prefix caching with a drafter: decode steps' features, journalled for the rows' logs.
        self._feature_journal: FeatureJournal[_RowState] = FeatureJournal()
        # OpenBLAS's thread count for small forwards, where an operator set one (CPU backend).
        self.blas = blas_threads()
        # Structured output's compiler (the engine sets it: it needs the tokenizer).
        self.grammars: GrammarCompiler | None = None
        # Where drafts and sampled tokens come from: this process, or in distributed mode
        # rank 0 on every rank (`engine.distributed.group.SharedDecisions`).
        self.decisions = Decisions()

    @property
    def source_depths(self) -> dict[str, int]:
        """The draft sources this runner serves and the most one proposal of each holds."""
        depths = {}
        if self.drafter is not None:
            depths[DFLASH] = self.drafter.max_depth
        if self.lookup is not None:
            depths[LOOKUP] = self.lookup.max_depth
        return depths

    @property
    def max_depth(self) -> int:
        return max(self.source_depths.values(), default=0)

    # ----------------------------------------------------------------- the step
    def execute(self, plan: StepPlan) -> StepResult:
        started = time.perf_counter()
        lookahead, self._lookahead = self._lookahead, None
        for save in plan.prefix_saves:  # before the rows leave
            self._save_prefix(save, ahead=lookahead)
        if plan.prefix_saves and plan.removals:
            # Computed now: a pending copy out of the cache would keep its buffers shared, and
            # the removal's in-place moves would then copy all of them.
            mx.eval(self._to_eval)
            self._to_eval = []
        self._remove(plan.removals)
        if lookahead is not None:
            lookahead.select(self.rows)
        for admission in plan.admissions:
            self._admit(admission)
        for entry_id in plan.prefix_drops:  # after the admissions copied from them
            del self.prefix_entries[entry_id]
        if plan.removals:
            self._settle_cache()  # the rows' moves, apart from the forward's time
        forward_started = time.perf_counter()

        first_tokens: dict[str, mx.array] = {}
        self._first_logprobs = first_logprobs = []  # of first tokens, for requests that asked
        self._prompt_logprobs: list[token_logprobs.LazyLogprobs] = []
        prefill_tokens = sum(c.end - c.start for c in plan.prefills)
        if self.blas is not None:  # before any of the step's forwards is computed
            self.blas.fit(prefill_tokens + len(self.rows) + sum(plan.depths.values()))

        self._draft_seconds = 0.0
        decode, ahead_seconds, discarded_seconds = None, 0.0, 0.0
        if lookahead is not None and not any(plan.depths.get(r, 0) for r in self.rows):
            decode = lookahead.decode
            ahead_seconds = lookahead.build_seconds + lookahead.eval_seconds
        elif lookahead is not None:
            self._discard(lookahead)
            discarded_seconds = lookahead.build_seconds + lookahead.eval_seconds
        # Prefill chunks ride in the rows' packed forward where they can (one forward, not
        # one per join); else they run on their own first.
        riding: list[_Segment] = []
        if self._chunks_ride(rows_forward=decode is None):
            riding = [_Segment(c, self.states[c.request_id]) for c in plan.prefills]
        else:
            self._prefill_apart(plan.prefills, first_tokens)
        if decode is None and self.rows:
            decode = self._decode(plan.depths, plan.sources, segments=riding)
        for segment in riding:
            self._segment_done(segment, first_tokens)
        early = self._launch_early(plan, decode)

        # The step's one host synchronisation.
        mx.eval(
            list(first_tokens.values()),
            [a for lazy in first_logprobs + self._prompt_logprobs for a in lazy.arrays()],
            [] if decode is None else decode.arrays(),
            [c.state for s in self.states.values() if s.prefill_cache for c in s.prefill_cache],
            self._to_eval,
        )
        self._to_eval = []
        computed = time.perf_counter()

        result = StepResult(prefill_tokens=prefill_tokens, discarded_seconds=discarded_seconds)
        if self._released:
            released, self._released = self._released, {}
            result.released_features = {r: np.asarray(f) for r, f in released.items()}
        if decode is not None:
            self._commit(decode, result, plan.match_lookup)
        result.first_tokens = {r: int(token.item()) for r, token in first_tokens.items()}
        for lazy in first_logprobs:
            for request_id, (first,) in lazy.to_host().items():
                result.first_logprobs[request_id] = first
        for lazy in self._prompt_logprobs:
            result.prompt_logprobs.update(lazy.to_host())
        self._join(result.first_tokens)
        if result.first_tokens:
            self._settle_cache()  # the join's copies belong to this step, not to the next
        result.lookup_matches = {r: self.states[r].lookup_match for r in self.rows}
        result.draft_backlogs = {
            r: self.states[r].session.pending_rows
            for r in self.rows
            if self.states[r].session is not None
        }
        if early is not None and self._lookup_due(plan.lookup_watch):
            self._unbuild(early)  # the next step will likely draft: never run it
            early = None
        if early is not None:
            early.cache_before = None  # kept: its writes may now update the cache in place
            self._lookahead = early
        elif plan.lookahead and self.rows and not self._lookup_due(plan.lookup_watch):
            self._lookahead = self._launch_lookahead()
        result.looked_ahead = self._lookahead is not None
        result.kv_bytes = self.kv_bytes
        finished = time.perf_counter()
        # A used lookahead was built and computed before this call (overlapped with the
        # loop's work): its time counts here, so the cost model sees what the forward cost.
        result.step_seconds = finished - started + ahead_seconds
        result.forward_seconds = forward = computed - forward_started + ahead_seconds
        if self.profile_phases:
            result.phase_seconds = {
                "draft": self._draft_seconds,
                "verify": forward - self._draft_seconds,
                "commit": finished - computed,
            }
        else:
            result.phase_seconds = {"forward": forward, "commit": finished - computed}
        result.memory_active = mx.get_active_memory()
        result.memory_peak = mx.get_peak_memory()
        return result

    def _chunks_ride(self, rows_forward: bool) -> bool:
        """Whether the step's prefill chunks ride in the rows' packed forward (all of them) or
        are prefilled apart (all of them). Riding needs rows decoding in a forward of this
        step (`rows_forward`: not one computed ahead) and the packed forward (which runs the
        head on every position of a chunk whose request asked for prompt logprobs)."""
        return rows_forward and bool(self.rows) and self.packed is not None

    def _prefill_apart(self, chunks: list[PrefillChunk], first_tokens: dict[str, mx.array]) -> None:
        """Prefill chunks in forwards of their own (no decoding rows to ride with, a target
        without the packed forward, or prompt logprobs asked for)."""
        whole = [c for c in chunks if c.start == 0 and c.last]
        together = {c.request_id for c in whole} if len(whole) > 1 else set()
        if together:  # whole prompts: one batched forward (short prompts are common)
            self._prefill_together(whole, first_tokens)
        for chunk in chunks:
            if chunk.request_id in together:
                continue
            state = self.states[chunk.request_id]
            ids = mx.array([state.prompt_ids[chunk.start : chunk.end]], dtype=mx.int32)
            full = state.params.prompt_logprobs is not None
            logits, last, features = self._prefill_forward(
                ids, state.prefill_cache, [ids.shape[1]], [full]
            )
            if features is not None:
                state.prefill_features.append(features[0])
            if full:
                self._prompt_logprobs_of(state, logits[0], chunk.start, chunk.end, chunk.last)
            if chunk.last:
                self._first_token(state, last[0], first_tokens)

    def _segment_done(self, segment: _Segment, first_tokens: dict[str, mx.array]) -> None:
        """A chunk that rode in the packed forward: its features, and its first token."""
        state = segment.state
        if segment.features is not None:
            state.prefill_features.append(segment.features)
        if segment.all_logits is not None:
            chunk = segment.chunk
            self._prompt_logprobs_of(state, segment.all_logits, chunk.start, chunk.end, chunk.last)
        if segment.chunk.last:
            self._first_token(state, segment.logits, first_tokens)

    def _first_token(self, state: _RowState, logits: mx.array,
                     first_tokens: dict[str, mx.array]) -> None:  # fmt: skip
        """Sample a request's first token from its prompt's last logits [1, V]."""
        mask = state.grammar.masks([]) if state.grammar is not None else None
        token = self.decisions.share(
            sample(logits, state.params, state.random, state.history, mask=mask)
        )[0]
        first_tokens[state.request_id] = token
        if state.params.logprobs is not None:
            self._first_logprobs.append(_logprobs_of([state], logits[None], token[None, None]))

    def _settle_cache(self) -> None:
        """Compute the batch cache's pending membership copies (rows leaving or joining) now.
        Left lazy they ran in the next step's sync and counted as that step's forward: a
        plain step after a join then measured 1.7x its cost, and the depth controller,
        judging drafts against it, read them as nearly free."""
        mx.eval([c.arrays() for c in self.cache])

    def _prefill_together(self, chunks: list, first_tokens: dict[str, mx.array]) -> None:
        """Prefill several whole prompts in one forward: right-padded to the longest (the
        causal mask keeps real positions from seeing the padding), padding rolled back, then
        each row becomes its request's own one-row cache, as if prefilled alone."""
        states = [self.states[c.request_id] for c in chunks]
        lengths = [len(s.prompt_ids) for s in states]
        longest = max(lengths)
        ids = mx.array([s.prompt_ids + [0] * (longest - len(s.prompt_ids)) for s in states],
                       dtype=mx.int32)  # fmt: skip
        cache = self.target.new_cache(len(states))
        for layer_cache in cache:
            if isinstance(layer_cache, RaggedStateCache):  # the padding must not reach a state
                layer_cache.lengths = mx.array(lengths, dtype=mx.int32)
        full = [s.params.prompt_logprobs is not None for s in states]
        logits, last, features = self._prefill_forward(ids, cache, lengths, full)
        for layer_cache in cache:
            if isinstance(layer_cache, RaggedStateCache):
                layer_cache.lengths = None
            else:
                layer_cache.trim_rows([longest - n for n in lengths])
        for row, (state, n) in enumerate(zip(states, lengths)):
            state.prefill_cache = [batched.take_rows([row]) for batched in cache]
            if features is not None:
                state.prefill_features.append(features[row, :n])
            if full[row]:
                self._prompt_logprobs_of(state, logits[row], 0, n, True)
            self._first_token(state, last[row], first_tokens)

    def _prefill_forward(
        self, ids: mx.array, cache: list[RaggedKVCache], lengths: list[int], full: list[bool]
    ) -> tuple[mx.array | None, mx.array, mx.array | None]:
        """A prefill forward of `ids` [B, L] (row b real up to lengths[b]). Returns logits
        [B, L, V] (None unless some row wants prompt logprobs: `full`), each row's last real
        position's logits [B, 1, V], and features. Where the target's head is separable it runs
        only on the positions read: one per row, not every prompt token."""
        ends = mx.array([n - 1 for n in lengths], dtype=mx.int32)[:, None, None]
        if not self.target.head_separable:
            logits, features = self.target(ids, cache)
            return logits, mx.take_along_axis(logits, ends, axis=1), features
        hidden, features = self.target.hidden_states(ids, cache)
        if not any(full):
            return None, self.target.unembed(mx.take_along_axis(hidden, ends, axis=1)), features
        logits = self.target.unembed(hidden)
        return logits, mx.take_along_axis(logits, ends, axis=1), features

    def _prompt_logprobs_of(self, state: _RowState, logits: mx.array, start: int, end: int,
                            last: bool) -> None:  # fmt: skip
        """Lazy logprobs of the prompt tokens a chunk's logits [>= end - start, V] predict: row
        i predicts token start + i + 1 (a last chunk's final row predicts the first generated
        token instead, which `first_logprobs` covers)."""
        rows = end - start - (1 if last else 0)
        if rows > 0:
            tokens = mx.array([state.prompt_ids[start + 1 : start + 1 + rows]], dtype=mx.int32)
            wanted = [state.params.prompt_logprobs]
            lazy = token_logprobs.compute(logits[None, :rows], tokens, [state.request_id], wanted)
            self._prompt_logprobs.append(lazy)

    # ----------------------------------------------------------------- lookahead
    def _host_bound(self) -> bool:
        """A row's next forward needs its committed tokens on the host (penalty counts, its
        grammar's state): no step may be built on this step's lazy tokens (a lookahead built
        after the commit is fine)."""
        return any(self.states[r].params.host_bound for r in self.rows)

    def _lookup_due(self, watched: set[str]) -> bool:
        """A watched row now has a lookup match: the next step will likely draft, so a
        looked-ahead plain step would be thrown away."""
        return any(self.states[r].lookup_match for r in watched if r in self.states)

    def _launch_lookahead(self, anchors: mx.array | None = None) -> _Lookahead:
        """Start the next plain decode step of every row now (after this step's joins), on
        the rows' committed anchors or on `anchors` [B, 1], this step's still lazy tokens."""
        started = time.perf_counter()
        draws = {r: self.states[r].draws for r in self.rows}
        state_before = [c.snapshot() for c in self._states]
        decode = self._decode({}, anchors=anchors)
        return _Lookahead(decode, list(self.rows), draws, time.perf_counter() - started,
                          state_before=state_before)  # fmt: skip

    def _launch_early(self, plan: StepPlan, decode: _Decode | None) -> _Lookahead | None:
        """mlx-lm's pipelining: when this step is plain for every row and no request joins
        after its sync, start this step's computation, then build the next plain step on its
        lazy tokens while it runs. On the CPU backend `async_eval` returns with the end of the
        graph still computing, so the next graph's Python-side build (a few ms) overlaps it.
        A lookup match found at the commit can still call it off (`_unbuild`)."""
        if (
            decode is None
            or not plan.lookahead
            or decode.width
            or any(chunk.last for chunk in plan.prefills)
            or self._host_bound()
        ):
            return None
        mx.async_eval(decode.arrays())
        # Only a watched row's lookup match can call it off: snapshot only then.
        cache_before = [c.snapshot() for c in self.cache] if plan.lookup_watch else None
        lookahead = self._launch_lookahead(anchors=decode.targets[:, :1])
        lookahead.cache_before = cache_before
        return lookahead

    def _unbuild(self, lookahead: _Lookahead) -> None:
        """Drop an early lookahead before it runs: the cache as before it, draws given back."""
        for layer_cache, before in zip(self.cache, lookahead.cache_before):
            layer_cache.restore(before)
        for request_id in lookahead.rows:
            self.states[request_id].give_back(lookahead.draws[request_id])

    def advance(self) -> None:
        """Compute the launched lookahead step (if any). The engine queues this on the MLX
        thread right after `execute` returns, so the forward runs while the asyncio loop
        handles the step's results. Calling `mx.async_eval` from `execute` itself would not
        do: on the CPU backend it computes most of the graph before it returns. Here it
        blocks the MLX thread for that part, off the loop, and returns before the graph's
        end, which then overlaps the next `execute`'s building of its early lookahead."""
        lookahead = self._lookahead
        if lookahead is not None and not lookahead.eval_seconds:
            started = time.perf_counter()
            if self.blas is not None:
                self.blas.fit(len(lookahead.rows))
            mx.async_eval(lookahead.decode.arrays())
            lookahead.eval_seconds = time.perf_counter() - started

    def _discard(self, lookahead: _Lookahead) -> None:
        """The plan was not plain after all: roll back the looked-ahead position of every row
        (lengths only) and give the rows their sampler draws back, as if it never ran."""
        for layer_cache in self._kv:
            layer_cache.trim_rows([1] * len(self.rows))
        for layer_cache, before in zip(self._states, lookahead.state_before):
            layer_cache.restore(before)  # the state before it (a state has no trim)
        for request_id in self.rows:
            self.states[request_id].give_back(lookahead.draws[request_id])

    # ----------------------------------------------------------------- decode
    def _decode(
        self,
        depth_by_id: dict[str, int],
        source_by_id: dict[str, str] | None = None,
        anchors: mx.array | None = None,
        segments: list[_Segment] = (),
    ) -> _Decode:
        """The step's forward for every row; `anchors` [B, 1] (lazy) replaces the rows'
        committed anchors (only for a plain step launched before they are known). Prefill
        `segments` ride in the packed forward (then it runs even for a plain step)."""
        states = [self.states[r] for r in self.rows]
        sources = [self._row_source(r, depth_by_id, source_by_id or {}) for r in self.rows]
        depths = [
            min(depth_by_id.get(r, 0), self.source_depths[s]) if s else 0
            for r, s in zip(self.rows, sources)
        ]
        lookup_drafts = {}
        for i, source in enumerate(sources):
            if source == LOOKUP:
                drafts = self.lookup.draft(states[i].lookup, states[i].anchor, depths[i])
                if states[i].grammar is not None:
                    drafts = states[i].grammar.cut(drafts)
                lookup_drafts[i] = drafts
                depths[i] = len(drafts)  # no match after all: the row verifies plainly
                sources[i] = LOOKUP if drafts else None
        width = max(depths)
        if anchors is None:
            anchors = mx.array([[s.anchor] for s in states], dtype=mx.int32)
        elif width:
            raise ValueError("lazy anchors are for plain steps only")
        drafting = [i for i, d in enumerate(depths) if d > 0 and sources[i] == DFLASH]
        if segments and self.packed is None:
            raise ValueError("prefill segments need the packed forward")
        # Read before the proposal writes them.
        context_rows = sum(states[i].session.pending_rows for i in drafting)
        masks = None
        if width or segments:
            drafts = None
            if width:
                drafts = self._draft_matrix(states, depths, drafting, lookup_drafts, width)
            if any(s.grammar is not None for s in states):
                drafts, masks = self._grammar_masks(states, depths, drafts, lookup_drafts)
                width = max(depths)
            if self.packed is not None:
                decode = self._verify_packed(states, depths, drafts, segments, masks)
                decode.drafted_rows, decode.sources = len(drafting), sources
                decode.draft_context_rows = context_rows
                decode.lookup_rows = len(lookup_drafts)
                return decode
            verify_ids = anchors if drafts is None else mx.concatenate([anchors, drafts], axis=1)
        else:
            verify_ids = anchors
            if any(s.grammar is not None for s in states):
                _, masks = self._grammar_masks(states, depths, None, {})
        recording = bool(width and self._states)  # a verify a hybrid row must roll back
        # A padded verify runs the LM head on each row's own positions only, where the head
        # is separable: the padding's logits are never read, and on a large vocabulary the
        # head is most of a position's cost (Gemma 3: 262,144 rows, more than its layers).
        head_rows = bool(width) and self.target.head_separable
        for layer_cache in self._states if recording else ():
            layer_cache.recording = True
        try:
            if head_rows:
                hidden, features = self.target.hidden_states(verify_ids, self.cache)
            else:
                logits, features = self.target(verify_ids, self.cache)
        finally:
            for layer_cache in self._states:
                layer_cache.recording = False
        layout = None
        if head_rows:
            logits, targets, layout = self._head_on_rows(hidden, states, depths, drafts, masks)
        else:
            targets = self._sample_rows(logits, states, drafts if width else None, masks)
            targets = self.decisions.share(targets)
        if width:
            accepted = _accepted(drafts, targets, depths)
        else:
            accepted = mx.zeros((len(states),), dtype=mx.int32)
        decode = _Decode(depths, width, targets, accepted, features, len(drafting),
                         context_rows, sources, len(lookup_drafts))  # fmt: skip
        if layout is not None:
            decode.sampled = list(layout.widths)
        decode.logprobs = _asked_logprobs(states, logits, targets, layout, width)
        return decode

    def _head_on_rows(
        self, hidden: mx.array, states: list[_RowState], depths: list[int], drafts: mx.array,
        masks: list | None,
    ) -> tuple[mx.array, mx.array, PackedLayout]:  # fmt: skip
        """The LM head and the samplers on each row's own ``1 + depth`` positions of a padded
        forward's hidden states [B, width + 1, d]. Returns the packed logits [N, V], the
        targets [B, width + 1] (past a row's own positions, its last one repeated: never
        read) and the packed layout of those positions."""
        B, W, d = hidden.shape
        layout = PackedLayout.build([1 + k for k in depths], [0] * B)
        real = [b * W + i for b in range(B) for i in range(layout.widths[b])]
        logits = self.target.unembed(hidden.reshape(B * W, d)[mx.array(real, dtype=mx.int32)])
        return logits, self._sample_own_positions(logits, states, layout, drafts, masks), layout

    def _sample_own_positions(
        self, logits: mx.array, states: list[_RowState], layout: PackedLayout,
        drafts: mx.array | None, masks: list | None,
    ) -> mx.array:  # fmt: skip
        """Each row samples only its own positions of the packed logits [N, V], with its own
        sampler and random stream; rank 0's samples on every rank. Returns the targets
        [B, width + 1] (past a row's own positions, its last one repeated: never read)."""
        packed = sample_rows(
            logits, [s.params for s in states], [s.random for s in states], layout.widths,
            [s.history for s in states], drafts, masks,
        )  # fmt: skip
        packed = self.decisions.share(packed)
        B, width = len(states), max(layout.widths) - 1
        by_row = mx.array(layout.padded_index(list(range(B)), 0, width + 1), dtype=mx.int32)
        return packed[by_row].reshape(B, width + 1)

    def _verify_packed(
        self, states: list[_RowState], depths: list[int], drafts: mx.array | None,
        segments: list[_Segment] = (), masks: list | None = None,
    ) -> _Decode:  # fmt: skip
        """The verify as one packed forward: row b contributes [anchor, its d_b drafts]
        (`drafts` is [B, width], each row's own drafts first; None when no row drafts), and
        each prefill segment its chunk's tokens after them."""
        B, width = len(states), max(depths)
        layout = PackedLayout.build([1 + d for d in depths], list(self._kv[0].lengths))
        # Packed ids gathered from [anchors of every row; the draft matrix, row by row].
        source = [
            j for b, d in enumerate(depths) for j in [b] + [B + b * width + i for i in range(d)]
        ]
        pool = [mx.array([s.anchor for s in states], dtype=mx.int32)]
        if drafts is not None:
            pool.append(drafts.reshape(-1))
        tokens = mx.concatenate(pool)[mx.array(source, dtype=mx.int32)]
        packed_segments = tuple(segment.packed() for segment in segments)
        if segments:
            prompt = [t for segment in packed_segments for t in segment.tokens]
            tokens = mx.concatenate([tokens, mx.array(prompt, dtype=mx.int32)])
        logits, features = self.packed(tokens, layout, self.cache, packed_segments)
        self._segment_outputs(segments, layout.total, logits, features)
        logits = logits[: layout.total] if segments else logits
        targets = self._sample_own_positions(logits, states, layout, drafts, masks)
        if drafts is None:
            accepted = mx.zeros((B,), dtype=mx.int32)
        else:
            accepted = _accepted(drafts, targets, depths)
        decode = _Decode(depths, width, targets, accepted, features, 0, layout=layout)
        decode.logprobs = _asked_logprobs(states, logits, targets, layout, width)
        return decode

    @staticmethod
    def _segment_outputs(segments: list[_Segment], rows_total: int, logits: mx.array,
                         features: mx.array | None) -> None:  # fmt: skip
        """Each riding segment's last logits (and all of them where it is `full`) and its
        features, read from the packed outputs (logits: the rows' positions, then one per
        segment, or all of a full one's; features: every position)."""
        start, read = rows_total, rows_total
        for segment in segments:
            n = segment.chunk.end - segment.chunk.start
            if segment.full:
                segment.all_logits = logits[read : read + n]
                read += n
            else:
                read += 1
            segment.logits = logits[read - 1 : read]
            if features is not None:
                segment.features = features[start : start + n]
            start += n

    def _row_source(
        self, request_id: str, depth_by_id: dict[str, int], source_by_id: dict[str, str]
    ) -> str | None:
        """Where a row's drafts come from this step (None: it does not draft). A plan that
        names no source (a policy that picks depths only) means DFlash where there is one."""
        if not depth_by_id.get(request_id, 0):
            return None
        source = source_by_id.get(request_id) or (DFLASH if self.drafter is not None else LOOKUP)
        state = self.states[request_id]
        has_session = state.session if source == DFLASH else state.lookup
        return source if has_session is not None else None

    def _draft_matrix(self, states: list[_RowState], depths: list[int], drafting: list[int],
                      lookup_drafts: dict[int, list[int]], width: int) -> mx.array:  # fmt: skip
        """[B, width] draft tokens: DFlash rows from one batched drafter forward (only those
        rows), lookup rows from the host, padding elsewhere (masked out by depth)."""
        rows = [lookup_drafts.get(i, []) for i in range(len(states))]
        host = mx.array([r + [0] * (width - len(r)) for r in rows], dtype=mx.int32)
        if not drafting:
            return host
        candidates = self.drafter.propose(
            [states[i].session for i in drafting],
            [states[i].anchor for i in drafting],
            [depths[i] for i in drafting],
        )
        drafted = self.decisions.share(candidates.tokens[:, :width])  # rank 0's everywhere
        if drafted.shape[1] < width:  # lookup rows drafted deeper than any DFlash row
            drafted = mx.pad(drafted, [(0, 0), (0, width - drafted.shape[1])])
        if self.profile_phases:
            draft_started = time.perf_counter()
            mx.eval(drafted)
            self._draft_seconds = time.perf_counter() - draft_started
        if len(drafting) == len(states):
            return drafted
        host[mx.array(drafting)] = drafted
        return host

    def _sample_rows(
        self, logits: mx.array, states: list[_RowState], drafts: mx.array | None = None,
        masks: list | None = None,
    ) -> mx.array:  # fmt: skip
        """Every verify row sampled with its request's own sampler: [B, W, V] -> [B, W]
        (`drafts` [B, W - 1]: what penalised rows count before each position; `masks`:
        constrained rows' grammar bitmasks)."""
        B, W, V = logits.shape
        params, streams = [s.params for s in states], [s.random for s in states]
        histories = [s.history for s in states]
        flat = logits.reshape(B * W, V)
        tokens = sample_rows(flat, params, streams, [W] * B, histories, drafts, masks)
        return tokens.reshape(B, W)

    def _grammar_masks(
        self, states: list[_RowState], depths: list[int], drafts: mx.array | None,
        lookup_drafts: dict[int, list[int]],
    ) -> tuple[mx.array | None, list]:  # fmt: skip
        """Structured rows: drafts cut at the first token the grammar rejects (`depths` is
        updated in place; lookup drafts were cut when drafted, DFlash ones need their values
        here: one sync, only when such a row drafts with DFlash), and each row's bitmasks for
        every verify position, the bonus included. Returns the draft matrix (narrowed to the
        new widest depth; None when no row drafts any more) and the per-row masks."""
        host = None
        if drafts is not None and any(
            s.grammar is not None and depths[i] and i not in lookup_drafts
            for i, s in enumerate(states)
        ):
            host = drafts.tolist()
        masks: list = [None] * len(states)
        for i, state in enumerate(states):
            if state.grammar is None:
                continue
            row = lookup_drafts.get(i)
            if row is None:
                row = host[i][: depths[i]] if host is not None and depths[i] else []
                row = state.grammar.cut(row)
            depths[i] = len(row)
            masks[i] = state.grammar.masks(row)
        width = max(depths, default=0)
        if drafts is not None:
            drafts = drafts[:, :width] if width else None
        return drafts, masks

    def _commit(self, decode: _Decode, result: StepResult, match_lookup: bool = True) -> None:
        targets = decode.targets.tolist()
        accepted = decode.accepted.tolist()
        logprobs = decode.logprobs.to_host() if decode.logprobs is not None else {}
        trims = decode.trims(accepted)
        unused = decode.unused_draws(accepted)
        for layer_cache in self._kv:
            layer_cache.trim_rows(trims)
        if decode.width and self._states:  # each row's state after its accepted + 1 positions
            keep = [a + 1 for a in accepted]
            for layer_cache in self._states:
                replay(layer_cache, keep)
        # Features of the positions now in the cache, journalled whole, one block per row
        # (`engine.step.feature_journal`): for the rows' DFlash sessions and the prefix cache's log.
        logging = self._logs_features and decode.features is not None
        drafter_blocks, log_blocks = [], []
        for i, request_id in enumerate(self.rows):
            state = self.states[request_id]
            a = accepted[i]
            committed = targets[i][: a + 1]
            source = decode.sources[i] if decode.sources else None
            # Both sessions see every committed position, whichever source proposed it.
            cached = [state.anchor] + committed[:a]  # positions now in the target cache
            start = decode.row_start(i)  # the row's first position in `flat_features()`
            if state.session is not None:
                drafter_blocks.append((state.session, start, cached))
            if logging:  # kept even for a row that does not draft with DFlash: a later hit may
                log_blocks.append((state, start, a + 1))
            state.anchor = committed[-1]
            if state.history is not None:
                state.history.add(committed)
            if state.grammar is not None:
                state.grammar.commit(committed)
            # The draws of the positions past the bonus go back: the row's k-th generated token
            # always takes its k-th uniform, so seeded output is the same at every depth.
            state.give_back(state.draws - unused[i])
            if state.lookup is not None:
                self.lookup.commit(state.lookup, None, cached)
                if source == LOOKUP:
                    self.lookup.record(state.lookup, decode.depths[i], a)
                state.lookup_match = (
                    self.lookup.match_length(state.lookup, state.anchor) if match_lookup else 0
                )
            outcome = RowOutcome(committed, decode.depths[i], a, source)
            if request_id in logprobs:
                outcome.logprobs = logprobs[request_id][: a + 1]
            result.outcomes[request_id] = outcome
        if drafter_blocks or log_blocks:
            features = decode.flat_features()
            if drafter_blocks:
                self.drafter.commit_step(features, drafter_blocks)
            if log_blocks and self._feature_journal.record(features, log_blocks):
                self._gather_feature_log()
        if self.drafter is not None:  # computed with the next step's sync, not now
            self._to_eval += self.drafter.take_unevaluated()
        result.batch_size = len(self.rows)
        result.verify_tokens = decode.verify_tokens
        result.drafted_rows = decode.drafted_rows
        result.draft_context_rows = decode.draft_context_rows
        result.lookup_rows = decode.lookup_rows

    # ----------------------------------------------------------------- membership
    def _admit(self, admission: Admission) -> None:
        params = admission.params
        state = _RowState(
            request_id=admission.request_id,
            prompt_ids=list(admission.prompt_ids),
            params=params,
            random=None if params.greedy else request_stream(params.seed),
            history=(
                TokenHistory(params, admission.prompt_ids, self.target.vocab_size)
                if params.penalised
                else None
            ),
            grammar=(
                self.grammars.matcher(params.structured) if params.structured is not None else None
            ),
            prefill_cache=self.target.new_cache(1),
        )
        if admission.prefix_entry is not None:
            # A prefix cache hit: one copy of the entry's first positions into the request's
            # own cache (room for the whole prompt); the entry itself is never written.
            entry, n = self.prefix_entries[admission.prefix_entry], admission.prefix_tokens
            if entry.features is None and self.drafter is not None and self.target.layer_ids:
                raise RuntimeError("a prefix entry without the features its drafter reads")
            room = len(state.prompt_ids) + 1
            kv = iter(zip(entry.keys, entry.values))
            saved = iter(entry.states or [])
            if entry.states is not None and n != entry.length:
                raise RuntimeError(f"a recurrent entry of {entry.length} positions hit at {n}")
            state.prefill_cache = [
                RaggedStateCache.from_state(next(saved))
                if isinstance(c, RaggedStateCache)
                else RaggedKVCache.from_prefix(*next(kv), n, room)
                for c in state.prefill_cache
            ]
            if entry.features is not None:
                # The drafter gets these rows at the join, as after a cold prefill.
                state.prefill_features.append(entry.features[:n])
        self.states[admission.request_id] = state

    # ----------------------------------------------------------------- prefix cache
    def _gather_feature_log(self) -> None:
        """Append each row's journalled decode features to its log (rows gone are dropped);
        computed with the next sync."""

        def live(state: _RowState) -> bool:
            return self.states.get(state.request_id) is state

        for state, features in self._feature_journal.gather(live).items():
            state.feature_log.append(features)
            self._to_eval.append(features)

    def _save_prefix(self, save: PrefixSave, ahead: _Lookahead | None) -> None:
        """Copy a row's first `save.length` cache positions into a new entry: a row in the
        batch (finished, aborted, or whose prompt was just prefilled), or a request aborted
        mid-prefill (its own prefill cache and features so far)."""
        state = self.states[save.request_id]
        n = save.length
        if state.prefill_cache is not None:
            self._save_prefilling(save, state)
            return
        row = self.rows.index(save.request_id)
        committed = self._kv[0].lengths[row] - (1 if ahead is not None else 0)  # a lookahead's
        if n > committed:  # position is not committed
            raise RuntimeError(f"prefix save of {n} positions from a row of {committed}")
        keys, values, states = [], [], None
        for c in self._kv:
            keys.append(mx.contiguous(c.keys[row : row + 1, :, :n, :]))
            values.append(mx.contiguous(c.values[row : row + 1, :, :n, :]))
        if self._states:
            # A state holds exactly the row's positions: saved only at the row's end (the
            # scheduler saves a hybrid row's whole cached sequence), before any lookahead.
            if n != committed:
                raise RuntimeError(f"a recurrent state of {committed} positions saved as {n}")
            states = []
            for i, c in enumerate(self._states):
                if ahead is not None:
                    before = ahead.state_before[i]
                    states.append([None if a is None else mx.contiguous(a[row : row + 1])
                                   for a in before])  # fmt: skip
                else:
                    states.append(c.row_state(row))
        features = None
        if state in self._feature_journal.rows:
            self._gather_feature_log()
        if state.feature_log:
            features = mx.concatenate(state.feature_log, axis=0)[:n]
        self._keep_entry(save.entry_id, PrefixEntry(keys, values, features, n, states))

    def _save_prefilling(self, save: PrefixSave, state: _RowState) -> None:
        """An aborted request's prompt positions computed so far, from its own prefill cache
        (one row) and the features its chunks produced."""
        n = save.length
        kv = [c for c in state.prefill_cache if isinstance(c, RaggedKVCache)]
        held = kv[0].lengths[0] if kv else n
        if n > held:
            raise RuntimeError(f"prefix save of {n} positions from a prefill of {held}")
        keys = [mx.contiguous(c.keys[:1, :, :n, :]) for c in kv]
        values = [mx.contiguous(c.values[:1, :, :n, :]) for c in kv]
        states = None
        recurrent = [c for c in state.prefill_cache if isinstance(c, RaggedStateCache)]
        if recurrent:
            if n != held:
                raise RuntimeError(f"a recurrent state of {held} positions saved as {n}")
            states = [c.row_state(0) for c in recurrent]
        features = None
        if self.drafter is not None and state.prefill_features:
            features = mx.concatenate(state.prefill_features, axis=0)[:n]
        self._keep_entry(save.entry_id, PrefixEntry(keys, values, features, n, states))

    def _keep_entry(self, entry_id: int, entry: PrefixEntry) -> None:
        self.prefix_entries[entry_id] = entry
        self._to_eval += entry.arrays()

    @property
    def prefix_cache_bytes(self) -> int:
        return sum(e.nbytes for e in self.prefix_entries.values())

    def prefix_bytes_per_token(self) -> int:
        """Bytes one cached prefix position costs: target KV, plus features with a drafter."""
        features = 0
        if self.drafter is not None and self.target.layer_ids:
            features = self.target.hidden_size * len(self.target.layer_ids) * self.target.dtype.size
        return self.bytes_per_token() + features

    def _join(self, first_tokens: dict[str, int]) -> None:
        """Prefilled requests join the decode batch: their caches are appended to the batch
        cache in one copy per layer, however many join this step."""
        if not first_tokens:
            return
        states = [self.states[r] for r in first_tokens]
        for layer, batch_cache in enumerate(self.cache):
            batch_cache.extend_many([s.prefill_cache[layer] for s in states])
        for state, first_token in zip(states, first_tokens.values()):
            state.prefill_cache = None
            self.rows.append(state.request_id)
            features = None
            if self.drafter is not None and state.prefill_features:
                features = mx.concatenate(state.prefill_features, axis=0)
                if self._logs_features:
                    state.feature_log = [features]
            # A session the request can never use is not opened: it would only cost the
            # drafter's catch-up writes.
            if self.drafter is not None and may_draft(state.params, DFLASH):
                state.session = self.drafter.open(state.prompt_ids)
                if features is not None:
                    self.drafter.commit(state.session, features, state.prompt_ids)
            state.prefill_features = []
            state.anchor = first_token
            if state.history is not None:
                state.history.add([first_token])
            if state.grammar is not None:
                state.grammar.commit([first_token])
            self._open_lookup(state)

    def _open_lookup(self, state: _RowState) -> None:
        """The row's lookup index over its prompt (constant work per token from here on)."""
        if self.lookup is None or not may_draft(state.params, LOOKUP):
            return
        state.lookup = self.lookup.open(state.prompt_ids)
        self.lookup.commit(state.lookup, None, state.prompt_ids)
        state.lookup_match = self.lookup.match_length(state.lookup, state.anchor)

    @property
    def _logs_features(self) -> bool:
        """Whether every row keeps the features of its cache positions (`_RowState.feature_log`)."""
        return (self.prefix_caching or self.keep_features) and self.drafter is not None

    def _release_features(self, state: _RowState) -> None:
        """With `keep_features`: a leaving row's features [n, F] of its n cache positions (its
        prompt and every committed token but the last), for this step's result."""
        if state in self._feature_journal.rows:
            self._gather_feature_log()
        if state.feature_log:
            features = mx.concatenate(state.feature_log, axis=0).astype(mx.float32)
            self._released[state.request_id] = features
            self._to_eval.append(features)

    def _remove(self, request_ids: list[str]) -> None:
        """Finished or aborted requests leave: per layer, one row copied into each hole."""
        leaving = set()
        for request_id in request_ids:
            state = self.states.get(request_id)
            if state is None:
                continue
            if self.keep_features:  # (a row without a drafter logged nothing to release)
                self._release_features(state)
            del self.states[request_id]
            leaving.add(request_id)
            if state.session is not None:
                self.drafter.close(state.session)
            if state.lookup is not None:
                self.lookup.close(state.lookup)
        gone = [i for i, r in enumerate(self.rows) if r in leaving]
        if gone:
            # The last rows move into the leavers' places (one row copied per hole), so the
            # batch order changes; every layer moves the same rows.
            orders = {tuple(layer_cache.remove_rows(gone)) for layer_cache in self.cache}
            (order,) = orders
            self.rows = [self.rows[i] for i in order]

    def profile(self, widths: tuple[int, ...] = (1, 2, 4, 8, 16), context: int = 64,
                repeats: int = 2) -> list[tuple[int, int, float]]:  # fmt: skip
        """Warm-up profile of the target: seconds of a B=1 forward over `width` new tokens at a
        short context, as (batch, width, seconds) — seeds the adaptive controller's cost curve."""
        samples = []
        for width in widths:
            cache = self.target.new_cache(1)
            logits, _ = self.target(mx.zeros((1, context), dtype=mx.int32), cache)
            mx.eval(logits)
            timings = []
            for _ in range(repeats):
                before = [c.snapshot() for c in cache if isinstance(c, RaggedStateCache)]
                started = time.perf_counter()
                logits, _ = self.target(mx.zeros((1, width), dtype=mx.int32), cache)
                mx.eval(mx.argmax(logits, axis=-1))
                timings.append(time.perf_counter() - started)
                states = iter(before)
                for layer_cache in cache:
                    if isinstance(layer_cache, RaggedStateCache):
                        layer_cache.restore(next(states))
                    else:
                        layer_cache.trim_rows([width])
            samples.append((1, width, min(timings)))
        return samples

    # ----------------------------------------------------------------- facts
    @property
    def kv_bytes(self) -> int:
        total = sum(c.nbytes for c in self.cache)
        for state in self.states.values():
            if state.prefill_cache:
                total += sum(c.nbytes for c in state.prefill_cache)
        # Reading the DFlash cache applies the step's session opens and closes (one copy per
        # step, which the next proposal would make anyway), so the bytes are the real ones.
        drafter_cache = getattr(self.drafter, "cache", None) or []
        return total + sum(c.nbytes for c in drafter_cache)

    @property
    def lookahead_pending(self) -> bool:
        """A looked-ahead step waits for `advance` (read between steps)."""
        return self._lookahead is not None and not self._lookahead.eval_seconds

    def cache_lengths(self) -> dict[str, int]:
        """Committed target cache length of every decoding row (for invariant checks); a
        looked-ahead position is not committed yet."""
        if not self._kv:
            return {}
        ahead = 1 if self._lookahead is not None else 0
        return {r: n - ahead for r, n in zip(self.rows, self._kv[0].lengths)}

    def lookup_sessions(self) -> dict[str, LookupSession]:
        """Every decoding row's lookup session (for statistics and checks)."""
        return {r: self.states[r].lookup for r in self.rows if self.states[r].lookup is not None}

    def draft_rows(self) -> dict[str, tuple[int, int]]:
        """(context rows, pending rows) of every decoding row's draft session."""
        out = {}
        for request_id in self.rows:
            session = self.states[request_id].session
            if session is not None:
                out[request_id] = (session.context_rows, session.pending_rows)
        return out

    def bytes_per_token(self) -> int:
        """KV bytes one cached token costs in the target (for admission budgets)."""
        if self.target.hybrid:
            return self._probe_bytes()[0]
        model = self.target.model
        args = getattr(model, "args", None)
        n_kv = getattr(args, "num_key_value_heads", None) or getattr(args, "num_attention_heads", 1)
        head_dim = getattr(args, "head_dim", None) or self.target.hidden_size // getattr(
            args, "num_attention_heads", 1
        )
        itemsize = self.target.dtype.size
        return 2 * self.target.num_layers * n_kv * head_dim * itemsize

    def bytes_per_row(self) -> int:
        """Bytes a row costs whatever its length: a hybrid target's recurrent states."""
        return self._probe_bytes()[1] if self.target.hybrid else 0

    def _probe_bytes(self) -> tuple[int, int]:
        """(KV bytes per position, state bytes per row), read off a one-token forward's
        caches: the attention layers' allocated buffers per position of capacity, and the
        state arrays (whatever the family's shapes and dtypes)."""
        if not hasattr(self, "_probed"):
            cache = self.target.new_cache(1)
            self.target(mx.zeros((1, 1), dtype=mx.int32), cache)
            mx.eval([c.arrays() for c in cache])
            kv = sum(c.nbytes // c.keys.shape[2] for c in cache if isinstance(c, RaggedKVCache))
            state = sum(c.nbytes for c in cache if isinstance(c, RaggedStateCache))
            self._probed = (kv, state)
        return self._probed


def _accepted(drafts: mx.array, targets: mx.array, depths: list[int]) -> mx.array:
    """[B] accepted drafts per row: the longest prefix (within the row's own depth) where
    draft == the target's sample at the same position."""
    width = drafts.shape[1]
    in_depth = mx.arange(width)[None, :] < mx.array(depths)[:, None]
    matches = (drafts == targets[:, :width]) & in_depth
    return mx.cumprod(matches.astype(mx.int32), axis=1).sum(axis=1)


def _asked_logprobs(states: list[_RowState], logits: mx.array, targets: mx.array,
                    layout: PackedLayout | None, width: int):  # fmt: skip
    """Lazy logprobs of a verify's `targets` [B, width + 1] for the rows that asked (only they
    pay for the log-softmax); None when none did. `logits` are padded [B, width + 1, V] when
    `layout` is None, else packed [N, V] at `layout`'s positions."""
    asking = [b for b, s in enumerate(states) if s.params.logprobs is not None]
    if not asking:
        return None
    picked = mx.array(asking, dtype=mx.int32)
    if layout is None:
        rows = logits[picked]
    else:  # their positions, padded like `targets` (the padding is never committed)
        index = mx.array(layout.padded_index(asking, 0, width + 1), dtype=mx.int32)
        rows = logits[index].reshape(len(asking), width + 1, logits.shape[-1])
    return _logprobs_of([states[b] for b in asking], rows, targets[picked])


def _logprobs_of(states: list[_RowState], logits: mx.array, tokens: mx.array):
    """Lazy log-probabilities of `tokens` [R, W] under `logits` [R, W, V] for these rows."""
    rows = [s.request_id for s in states]
    wanted = [s.params.logprobs or 0 for s in states]
    return token_logprobs.compute(logits, tokens, rows, wanted)
