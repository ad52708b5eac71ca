"""When the scheduler lets the runner look a plain step ahead, and when a prefill due next
step rides in that step's forward instead (`Scheduler.prefill_rides`)."""

from __future__ import annotations

from engine.step.sampling import SamplingParams
from engine.step.stopping import StopChecker
from scheduler.depth import FixedDepthPolicy
from scheduler.request import Request, RequestStatus
from scheduler.scheduler import Scheduler, SchedulerLimits


def _request(rid: str, prompt: int, max_tokens: int, generated: int = 0) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    request = Request(rid, list(range(3, 3 + prompt)), params, StopChecker(params))
    request.stop.token_ids.extend([7] * generated)
    return request


def _scheduler(rides: bool, running: list[Request], waiting: list[Request] = (),
               kv_cache_bytes: int = 1 << 30) -> Scheduler:  # fmt: skip
    limits = SchedulerLimits(max_num_seqs=2, kv_cache_bytes=kv_cache_bytes, bytes_per_token=1)
    scheduler = Scheduler(limits, FixedDepthPolicy(0), 0, {}, prefill_rides=rides)
    for request in running:
        request.status = RequestStatus.RUNNING
        request.prefilled = len(request.prompt_ids)
        scheduler.requests[request.request_id] = request
        scheduler.running.append(request)
    for request in waiting:
        scheduler.requests[request.request_id] = request
        scheduler.waiting.append(request)
    return scheduler


def test_no_lookahead_when_a_waiting_request_takes_the_slot_this_step_frees():
    # b commits its last token this step, so c is admitted and prefills next step.
    running = [_request("a", 5, 20), _request("b", 5, 20, generated=19)]
    plan = _scheduler(True, running, [_request("c", 5, 20)]).plan()
    assert not plan.admissions and plan.depths == {"a": 0, "b": 0}
    assert not plan.lookahead
    # Without riding the looked-ahead step is worth more than one forward saved at the join.
    running = [_request("a", 5, 20), _request("b", 5, 20, generated=19)]
    assert _scheduler(False, running, [_request("c", 5, 20)]).plan().lookahead


def test_lookahead_when_no_prefill_can_come_next_step():
    # Both rows run on and the batch is full: the waiting request cannot be admitted.
    running = [_request("a", 5, 20), _request("b", 5, 20, generated=3)]
    assert _scheduler(True, running, [_request("c", 5, 20)]).plan().lookahead
    # A slot frees, but the waiting request's KV reservation does not fit beside a's.
    running = [_request("a", 5, 20), _request("b", 5, 20, generated=19)]
    tight = _scheduler(True, running, [_request("c", 5, 20)], kv_cache_bytes=40)
    assert tight.plan().lookahead
    # Nobody waits.
    assert _scheduler(True, [_request("a", 5, 20)]).plan().lookahead


def test_no_lookahead_while_a_prompt_has_chunks_left():
    scheduler = _scheduler(True, [_request("a", 5, 20)], [_request("long", 100, 8)])
    scheduler.limits.prefill_chunk_tokens = 32
    plan = scheduler.plan()  # admits "long" and runs its first chunk beside a's decoding
    assert [(c.start, c.end, c.last) for c in plan.prefills] == [(0, 32, False)]
    assert not plan.lookahead
