"""The DFlash draft model and drafter: batching is exact, caches hold context rows only."""

from __future__ import annotations

import mlx.core as mx
import pytest

from drafters.dflash import load_dflash_model
from engine import load_pair

ATOL = 2e-5


@pytest.fixture
def model(drafter_dir):
    return load_dflash_model(drafter_dir)


def _run_steps(model, contexts: list[mx.array], blocks: list[mx.array], fused: bool):
    """Feed rows' contexts (ragged) then blocks as one batch; two steps to exercise appends."""
    if fused:
        model.fuse_context_projections()
    cache = model.make_cache(len(contexts))
    outputs = []
    for step in range(2):
        counts = [c[step].shape[0] for c in contexts]
        width = contexts[0][step].shape[-1]
        longest = max(counts)
        padded = mx.stack(
            [
                mx.concatenate([c[step], mx.zeros((longest - c[step].shape[0], width))])
                for c in contexts
            ]
        )
        block = mx.stack([b[step] for b in blocks])
        outputs.append(model(block, cache, padded, counts))
    return outputs, cache


@pytest.mark.parametrize("fused", [False, True])
def test_batch_of_two_ragged_rows_equals_two_single_rows(model, fused):
    mx.random.seed(0)
    # row 0: 7 then 2 context rows; row 1: 3 then 5 (different lengths at every step)
    contexts = [
        [mx.random.normal((7, 128)), mx.random.normal((2, 128))],
        [mx.random.normal((3, 128)), mx.random.normal((5, 128))],
    ]
    blocks = [[mx.random.normal((8, 64)) for _ in range(2)] for _ in range(2)]
    batched, cache = _run_steps(model, contexts, blocks, fused)
    assert cache[0].lengths == [9, 8]
    for row in range(2):
        single, _ = _run_steps(model, [contexts[row]], [blocks[row]], fused)
        for step in range(2):
            assert mx.allclose(batched[step][row], single[step][0], atol=ATOL), (row, step)


def test_fused_context_projection_equals_per_layer(model):
    mx.random.seed(1)
    feats = mx.random.normal((2, 6, 128))
    plain = model.context_kv(model.project_context(feats), mx.array([0, 4]))
    model.fuse_context_projections()
    fused = model.context_kv(model.project_context(feats), mx.array([0, 4]))
    for (k1, v1), (k2, v2) in zip(plain, fused):
        assert mx.allclose(k1, k2, atol=ATOL) and mx.allclose(v1, v2, atol=ATOL)


def test_proposing_for_a_subset_equals_proposing_alone(qwen3_target_dir, drafter_dir):
    """Sessions drafting in a batch, or a subset of them, get the same drafts as alone."""
    pair = load_pair(qwen3_target_dir, drafter_dir)
    drafter, target = pair.drafter, pair.target
    prompts = [[5, 9, 31, 77, 100, 4], [12, 13], [200, 201, 202, 203]]

    def features(ids):
        _, feats = target(mx.array([ids]))
        return feats[0]

    def open_all():
        sessions = [drafter.open() for _ in prompts]
        for s, ids in zip(sessions, prompts):
            drafter.commit(s, features(ids))
        return sessions

    sessions = open_all()
    together = drafter.propose(sessions, [1, 2, 3], [7, 3, 5])
    subset = drafter.propose([sessions[2], sessions[0]], [9, 8], [4, 4])
    mx.eval(together.tokens, subset.tokens)
    assert [s.context_rows for s in sessions] == [6, 2, 4]  # context only, no block rows
    for s in sessions:
        drafter.close(s)
    assert drafter.cache[0].batch_size == 0

    for i in range(len(prompts)):
        (alone,) = open_all()[i : i + 1]
        for s in list(drafter._sessions):
            if s is not alone:
                drafter.close(s)
        one = drafter.propose([alone], [[1, 2, 3][i]], [7])
        assert (
            one.tokens[0, : together.depths[i]].tolist()
            == together.tokens[i, : together.depths[i]].tolist()
        )
        assert mx.allclose(one.probs[0, :3], together.probs[i, :3], atol=1e-4)
        drafter.close(alone)
    assert subset.tokens.shape == (2, 4)


