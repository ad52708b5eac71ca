"""The "never slower" guard: drafting stays on only where it measurably beats plain decoding.

The adaptive controller decides from models: an acceptance estimate per request and cost
curves of the loop's step cadence. Some costs never reach those models: the catch-ups of
draft sessions (left out of the curves as one-offs), their per-step upkeep on plain steps,
and prefill steps (priced by their forwards). On a target whose step is a few milliseconds
(the bundled pair at 8 rows: 15 ms) they can add up to a tenth of the time, and drafting
that the models call a small win is then a loss.

So the guard measures the whole loop instead. Per octave of batch size it runs the
controller in epochs of EPOCH_STEPS decode steps (and EPOCH_SECONDS), either free (the
controller decides) or held plain (no drafting, no planning), and scores each epoch by its
speed against plain decoding:

    speed = sum over steps of (committed tokens / rows) x plain step seconds(rows)
            / wall seconds of those steps (event loop included)

which is about 1 for plain decoding and is compared between the two arms on the same curve,
so the batch size and the machine's speed cancel. Steps that prefill or join are left out
(their cost is not the drafting's; so the joins that drafting desynchronises in a lockstep
batch stay unseen), as are gaps in which the engine sat idle. Drafting wins when its
smoothed speed beats held decoding's by FREE_MARGIN (a tie holds: an epoch's speed moves by
a few percent with the host alone), else held decoding; the loser is re-measured for one
epoch after 2, 4, then every MAX_EXPLORE_GAP epochs while it keeps losing, so a workload that
changes is noticed and a losing arm costs at most a few percent of its loss. Where drafting
wins clearly (CLEAR_WIN), held decoding is not measured at all: it could not catch up, and
each held epoch would cost the drafting's whole gain for its length.

A held octave also measures drafting at once when the traffic turns to copying. The
controller tells the guard of every request that joins a held batch with a prompt-lookup
match at its first step (the match the runner works out at prefill; while held it asks for
no other), and once those add up to the whole batch (one request at c=1, eight at 8 rows)
the held epoch under way is dropped and a free one starts. Drafting that lost on chat may win
twice over on editing: at c=1 on SmolLM2 a hold earned on chat and completion parked three
editing requests of four before its gap was up. A large batch turns over more slowly than
the gap comes round, so there this changes little.

An octave seen for the first time above one where held decoding won starts held: a larger
batch is more compute-bound, so drafting there only loses more, and a free first epoch would
pay that loss before anything is learned. It measures drafting after MIN_EXPLORE_GAP held
epochs, as any loser is, so a batch size where drafting does pay is still found.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

FREE, HELD = "free", "held"
# An epoch is at least this many decode steps and this many seconds: on a target whose step
# takes 5 ms, 16 steps are 80 ms, and one stall of 20 ms would move the epoch's speed by 25%.
EPOCH_STEPS, EPOCH_SECONDS = 16, 0.4
SPEED_ALPHA = 0.35  # EWMA weight of an epoch's speed
# Epochs of the winner between two of the loser. At most 8: a loser of 10% then costs about
# 1%, and a workload that turns (the same engine, other traffic) is noticed within 128 steps.
MIN_EXPLORE_GAP, MAX_EXPLORE_GAP = 2, 8
# Drafting this much faster than held decoding is never re-checked against it (held decoding
# scores about 1; the lookahead it gets back is worth a few percent, not a quarter).
CLEAR_WIN = 1.25
# Drafting must beat held decoding by this much to be kept: the promise is "never slower",
# so a tie holds. An epoch's speed moves by several percent with the host alone; without a
# margin a free arm losing 3-5% won enough epochs to run most steps of a c=32 completion load.
FREE_MARGIN = 1.03
IDLE_FACTOR = 4.0  # a gap this many plain steps long (plus IDLE_SLACK) was idle, not work
IDLE_SLACK = 0.05


@dataclass
class _Arms:
    """One batch-size octave's two arms: smoothed speeds, the current epoch, the schedule."""

    arm: str = FREE
    speed: dict[str, float] = field(default_factory=dict)
    work: float = 0.0  # plain-step seconds the epoch's committed tokens stand for
    seconds: float = 0.0  # wall seconds the epoch took
    steps: int = 0
    gap: int = MIN_EXPLORE_GAP  # winner epochs before the loser is measured again
    since_explore: int = 0  # winner epochs since the loser's last one
    exploring: bool = False  # the current epoch re-measures the losing arm
    # Requests with a lookup match that joined since drafting was last measured, as a share
    # of the batch they joined (see the module docstring).
    turnover: float = 0.0

    def held_won(self) -> bool:
        """Both arms measured and held decoding the faster."""
        return FREE in self.speed and HELD in self.speed and not self._free_wins()

    def _free_wins(self) -> bool:
        return self.speed.get(FREE, 0.0) >= FREE_MARGIN * self.speed[HELD]

    def measure_drafting_now(self) -> None:
        """Drop the held epoch under way and run a free one, as a re-measure of the loser."""
        self.work = self.seconds = 0.0
        self.steps = 0
        self.arm, self.exploring, self.turnover = FREE, True, 0.0

    def close_epoch(self) -> None:
        if self.arm == FREE:  # drafting was just measured: count copying arrivals afresh
            self.turnover = 0.0
        speed = self.work / self.seconds if self.seconds > 0 else None
        self.work = self.seconds = 0.0
        self.steps = 0
        if speed is None:
            return
        before = self.speed.get(self.arm)
        self.speed[self.arm] = speed if before is None else before + SPEED_ALPHA * (speed - before)
        held = self.speed.get(HELD, 1.0)  # unmeasured: what plain decoding scores
        if self.speed.get(FREE, 0.0) >= CLEAR_WIN * held:
            # Drafting wins by more than held decoding could make up: no epoch is spent on
            # re-measuring plain (at 2x, one held epoch in five would cost a tenth).
            self.arm, self.exploring, self.since_explore = FREE, False, 0
            return
        if HELD not in self.speed:  # the first epoch ran free: measure plain next
            self.arm, self.exploring = HELD, True
            return
        winner = FREE if self._free_wins() else HELD
        if self.exploring:
            # The loser got its epoch: lost again, explore it less often; won, watch closely.
            self.gap = min(MAX_EXPLORE_GAP, 2 * self.gap) if self.arm != winner else MIN_EXPLORE_GAP
            self.since_explore = 0
        else:
            self.since_explore += 1
        self.exploring = self.since_explore >= self.gap
        self.arm = (HELD if winner == FREE else FREE) if self.exploring else winner