def test_flush_cap_writes_pending_rows_while_parked(qwen3_target_dir, drafter_dir):
    pair = load_pair(qwen3_target_dir, drafter_dir)
    drafter = pair.drafter
    drafter.flush_cap = 10
    session = drafter.open()
    _, feats = pair.target(mx.array([list(range(3, 30))]))
    for start in range(0, 24, 4):  # 6 commits of 4 rows; flush at 12 and 24
        drafter.commit(session, feats[0, start : start + 4])
    assert (session.context_rows, session.pending_rows) == (24, 0)
    drafter.commit(session, feats[0, 24:27])
    assert (session.context_rows, session.pending_rows) == (24, 3)
    drafter.close(session)
    # Decode steps (`commit_step`): a session past the cap is written at once, and the
    # rows gathered for the others stay handed to the caller (not dropped by that write).
    full, other = drafter.open(), drafter.open()
    drafter.commit(full, feats[0, :8])
    for _ in range(2):  # `full` reaches 10 at the second step
        drafter.commit_step(feats[0, :2], [(full, 0, [1]), (other, 1, [1])])
    assert (full.context_rows, full.pending_rows) == (10, 0)
    assert (other.context_rows, other.pending_rows) == (0, 2)
    handed = drafter.take_unevaluated()
    assert any(a is other.pending[0] for a in handed)  # the other session's gathered rows
    assert len(handed) > 1  # and the written cache, for the caller's sync


def test_journalled_steps_are_gathered_without_a_forward_and_draft_as_if_given_at_once(
    qwen3_target_dir, drafter_dir, monkeypatch
):
    """Parked sessions hold their rows (no drafter forward below the flush cap). A decode
    step's rows arrive as one array for all sessions (`commit_step`) and are journalled, not
    sliced; every MERGE_EVERY steps each session's rows are gathered into an array of its own
    (not a view of one shared by all), handed once to the caller's next sync; a closed
    session's journalled rows are dropped; and the next proposal equals that of a session
    given the same rows in one commit."""
    from engine.step.feature_journal import MERGE_EVERY

    pair = load_pair(qwen3_target_dir, drafter_dir)
    drafter = pair.drafter
    forwards = []
    real_append = drafter.model.append_context
    monkeypatch.setattr(drafter.model, "append_context",
                        lambda *a: forwards.append(1) or real_append(*a))  # fmt: skip
    length, prompt, width = 400, 10, 3
    _, feats = pair.target(mx.array([[3 + i % 40 for i in range(length)]]))
    feats = feats[0]
    first, second, leaving = drafter.open(), drafter.open(), drafter.open()
    for session in (first, second, leaving):
        drafter.commit(session, feats[:prompt])
    # Each step: 3 rows of `width` verify positions; `first` commits 1 or 2 of its own,
    # `second` always 1, `leaving` 1 (it closes midway). Rows 0 and 2 read the same
    # features for simplicity; row 1 reads features shifted by one (checked below).
    positions = {first: prompt, second: prompt, leaving: prompt}
    steps = MERGE_EVERY + 5
    for step in range(steps):
        counts = {first: 1 + step % 2, second: 1, leaving: 1}
        rows = []
        for session in (first, second, leaving):
            at = positions[session]
            rows.append(
                feats[at : at + width] if session is not second else feats[at + 1 : at + 1 + width]
            )
        live = (first, second, leaving) if step <= 20 else (first, second)
        blocks = [(s, r * width, list(range(counts[s]))) for r, s in enumerate(live)]
        drafter.commit_step(mx.concatenate(rows), blocks)
        for session, _, tokens in blocks:
            positions[session] += len(tokens)
        if step == 20:
            drafter.close(leaving)
        if step == MERGE_EVERY - 1:
            gathered = drafter.take_unevaluated()
            assert len(gathered) == 2  # one array per open session, the closed one dropped
            assert [len(s.pending) for s in (first, second)] == [2, 2]
            assert gathered[0] is first.pending[1] and gathered[1] is second.pending[1]
            assert first.pending[1].shape[0] == positions[first] - prompt
            assert drafter.take_unevaluated() == []
        else:
            assert drafter.take_unevaluated() == []
    assert forwards == []  # parked: nothing written
    for session in (first, second):
        assert session.pending_rows == positions[session] and session.context_rows == 0
    assert len(first.pending) == 2  # the last 5 steps still in the journal
    at_once = drafter.open()
    drafter.commit(at_once, feats[: positions[first]])
    anchor = 7
    a = drafter.propose([first], [anchor], [4])
    b = drafter.propose([at_once], [anchor], [4])
    assert a.tokens.tolist() == b.tokens.tolist()
    assert mx.allclose(a.probs, b.probs, atol=ATOL)
    assert first.context_rows == positions[first] and first.pending_rows == 0
    # `second`'s rows were the shifted ones: its context is not `first`'s.
    shifted = drafter.open()
    drafter.commit(
        shifted, mx.concatenate([feats[:prompt], feats[prompt + 1 : positions[second] + 1]])
    )
    c = drafter.propose([second], [anchor], [4])
    d = drafter.propose([shifted], [anchor], [4])
    assert c.tokens.tolist() == d.tokens.tolist()
    assert mx.allclose(c.probs, d.probs, atol=ATOL)
    # A caller that never takes the gathered rows: the next proposal drops them.
    for _ in range(MERGE_EVERY):
        drafter.commit_step(feats[:1], [(at_once, 0, [0])])
    drafter.propose([at_once], [anchor], [2])
    assert drafter.take_unevaluated() == []


def test_a_steps_opens_and_closes_copy_the_cache_once_each(
    qwen3_target_dir, drafter_dir, monkeypatch
):
    """Sessions that come and go between two uses of the cache cost one filter and one
    append in all, and every survivor keeps its own context rows."""
    from engine.step.kv_cache import RaggedKVCache

    pair = load_pair(qwen3_target_dir, drafter_dir)
    drafter, target = pair.drafter, pair.target
    _, feats = target(mx.array([list(range(5, 25))]))
    first = [drafter.open() for _ in range(4)]
    for n, s in zip((3, 5, 7, 9), first):
        drafter.commit(s, feats[0, :n])
    drafter.propose(first, [1, 1, 1, 1], [2, 2, 2, 2])  # rows exist now
    calls = []
    for name in ("filter", "extend_many"):
        real = getattr(RaggedKVCache, name)

        def counted(self, *args, _real=real, _name=name):
            calls.append(_name)
            return _real(self, *args)

        monkeypatch.setattr(RaggedKVCache, name, counted)
    drafter.close(first[1])
    drafter.close(first[2])
    later = [drafter.open() for _ in range(3)]
    for s in later:
        drafter.commit(s, feats[0, :4])
    assert calls == []  # nothing copied yet: membership is only marked
    assert [s.context_rows for s in [first[0], first[3], *later]] == [3, 9, 0, 0, 0]
    layers = len(drafter.cache)
    assert sorted(calls) == ["extend_many"] * layers + ["filter"] * layers
    assert drafter.cache[0].batch_size == 5
    assert [s.pending_rows for s in later] == [4, 4, 4]


def test_cpu_kernels_give_the_same_block_outputs(drafter_dir):
    """The drafter on `engine.backend.cpu_kernels` (the engine's choice on the CPU backend) equals
    MLX's attention and SwiGLU for ragged rows over two steps."""
    mx.random.seed(2)
    contexts = [
        [mx.random.normal((7, 128)), mx.random.normal((2, 128))],
        [mx.random.normal((3, 128)), mx.random.normal((5, 128))],
    ]
    blocks = [[mx.random.normal((8, 64)) for _ in range(2)] for _ in range(2)]
    stock, _ = _run_steps(load_dflash_model(drafter_dir), contexts, blocks, True)
    fast_model = load_dflash_model(drafter_dir)
    fast_model.use_cpu_kernels()
    fast, _ = _run_steps(fast_model, contexts, blocks, True)
    for a, b in zip(stock, fast):
        assert mx.allclose(a, b, atol=ATOL).item()
    assert not load_dflash_model(drafter_dir).layers[0].self_attn.cpu_kernels


def test_a_long_backlog_is_written_first_and_drafts_as_if_padded_with_the_rest(
    qwen3_target_dir, drafter_dir, monkeypatch
):
    """A proposal pads its rows' pending context to the longest: one request's prompt beside
    rows with a step's backlog is written by a forward of its own first, so the proposal runs
    3 x 2 context positions, not 3 x 200, and drafts the same tokens as one padded forward."""
    from drafters.dflash import drafter as drafter_module

    assert drafter_module.backlogs_to_write_first([2, 200, 1], ["a", "b", "c"]) == ["b"]
    assert drafter_module.backlogs_to_write_first([20, 24, 30], ["a", "b", "c"]) == []
    assert drafter_module.backlogs_to_write_first([], []) == []
    _, feats = load_pair(qwen3_target_dir, drafter_dir).target(
        mx.array([[3 + i % 40 for i in range(200)]])
    )

    def propose(split: bool):
        if not split:
            monkeypatch.setattr(drafter_module, "backlogs_to_write_first", lambda c, s: [])
        pair = load_pair(qwen3_target_dir, drafter_dir)
        drafter = pair.drafter
        sessions = [drafter.open() for _ in range(3)]
        for s, n in zip(sessions, (2, 200, 1)):
            drafter.commit(s, feats[0, :n])
        widths = []
        real_append = drafter.model.append_context

        def counted(features, counts, cache):
            widths.append(features.shape[:2])
            real_append(features, counts, cache)

        monkeypatch.setattr(drafter.model, "append_context", counted)
        out = drafter.propose(sessions, [7, 8, 9], [3, 3, 3])
        monkeypatch.undo()
        assert [s.context_rows for s in sessions] == [2, 200, 1]
        return out, widths

    split, split_widths = propose(True)
    padded, padded_widths = propose(False)
    assert split_widths == [(1, 200), (3, 2)] and padded_widths == [(3, 200)]
    assert split.tokens.tolist() == padded.tokens.tolist()
    assert mx.allclose(split.probs, padded.probs, atol=ATOL)