class DraftingGuard:
    """Per batch-size octave, whether the controller may draft (see the module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter,
                 epoch_seconds: float = EPOCH_SECONDS) -> None:  # fmt: skip
        self.clock = clock
        self.epoch_seconds = epoch_seconds
        self.arms: dict[int, _Arms] = {}
        self._last: float | None = None

    @staticmethod
    def bucket(batch: int) -> int:
        return int(math.log2(max(batch, 1)))

    def allows_drafting(self, batch: int) -> bool:
        """Free for this batch size now (the controller decides), or held plain. A pure
        read: an octave never measured answers with the arm it would start on."""
        bucket = self.bucket(batch)
        arms = self.arms.get(bucket)
        return (arms.arm if arms is not None else self._first_arm(bucket)) == FREE

    def _first_arm(self, bucket: int) -> str:
        """A new octave starts held above an octave where held won, else free."""
        below = [b for b in self.arms if b < bucket]
        return HELD if below and self.arms[max(below)].held_won() else FREE

    def _arms(self, bucket: int) -> _Arms:
        """The octave's arms, created on its first measured step."""
        arms = self.arms.get(bucket)
        if arms is None:
            arms = self.arms[bucket] = _Arms(arm=self._first_arm(bucket))
        return arms

    def note_copying_request(self, batch: int) -> None:
        """A request with a prompt-lookup match joined `batch` decoding rows held plain. Once
        such requests add up to the whole batch, drafting is measured at once (see the module
        docstring); a held epoch that re-measures plain is left to finish."""
        arms = self._arms(self.bucket(batch))
        if arms.arm != HELD or arms.exploring:
            return
        arms.turnover += 1.0 / max(batch, 1)
        if arms.turnover >= 1.0 - 1e-9:
            arms.measure_drafting_now()

    def observe(self, batch: int, tokens: int, plain_seconds: float, clean: bool) -> None:
        """One step ended: `tokens` committed by `batch` decoding rows; `plain_seconds` is the
        cost model's plain step of that many rows; `clean`: no prefill and no join in it."""
        now = self.clock()
        elapsed, self._last = (None if self._last is None else now - self._last), now
        if not clean or batch <= 0 or elapsed is None or plain_seconds <= 0:
            return
        if elapsed > IDLE_FACTOR * plain_seconds + IDLE_SLACK:
            return  # the engine waited for work in between
        arms = self._arms(self.bucket(batch))
        arms.work += tokens / batch * plain_seconds
        arms.seconds += elapsed
        arms.steps += 1
        if arms.steps >= EPOCH_STEPS and arms.seconds >= self.epoch_seconds:
            arms.close_epoch()

    def state(self) -> dict:
        return {
            f"batch {2**b}-{2 ** (b + 1) - 1}": {
                "arm": a.arm,
                "speed": {k: round(v, 3) for k, v in a.speed.items()},
                "explore_gap": a.gap,
            }
            for b, a in sorted(self.arms.items())
        }
